"""The README ledger's hand-written forwards, each checked once at start-up against the script's
own forwards as they are (edited or not), and the parts of a transformers model they reach into (its
blocks, the model inside a peft wrapper). This module imports no script: it calls the script's
`left_pad`, `model_inputs`, `response_logprobs` and `value_forward` through `script`.

The frozen trunk (--num-trainable-layers N). A model that trains only its top N blocks gets no
gradient in the blocks below, so their output cannot change within an update: the scripts run them
once per update (`frozen_trunk`) and every later forward of that update from their output, through
the blocks above alone (`blocks_only`). On a CPU this decides whether a 135M model trains in minutes
or in hours. `check_trunks` checks that a forward from the trunk gives the full forward's outputs
and gradients, model by model, and which models share the policy's trunk: the reference and a value
model started from the SFT policy hold the same bottom weights, so one trunk serves all three, but
an edit that loads another reference gets its own.

`keep_trunk` keeps the policy's trunk while the rollout samples: sampling runs the bottom blocks
over every token anyway, the prompts in the prefill and each sampled token as it is fed back, so
forward hooks record their output and the `trunk` it yields lays it out as the tensor
`frozen_trunk` would compute. A KV cache's states are not bit-identical to a full forward's:
`check_kept_trunk` compares them once at start-up (to 1e-4) and refuses them where they differ (bf16
autocast, a drifting cache).

The LM head over vocabulary blocks (`HeadLogprobs`, `FusedHeadForward`, `fused_head`): training's
log-probs and entropies straight from the final hidden states, a block of the vocabulary at a time,
never a (batch, length, vocab) tensor. On a small model with a large vocabulary (the throughput
bench: 49k words on hidden 128) the plain head's logits are a 340 MB tensor that the log-softmax,
the gather, the entropy and their backward pass over about a dozen times; this halves that run.
On the default run (49k words on hidden 576, 6 trained blocks) it buys 1.06x, under the ledger's
1.2x, so ppo.py runs it only with --fused-lm-head; the sibling scripts not at all.

`FusedHeadForward` stands in for the script's `PolicyAndValueWrapper` in training: the same
submodules under the same names (the optimizer, accelerate and the checkpoints see the same model)
and a forward that reads the log-probs from the hidden states through `HeadLogprobs` instead of the
script's `response_logprobs`. `fused_head` builds it where a probe finds its outputs and gradients
equal to the script's own forward as edited, else hands back the script's wrapper. The reference's
log-probs and every other forward stay the script's own.
"""
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from peft import PeftModel


# ---- The parts of a transformers model the forwards reach into
def unpeft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (whose LoRA layers are injected in place), or the
    model itself."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The attribute name and the list of transformer blocks of a transformers model's backbone."""
    for name, child in model.get_decoder().named_children():
        if isinstance(child, nn.ModuleList):
            return name, child
    raise ValueError(f"{type(model).__name__}: no list of transformer blocks found")


# a block list -> {(start, stop): its slice}: one object per slice, so that compiled code's guards
# on the module hold from one forward to the next (a new ModuleList each time would recompile)
_SLICES = weakref.WeakKeyDictionary()


@contextmanager
def blocks_only(model: nn.Module, start: int, stop: int | None = None):
    """Run the backbone through blocks[start:stop] alone; per-block config lists (layer_types...)
    are sliced too."""
    name, blocks = transformer_blocks(model)
    backbone = model.get_decoder()
    part = _SLICES.setdefault(blocks, {}).setdefault((start, stop), blocks[start:stop])
    per_block = {k: v for k, v in vars(backbone.config).items()
                 if isinstance(v, list) and len(v) == len(blocks)}
    setattr(backbone, name, part)
    for key, values in per_block.items():
        setattr(backbone.config, key, values[start:stop])
    try:
        yield
    finally:
        setattr(backbone, name, blocks)
        for key, values in per_block.items():
            setattr(backbone.config, key, values)


def frozen_trunk(model: nn.Module, query_responses, pad_token_id: int, num_frozen: int,
                 model_inputs) -> torch.Tensor:
    """Hidden states after the embeddings and the `num_frozen` frozen bottom blocks (`model_inputs`:
    the script's)."""
    outputs = []
    hook = transformer_blocks(model)[1][num_frozen - 1].register_forward_hook(
        lambda module, args, output: outputs.append(output[0] if isinstance(output, tuple)
                                                    else output))
    try:
        with blocks_only(model, 0, num_frozen):
            model.get_decoder()(**model_inputs(query_responses, pad_token_id), use_cache=False)
    finally:
        hook.remove()
    return outputs[0]


def check_trunks(script, args, setup, policy, ref_policy=None, value_model=None, value_head=None):
    """(the frozen blocks of each model whose trunk is exact, {"policy": n, "reference": n, "value":
    n}; the models that share the policy's trunk; the banner's line). None under --no-fast-paths,
    under ZeRO-3 (its sharded weights are whole only inside DeepSpeed's forward hooks) or where
    every block trains. `ref_policy` None: the reference is the policy with its adapter off, whose
    trunk is the policy's where no adapter lies in it."""
    if not args.fast_paths or setup.zero3 or getattr(args, "num_trainable_layers", None) is None:
        why = ("--no-fast-paths" if not args.fast_paths
               else "ZeRO-3 shards the weights" if setup.zero3
               else "every block trains")
        return {}, set(), f"frozen trunks: none ({why})"
    pad_token_id = setup.tokenizer.pad_token_id
    probe = script.left_pad(setup.probe_ids[:2], pad_token_id).to(policy.device)
    num_frozen, shares, refused = {}, set(), []
    reference = policy if ref_policy is None else ref_policy
    for name, model in (("policy", policy), ("reference", reference), ("value", value_model)):
        frozen = (len(transformer_blocks(model)[1]) - args.num_trainable_layers
                  if model is not None else 0)
        if frozen <= 0:
            continue
        # --use-peft: the policy itself, its adapter off
        if model is policy and name == "reference":
            exact = "policy" in num_frozen
        else:
            exact = adapter_free_trunk(model, frozen) and trunk_is_exact(
                script, model, probe.to(model.device), pad_token_id, frozen,
                value_head if name == "policy" else None)
        if not exact:
            refused.append(f"the {name}'s")
            continue
        num_frozen[name] = frozen
        # the same bottom weights give the same output: compared once, on the probe
        if name != "policy" and num_frozen.get("policy") == frozen and (
                model is policy or torch.equal(
                    *(frozen_trunk(m, probe.to(m.device), pad_token_id, frozen,
                                   script.model_inputs).cpu()
                      for m in (model, policy)))):
            shares.add(name)
    # --use-peft's reference is the policy itself, its adapter off: not a model of its own to name
    trunks = ", ".join(f"{name} {n} blocks" + (" (the policy's)" if name in shares else "")
                       for name, n in num_frozen.items()
                       if not (name == "reference" and reference is policy)
                       ) or "none"
    return num_frozen, shares, f"frozen trunks run once per update: {trunks}" + (
        f"; full forwards for {', '.join(refused)} (its split forward is not exact)"
        if refused else "")


def adapter_free_trunk(model: nn.Module, num_frozen: int) -> bool:
    """Whether the embeddings and the bottom `num_frozen` blocks carry no peft module of any
    kind."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    name, blocks = transformer_blocks(model)
    top = tuple(f"{name}.{i}." for i in range(num_frozen, len(blocks)))
    return not any(isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))
                   and not f"{n}.".startswith(top)
                   for n, m in model.get_decoder().named_modules())


def trunk_is_exact(script, model, query_responses, pad_token_id: int, num_frozen: int,
                   value_head=None) -> bool:
    """Whether the script's forwards from the frozen trunk give its full forwards' log-probs (a
    causal LM) or values (a sequence classifier, or a value head on a causal LM) and their gradients
    (GPT-2 adds position embeddings inside its backbone, so its trunk is refused)."""
    trunk = (frozen_trunk(model, query_responses, pad_token_id, num_frozen,
                          script.model_inputs).detach(),
             num_frozen)
    ids = query_responses[:, 1:].masked_fill(query_responses[:, 1:] == pad_token_id, 0)
    if hasattr(model, "score"):
        head = None

        def outputs(t):
            return (script.value_forward(model, query_responses, pad_token_id, 1, trunk=t),)
    else:
        head = value_head

        def outputs(t):
            logprobs, entropy, hidden = script.response_logprobs(model, query_responses,
                                                                 pad_token_id, 1, ids, 1.0, True, t,
                                                                 with_hidden=head is not None)
            return (logprobs, entropy) + ((script.value_forward(model, query_responses,
                                                                pad_token_id, 1, head, hidden),)
                                          if head is not None else ())
    params = [p for p in [*model.parameters(), *(head.parameters() if head is not None else ())]
              if p.requires_grad]
    return same_values_and_gradients(lambda: outputs(trunk), lambda: outputs(None), params)


def same_values_and_gradients(fast, plain, params, rtol=1e-4, atol=1e-4, grad_rtol=1e-3) -> bool:
    """Whether two computations give the same outputs (to rtol and atol, element by element) and the
    same gradients of a random weighted sum of them with respect to `params`, each gradient to
    grad_rtol of its largest element (a gradient's elements are sums whose terms may be far larger
    than the sum: float32 rounding alone reaches 1e-4 of the largest in SmolLM2's top blocks; an
    edited computation differs by far more). The gradients are put back."""
    saved = [p.grad for p in params]
    try:
        results = []
        for compute in (fast, plain):
            for p in params:
                p.grad = None
            outputs = compute()
            weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i))
                       .to(o.device, o.dtype) for i, o in enumerate(outputs)]
            total = sum((o * w).sum() for o, w in zip(outputs, weights) if o.numel())
            grads = (torch.autograd.grad(total, params, allow_unused=True)
                     if total.requires_grad and params else ())
            results.append(([o.detach() for o in outputs], grads))
        (values, grads), (plain_values, plain_grads) = results
        same_values = all(a.shape == b.shape
                          and torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)
                          for a, b in zip(values, plain_values))
        same_grads = len(grads) == len(plain_grads) and all(
            (a is None) == (b is None)
            and (a is None or bool((a.float() - b.float()).abs().max()
                                   <= grad_rtol * b.float().abs().max() + 1e-6))
            for a, b in zip(grads, plain_grads))
        return same_values and same_grads
    finally:
        for p, g in zip(params, saved):
            p.grad = g


# ---- The policy's trunk kept while sampling
@contextmanager
def keep_trunk(policy, num_frozen: int | None):
    """Inside: every forward of `policy` records the output of its bottom `num_frozen` blocks (each
    marked as a chunk's prefill or as one fed-back token); it yields `trunk(total_length)`, which
    lays them out as (the states of every query-response position of the rollout, the number of
    frozen blocks), or None where nothing was kept (`num_frozen` None). `total_length`: the
    queries' width plus the padded responses'. Positions no forward ran (past a chunk's last token)
    are 0: padding, which no later forward attends to. Outside, no hook is left on the policy."""
    pieces, state = [], {"prefill": True}

    def trunk(total_length: int):
        if num_frozen is None or not pieces:
            return None
        chunks = []
        for prefill, piece in pieces:
            if prefill:
                chunks.append([piece])
            else:
                chunks[-1].append(piece)
        states = [torch.cat(chunk, 1)[:, :total_length] for chunk in chunks]
        out = states[0].new_zeros(sum(s.size(0) for s in states), total_length, states[0].size(-1))
        row = 0
        for s in states:
            out[row:row + s.size(0), :s.size(1)] = s
            row += s.size(0)
        return out, num_frozen

    if num_frozen is None:
        yield trunk
        return

    def start(module, args, kwargs):  # a forward without a cache is a chunk's prefill
        state["prefill"] = kwargs.get("past_key_values") is None

    def record(module, args, output):
        pieces.append((state["prefill"], output[0] if isinstance(output, tuple) else output))

    hooks = [policy.register_forward_pre_hook(start, with_kwargs=True),
             transformer_blocks(policy)[1][num_frozen - 1].register_forward_hook(record)]
    try:
        yield trunk
    finally:
        for hook in hooks:
            hook.remove()


def check_kept_trunk(script, args, setup, policy, num_frozen: int | None) -> tuple[bool, str]:
    """(whether the states kept while the script's `generate` samples a probe equal the full
    forward's trunk at every real position, to 1e-4, and the log-probs computed from them the full
    forward's; the banner's line). Run on the prepared policy under the run's autocast."""
    if num_frozen is None:
        return False, "kept while sampling: nothing"
    pad_token_id, training = setup.tokenizer.pad_token_id, policy.training
    queries = script.left_pad(setup.probe_ids[:4], pad_token_id).to(policy.device)
    policy.eval()  # as sampling runs it (gradient checkpointing allows no KV cache in train mode)
    with torch.no_grad():
        with keep_trunk(policy, num_frozen) as kept_trunk:
            responses, _ = script.generate(policy, queries, pad_token_id, args, setup.stop_token_id,
                                           torch.Generator(policy.device).manual_seed(0), False)
        qr = torch.cat((queries, responses), 1)
        real, context_length = qr != pad_token_id, queries.size(1)
        trunk = kept_trunk(qr.size(1))
        full = frozen_trunk(policy, qr, pad_token_id, num_frozen, script.model_inputs)
        ids = responses.masked_fill(responses == pad_token_id, 0)
        logprobs = [script.response_logprobs(policy, qr, pad_token_id, context_length, ids,
                                             args.temperature, trunk=t)[0][real[:, context_length:]]
                    for t in (trunk, None)]
    policy.train(training)
    exact = (trunk is not None
             and torch.allclose(trunk[0][real].float(), full[real].float(), rtol=1e-4, atol=1e-4)
             and torch.allclose(*logprobs, rtol=1e-4, atol=1e-4))
    return exact, "kept while sampling: the policy's trunk" if exact else (
        "kept while sampling: nothing (the sampled states differ from a full forward's: "
        "the trunk runs once)")


# ---- The LM head over vocabulary blocks, in training
class HeadLogprobs(torch.autograd.Function):
    """log softmax(scale_logits(hidden @ weight.T))[token] and its entropy, a block of the
    vocabulary at a time for all rows, with a running logsumexp (flash attention's online softmax):
    a block's logits and exponentials, in two buffers every block reuses, are the only (words, rows)
    tensors. The backward recomputes them. Both outputs carry their gradients."""

    @staticmethod
    def logits(hidden, weight, start, temperature, pad_token_id, buffer):
        """scale_logits(hidden @ weight.T).T for a block of words, the first being word `start`, in
        `buffer`; the temperature applied inside the product, except under autocast, where the
        product rounds first as in the model."""
        out = buffer[:weight.size(0) * hidden.size(0)].view(weight.size(0), hidden.size(0))
        if torch.is_autocast_enabled(hidden.device.type) or not hidden.dtype == weight.dtype == out.dtype:
            out.copy_((hidden @ weight.T).T).div_(temperature + 1e-7)
        else:
            torch.addmm(out, weight, hidden.T, beta=0, alpha=1 / (temperature + 1e-7), out=out)
        if 0 <= pad_token_id - start < out.size(0):
            out[pad_token_id - start] = torch.finfo(out.dtype).min
        return out

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, pad_token_id, block, with_entropy):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        buffer, scratch = (hidden.new_empty(block * hidden.size(0), dtype=dtype) for _ in range(2))
        # running max, sum of exp(l - m)
        m = hidden.new_full((hidden.size(0),), torch.finfo(dtype).min, dtype=dtype)
        # u: sum of exp(l - m) (m - l)
        s, u, picked = (hidden.new_zeros(hidden.size(0), dtype=dtype) for _ in range(3))
        for start in range(0, weight.size(0), block):
            logits = HeadLogprobs.logits(hidden, weight[start:start + block], start, temperature, pad_token_id, buffer)
            local = tokens - start  # each row's token as a row of this block, where it lies in it
            found = (local >= 0) & (local < logits.size(0))
            local = local.clamp(0, logits.size(0) - 1)[None]
            picked = torch.where(found, logits.gather(0, local).squeeze(0), picked)
            new_m = torch.maximum(m, logits.amax(0))
            # the earlier blocks' sums at the new maximum (0 before the first block)
            rescale = torch.exp(m - new_m)
            shifted = logits.sub_(new_m)
            e = torch.exp(shifted, out=scratch[:shifted.numel()].view_as(shifted))
            if with_entropy:  # -sum p log p = log s + u / s: every term >= 0, nothing cancels
                u = rescale * (u + (new_m - m) * s) - shifted.mul_(e).sum(0)
            s, m = s * rescale + e.sum(0), new_m
        lse = s.log() + m
        entropy = s.log() + u / s if with_entropy else lse.new_zeros(0)
        ctx.save_for_backward(hidden, weight, tokens, lse, entropy)
        ctx.temperature, ctx.pad_token_id, ctx.block = temperature, pad_token_id, block
        # the backward recomputes the logits under the forward's autocast (see there)
        device = hidden.device.type
        ctx.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                            dtype=torch.get_autocast_dtype(device))
        # an output the loss does not use gets None: no work for it
        ctx.set_materialize_grads(False)
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
            # the backward runs outside autocast: logits recomputed in float32 would not match the
            # saved logsumexp of bf16 logits
            with torch.autocast(**ctx.autocast):
                logp = HeadLogprobs.logits(hidden, w, start, ctx.temperature, ctx.pad_token_id, buffer).sub_(lse)
            if ge is None:
                grad = logp.exp_().mul_(-g)
            # and d entropy / d logits = -p (log p + entropy) / T, formed as p (...) first: 0 for
            # the pad word
            else:
                p = torch.exp(logp, out=scratch[:logp.numel()].view_as(logp))
                grad = logp.add_(entropy).mul_(p).mul_(ge).add_(p.mul_(g)).neg_()
            local = tokens - start  # as in the forward
            found = (local >= 0) & (local < w.size(0))
            local = local.clamp(0, w.size(0) - 1)[None]
            grad.scatter_add_(0, local, torch.where(found, g, 0).unsqueeze(0))
            if grad_hidden is not None:  # summed over the blocks, in float32
                grad_hidden.addmm_(grad.T, w.to(grad.dtype), beta=start > 0)
            if grad_weight is not None:
                torch.mm(grad, hidden_float, out=grad_weight[start:start + ctx.block])
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None, None, None)


def head_logprobs(hidden, weight, tokens, temperature, pad_token_id, with_entropy=False, chunk_elements=2**22):
    """(logprobs, entropy or empty) of `tokens` under scale_logits(hidden @ weight.T), by
    `HeadLogprobs`, in blocks of about `chunk_elements` logits."""
    shape, hidden = tokens.shape, hidden.reshape(-1, hidden.size(-1))
    block = max(1, chunk_elements // max(1, hidden.size(0)))  # words per block
    logprobs, entropy = HeadLogprobs.apply(hidden, weight, tokens.reshape(-1), temperature, pad_token_id, block,
                                           with_entropy)
    return logprobs.view(shape), entropy.view(shape) if with_entropy else entropy


class FusedHeadForward(nn.Module):
    """The script's training forward, (log-probs, entropies, values) of the responses, with the
    log-probs and entropies from `head_logprobs`: the same `policy`, `value_model` and `value_head`
    as the wrapper it stands in for, and the script's own `model_inputs` and `value_forward`
    (`script`: the script's module)."""

    def __init__(self, wrapper: nn.Module, script):
        super().__init__()
        self.policy = wrapper.policy
        self.value_model = getattr(wrapper, "value_model", None)
        self.value_head = getattr(wrapper, "value_head", None)
        self.script = script

    def forward(self, query_responses, pad_token_id, context_length, response_ids, temperature, trunks=None):
        script, trunks = self.script, trunks or {}
        trunk = trunks.get("policy")
        with nullcontext() if trunk is None else blocks_only(self.policy, trunk[1]):
            hidden = self.policy.get_decoder()(**script.model_inputs(query_responses, pad_token_id, trunk),
                                               use_cache=False).last_hidden_state
        logprobs, entropy = head_logprobs(hidden[:, context_length - 1:-1],
                                          self.policy.get_output_embeddings().weight, response_ids,
                                          temperature, pad_token_id, with_entropy=True)
        if self.value_head is not None:  # --shared-value-head: from the same hidden states
            values = script.value_forward(self.policy, query_responses, pad_token_id, context_length,
                                          self.value_head, hidden)
        else:
            split = {"trunk": trunks["value"]} if "value" in trunks else {}
            values = script.value_forward(self.value_model, query_responses, pad_token_id, context_length,
                                          **split)
        return logprobs, entropy, values


def fused_head(script, wrapper: nn.Module, setup, args, compiled: bool) -> tuple[nn.Module, str]:
    """A `FusedHeadForward` around the script's `wrapper` where it is asked for (--fused-lm-head)
    and applies (not under --no-fast-paths or ZeRO-3, whose weights are whole only inside
    DeepSpeed's hooks; not where the training step is compiled, the compiler fusing the script's own
    lines instead; a head that is one bias-free matrix) and a probe finds its log-probs, entropies,
    values and their gradients the script's, else `wrapper` itself; and the banner's line."""
    head = wrapper.policy.get_output_embeddings()
    why = ("--fused-lm-head is off" if not args.fused_lm_head else
           "--no-fast-paths" if not args.fast_paths else "ZeRO-3" if setup.zero3 else
           "the training step is compiled" if compiled else
           "the head is not one bias-free "
           "matrix" if type(head) is not nn.Linear or head.bias is not None else None)
    if why is None:
        pad_token_id = setup.tokenizer.pad_token_id
        probe = script.left_pad(setup.probe_ids[:2], pad_token_id).to(head.weight.device)
        ids = probe[:, 1:].masked_fill(probe[:, 1:] == pad_token_id, 0)
        fused = FusedHeadForward(wrapper, script)
        params = [p for p in wrapper.parameters() if p.requires_grad]
        if same_values_and_gradients(lambda: fused(probe, pad_token_id, 1, ids, args.temperature),
                                     lambda: wrapper(probe, pad_token_id, 1, ids, args.temperature), params):
            return fused, "LM head: over vocabulary blocks in training (README: the ledger)"
        why = "its probe differs from the script's own forward"
    return wrapper, f"LM head: the script's own ({why})"
