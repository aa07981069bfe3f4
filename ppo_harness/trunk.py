"""The frozen trunk (--num-trainable-layers N). A model that trains only its top N blocks gets no
gradient in the blocks below, so their output cannot change within an update: the scripts run them
once per update (`frozen_trunk`) and every later forward of that update from their output, through
the blocks above alone (`blocks_only`). On a CPU this decides whether a 135M model trains in minutes
or in hours.

`check_trunks` checks once, at start-up, against the script's own forwards as they are (edited or
not), that a forward from the trunk gives the full forward's outputs and gradients, model by model,
and which models share the policy's trunk: the reference and a value model started from the SFT
policy hold the same bottom weights, so one trunk serves all three, but an edit that loads another
reference gets its own. This module imports no script: it calls the script's `left_pad`,
`model_inputs`, `response_logprobs` and `value_forward` through `script`.

`keep_trunk` keeps the policy's trunk while the rollout samples (README: the ledger): sampling runs
the bottom blocks over every token anyway, the prompts in the prefill and each sampled token as it
is fed back, so forward hooks record their output and `KeptTrunk.trunk` lays it out as the tensor
`frozen_trunk` would compute. A KV cache's states are not bit-identical to a full forward's:
`check_kept_trunk` compares them once at start-up (to 1e-4) and refuses them where they differ (bf16
autocast, a drifting cache).
"""
import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn

from ppo_harness.models import transformer_blocks, unpeft

# a block list -> {(start, stop): its slice}: one object per slice, so that compiled code's guards
# on the module hold from one forward to the next (a new ModuleList each time would recompile)
_SLICES = weakref.WeakKeyDictionary()


@contextmanager
def blocks_only(model: nn.Module, start: int, stop: int | None = None):
    """Run the backbone through blocks[start:stop] alone; per-block config lists (layer_types...)
    are sliced too."""
    name, blocks = transformer_blocks(model)
    backbone = unpeft(model).base_model
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
            unpeft(model).base_model(**model_inputs(query_responses, pad_token_id), use_cache=False)
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
    probe = script.left_pad(setup.train_dataset[:2]["input_ids"], pad_token_id).to(policy.device)
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
                   for n, m in unpeft(model).base_model.named_modules())


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
# -------------------------------------------------------
class KeptTrunk:
    """The frozen blocks' output of each forward of the policy, in call order, each marked as a
    prefill (the start of a chunk of prompts) or as one fed-back token."""

    def __init__(self, num_frozen: int | None):
        self.num_frozen, self.pieces, self.prefill = num_frozen, [], True

    def trunk(self, total_length: int):
        """(the states of every query-response position of the rollout, the number of frozen
        blocks), or None where nothing was kept. `total_length`: the queries' width plus the padded
        responses'. Positions no forward ran (past a chunk's last token) are 0: padding, which no
        later forward attends to."""
        if self.num_frozen is None or not self.pieces:
            return None
        chunks = []
        for prefill, piece in self.pieces:
            if prefill:
                chunks.append([piece])
            else:
                chunks[-1].append(piece)
        states = [torch.cat(pieces, 1)[:, :total_length] for pieces in chunks]
        out = states[0].new_zeros(sum(s.size(0) for s in states), total_length, states[0].size(-1))
        row = 0
        for s in states:
            out[row:row + s.size(0), :s.size(1)] = s
            row += s.size(0)
        return out, self.num_frozen


@contextmanager
def keep_trunk(policy, num_frozen: int | None):
    """Inside: every forward of `policy` records the output of its bottom `num_frozen` blocks into
    the `KeptTrunk` it yields (nothing where `num_frozen` is None). Outside, no hook is left on the
    policy."""
    kept = KeptTrunk(num_frozen)
    if num_frozen is None:
        yield kept
        return

    def start(module, args, kwargs):  # a forward without a cache is a chunk's prefill
        kept.prefill = kwargs.get("past_key_values") is None

    def record(module, args, output):
        kept.pieces.append((kept.prefill, output[0] if isinstance(output, tuple) else output))

    hooks = [policy.register_forward_pre_hook(start, with_kwargs=True),
             transformer_blocks(policy)[1][num_frozen - 1].register_forward_hook(record)]
    try:
        yield kept
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
    queries = script.left_pad(setup.train_dataset[:4]["input_ids"], pad_token_id).to(policy.device)
    policy.eval()  # as sampling runs it (gradient checkpointing allows no KV cache in train mode)
    with torch.no_grad():
        with keep_trunk(policy, num_frozen) as kept:
            responses, _ = script.generate(policy, queries, pad_token_id, args, setup.stop_token_id,
                                           torch.Generator(policy.device).manual_seed(0), False)
        qr = torch.cat((queries, responses), 1)
        real, context_length = qr != pad_token_id, queries.size(1)
        trunk = kept.trunk(qr.size(1))
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
