"""The speed layer: the shortcuts a script takes where a start-up check finds them equal to its own code, and the
plumbing of two choices of data flow the scripts make in plain sight. Each shortcut is named at the script's line
that takes it, and `check_forwards` and `check_sampling` check every one once, at start-up, against the script's functions as they are
(edited or not), refusing by name any that differs:

- `prefill_shared_prefix`: sampling runs the prompts' common prefix (a chat template's) once per chunk;
- `StaticSampler`: on CUDA, sampling's next-token forward through a static KV cache compiled into CUDA graphs;
- `head_logprobs`: log-probs and entropies straight from the final hidden states, a block of the vocabulary at a
  time (never a (batch, length, vocab) tensor), where the training step is not compiled; checked on values and
  gradients. With --compile the script's own code is compiled instead.

The data flow, visible in the scripts: the frozen bottom blocks run once per update (`frozen_trunk`, then
`blocks_only` runs the blocks above), and the states sampling computes anyway are kept (`keep_states`,
`kept_states`) instead of computed again. This module imports no script: the checks call the script's functions
through `script`, the script's module, by the names in `SCRIPT_CONTRACT`; `check_forwards` (on the models as
loaded) and `check_sampling` (on the prepared policy) run the checks.
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
from transformers import StaticCache

from ppo_harness.models import transformer_blocks, unpeft

# The names the speed layer calls in a script: its contract with ppo.py and ppo_tldr.py (tests/test_harness.py)
SCRIPT_CONTRACT = ("model_inputs", "final_hidden_states", "response_logprobs", "value_forward", "generate",
                   "scale_logits", "logprobs_from_logits", "left_pad")


def check_contract(script) -> None:
    """Refuse a script (a copy) that lacks a function the speed layer calls, by name."""
    missing = [name for name in SCRIPT_CONTRACT if not callable(getattr(script, name, None))]
    if missing:
        raise AttributeError(f"{script.__file__}: the speed layer (ppo_harness/speed.py) calls {missing}, which this "
                             "script does not define; restore them, or run with --no-fast-paths")


@dataclass(frozen=True)
class Shortcuts:
    """What the start-up checks accepted; Shortcuts() is the plain computation (--no-fast-paths, ZeRO-3)."""
    fused_head: bool = False  # `head_logprobs` instead of logits (where the training step is not compiled)
    shared_prefix: bool = False  # `prefill_shared_prefix` while sampling
    static: "StaticSampler | None" = None  # the compiled static-cache sampler (CUDA)
    num_frozen: dict = field(default_factory=dict)  # "policy"/"value": frozen bottom blocks run once per update
    value_shares_trunk: bool = False  # the value model starts from the policy's checkpoint: one trunk serves both
    keep: tuple = ()  # what sampling keeps: "trunk" (the policy's frozen blocks' output), "final" (for a value head)
    notes: tuple = ()  # the banner's lines


def check_forwards(script, args, setup, policy, value_model=None, value_head=None, compiled=False,
                   value_shares_trunk=False) -> Shortcuts:
    """The checks on the models as loaded: each frozen trunk (the script's forwards from it against its full ones,
    values and gradients), and the fused head (unless `compiled`: the training step is compiled instead). Not under
    ZeRO-3, whose weights are whole only inside DeepSpeed's hooks."""
    if not args.fast_paths or setup.zero3:
        reason = "--no-fast-paths" if not args.fast_paths else "ZeRO-3 shards the weights"
        return Shortcuts(notes=(f"frozen trunks, kept states and shortcuts: none ({reason})",))
    check_contract(script)
    pad_token_id = setup.tokenizer.pad_token_id
    probe = script.left_pad(setup.train_dataset[:2]["input_ids"], pad_token_id).to(policy.device)
    num_frozen, refused = {}, []
    for name, model in (("policy", policy), ("value", value_model)):
        frozen = len(transformer_blocks(model)[1]) - args.num_trainable_layers if (
            model is not None and getattr(args, "num_trainable_layers", None) is not None) else 0
        if frozen <= 0:
            continue
        if adapter_free_trunk(model, frozen) and trunk_is_exact(script, model, probe.to(model.device), pad_token_id,
                                                                frozen, value_head if name == "policy" else None):
            num_frozen[name] = frozen
        else:
            refused.append(f"the {name}'s frozen trunk")
    fused_head = not compiled and fused_head_is_exact(script, policy, probe, pad_token_id, args.temperature)
    if not compiled and not fused_head:
        refused.append("the fused LM head")
    return Shortcuts(fused_head=fused_head, num_frozen=num_frozen, notes=tuple(refused),
                     value_shares_trunk=value_shares_trunk and len(num_frozen) == 2)


def check_sampling(script, args, accelerator, setup, policy, value_head, shortcuts: Shortcuts) -> Shortcuts:
    """The checks of sampling, on the prepared policy under the run's autocast: the shared prefix, then one sampling
    loop of the script's own `generate` whose tokens serve the static sampler's check (fed through it) and the kept
    states' check (a full forward on them). `shortcuts`: `check_forwards`'; the banner's lines in its notes."""
    if not args.fast_paths or setup.zero3:
        asked = setup.zero3 and args.sampler in ("static", "compiled")  # said, never silently dropped
        note = f" ({args.sampler} refused under ZeRO-3: weights gathered per rollout)" if asked else ""
        return replace(shortcuts, notes=shortcuts.notes + (f"sampler: dynamic KV cache{note}",))
    pad_token_id, device, temperature = setup.tokenizer.pad_token_id, accelerator.device, args.temperature
    refused, rows = list(shortcuts.notes), setup.train_dataset[:8]["input_ids"]
    queries = script.left_pad(rows, pad_token_id).to(device)[:args.local_rollout_forward_batch_size]
    with accelerator.autocast():
        shared = min(len(row) for row in rows) - 1 if len(rows) > 1 else 0  # a prefix the probe rows surely share
        shared_queries = script.left_pad([rows[0][:shared] + row[shared:] for row in rows], pad_token_id).to(device)
        shared_prefix = shared > 0 and shared_prefix_is_exact(script, policy, shared_queries, pad_token_id)
        if shared > 0 and not shared_prefix:
            refused.append("the shared prompt prefix")
        static, static_note = None, "dynamic KV cache"
        mode = args.sampler if args.sampler != "auto" else "compiled" if setup.compiled else "dynamic"
        if mode != "dynamic":  # one cache width for the run: its widest prompt's (one compilation)
            widest = max(len(ids) for part in (setup.train_dataset, setup.eval_rows) if len(part)
                         for ids in part["input_ids"])
            static = StaticSampler(args.local_rollout_forward_batch_size, compile=mode == "compiled", width=widest)
        candidates = () if static is not None else tuple(name for name, use in (
            ("trunk", "policy" in shortcuts.num_frozen), ("final", value_head is not None)) if use)
        plain = replace(shortcuts, fused_head=False, shared_prefix=shared_prefix, keep=candidates)
        with torch.no_grad(), keep_states(policy, plain) as pieces:  # the one sampling loop, as the run would
            responses, logprobs = script.generate(policy, queries, pad_token_id, args, setup.stop_token_id,
                                                  torch.Generator(device).manual_seed(0), False, plain)
        qr = torch.cat((queries, responses), 1)
        with torch.no_grad():
            full = script.response_logprobs(policy, qr, pad_token_id, queries.size(1), responses, temperature)[0]
        kept = kept_states(pieces, queries != pad_token_id, [responses.size(1)], qr.size(1))
        keep = tuple(name for name in candidates if kept_is_exact(script, policy, qr, pad_token_id, queries.size(1),
                                                                   temperature, kept, name, shortcuts.num_frozen,
                                                                   full))
        refused += [f"the kept {name} states" for name in candidates if name not in keep]
        if static is not None:
            every_process = lambda ok: bool(accelerator.gather(  # noqa: E731 (all sample alike, or none)
                torch.tensor([float(ok)], device=device)).min() > 0)
            accepted, static_note = static.probe(script, policy, queries, pad_token_id, args, responses,
                                                 (logprobs - full).abs().max().item(), full, shared_prefix,
                                                 every_process)
            static = static if accepted else None
    trunks = ", ".join(f"{name} {n} blocks" for name, n in shortcuts.num_frozen.items()) or "none"
    head = "on" if shortcuts.fused_head else "off (the training step is compiled)" if setup.compiled else "off"
    return replace(shortcuts, shared_prefix=shared_prefix, static=static, keep=keep, notes=(
        f"frozen trunks run once per update: {trunks}; kept while sampling: {', '.join(keep) or 'nothing'}",
        f"shortcuts: fused LM head {head}; shared prompt prefix {'on' if shared_prefix else 'off'}; sampler: "
        f"{static_note}" + (f"; refused by their checks: {', '.join(refused)}" if refused else ""),
        f"training step: {'compiled (torch.compile, fullgraph)' if setup.compiled else 'eager'} (--compile "
        f"{args.compile})"))


def should_compile(args, accelerator, num_updates: int, pays_back_after: int = 40) -> bool:
    """--compile: on, off, or auto: on for one CUDA process, without DeepSpeed, in a run of at least
    `pays_back_after` updates, where compiling pays back (benchmarks/README.md#gpu). Several processes (DDP) compile
    with --compile on only: not yet measured on several GPUs. DeepSpeed's engine is refused by name. Sets the compile
    cache's folder (`compile_cache`)."""
    deepspeed = accelerator.state.deepspeed_plugin is not None
    if args.compile == "on" and deepspeed:
        raise ValueError("--compile on: DeepSpeed's engine runs its own forward hooks, which are not compiled here; "
                         "use --compile off (or auto) with DeepSpeed, or a DDP launch")
    compiled = args.compile == "on" or (args.compile == "auto" and accelerator.device.type == "cuda" and not deepspeed
                                        and accelerator.num_processes == 1 and num_updates >= pays_back_after)
    if compiled:
        compile_cache()
    return compiled


# ---- The frozen trunk: the bottom blocks run once per update, the blocks above from their output ------------------
def adapter_free_trunk(model: nn.Module, num_frozen: int) -> bool:
    """Whether the embeddings and the bottom `num_frozen` blocks carry no peft module of any kind."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    name, blocks = transformer_blocks(model)
    top = tuple(f"{name}.{i}." for i in range(num_frozen, len(blocks)))
    return not any(isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)) and not f"{n}.".startswith(top)
                   for n, m in unpeft(model).base_model.named_modules())


_SLICES = {}  # (id of a block list, start, stop) -> its slice: one object per slice, so compiled code's guards hold


@contextmanager
def blocks_only(model: nn.Module, start: int, stop: int | None = None):
    """Run the backbone through blocks[start:stop] alone; per-block config lists (layer_types...) are sliced too."""
    name, blocks = transformer_blocks(model)
    backbone = unpeft(model).base_model
    part = _SLICES.setdefault((id(blocks), start, stop), (blocks, blocks[start:stop]))[1]
    per_block = {k: v for k, v in vars(backbone.config).items() if isinstance(v, list) and len(v) == len(blocks)}
    setattr(backbone, name, part)
    for key, values in per_block.items():
        setattr(backbone.config, key, values[start:stop])
    try:
        yield
    finally:
        setattr(backbone, name, blocks)
        for key, values in per_block.items():
            setattr(backbone.config, key, values)


def frozen_trunk(model: nn.Module, query_responses, pad_token_id: int, num_frozen: int, model_inputs) -> torch.Tensor:
    """Hidden states after the embeddings and the `num_frozen` frozen bottom blocks (`model_inputs`: the script's)."""
    outputs = []
    hook = transformer_blocks(model)[1][num_frozen - 1].register_forward_hook(
        lambda module, args, output: outputs.append(output[0] if isinstance(output, tuple) else output))
    try:
        with blocks_only(model, 0, num_frozen):
            unpeft(model).base_model(**model_inputs(query_responses, pad_token_id), use_cache=False)
    finally:
        hook.remove()
    return outputs[0]


def trunk_is_exact(script, model, query_responses, pad_token_id: int, num_frozen: int, value_head=None) -> bool:
    """Whether the script's forwards from the frozen trunk give its full forwards' log-probs (a causal LM) or values
    (a sequence classifier, or a value head on a causal LM) and their gradients (GPT-2 adds position embeddings
    inside its backbone, so its trunk is refused)."""
    trunk = (frozen_trunk(model, query_responses, pad_token_id, num_frozen, script.model_inputs).detach(), num_frozen)
    ids = query_responses[:, 1:].masked_fill(query_responses[:, 1:] == pad_token_id, 0)
    if hasattr(model, "score"):
        head = None
        outputs = lambda t: (script.value_forward(model, query_responses, pad_token_id, 1, trunk=t),)  # noqa: E731
    else:
        head = value_head

        def outputs(t):
            logprobs, entropy, hidden = script.response_logprobs(model, query_responses, pad_token_id, 1, ids, 1.0,
                                                                 True, t, with_hidden=head is not None)
            return (logprobs, entropy) + ((script.value_forward(model, query_responses, pad_token_id, 1, head,
                                                                hidden),) if head is not None else ())
    params = [p for p in [*model.parameters(), *(head.parameters() if head is not None else ())] if p.requires_grad]
    return same_values_and_gradients(lambda: outputs(trunk), lambda: outputs(None), params)


def same_values_and_gradients(fast, plain, params, rtol=1e-4, atol=1e-4, grad_rtol=1e-3) -> bool:
    """Whether two computations give the same outputs (to rtol and atol, element by element) and the same gradients
    of a random weighted sum of them with respect to `params`, each gradient to grad_rtol of its largest element (a
    gradient's elements are sums whose terms may be far larger than the sum: float32 rounding alone reaches 1e-4 of
    the largest in SmolLM2's top blocks; an edited computation differs by far more). The gradients are put back."""
    saved = [p.grad for p in params]
    try:
        results = []
        for compute in (fast, plain):
            for p in params:
                p.grad = None
            outputs = compute()
            weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o.device, o.dtype)
                       for i, o in enumerate(outputs)]
            total = sum((o * w).sum() for o, w in zip(outputs, weights) if o.numel())
            grads = torch.autograd.grad(total, params, allow_unused=True) if total.requires_grad and params else ()
            results.append(([o.detach() for o in outputs], grads))
        (values, grads), (plain_values, plain_grads) = results
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)
                   for a, b in zip(values, plain_values)) and len(grads) == len(plain_grads) and all(
            (a is None) == (b is None) and (a is None or bool((a.float() - b.float()).abs().max() <= grad_rtol * b.float(
            ).abs().max() + 1e-6)) for a, b in zip(grads, plain_grads))
    finally:
        for p, g in zip(params, saved):
            p.grad = g


# ---- The fused LM head ------------------------------------------------------------------------------------------
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


def fused_head_is_exact(script, policy, query_responses: torch.Tensor, pad_token_id: int, temperature: float) -> bool:
    """Whether the script's `response_logprobs` gives the same log-probs, entropies and gradients (of the trained
    weights) through the fused head as through its own lines (not for a head that scales, caps or biases its
    logits, nor for an edited computation of the log-probs)."""
    head = policy.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:  # e.g. a LoRA-wrapped head: its weight is not all of it
        return False
    ids = query_responses[:, 1:].masked_fill(query_responses[:, 1:] == pad_token_id, 0)
    params = [p for p in policy.parameters() if p.requires_grad]
    return same_values_and_gradients(*(lambda fused=fused: script.response_logprobs(
        policy, query_responses, pad_token_id, 1, ids, temperature, True, fused_head=fused)[:2]
        for fused in (True, False)), params)


# ---- Sampling: what it keeps, the shared prefix, the static sampler ------------------------------------------------
@contextmanager
def keep_states(policy, shortcuts: Shortcuts):
    """Keep what sampling computes anyway, a piece per forward: the frozen blocks' output ("trunk") and the final
    hidden states ("final"), as `shortcuts.keep` asks. A KV cache's states are not bit-identical to a full forward's:
    `kept_is_exact` checks them at start-up."""
    pieces, hooks = {"trunk": [], "final": []}, []
    if "trunk" in shortcuts.keep:
        hooks.append(transformer_blocks(policy)[1][shortcuts.num_frozen["policy"] - 1].register_forward_hook(
            lambda module, args, output: pieces["trunk"].append(output[0] if isinstance(output, tuple) else output)))
    if "final" in shortcuts.keep:
        hooks.append(unpeft(policy).base_model.register_forward_hook(
            lambda module, args, output: pieces["final"].append(output.last_hidden_state)))
    try:
        yield pieces
    finally:
        for hook in hooks:
            hook.remove()


def kept_states(pieces: dict, real: torch.Tensor, lengths: list[int], total_length: int) -> dict:
    """The states `keep_states` kept while chunks of queries (`real`: their tokens, not padding) got `lengths` new
    tokens each, as (rows, total_length, hidden) tensors aligned with the query-responses: a chunk's prefill (maybe
    a shared prefix, then each row's rest, right-aligned), then one piece per token; columns no forward ran are 0.
    The pieces arrive in this order because the hooks append one per forward."""
    starts, width = real.int().argmax(1), real.size(1)

    def assemble(pieces: list):
        out, row = pieces[0].new_zeros(real.size(0), total_length, pieces[0].size(-1)), 0
        for n in lengths:
            # a one-row piece before a wider one: a shared prefix (`prefill_shared_prefix` shares between 2+ rows)
            prefix = pieces.pop(0) if pieces[0].size(0) < pieces[1].size(0) else None
            chunk = torch.cat(pieces[:n + 1], 1)
            del pieces[:n + 1]
            out[row:row + chunk.size(0), width + n - chunk.size(1):width + n] = chunk
            if prefix is not None:
                index = torch.arange(row, row + chunk.size(0), device=chunk.device)[:, None]
                out[index, starts[index] + torch.arange(prefix.size(1), device=chunk.device)] = prefix
            row += chunk.size(0)
        return out
    return {name: assemble(list(kept)) for name, kept in pieces.items() if kept}


def kept_is_exact(script, policy, query_responses, pad_token_id, context_length, temperature, kept: dict,
                  name: str, num_frozen: dict, full_logprobs) -> bool:
    """Whether a state kept while sampling gives what a full forward does on the sampled sequences: the log-probs
    computed from the kept trunk (those sampling drew are as close), or the final states themselves."""
    real = query_responses != pad_token_id
    with torch.no_grad():
        if name == "trunk":
            trunk = (kept["trunk"], num_frozen["policy"])
            fast = script.response_logprobs(policy, query_responses, pad_token_id, context_length,
                                            query_responses[:, context_length:], temperature, trunk=trunk)[0]
            pair = fast[real[:, context_length:]], full_logprobs[real[:, context_length:]]
        else:
            pair = kept["final"][real], script.final_hidden_states(policy, query_responses, pad_token_id)[real]
        return torch.allclose(*pair, rtol=1e-4, atol=1e-4)


def prefill_shared_prefix(policy, queries, pad_token_id, model_inputs):
    """Sampling's first forward with the tokens every row starts with (a chat template's) run once, their KV cache
    repeated for each row, then each row's [padding, rest]: (output, attention mask, last position ids), as the plain
    prefill's. `keep_states` sees the prefix as a piece with one row."""
    inputs = model_inputs(queries, pad_token_id)
    real = inputs["attention_mask"].bool()
    starts, shortest, n = real.int().argmax(1), int(real.sum(1).min()), 0
    last = torch.tensor([-1], device=queries.device)  # not logits_to_keep=1: a slice made the head a batched matmul
    if queries.size(0) > 1:  # the longest common prefix, each row keeping a token of its own
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


def shared_prefix_is_exact(script, policy, queries, pad_token_id: int) -> bool:
    """Whether the prefill with the prefix these queries share run once gives the plain prefill's next-token logits; a
    cache that cannot repeat its rows (a linear-attention layer's) refuses it."""
    inputs = script.model_inputs(queries, pad_token_id)
    last = torch.tensor([-1], device=queries.device)
    try:
        with torch.no_grad():
            shared = prefill_shared_prefix(policy, queries, pad_token_id, script.model_inputs)[0].logits
            return torch.allclose(shared, policy(**inputs, use_cache=True, logits_to_keep=last).logits, rtol=1e-4,
                                  atol=1e-4)
    except (AttributeError, NotImplementedError):
        return False


class HostFlag:
    """A 0-d GPU tensor copied to the host without waiting for the work queued after it: `send` queues the copy into
    pinned memory and marks it with an event, `read` waits for that event alone. On the CPU, the tensor itself."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.value = torch.zeros((), dtype=torch.float32, pin_memory=True) if self.cuda else None
        self.event = torch.cuda.Event() if self.cuda else None

    def send(self, flag: torch.Tensor) -> None:
        if self.cuda:
            self.value.copy_(flag.to(self.value.dtype), non_blocking=True)
            self.event.record()
        else:
            self.value = flag

    def read(self) -> bool:
        if self.cuda:
            self.event.synchronize()
        return bool(self.value)


def on_device(array, device) -> torch.Tensor:
    """A numpy array as a tensor on `device`, copied without waiting for the GPU's queue (pinned memory)."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


def stored_as_allocated(layer) -> None:
    """A static cache layer that casts what it stores to its own dtypes. Under autocast RoPE leaves the keys in float32
    while a step's values come out of their projection in bf16, and the layer allocated both as the prefill's keys:
    storing bf16 in float32 is exact, and attention's autocast casts both back as it does the dynamic cache's."""
    update = layer.update

    def update_in_the_caches_dtype(key_states, value_states, *args, **kwargs):
        return update(key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype), *args, **kwargs)
    layer.update = update_in_the_caches_dtype


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with copies of its first row appended up to `rows` rows (rows nobody reads: a static shape)."""
    return torch.cat((tensor, tensor[:1].expand(rows - tensor.size(0), *tensor.shape[1:]))) if rows > len(tensor) \
        else tensor


class StaticSampler:
    """Sampling's next-token forwards through transformers' `StaticCache`, compiled into CUDA graphs (torch.compile,
    mode "reduce-overhead"). With a dynamic cache a small model's loop is bound by kernel launches (about 36 ms a
    token at batch 64 for 135M parameters on an H100); a graph replays them all at once. Static shapes recompile, so
    a chunk is padded to `rows` rows and its cache to `width` (the run's widest prompt) rounded up to `bucket`, plus
    the response: one compilation per run and dtype, its seconds in `compilations`, and any later one reported."""

    def __init__(self, rows: int, bucket: int = 64, compile: bool = True, width: int = 0):
        self.rows, self.bucket, self.compile, self.width = rows, bucket, compile, width
        self.caches, self.forwards, self.compilations = {}, {}, []
        self.graphs = graph_counts()

    def start(self, policy, prefilled, attention_mask, position_ids, response_length):
        """A step function for one chunk, token (n, 1) -> the next token's logits (n, vocab), after copying the
        prefill's dynamic cache `prefilled` into a static one."""
        n, width = attention_mask.shape
        rows, length = max(self.rows, n), -(-max(width, self.width) // self.bucket) * self.bucket + response_length
        key = (rows, length, prefilled.layers[0].keys.dtype)
        new_shape = key not in self.caches
        if new_shape:
            self.caches[key] = StaticCache(config=unpeft(policy).config, max_cache_len=length)
        cache = self.caches[key]
        for layer, source in zip(cache.layers, prefilled.layers):
            keys, values = pad_rows(source.keys, rows), pad_rows(source.values, rows)
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
                stored_as_allocated(layer)
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
            positions, column, timer, graphs = positions + 1, column + 1, time.perf_counter(), graph_counts()[0]
            if self.compile:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: the graph may rerun
            # contiguous: a column of the probe's responses is strided, and a stride is one of the compiled guards
            logits = self.forwards[id(policy)](input_ids=pad_rows(token, rows).contiguous(), attention_mask=mask,
                                               position_ids=positions, past_key_values=cache, use_cache=True).logits
            logits = logits[:n, -1].clone()  # a CUDA graph's output is overwritten by its next replay
            if new_shape:
                self.compilations.append((key, time.perf_counter() - timer))
                new_shape = False
                if self.compile:  # benchmarks/gpu_bench.py reads this line
                    print(f"compiled the sampler for {rows} rows x {length} positions in "
                          f"{self.compilations[-1][1]:.1f} s ({self.counted()})")
            elif self.compile and graph_counts()[0] != graphs:  # a guard failed: dynamo compiled again
                print(f"the sampler compiled again at {rows} rows x {length} positions ({self.counted()})")
            return logits
        return step

    def counted(self) -> str:
        """The graphs dynamo compiled and the CUDA graphs inductor skipped, so far (also another model's)."""
        self.graphs = graph_counts()
        return f"{self.graphs[0]} graphs compiled, {self.graphs[1]} CUDA graph skips"

    def probe(self, script, policy, queries, pad_token_id, args, responses, dynamic_error: float, full,
              share_prefix: bool, agree=bool) -> tuple:
        """(accepted, the banner's note). The tokens sampling drew (with the dynamic cache, whose error against a full
        forward is `dynamic_error`) are fed through this sampler (compiling it), and its log-probs compared with the
        full forward's `full`: accepted if its error is within 1e-4, twice the dynamic cache's, or the compute dtype's
        rounding of the log-probs (bf16's). `agree` makes one verdict of every process's."""
        if any(getattr(layer, "is_sliding", False) for layer in StaticCache(
                config=unpeft(policy).config, max_cache_len=2).layers):
            agree(False)
            return False, "dynamic KV cache (static refused: a sliding-window layer would recompile at every step)"
        error, note = None, ""
        try:
            error = (forced_logprobs(script, policy, queries, pad_token_id, responses, args, self, share_prefix)
                     - full).abs().max().item()
            device = queries.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else full.dtype
            tolerance = max(1e-4, 2 * dynamic_error, torch.finfo(dtype).eps * full.abs().max().item())
        except Exception as failure:  # a model whose cache or forward does not compile: the dynamic cache samples
            note = f"dynamic KV cache (the static probe failed: {type(failure).__name__}: {str(failure)[:200]})"
        accepted = agree(error is not None and error <= tolerance)
        if error is None:
            return False, note
        kind = f"static KV cache compiled in {sum(s for _, s in self.compilations):.0f} s, {self.counted()}" if \
            self.compile else "static KV cache, uncompiled"
        verdict = kind if accepted else f"dynamic KV cache (refused: {kind}" + (
            ")" if error <= tolerance else f"; over {tolerance:.1e})")
        return accepted, (f"{verdict}; probe: max |log-prob - full forward's| {error:.1e}, the dynamic "
                          f"cache's {dynamic_error:.1e}, on the same tokens")


def graph_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, CUDA graphs inductor skipped) in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]


@torch.no_grad()
def forced_logprobs(script, policy, queries, pad_token_id, responses, args, static, share_prefix=False):
    """The log-probs of `responses` fed token by token through a `StaticSampler`, as sampling computes them."""
    if share_prefix:
        out, attention_mask, position_ids = prefill_shared_prefix(policy, queries, pad_token_id, script.model_inputs)
    else:
        inputs = script.model_inputs(queries, pad_token_id)
        out = policy(**inputs, use_cache=True, logits_to_keep=torch.tensor([-1], device=queries.device))
        attention_mask, position_ids = inputs["attention_mask"], inputs["position_ids"][:, -1:]
    step_model = static.start(policy, out.past_key_values, attention_mask, position_ids, args.response_length)
    logits, logprobs = out.logits[:, -1], []
    for step in range(responses.size(1)):
        token = responses[:, step:step + 1]
        scaled = script.scale_logits(logits, args.temperature, pad_token_id)
        logprobs.append(script.logprobs_from_logits(scaled, token.squeeze(-1)))
        if step == responses.size(1) - 1:
            break
        logits = step_model(token)
    return torch.stack(logprobs, dim=1)


# ---- The compiled training step ------------------------------------------------------------------------------------
class CompileWatch:
    """What torch.compile compiled during each update (the graphs dynamo made, the CUDA graphs inductor skipped): after
    the first update with compiled code, what compiling cost; after a later one, a recompilation (a failed guard)."""

    def __init__(self):
        self.seen, self.first = graph_counts(), None

    def report(self, update: int, seconds: float, console=None) -> None:
        now = graph_counts()
        graphs, self.seen = now[0] - self.seen[0], now
        if graphs and console is not None:
            first, self.first = self.first is None, self.first or update
            console.print(f"update {update}: torch.compile made {graphs} graph(s) ({now[1]} CUDA graph skips so far); "
                          f"its training phase took {seconds:.1f} s" + (
                              "" if first else " (a recompilation: TORCH_LOGS=recompiles says why)"), highlight=False)


def compile_cache(root: str = "cache/torch_compile") -> str:
    """Where torch.compile keeps its artefacts (inductor's FX graph cache, autotuning, kernels), so that a second run
    of the same shapes starts warm: TORCHINDUCTOR_CACHE_DIR if set, else `root` beside the run's other caches."""
    import os
    from pathlib import Path

    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(root).resolve()))


def ready_to_compile(*models) -> None:
    """transformers installs the hooks that record hidden states (`output_hidden_states`) on the first forward that
    asks for them, under a lock dynamo cannot trace: install them before the training step is compiled."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks

    for model in models:
        for module in model.modules():
            if _CAN_RECORD_REGISTRY.get(module):
                maybe_install_capturing_hooks(module)


class CompiledOrEager:
    """A compiled training step that falls back to the eager one where the compiler fails on its first call (an
    operator it cannot trace whole, a kernel that does not build), saying so once: with --compile auto the run goes
    on eagerly; with --compile on the error is raised."""

    def __init__(self, compiled, eager, strict: bool, console=print):
        self.compiled, self.eager, self.strict, self.console, self.first = compiled, eager, strict, console, True

    def __call__(self, *args, **kwargs):
        if not self.first:
            return self.compiled(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as error:  # the compiler's errors are of many kinds (dynamo's, inductor's, triton's)
            if self.strict:
                raise
            self.console(f"the training step did not compile ({type(error).__name__}: {str(error)[:300]}); it "
                         "runs eagerly (--compile off skips the attempt)")
            self.compiled = self.eager
            out = self.eager(*args, **kwargs)
        self.first = False
        return out
