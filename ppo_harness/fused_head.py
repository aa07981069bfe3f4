"""The LM head over vocabulary blocks (README: the ledger): training's log-probs and entropies
straight from the final hidden states, a block of the vocabulary at a time, never a (batch, length,
vocab) tensor. On a small model with a large vocabulary (the throughput bench: 49k words on hidden
128) the plain head's logits are a 340 MB tensor that the log-softmax, the gather, the entropy and
their backward pass over about a dozen times; this halves that run.

`FusedHeadForward` stands in for the script's `PolicyAndValueWrapper` in training: the same
submodules under the same names (the optimizer, accelerate and the checkpoints see the same model)
and a forward that reads the log-probs from the hidden states through `HeadLogprobs` instead of the
script's `response_logprobs`. `fused_head` builds it where a probe finds its outputs and gradients
equal to the script's own forward as edited, else hands back the script's wrapper. The reference's
log-probs and every other forward stay the script's own.
"""
import torch
import torch.nn as nn

from ppo_harness.trunk import same_values_and_gradients


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
    def in_block(tokens, start, words):
        """(each row's token as a row of this block, clamped into it; whether it is in the block).
        """
        local = tokens - start
        return local.clamp(0, words - 1).unsqueeze(0), (local >= 0) & (local < words)

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
            local, found = HeadLogprobs.in_block(tokens, start, logits.size(0))
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
            local, found = HeadLogprobs.in_block(tokens, start, w.size(0))
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
    as the wrapper it stands in for, and the script's own `final_hidden_states` and `value_forward`
    (`script`: the script's module)."""

    def __init__(self, wrapper: nn.Module, script):
        super().__init__()
        self.policy = wrapper.policy
        self.value_model = getattr(wrapper, "value_model", None)
        self.value_head = getattr(wrapper, "value_head", None)
        self.script = script

    def forward(self, query_responses, pad_token_id, context_length, response_ids, temperature, trunks=None):
        script, trunks = self.script, trunks or {}
        split = {"trunk": trunks["policy"]} if "policy" in trunks else {}
        hidden = script.final_hidden_states(self.policy, query_responses, pad_token_id, **split)
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
    """A `FusedHeadForward` around the script's `wrapper` where it applies (not under
    --no-fast-paths or ZeRO-3, whose weights are whole only inside DeepSpeed's hooks; not where the
    training step is compiled, the compiler fusing the script's own lines instead; a head that is
    one bias-free matrix) and a probe finds its log-probs, entropies, values and their gradients the
    script's, else `wrapper` itself; and the banner's line."""
    head = wrapper.policy.get_output_embeddings()
    why = ("--no-fast-paths" if not args.fast_paths else "ZeRO-3" if setup.zero3 else
           "the training step is compiled" if compiled else
           "the head is not one bias-free "
           "matrix" if type(head) is not nn.Linear or head.bias is not None else None)
    if why is None:
        pad_token_id = setup.tokenizer.pad_token_id
        probe = script.left_pad(setup.train_dataset[:2]["input_ids"], pad_token_id).to(head.weight.device)
        ids = probe[:, 1:].masked_fill(probe[:, 1:] == pad_token_id, 0)
        fused = FusedHeadForward(wrapper, script)
        params = [p for p in wrapper.parameters() if p.requires_grad]
        if same_values_and_gradients(lambda: fused(probe, pad_token_id, 1, ids, args.temperature),
                                     lambda: wrapper(probe, pad_token_id, 1, ids, args.temperature), params):
            return fused, "LM head: over vocabulary blocks in training (README: the ledger)"
        why = "its probe differs from the script's own forward"
    return wrapper, f"LM head: the script's own ({why})"
