# PPO on Reddit TL;DR, CleanRL style: "The N+ Implementation Details of RLHF with PPO" (Huang et
# al., 2024; "SFD": github.com/vwxyzjn/summarize_from_feedback_details) in one file: `Args`, the PPO
# math, `main`, then what it calls in call order. "ALGO LOGIC" marks where an experiment's change
# goes; what none edits is in ppo_harness/. Docs: README.md.
from __future__ import annotations

import bisect
import json
import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Callable, Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from datasets import Dataset
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ppo_harness.launch import check_flags, gather_once, process_share, start
from ppo_harness.models import check_scalar_model, gathered_for_init, shard_frozen
from ppo_harness.prompt_files import check_text_columns, load_prompt_dataset
from ppo_harness.run import start_run
from ppo_harness.run_folder import RunFolder, claim
from ppo_harness.run_log import RunLog, check_finite_losses, lr_outside_schedule, print_rows
from ppo_harness.speed import CompiledOrEager, ready_to_compile, should_compile, static_sampler
from ppo_harness.writes import write_atomic

# logprob written at padding positions: ref and policy both get it, so their KL there is 0
INVALID_LOGPROB = 1.0
# N+ detail 1
QUERY_TEMPLATE = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
TLDR_COLUMNS = ("subreddit", "title", "post", "summary")
# near-greedy validation generation, as OpenAI's sample.py and SFD (N+ detail 30)
EVAL_TEMPERATURE = 0.01
RESUME_MAY_CHANGE = {  # a resume may change how the run is logged, saved or run, not what it trains
    "exp_name", "track", "wandb_project_name", "wandb_entity", "output_dir", "eval_every", "save_every",
    "save_at_end", "save_total_limit", "push_to_hub", "hub_model_id", "hub_private_repo", "hub_strategy", "resume",
    "overwrite", "resume_with_changes", "peer_timeout", "trust_remote_code", "ds3_gather_for_generation",
    "eval_samples", "compile"}


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
    wandb_project_name: str = "tldr_summarize"
    """the wandb's project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    output_dir: str | None = None
    """the run's folder (models, args.json, metrics.jsonl, eval/ tables); default runs/{run_name}"""

    # models: each a hub id or a local directory; the defaults are the paper's Pythia-1B SFT policy
    # and reward model
    sft_model_path: str = "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the policy to train, also the frozen reference (N+ detail 19)"""
    reward_model_path: str = "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr"
    """the reward model (AutoModelForSequenceClassification, num_labels=1, same tokenizer as the
    policy)"""
    value_model_path: str | None = None
    """initialises the value model; default: the reward model (N+ detail 18)"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype every model loads in (auto: as saved); float32: AdamW's small steps round away
    in bf16 (trl#4778)"""

    # data: a hub id, a local dataset directory, a `save_to_disk` directory, or a
    # .json/.jsonl/.parquet/.csv file
    dataset_name: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered"
    """the Reddit posts, with columns subreddit, title, post and summary (the reference TL;DR)"""
    dataset_config: str | None = None
    """the configuration of --dataset-name, if it has several"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_eval_split: str = "validation"
    """the split of held-out posts to validate on (a single file is one split: give
    --eval-dataset-name instead)"""
    eval_dataset_name: str | None = None
    """the held-out posts, if not in --dataset-name: hub id, directory or file (--dataset-config
    is not applied)"""
    max_query_length: Annotated[int, "[1, inf)"] = 512
    """the query's token budget: the post is cut at its last newline until the query fits (N+
    detail 2)"""
    eval_samples: Annotated[int | None, "[1, inf)"] = 256
    """validate on the first N held-out posts (None: all of them)"""
    eval_every: Annotated[int, "[0, inf)"] = 100
    """validate every N updates, and always after the last one (0: only after the last)"""

    # batch sizes (see `batch_sizes`); the defaults are TRL's documented 8-GPU run, batch 512
    total_episodes: Annotated[int, "[1, inf)"] = 1_000_000
    """the total number of sampled responses to train on (the one budget knob)"""
    per_device_train_batch_size: Annotated[int, "[1, inf)"] = 16
    """the micro-batch size per process: responses in one training forward/backward"""
    gradient_accumulation_steps: Annotated[int, "[1, inf)"] = 4
    """micro-batches accumulated into one minibatch, which is one optimizer step"""
    num_mini_batches: Annotated[int, "[1, inf)"] = 1
    """minibatches (optimizer steps) per PPO epoch"""
    num_ppo_epochs: Annotated[int, "[1, inf)"] = 4
    """passes of PPO over each rollout batch"""
    local_rollout_forward_batch_size: Annotated[int, "[1, inf)"] = 16
    """per-process chunk size for generation, validation and the no-grad reference/value/reward
    forwards"""

    # generation
    response_length: Annotated[int, "[1, inf)"] = 53
    """the maximum number of generated tokens (53: the SFT length limit of the TL;DR references)"""
    stop_token: Literal["eos"] | None = "eos"
    """`eos`: stop at the eos token and truncate after it (N+ detail 21); None: always sample to
    --response-length"""
    temperature: Annotated[float, "(0, inf)"] = 0.7
    """the sampling temperature; the same temperature divides the logits in every forward (N+
    detail 23)"""
    missing_eos_rule: Literal["replace", "subtract", "none"] = "replace"
    """a response without eos: `replace` its score (N+/SFD), `subtract` a penalty from it (TRL),
    or `none`"""
    penalty_reward_value: Annotated[float, "(-inf, inf)"] = -1.0
    """the score a response without eos gets under --missing-eos-rule replace (N+ detail 22)"""
    missing_eos_penalty: Annotated[float, "[0, inf)"] = 1.0
    """subtracted from the score of a response without eos under --missing-eos-rule subtract
    (TRL's documented 1.0)"""

    # PPO
    kl_coef: Annotated[float, "[0, inf)"] = 0.05
    """the KL coefficient (beta) of the per-token KL penalty (N+ detail 24)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """k1: log(pi/pi_ref); k3: (r - 1) - log r with r = pi_ref/pi (unbiased, always >= 0)"""
    cliprange: Annotated[float, "(0, inf)"] = 0.2
    """the policy-ratio clip range"""
    vf_coef: Annotated[float, "[0, inf)"] = 0.1
    """the value-loss coefficient"""
    cliprange_value: Annotated[float, "(0, inf)"] = 0.2
    """the value clip range (absolute, around the rollout's values)"""
    gamma: Annotated[float, "[0, 1]"] = 1.0
    """the discount factor"""
    lam: Annotated[float, "[0, 1]"] = 0.95
    """the GAE lambda"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (masked) before GAE (off in the paper's runs, N+ detail 26)"""

    # optimizer
    learning_rate: Annotated[float, "[0, inf)"] = 3e-6
    """the AdamW learning rate, annealed linearly to 0 over the updates (N+ details 10 and 29)"""
    max_grad_norm: Annotated[float | None, "(0, inf)"] = 1.0
    """clip the global gradient norm of policy + value to this (None: no clipping)"""

    # checkpoints
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
    """ZeRO-3: gather the policy once per rollout to sample fast (off: sample from the shards,
    slowly but smaller)"""
    fast_paths: bool = True
    """the hand-written path of the README's ledger where its start-up check passes: on CUDA the
    static sampler (off: the dynamic cache alone)"""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the training step (`ppo_loss`) and the sampler; auto: on CUDA, for runs long
    enough to pay the compile time back (README "Speed"), off on the CPU (slower there than
    eager)"""
    tf32: bool = False
    """on CUDA, float32 matmuls in TensorFloat-32 (10-bit mantissa): faster on Ampere and later,
    values change"""
    sampler: Literal["auto", "dynamic", "static", "compiled"] = "auto"
    """auto: a static KV cache in CUDA graphs where --compile is on and its check passes, else
    dynamic; static: uncompiled"""


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
def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) from the sampled token's log-probs
    (http://joschu.net/blog/kl-approx.html)."""
    logr = ref_logprobs - logprobs
    return -logr if estimator == "k1" else torch.expm1(logr) - logr


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


def apply_missing_eos_rule(scores: torch.Tensor, contain_eos: torch.Tensor, rule: str,
                           penalty_reward_value: float, missing_eos_penalty: float) -> torch.Tensor:
    """A response without eos (N+ detail 22): score `replace`d (SFD), penalty `subtract`ed (TRL),
    or kept (`none`)."""
    if rule == "replace":
        return torch.where(contain_eos, scores, torch.full_like(scores, penalty_reward_value))
    if rule == "subtract":
        return scores - missing_eos_penalty * (~contain_eos).to(scores.dtype)
    if rule == "none":
        return scores
    raise ValueError(f"unknown --missing-eos-rule {rule!r}: choose replace, subtract or none")


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


def aggregate_loss(losses: torch.Tensor, mask: torch.Tensor, aggregation: str = "micro-batch",
                   denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token losses to one (verl's loss_agg_mode): micro-batch, its token mean (TRL's); token
    or sequence, the sum of tokens' losses or sequences' means / `denominator` (DAPO 3.3)."""
    if aggregation == "micro-batch":
        return masked_mean(losses, mask)
    if aggregation == "token":
        return (losses * mask).sum() / denominator
    return ((losses * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / denominator


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
    # the training step is the page's own `ppo_loss`, compiled whole by --compile (backward too)
    training_loss = ppo_loss
    if setup.compiled:  # --compile auto: where the compiler fails, `ppo_loss` runs as it is (said once)
        compiled = torch.compile(ppo_loss, fullgraph=True, dynamic=False)
        training_loss = CompiledOrEager(compiled, ppo_loss, strict=args.compile == "on")
    # each rank samples with its own seed (N+ detail 8); the data order is shared: `rollout_indices`
    local_seed = args.seed + accelerator.process_index * 100003
    random.seed(local_seed)
    np.random.seed(local_seed)  # minibatch permutations: TRL never seeded numpy, so runs differed
    torch.manual_seed(local_seed)
    # TRY NOT TO MODIFY: a resume's weights, optimizer and random states; the logs; banner; SIGTERM
    rm_bias = score_bias(models.reward_model.config)
    value_bias = score_bias(models.value_model.config)
    biases = f"score bias (N+ detail 14): reward model {rm_bias:.4g}, value model {value_bias:.4g}"
    run = start_run(accelerator, args, setup, optimizer, models.named(), [biases, *models.notes],
                    args.sft_model_path)
    eval_queries = left_pad(setup.eval_rows["input_ids"], pad_token_id).to(device)
    for update in range(run.start_update, sizes.num_updates + 1):
        episode = update * sizes.batch_size
        last = update == sizes.num_updates  # an early end sets `last` in phase 7
        # ALGO LOGIC: schedules (lr, args.temperature, kl_coef), set from `update`
        anneal = 1.0 - (update - 1.0) / sizes.num_updates  # the lr anneals linearly (N+ detail 29)
        for group in optimizer.param_groups:  # "policy" and "value", each from its own starting lr
            if group["lr"] != group.get("scheduled_lr", group["initial_lr"]):  # written elsewhere
                raise ValueError(lr_outside_schedule(group))
            group["lr"] = group["scheduled_lr"] = anneal * group["initial_lr"]
        lr = optimizer.param_groups[0]["lr"]  # the policy's
        indices = rollout_indices(len(setup.train_dataset), sizes, update, args.seed,
                                  accelerator.process_index)
        # compiled, every update is as wide as the widest query (`Setup.query_width`): one compile
        rows = setup.train_dataset[indices.tolist()]["input_ids"]
        queries = left_pad(rows, pad_token_id, setup.query_width).to(device)
        context_length = queries.size(1)
        model.eval()  # dropout is off already; eval() only spares generation train-mode code paths
        timer = time.perf_counter()
        with torch.no_grad(), accelerator.autocast():
            # 1. Rollout: sample in chunks, keeping each token's log-prob; cut after eos (N+ 21)
            responses, logprobs = sample_responses(accelerator, models.sampler, queries, args,
                                                   setup.zero3, pad_token_id, stop_token_id)
            # as wide as --response-length (SFD): a score lands past the eos
            responses = F.pad(responses, (0, args.response_length - responses.size(1)), value=pad_token_id)
            logprobs = F.pad(logprobs, (0, args.response_length - logprobs.size(1)), value=INVALID_LOGPROB)
            time_generation = time.perf_counter() - timer
            query_responses = torch.cat((queries, responses), 1)
            # the index of each response's last real token (-1: an empty response)
            sequence_lengths = first_true_indices(responses == pad_token_id) - 1
            # the ids log-probs are gathered at: [PAD] may lie outside the vocabulary (masked later)
            response_ids = responses.masked_fill(responses == pad_token_id, 0)

            # 2. Scoring forwards: reference log-probs and values
            ref_logprobs, values, _ = reference_and_values(models, query_responses, response_ids,
                                                           context_length, args, pad_token_id)
            # 3. Scores: the reward model's, then the missing-eos rule (N+ detail 22)
            scores = score_responses(models.reward_model, queries, responses, pad_token_id,
                                     args.local_rollout_forward_batch_size)
            time_scoring = time.perf_counter() - timer - time_generation
            # on the truncated responses
            contain_eos_token = (responses == setup.tokenizer.eos_token_id).any(-1)
            scores = apply_missing_eos_rule(scores, contain_eos_token, args.missing_eos_rule,
                                            args.penalty_reward_value, args.missing_eos_penalty)

            # 4. KL-penalised per-token rewards (careful with padding_mask_p1: N+ detail 25)
            # padding_mask_p1 keeps one more position, where the score lands (N+ detail 25)
            positions = torch.arange(responses.size(1), device=responses.device)[None]
            padding_mask = positions > sequence_lengths[:, None]
            padding_mask_p1 = positions > sequence_lengths[:, None] + 1
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            values = values.masked_fill(padding_mask_p1, 0)
            # 0 at padding: both log-probs are INVALID_LOGPROB there
            kl = kl_penalty(logprobs, ref_logprobs, args.kl_estimator)
            rewards, non_score_reward = compute_rewards(scores, kl, args.kl_coef, sequence_lengths)
            # ALGO LOGIC: a per-token reward term is added to `rewards` here (objective/rlhf_reward)

            # 5. GAE (ALGO LOGIC: another advantage estimator); returns before the whitening,
            # advantages 0 at padding
            gae_rewards = rewards
            if args.whiten_rewards:
                gae_rewards = whiten_rewards(rewards, padding_mask_p1)
            advantages, returns = compute_gae(gae_rewards, values, args.gamma, args.lam)
            advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)  # N+ detail 27
            # the rollout as phase 6 trains on it and phase 7's metrics read it
            rollout = Rollout(
                query_responses=query_responses, response_ids=response_ids, responses=responses,
                sequence_lengths=sequence_lengths, padding_mask=padding_mask,
                padding_mask_p1=padding_mask_p1, logprobs=logprobs, ref_logprobs=ref_logprobs,
                values=values, kl=kl, non_score_reward=non_score_reward, rewards=rewards,
                advantages=advantages, returns=returns, scores=scores,
                contain_eos_token=contain_eos_token)

        # 6. PPO: num_ppo_epochs x num_mini_batches optimizer steps (of gradient_accumulation_steps
        # micro-batches each)
        timer = time.perf_counter()
        model.train()
        step_stats, optimizer_steps = [], 0  # a dict per micro-batch
        losses = []  # each micro-batch's (loss, epoch, minibatch), checked on the device after the epochs
        for ppo_epoch_idx in range(args.num_ppo_epochs):
            # one copy to the device per epoch, not one per micro-batch
            b_inds = torch.from_numpy(np.random.permutation(sizes.local_batch_size)).to(device)
            mb_size, micro_size = sizes.local_mini_batch_size, args.per_device_train_batch_size
            for minibatch_idx, mb_start in enumerate(range(0, sizes.local_batch_size, mb_size)):
                mini_batch_inds = b_inds[mb_start:mb_start + mb_size]
                micro_batches = [mini_batch_inds[i:i + micro_size]
                                 for i in range(0, mb_size, micro_size)]
                for mbi in micro_batches:
                    with accelerator.accumulate(model):
                        loss, stats = training_loss(model, mbi, rollout, args, pad_token_id)
                        losses.append((loss.detach(), ppo_epoch_idx + 1, minibatch_idx + 1))
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            optimizer_steps += 1
                            if args.max_grad_norm is not None:  # TRL accepted it, never clipped
                                accelerator.clip_grad_norm_(model.parameters(),
                                                            args.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                        step_stats.append({k: v.detach() for k, v in stats.items()})
                    del loss, stats
        check_finite_losses(accelerator, losses, update, run.folder.checkpoints)
        time_training = time.perf_counter() - timer

        # 7. Metrics, averaged over processes (TRL's names); the held-out validation (N+ detail 30)
        with torch.no_grad():
            metrics = {
                **gathered_metrics(accelerator, args, rollout, step_stats),
                "policy/optimizer_steps": optimizer_steps,
                "time/generation": time_generation,  # seconds on rank 0: sampling
                "time/scoring": time_scoring,  # reference, value and reward forwards
                "time/training": time_training,  # PPO epochs
                "lr": lr, "episode": episode}
        # ALGO LOGIC: an early end: `last = last or <condition>` here; that update is validated and
        # saved as the last (a condition on the validation: after `evaluate` below)
        if last or (args.eval_every > 0 and update % args.eval_every == 0):
            held_out = evaluate(accelerator, models, args, setup, eval_queries, update, run.log)
            metrics.update(held_out)
        run.log_update(update, metrics, training_seconds=time_training)  # TRY NOT TO MODIFY

        # 8. Checkpoint: every --save-every updates, at the end (models first), on SIGTERM or SIGINT
        state = {}  # ALGO LOGIC: state kept across updates: saved here, read back from `run.saved`
        stopping = run.checkpoint(model, update, episode, last, lr, state)  # TRY NOT TO MODIFY
        del (query_responses, responses, response_ids, logprobs, ref_logprobs, values, rewards,
             advantages, returns, rollout)
        if last or stopping:  # the run's end, an early one, or a stop asked for
            break
    run.finish(update, last, stopping)  # TRY NOT TO MODIFY


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


# ---- Phase 2: the scoring forwards ---------------------------------------------------------------
def reference_and_values(models: Models, query_responses: torch.Tensor, response_ids: torch.Tensor,
                         context_length: int, args: Args, pad_token_id: int, with_values=True):
    """The no-grad forwards in chunks: reference log-probs, values (or None), no exact KL
    (TL;DR's k1 and k3)."""
    chunk, ref_logprobs, values = args.local_rollout_forward_batch_size, [], []
    for i in range(0, query_responses.size(0), chunk):
        qr = query_responses[i:i + chunk]
        ref_logprobs.append(response_logprobs(models.ref_policy, qr, pad_token_id, context_length,
                                              response_ids[i:i + chunk], args.temperature)[0])
        if with_values:
            values.append(value_forward(models.value_model, qr, pad_token_id, context_length))
    return torch.cat(ref_logprobs), torch.cat(values) if with_values else None, None


def model_inputs(query_responses: torch.Tensor, pad_token_id: int) -> dict:
    """A forward's inputs (SFD's `forward`): [PAD] masked out, each row's positions counted from its
    first real token."""
    attention_mask = query_responses != pad_token_id
    return dict(input_ids=query_responses.masked_fill(~attention_mask, 0),
                attention_mask=attention_mask.long(),
                position_ids=attention_mask.cumsum(1) - attention_mask.long())


def policy_logits(policy, query_responses, pad_token_id, context_length):
    """Logits that predict each response token: positions context_length-1 .. -2. The LM head
    runs only there."""
    response_length = query_responses.size(1) - context_length
    out = policy(**model_inputs(query_responses, pad_token_id), logits_to_keep=response_length + 1, use_cache=False)
    return out.logits[:, :-1]


def final_hidden_states(model, query_responses, pad_token_id):
    """Final hidden states of a model's backbone (a sequence classifier's `score` head is applied
    by callers)."""
    return model.base_model(**model_inputs(query_responses, pad_token_id), use_cache=False).last_hidden_state


def response_logprobs(policy, query_responses, pad_token_id, context_length, response_ids, temperature,
                      with_entropy=False):
    """(log-probs of `response_ids`, entropies or empty) under the sampling distribution."""
    logits = scale_logits(policy_logits(policy, query_responses, pad_token_id, context_length), temperature,
                          pad_token_id)
    # recomputed in the backward, only if a loss term uses it: no second (batch, length, vocab)
    # tensor is kept
    entropy = (checkpoint(entropy_from_logits, logits, use_reentrant=False) if with_entropy
               else logits.new_zeros(0))
    return logprobs_from_logits(logits, response_ids), entropy


def score_bias(config) -> float:
    """`config.bias`, the reward normalisation (N+ detail 14); a bool `bias` is an architecture
    flag (Falcon)."""
    bias = getattr(config, "bias", None)
    return float(bias) if isinstance(bias, (int, float)) and not isinstance(bias, bool) else 0.0


def value_forward(value_model, query_responses, pad_token_id, context_length):
    """values[:, t] is read at the hidden state just before response token t."""
    hidden = final_hidden_states(value_model, query_responses, pad_token_id)
    hidden = hidden[:, context_length - 1 : -1]
    return value_model.score(hidden).squeeze(-1).float() - score_bias(value_model.config)


# ---- Phase 3: scores, the reward model's ---------------------------------------------------------
def score_responses(reward_model: nn.Module, queries: torch.Tensor, responses: torch.Tensor,
                    pad_token_id: int, chunk: int) -> torch.Tensor:
    """The reward model's scores of the responses, in chunks, minus its score bias
    (`reward_model_scores`)."""
    return torch.cat([reward_model_scores(reward_model,
                                          torch.cat((queries[i:i + chunk], responses[i:i + chunk]), 1),
                                          pad_token_id, queries.size(1))
                      for i in range(0, queries.size(0), chunk)])


def reward_model_scores(reward_model, query_responses, pad_token_id, context_length):
    """The reward model's score at the response's last non-pad token (the last query token if it
    is empty)."""
    hidden = final_hidden_states(reward_model, query_responses, pad_token_id)
    last = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    rows = torch.arange(hidden.size(0), device=hidden.device)
    scores = reward_model.score(hidden[rows, last]).squeeze(-1).float()
    return scores - score_bias(reward_model.config)


# ---- Phase 6: the PPO step on a micro-batch (after the rollout's record, `Rollout`) --------------
class Rollout(NamedTuple):
    """One update's rollout on this process as phases 1-5 left it: what phase 6 trains on, what a
    metric can read."""
    query_responses: torch.Tensor
    response_ids: torch.Tensor  # the responses with 0 for [PAD]: the ids log-probs are gathered at
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
    scores: torch.Tensor  # the reward model's score after the missing-eos rule
    contain_eos_token: torch.Tensor


def ppo_loss(model, rows, r: "Rollout", args: Args, pad_token_id: int):
    """Phase 6 on some rows of the rollout: the training forward, the clipped policy and value
    losses, their sum (loss, stats). Compiled whole on CUDA (--compile): nothing in here may read
    a tensor on the host."""
    context_length = r.query_responses.size(1) - r.responses.size(1)
    new_logprobs, entropy, vpred = model(r.query_responses[rows], pad_token_id, context_length,
                                         r.response_ids[rows], args.temperature)
    padding_mask, padding_mask_p1 = r.padding_mask[rows], r.padding_mask_p1[rows]
    new_logprobs = new_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
    vpred = vpred.masked_fill(padding_mask_p1, 0)
    pg_loss, pg_clipfrac, approxkl, ratio_mean = policy_loss(new_logprobs, r.logprobs[rows], r.advantages[rows],
                                                             padding_mask, args.cliprange)
    vf_loss, vf_clipfrac = value_loss(vpred, r.values[rows], r.returns[rows], padding_mask_p1, args.cliprange_value)
    stats = {"policy/approxkl_avg": approxkl, "policy/clipfrac_avg": pg_clipfrac, "loss/policy_avg": pg_loss,
             "loss/value_avg": vf_loss, "val/clipfrac_avg": vf_clipfrac,
             "policy/entropy_avg": masked_mean(entropy, ~padding_mask), "ratio": ratio_mean}
    # ALGO LOGIC: a loss term goes here (and its mean into `stats`, to log it)
    loss = pg_loss + args.vf_coef * vf_loss  # no entropy bonus, no KL loss term (as TRL and SFD)
    return loss, stats


class PolicyAndValueWrapper(nn.Module):
    """Policy and value as one module: one prepare, one optimizer (TRL's critic never trained:
    trl#2463)."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, query_responses, pad_token_id, context_length, response_ids, temperature):
        """(log-probs, entropies, values) of the responses."""
        logprobs, entropy = response_logprobs(self.policy, query_responses, pad_token_id, context_length,
                                              response_ids, temperature, with_entropy=True)
        return logprobs, entropy, value_forward(self.value_model, query_responses, pad_token_id, context_length)


# ---- Phase 7: metrics by name (a new one is one line of `local`), the held-out validation --------
def gathered_metrics(accelerator: Accelerator, args: Args, r: Rollout,
                     step_stats: list[dict]) -> dict:
    """The update's metrics by name (TRL's): per-process scalars in `local`, averaged over
    processes in one gather."""
    real, n = (~r.padding_mask).float(), accelerator.num_processes
    local = {
        "objective/kl": r.kl.sum(1).mean(),
        # TRL's entropy counted padding (as -1 each)
        "objective/entropy": (-r.logprobs * real).sum(1).mean(),
        "objective/non_score_reward": r.non_score_reward.sum(1).mean(),
        # what PPO maximised: every reward term, before whitening
        "objective/rlhf_reward": r.rewards.sum(1).mean(),
        "objective/scores": r.scores.mean(),
        # over all processes: the mean of n x each's
        "val/num_eos_tokens": n * r.contain_eos_token.sum().float(),
        "val/response_length": (r.sequence_lengths + 1).float().mean(),
        # ALGO LOGIC: a metric is one line here, from `r` or `args`, averaged over processes; the
        # means of `stats`:
        **{k: torch.stack([s[k] for s in step_stats]).mean() for k in (step_stats[0] if step_stats else ())
           if k != "ratio"},
    }
    local = {k: torch.as_tensor(v, dtype=torch.float32, device=accelerator.device) for k, v in local.items()}
    metrics = dict(zip(local, accelerator.gather(torch.stack(list(local.values())).unsqueeze(0)).mean(0).tolist()))
    ratios = accelerator.gather(torch.stack([s["ratio"] for s in step_stats])) if step_stats else torch.ones(1)
    return {**metrics, "val/ratio": ratios.mean().item(), "val/ratio_var": ratios.var().item() if ratios.numel() > 1
            else 0.0}


def evaluate(accelerator: Accelerator, models: Models, args: Args, setup: Setup, eval_queries: torch.Tensor,
             update: int, run_log: RunLog) -> dict:
    """Near-greedy held-out summaries (N+ detail 30), scored without the missing-eos rule (SFD),
    own generator."""
    tokenizer, pad_token_id, held_out = setup.tokenizer, setup.tokenizer.pad_token_id, setup.eval_rows[:]
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed + update)
    eval_args, chunk = replace(args, temperature=EVAL_TEMPERATURE), args.local_rollout_forward_batch_size
    with torch.no_grad(), accelerator.autocast():
        responses, _ = sample_responses(accelerator, models.sampler, eval_queries, eval_args, setup.zero3,
                                        pad_token_id, setup.stop_token_id, generator)
        scores = score_responses(models.reward_model, eval_queries, responses, pad_token_id, chunk)
    columns = zip(held_out["query"], [tokenizer.decode(ids) for ids in held_out["reference_ids"]], responses,
                  scores.tolist())
    rows = [{"query": query, "reference": reference, "response": tokenizer.decode(r[r != pad_token_id]),
             "score": score} for query, reference, r, score in columns]  # the eos stays visible
    rows = gather_once(held_out["index"], rows)  # each post once
    if accelerator.is_main_process:
        (setup.folder.path / "eval").mkdir(exist_ok=True)
        write_atomic(setup.folder.path / "eval" / f"update-{update:06d}.jsonl",
                     "".join(json.dumps(row) + "\n" for row in rows))
        print_rows(run_log.console, rows[:3], f"validation after update {update}", cut={"query": 300})
        run_log.table("validation", rows)  # to wandb with --track
    return {"objective/validation_score": sum(row["score"] for row in rows) / len(rows),
            "objective/reference_score": models.reference_score}


def reference_score(accelerator: Accelerator, reward_model: nn.Module, setup: Setup,
                    chunk: int) -> float:
    """The reward model's mean score of the held-out reference summaries, each post once over the
    processes."""
    pad_token_id = setup.tokenizer.pad_token_id
    queries = left_pad(setup.eval_rows["input_ids"], pad_token_id).to(accelerator.device)
    references = pad_sequence([torch.tensor(ids, dtype=torch.long) for ids in setup.eval_rows["reference_ids"]],
                              batch_first=True, padding_value=pad_token_id).to(accelerator.device)
    with torch.no_grad(), accelerator.autocast():
        scores = score_responses(reward_model, queries, references, pad_token_id, chunk)
    scores = gather_once(setup.eval_rows["index"], scores.tolist())
    return sum(scores) / len(scores)


# ---- Set-up, in call order: every check before any model loads, the run's folder taken last ------
@dataclass
class Setup:
    """What `set_up` resolved and checked before any model loads (TL;DR's fields)."""
    sizes: BatchSizes
    zero3: bool
    folder: RunFolder  # the run's folder, and the checkpoint a resume continues from
    # what a checkpoint records and a resume must match: the batch arithmetic, the data's size
    run_state: dict
    tokenizer: object
    stop_token_id: int | None
    train_dataset: Dataset
    eval_rows: Dataset  # this process's held-out posts, with their `index` among all of them
    # the first training posts' ids: the probe of the start-up checks (ppo_harness/forwards.py)
    probe_ids: list[list[int]]
    compiled: bool = False  # --compile: the training step and the sampler through torch.compile
    # compiled: every update's queries padded to the widest post (one compilation)
    query_width: int | None = None


def set_up(args: Args) -> tuple[Accelerator, Setup]:
    """Every check before any model loads (SFD's `parse_args`): flags, tokenizer, posts (N+ 1-4),
    models, folder."""
    check_args(args)
    accelerator, zero3 = start(args)  # DeepSpeed's accumulation and clipping set to the flags'
    sizes = batch_sizes(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                        args.num_mini_batches, accelerator.num_processes, args.total_episodes)
    # --compile auto: CUDA, and a run long enough
    compiled = should_compile(args, accelerator, sizes.num_updates)
    # 10-bit mantissa matmuls: faster, values change
    if args.tf32 and accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    # N+ detail 3
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path, padding_side="left",
                                              trust_remote_code=args.trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{args.sft_model_path}: the tokenizer has no eos token; TL;DR responses and references end "
                         "in eos, where the reward model reads its score")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # N+ detail 6: else the eos would be masked as padding
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    train_dataset = load_tldr_split(args.dataset_name, args.dataset_config, args.dataset_train_split,
                                    "--dataset-name")
    eval_dataset = load_tldr_split(args.eval_dataset_name or args.dataset_name,
                                   None if args.eval_dataset_name else args.dataset_config, args.dataset_eval_split,
                                   "--eval-dataset-name" if args.eval_dataset_name else "--dataset-name")
    if len(train_dataset) < sizes.batch_size:
        raise ValueError(f"{args.dataset_name} has {len(train_dataset)} posts in {args.dataset_train_split!r}: too few "
                         f"for one rollout batch of {sizes.batch_size}")
    if args.eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(args.eval_samples, len(eval_dataset))))
    if len(eval_dataset) < accelerator.num_processes:
        raise ValueError(f"{len(eval_dataset)} held-out posts cannot be shared by {accelerator.num_processes} "
                         "processes: raise --eval-samples")
    tokenize = dict(function=tokenize_tldr, batched=True,
                    fn_kwargs=dict(tokenizer=tokenizer, max_query_length=args.max_query_length))
    # the others read its cache
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        train_dataset = train_dataset.map(**tokenize, remove_columns=train_dataset.column_names)
        train_dataset = train_dataset.remove_columns(["query", "reference_ids"])
        eval_dataset = eval_dataset.map(**tokenize, remove_columns=eval_dataset.column_names)
    remote = dict(trust_remote_code=args.trust_remote_code)
    reward_config = check_scalar_model(args.reward_model_path, "--reward-model-path", require_head=True,
                                       **remote)
    check_scalar_model(args.value_model_path or args.reward_model_path, "value model", require_head=False,
                       **remote)
    configs = (AutoConfig.from_pretrained(args.sft_model_path, **remote), reward_config)
    positions = [getattr(c, "max_position_embeddings", None) for c in configs]
    max_positions = min((p for p in positions if p), default=None)
    longest = max(args.response_length, max(len(ids) for ids in eval_dataset["reference_ids"]))
    if max_positions is not None and args.max_query_length + longest > max_positions:
        raise ValueError(f"--max-query-length {args.max_query_length} plus the longest response or reference "
                         f"({longest} tokens) exceeds the models' {max_positions} positions: lower "
                         "--max-query-length or --response-length")
    # each process every world-th post, wrapping round so all have as many (ZeRO-3)
    n = len(eval_dataset)
    eval_rows = eval_dataset.add_column("index", list(range(n))).select(process_share(n, accelerator, in_step=True))
    stop_token_id = tokenizer.eos_token_id if args.stop_token == "eos" else None

    # the run's folder, last: a resume's checkpoint found and matched to this run, the folder locked
    # and taken
    run_state = dict(seed=args.seed, batch_size=sizes.batch_size, num_updates=sizes.num_updates,
                     num_prompts=len(train_dataset), num_processes=accelerator.num_processes)
    reads = {"--sft-model-path": args.sft_model_path, "--reward-model-path": args.reward_model_path,
             "--value-model-path": args.value_model_path, "--dataset-name": args.dataset_name,
             "--eval-dataset-name": args.eval_dataset_name}
    folder = claim(accelerator, args, run_state, RESUME_MAY_CHANGE, reads)
    query_width = max(len(ids) for ids in train_dataset["input_ids"]) if compiled else None
    return accelerator, Setup(sizes=sizes, zero3=zero3, folder=folder, run_state=run_state,
                              tokenizer=tokenizer, stop_token_id=stop_token_id,
                              train_dataset=train_dataset, eval_rows=eval_rows,
                              probe_ids=train_dataset[:4]["input_ids"], compiled=compiled, query_width=query_width)


def check_args(args: Args) -> None:
    """Refuse what the flags alone show to be wrong, before anything loads; each message names
    the flag to change."""
    # numeric flags within their intervals, Literal ones among their choices (`Args`)
    check_flags(args)
    if args.eval_dataset_name is None and Path(args.dataset_name).is_file():
        raise ValueError(f"--dataset-name {args.dataset_name} is a single file, so it has no "
                         f"{args.dataset_eval_split!r} split: give the held-out posts with --eval-dataset-name")
    local_batch_size = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                        * args.num_mini_batches)
    if args.whiten_rewards and local_batch_size < 8:
        raise ValueError(f"--whiten-rewards needs at least 8 responses per process, got {local_batch_size}")


def load_tldr_split(name: str, config: str | None, split: str, flag: str) -> Dataset:
    """A hub id, a dataset or `save_to_disk` directory, or a json/jsonl/parquet/csv file; with
    the TL;DR columns."""
    dataset = load_prompt_dataset(name, config, split, flag)
    check_text_columns(dataset, f"{flag} {name}", TLDR_COLUMNS)
    return dataset


# ---- TL;DR data: queries (N+ details 1-4), references (tests/test_tldr.py checks each) -----------
def format_query(subreddit: str, title: str, post: str) -> str:
    return QUERY_TEMPLATE.format(subreddit=subreddit, title=title, post=post)


def truncate_query(encode: Callable[[str], list[int]], subreddit: str, title: str, post: str,
                   max_query_length: int) -> tuple[str, list[int]]:
    """The query and its tokens, the post cut to fit (N+ detail 2) at its last newline (SFD),
    space, or character. SFD cuts and re-encodes one cut at a time (a 22k-word post without a
    newline: 22k encodes of the whole query); here the same cuts are listed first, then the first
    that fits is found by bisection (a shorter post never has more tokens): a few dozen encodes."""
    ends, no_newline, no_space = [len(post)], False, False  # each cut's post is post[:end]
    while ends[-1] > 0:
        end, cut = ends[-1], -1
        if not no_newline:
            cut = post.rfind("\n", 0, end)
            no_newline = cut < 0  # a shorter post has none either
        if cut < 0 and not no_space:
            cut = post.rfind(" ", 0, end)
            no_space = cut < 0
        ends.append(cut if cut >= 0 else end - 1)

    def fits(i: int) -> bool:
        return len(encode(format_query(subreddit, title, post[:ends[i]]))) <= max_query_length
    if not fits(len(ends) - 1):
        ids = encode(format_query(subreddit, title, ""))
        raise ValueError(f"the query for the post titled {title[:80]!r} is {len(ids)} tokens with an empty post: "
                         f"--max-query-length {max_query_length} is too small for its subreddit and title")
    first = bisect.bisect_left(range(len(ends)), True, key=fits)
    query = format_query(subreddit, title, post[:ends[first]])
    return query, encode(query)


def tokenize_tldr(batch: dict, tokenizer, max_query_length: int) -> dict:
    """`Dataset.map`: query text and tokens; the reference's tokens, summary + the eos id (N+
    detail 4)."""
    # noqa: E731 (with the tokenizer's own special tokens, e.g. BOS)
    encode = lambda text: tokenizer(text)["input_ids"]
    out = {"query": [], "input_ids": [], "reference_ids": []}
    for subreddit, title, post, summary in zip(*(batch[c] for c in TLDR_COLUMNS)):
        query, ids = truncate_query(encode, subreddit, title, post, max_query_length)
        if ids[-1] == tokenizer.eos_token_id:
            raise ValueError(f"the query for {title[:80]!r} ends in the eos token: the tokenizer appends eos to every "
                             "text (e.g. add_eos_token=True); use a tokenizer that does not")
        out["query"].append(query)
        out["input_ids"].append(ids)
        out["reference_ids"].append(tokenizer(" " + summary, add_special_tokens=False)["input_ids"]
                                    + [tokenizer.eos_token_id])
    return out


# ---- The models: policy, reference, value and reward models, one optimizer -----------------------
@dataclass
class Models:
    """The loaded models; `model` (policy + value, one module) and `optimizer` are
    accelerate-prepared."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    policy: nn.Module
    ref_policy: nn.Module
    value_model: nn.Module
    reward_model: nn.Module
    # the held-out references' mean score, the same at every validation: scored once
    reference_score: float
    notes: list  # the banner's lines on the sampler and the training step
    # what `sample_responses` samples with: the prepared model, or (main) a `StaticSampler` around
    # its policy
    sampler: object = None

    def named(self) -> dict:
        """Each model by its name in the banner."""
        return {"policy": self.policy, "reference": self.ref_policy, "value model": self.value_model,
                "reward model": self.reward_model}


def load_models(args: Args, accelerator: Accelerator, setup: Setup) -> Models:
    """Policy, reference (N+ 19), value model from the reward model (N+ 18), reward model: one
    AdamW (N+ 17)."""
    # "auto" would train a bf16 save in bf16
    kwargs = dict(trust_remote_code=args.trust_remote_code, dtype=args.dtype)
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, **kwargs)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, **kwargs)
    value_model, loading_info = AutoModelForSequenceClassification.from_pretrained(
        args.value_model_path or args.reward_model_path, num_labels=1, output_loading_info=True, **kwargs)
    if any(k.startswith("score.") for k in loading_info["missing_keys"]):
        # a fresh head: V = 0, as LMHP's (ZeRO-3: sharded)
        with gathered_for_init(value_model.score.parameters()):
            for p in value_model.score.parameters():
                nn.init.zeros_(p)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, num_labels=1,
                                                                      **kwargs)
    for m in (policy, ref_policy, value_model, reward_model):
        disable_dropout(m)  # N+ detail 7
    for m in (ref_policy, reward_model):
        m.eval().requires_grad_(False).to(accelerator.device)
    model = PolicyAndValueWrapper(policy, value_model)
    # transformers installs its hidden-state hooks under a lock dynamo cannot trace
    if setup.compiled:
        ready_to_compile(model)
    # AdamW over policy AND value, eps 1e-5 (N+ detail 9), no weight decay (TRL's default), a named
    # group each ALGO LOGIC: a critic's own lr: param_groups(lr, policy=policy) +
    # param_groups(args.vf_learning_rate, value=...)
    optimizer = torch.optim.AdamW(param_groups(args.learning_rate, policy=policy, value=value_model), eps=1e-5,
                                  weight_decay=0.0, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    if setup.zero3:  # the frozen models sharded too (N+ detail 31)
        for m in (ref_policy, reward_model):
            shard_frozen(m, accelerator.deepspeed_config)
    # DeepSpeed holds the policy in bf16/fp16: KL starts at 0
    elif accelerator.state.deepspeed_plugin is not None:
        dtype = next(accelerator.unwrap_model(model).parameters()).dtype
        for m in (ref_policy, reward_model):
            m.to(dtype)
    training_step = f"training step: {'compiled (torch.compile, fullgraph)' if setup.compiled else 'eager'} " \
                    f"(--compile {args.compile})"
    return Models(model, optimizer, policy, ref_policy, value_model, reward_model,
                  reference_score(accelerator, reward_model, setup, args.local_rollout_forward_batch_size),
                  [training_step], sampler=model)


def param_groups(lr: float, **modules: nn.Module) -> list[dict]:
    """An optimizer group per trained module, by name: `initial_lr`, where the lr's anneal starts,
    and `scheduled_lr`, the lr the schedule set last (another lr there was written elsewhere)."""
    groups = [dict(name=name, params=[p for p in m.parameters() if p.requires_grad])
              for name, m in modules.items()]
    return [dict(g, lr=lr, initial_lr=lr, scheduled_lr=lr) for g in groups if g["params"]]


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


if __name__ == "__main__":
    main(tyro.cli(Args))
