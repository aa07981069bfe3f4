"""The speed layer: exact shortcuts behind the training script's plain forwards, each switched on only where a start-up
probe on the run's device and precision finds it within 1e-4 of the script's own (possibly edited) computation.

`SpeedLayer` has the methods of the script's `Forwards` (sample, score, train, logprobs) and calls the script's plain
functions (passed in as `script`, the script's module: this package imports no script) where no shortcut applies:
- the fused LM head (`HeadLogprobs`): log-probs and entropies straight from the hidden states, a block of the
  vocabulary at a time, never a (batch, length, vocab) tensor;
- frozen bottom blocks (--num-trainable-layers) run once per update (`frozen_trunk`), and the states sampling computes
  anyway kept for scoring (`kept_while_sampling`);
- the prompts' common prefix (a chat template's) run once per chunk (`prefill`);
- on CUDA, a static KV cache compiled into CUDA graphs (`StaticSampler`).
Without this module the scripts run their plain forwards, as --no-fast-paths does.
"""
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from transformers import StaticCache

from ppo_harness.models import policy_for_generation, transformer_blocks, unpeft


class SpeedLayer:
    """`main`'s forwards (`Forwards`) through the shortcuts its probes accept: the fused LM head (`HeadLogprobs`), the
    frozen bottom blocks run once per update (`frozen_trunk`), states kept while sampling (`kept_while_sampling`), the
    prompts' common prefix run once (`prefill`), and on CUDA a compiled static-cache sampler (`StaticSampler`)."""

    def __init__(self, script, args, setup, policy, value_model=None, value_head=None, num_trainable_layers=None,
                 value_shares_trunk=False):
        """The probes that need the models as loaded (before accelerate wraps them). `script`: the training script's
        module, whose plain forwards the probes compare against; `value_shares_trunk`: the value model starts from the
        policy's weights, so one frozen trunk serves both."""
        pad_token_id, self.zero3, self.script = setup.tokenizer.pad_token_id, setup.zero3, script
        # not under ZeRO-3, whose sharded weights are whole only inside DeepSpeed's forward hooks; a silent error
        # elsewhere (GPT-2 adds position embeddings inside its backbone; some heads scale or cap their logits)
        first_queries = script.left_pad(setup.train_dataset[:2]["input_ids"], pad_token_id)
        num_frozen = {}
        if num_trainable_layers is not None and not setup.zero3:
            for name, m in (("policy", policy), ("value", value_model)):
                frozen = len(transformer_blocks(m)[1]) - num_trainable_layers if m is not None else 0
                if frozen > 0 and adapter_free_trunk(m, frozen) and split_forward_is_exact(
                        script, m, first_queries, pad_token_id, frozen):
                    num_frozen[name] = frozen
        fused_head = not setup.zero3 and fused_head_is_exact(script, policy, first_queries, pad_token_id,
                                                              args.temperature)
        paths = FastPaths(script, fused_head, num_frozen, value_shares_trunk and len(num_frozen) == 2)
        # the shortcuts together against the script's own forwards (an edited one included), else none of them
        self.edited = (paths.fused_head or bool(paths.num_frozen)) and not paths_are_exact(
            paths, policy, value_model, value_head, first_queries, pad_token_id, args.temperature)
        self.paths = self.update = FastPaths(script) if self.edited else paths
        num_frozen = self.paths.num_frozen
        self.static, self.static_note, self.loop_is_exact = None, "dynamic KV cache", True
        self.keep_candidates = tuple(name for name, use in (("trunk", "policy" in num_frozen),
                                                            ("final", value_head is not None)) if use)

    def probe_sampling(self, args, accelerator, setup, policy):
        """The probes of sampling, on the prepared models, under the run's autocast: the shared prefix, then the
        static-cache sampler or, without it, the states a KV cache keeps (bf16 drifts after about 10 tokens)."""
        probe_rows, pad_token_id = setup.train_dataset[:8]["input_ids"], setup.tokenizer.pad_token_id
        queries = self.script.left_pad(probe_rows, pad_token_id).to(accelerator.device)
        shared = min(len(row) for row in probe_rows) - 1  # a prefix the probe is sure to share: the first row's start
        shared_queries = self.script.left_pad([probe_rows[0][:shared] + row[shared:] for row in probe_rows],
                                              pad_token_id)
        with accelerator.autocast():
            shared_prefix = not self.zero3 and len(probe_rows) > 1 and shared > 0 and shared_prefix_is_exact(
                self.script, policy, shared_queries.to(accelerator.device), pad_token_id)
            self.paths = replace(self.paths, shared_prefix=shared_prefix)
            mode = args.sampler if args.sampler != "auto" else "compiled" if accelerator.device.type == "cuda" \
                else "dynamic"
            if mode != "dynamic" and self.zero3:
                self.static_note = f"dynamic KV cache ({mode} refused under ZeRO-3: weights gathered per rollout)"
            elif mode != "dynamic":  # one cache width for the run: its widest prompt's (one compilation)
                chunk = args.local_rollout_forward_batch_size
                widest = max(len(ids) for rows in (setup.train_dataset, setup.eval_rows) if len(rows)
                             for ids in rows["input_ids"])
                static = StaticSampler(chunk, compile=mode == "compiled", width=widest)
                every_process = lambda ok: bool(accelerator.gather(  # noqa: E731 (all sample alike, or none)
                    torch.tensor([float(ok)], device=accelerator.device)).min() > 0)
                accepted, self.static_note = static.probe(self.script, policy, queries[:chunk], pad_token_id, args,
                                                          setup.stop_token_id, shared_prefix, every_process)
                self.static = static if accepted else None
            else:
                self.static_note = "dynamic KV cache" + (" (--sampler auto off CUDA)" if args.sampler == "auto" else "")
            candidates = () if self.zero3 or self.static else self.keep_candidates
            kept = sampled_states_are_exact(policy, queries, pad_token_id, FastPaths(
                self.script, num_frozen=self.paths.num_frozen, shared_prefix=shared_prefix), candidates, args,
                setup.stop_token_id) if candidates else ()
            # this layer's sampling loop against the script's own `generate` (an edited one included); under ZeRO-3
            # no shortcut samples, so the script's own sampling runs anyway
            self.loop_is_exact = self.zero3 or sampling_is_exact(self.script, policy, queries, pad_token_id, args,
                                                                 setup.stop_token_id)
        if not self.loop_is_exact:  # the shortcuts would sample otherwise than the script asks
            self.static, kept, shared_prefix = None, (), False
            self.static_note = "the script's own `generate` (the speed layer's loop draws otherwise: an edited one?)"
        self.paths = self.update = replace(self.paths, from_sampling=kept, shared_prefix=shared_prefix,
                                           refused=tuple(name for name in candidates if name not in kept))

    def describe(self) -> str:
        """The banner's line: the paths the start-up probes found exact (the others compute in full)."""
        p = self.paths
        if self.edited:
            return f"fast paths: off (the shortcuts differ from the script's forwards: an edited forward); sampler: " \
                   f"{self.static_note}"
        trunks = ", ".join(f"{name} {n} blocks" for name, n in p.num_frozen.items()) or "none"
        refused = f" (refused, a KV cache's differ here: {', '.join(p.refused)})" if p.refused else ""
        return (f"fast paths: fused LM head {'on' if p.fused_head else 'off'}; frozen trunks: {trunks}; kept "
                f"while sampling: {', '.join(p.from_sampling) or 'nothing'}{refused}; shared prompt prefix "
                f"{'on' if p.shared_prefix else 'off'}; sampler: {self.static_note}")

    def sample(self, accelerator, model, queries, args, zero3, pad_token_id, stop_token_id, generator=None):
        """Phase 1, keeping what sampling computes anyway for `score` (this update's frozen trunk, final states);
        the script's own sampling where no shortcut applies or its probe found the script's differ."""
        self.update, chunk = self.paths, args.local_rollout_forward_batch_size  # the last update's trunks are freed
        p = self.paths
        if not (self.static or p.shared_prefix or p.from_sampling):
            return self.script.sample_responses(accelerator, model, queries, args, zero3, pad_token_id,
                                                stop_token_id, generator)
        with policy_for_generation(accelerator, model, zero3, args.ds3_gather_for_generation) as (sampler, synced), \
                kept_while_sampling(sampler, self.paths) as pieces:
            generated = [fast_generate(self.script, sampler, queries[i:i + chunk], pad_token_id, args, stop_token_id,
                                       generator, synced, feed_last=bool(p.from_sampling),
                                       share_prefix=p.shared_prefix, static=self.static)
                         for i in range(0, queries.size(0), chunk)]
        responses = self.script.pad_right([r for r, _ in generated], pad_token_id)
        logprobs = self.script.pad_right([lp for _, lp in generated], self.script.INVALID_LOGPROB)
        self.update = self.paths.kept(pieces, queries != pad_token_id, [r.size(1) for r, _ in generated],
                                      queries.size(1) + responses.size(1))
        if stop_token_id is not None:
            responses = self.script.truncate_response(stop_token_id, pad_token_id, responses)
        return responses, logprobs

    def score(self, models, query_responses, response_ids, context_length, args, pad_token_id, with_values=True):
        """Phase 2 from what sampling kept; the frozen trunks it computes stay for `train` and `logprobs`."""
        ref_logprobs, values, chunks, full_kls = [], [], [], []
        policy, value_model, kept, script = models.policy, models.value_model, self.update, self.script
        value_head = getattr(models, "value_head", None)  # ppo.py's --shared-value-head
        ref_model = policy if models.ref_policy is None else models.ref_policy
        chunk, full = args.local_rollout_forward_batch_size, args.kl_estimator == "full"
        for i in range(0, query_responses.size(0), chunk):
            qr, ids = query_responses[i:i + chunk], response_ids[i:i + chunk]
            # the reference shares the policy's frozen blocks: the same SFT weights, never trained
            paths = kept.rows(slice(i, i + chunk)).with_trunks({"policy": policy, "value": value_model} if with_values
                                                               else {"policy": policy}, qr, pad_token_id)
            # no reference model: the policy with its adapter off (ppo.py's --use-peft)
            reference = (script.reference_adapter(policy, args.ref_adapter_name, args.model_adapter_name or "default")
                         if models.ref_policy is None else nullcontext())
            with reference:
                if full:
                    ref_out = script.scale_logits(paths.policy_logits(ref_model, qr, pad_token_id, context_length),
                                           args.temperature, pad_token_id)
                else:
                    ref_out = paths.response_logprobs(ref_model, qr, pad_token_id, context_length, ids,
                                                      args.temperature)[0]
            if full:
                ref_logprobs.append(script.logprobs_from_logits(ref_out, ids))
                full_kls.append(script.full_kl(script.scale_logits(
                    paths.policy_logits(policy, qr, pad_token_id, context_length), args.temperature, pad_token_id),
                    ref_out))
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
    (with the final hidden states a value head reads). FastPaths(script) computes what the script's plain forwards
    compute."""
    script: object  # the training script's module: its plain forwards run where no shortcut applies
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
                                     frozen_trunk(self.script, models[name], query_responses, pad_token_id, n)
                                     for name, n in self.num_frozen.items()
                                     if name in models and not (name == "value" and self.value_shares_trunk)})

    def rows(self, index) -> "FastPaths":
        """Restricted to some rows (a micro-batch)."""
        return replace(self, trunks={name: hidden[index] for name, hidden in self.trunks.items()},
                       final_hidden=None if self.final_hidden is None else self.final_hidden[index])

    def policy_logits(self, policy, query_responses, pad_token_id, context_length):
        """`policy_logits`, from the policy's frozen trunk where these paths hold it."""
        response_length = query_responses.size(1) - context_length
        inputs, blocks = backbone_inputs(self.script, policy, query_responses, pad_token_id, self.trunk("policy"))
        with blocks:
            out = policy(**inputs, logits_to_keep=response_length + 1, use_cache=False)
        return out.logits[:, :-1]

    def response_logprobs(self, policy, query_responses, pad_token_id, context_length, response_ids, temperature,
                          with_entropy=False):
        """`response_logprobs`; with the fused head, through `head_logprobs`, without (batch, length, vocab) logits."""
        if self.fused_head:
            hidden = trunk_hidden_states(self.script, policy, query_responses, pad_token_id, self.trunk("policy"))
            return head_logprobs(hidden[:, context_length - 1 : -1], policy.get_output_embeddings().weight,
                                 response_ids, temperature, pad_token_id, with_entropy)
        if self.trunk("policy") is None:
            return self.script.response_logprobs(policy, query_responses, pad_token_id, context_length, response_ids,
                                                 temperature, with_entropy)
        s = self.script
        logits = s.scale_logits(self.policy_logits(policy, query_responses, pad_token_id, context_length), temperature,
                                pad_token_id)
        entropy = checkpoint(s.entropy_from_logits, logits, use_reentrant=False) if with_entropy else \
            logits.new_zeros(0)
        return s.logprobs_from_logits(logits, response_ids), entropy

    def value_forward(self, value_model, query_responses, pad_token_id, context_length, head=None):
        """The script's `value_forward`, from the final hidden states a trunk gives, or (a value head) that sampling
        kept; where neither is held, the script's forward whole."""
        trunk = self.trunk("value" if head is None else "policy")
        if trunk is None and (head is None or self.final_hidden is None):
            return self.script.value_forward(value_model, query_responses, pad_token_id, context_length,
                                             *(() if head is None else (head,)))
        hidden = self.final_hidden if head is not None and self.final_hidden is not None else trunk_hidden_states(
            self.script, value_model, query_responses, pad_token_id, trunk)
        return self.script.value_forward(value_model, query_responses, pad_token_id, context_length, head, hidden)

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


def adapter_free_trunk(model: nn.Module, num_frozen: int) -> bool:
    """Whether the embeddings and the bottom `num_frozen` blocks carry no peft module of any kind."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    name, blocks = transformer_blocks(model)
    top = tuple(f"{name}.{i}." for i in range(num_frozen, len(blocks)))
    return not any(isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)) and not f"{n}.".startswith(top)
                   for n, m in unpeft(model).base_model.named_modules())


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


def backbone_inputs(script, model, query_responses, pad_token_id, trunk):
    """Model inputs and a context: the whole model, or (trunk = (hidden states, num_frozen)) the top blocks alone."""
    inputs = script.model_inputs(query_responses, pad_token_id)
    if trunk is None:
        return inputs, nullcontext()
    hidden, num_frozen = trunk
    del inputs["input_ids"]
    return {**inputs, "inputs_embeds": hidden}, blocks_only(model, num_frozen)


def trunk_hidden_states(script, model, query_responses, pad_token_id, trunk=None):
    """`final_hidden_states`, starting from a frozen trunk's output (trunk = (hidden states, num_frozen)) if given."""
    inputs, blocks = backbone_inputs(script, model, query_responses, pad_token_id, trunk)
    with blocks:
        return unpeft(model).base_model(**inputs, use_cache=False).last_hidden_state


def frozen_trunk(script, model, query_responses, pad_token_id, num_frozen: int) -> torch.Tensor:
    """Hidden states after the embeddings and the `num_frozen` frozen bottom blocks: computed once per update, every
    later forward (`trunk=`) runs only the top blocks."""
    outputs = []
    hook = transformer_blocks(model)[1][num_frozen - 1].register_forward_hook(
        lambda module, args, output: outputs.append(output[0] if isinstance(output, tuple) else output))
    try:
        with blocks_only(model, 0, num_frozen):
            unpeft(model).base_model(**script.model_inputs(query_responses, pad_token_id), use_cache=False)
    finally:
        hook.remove()
    return outputs[0]


def split_forward_is_exact(script, model, query_responses: torch.Tensor, pad_token_id: int, num_frozen: int) -> bool:
    """Whether starting from `frozen_trunk` reproduces the full forward on these sequences."""
    with torch.no_grad():
        full = script.final_hidden_states(model, query_responses, pad_token_id)
        trunk = (frozen_trunk(script, model, query_responses, pad_token_id, num_frozen), num_frozen)
        return torch.allclose(full, trunk_hidden_states(script, model, query_responses, pad_token_id, trunk), rtol=1e-4,
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

def fused_head_is_exact(script, policy, query_responses: torch.Tensor, pad_token_id: int, temperature: float) -> bool:
    """Whether the fused path reproduces the model's own head on these sequences (not for a head that
    scales, caps or biases its logits)."""
    head = policy.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:  # e.g. a LoRA-wrapped head: its weight is not all of it
        return False
    ids = query_responses[:, 1:].masked_fill(query_responses[:, 1:] == pad_token_id, 0)
    with torch.no_grad():
        fused = FastPaths(script, True).response_logprobs(policy, query_responses, pad_token_id, 1, ids, temperature,
                                                  with_entropy=True)
        plain = script.response_logprobs(policy, query_responses, pad_token_id, 1, ids, temperature,
                                         with_entropy=True)
        return all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(fused, plain))


def paths_are_exact(paths: FastPaths, policy, value_model, value_head, query_responses: torch.Tensor,
                    pad_token_id: int, temperature: float) -> bool:
    """Whether these paths' log-probs, entropies and values (their trunks computed) are the script's own forwards' on
    these sequences, to `fused_head_is_exact`'s tolerance: a script whose forward was edited falls back to it."""
    ids = query_responses[:, 1:].masked_fill(query_responses[:, 1:] == pad_token_id, 0)
    models = {"policy": policy, "value": value_model}
    script, value = paths.script, (policy, value_head) if value_head is not None else (value_model,)
    with torch.no_grad():
        fast = paths.with_trunks(models, query_responses, pad_token_id)
        pairs = list(zip(fast.response_logprobs(policy, query_responses, pad_token_id, 1, ids, temperature, True),
                         script.response_logprobs(policy, query_responses, pad_token_id, 1, ids, temperature, True)))
        if value[0] is not None:
            pairs.append((fast.value_forward(value[0], query_responses, pad_token_id, 1, *value[1:]),
                          script.value_forward(value[0], query_responses, pad_token_id, 1, *value[1:])))
        return all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in pairs)


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


def sampled_states_are_exact(policy, queries, pad_token_id: int, paths: FastPaths, candidates: tuple, args,
                             stop_token_id: int | None) -> tuple:
    """Which of `candidates` sampling with a KV cache keeps close to a full forward, on these queries and responses
    sampled as in a rollout: "trunk" if the log-probs computed from it (the policy's, and at start the reference's)
    agree to `fused_head_is_exact`'s tolerance (sampling's own log-probs differ as much), "final" if the states do."""
    paths = replace(paths, from_sampling=candidates)
    with torch.no_grad(), kept_while_sampling(policy, paths) as pieces:
        generator = torch.Generator(queries.device).manual_seed(0)
        responses = fast_generate(paths.script, policy, queries, pad_token_id, args, stop_token_id, generator,
                                  feed_last=True, share_prefix=paths.shared_prefix)[0]
    qr = torch.cat((queries, responses), 1)
    real = qr != pad_token_id
    kept = paths.kept(pieces, real[:, :queries.size(1)], [responses.size(1)], qr.size(1))

    def pair(name):
        if name == "trunk":
            return [p.response_logprobs(policy, qr, pad_token_id, queries.size(1), responses, args.temperature)[0][
                real[:, queries.size(1):]] for p in (replace(kept, final_hidden=None), FastPaths(paths.script))]
        return kept.final_hidden[real], paths.script.final_hidden_states(policy, qr, pad_token_id)[real]

    with torch.no_grad():
        return tuple(name for name in candidates if torch.allclose(*pair(name), rtol=1e-4, atol=1e-4))


def sampling_is_exact(script, policy, queries, pad_token_id: int, args, stop_token_id: int | None) -> bool:
    """Whether `fast_generate`'s loop (no shortcut) draws the script's own `generate`'s tokens and log-probs from the
    same random numbers: a copier's edited `generate` no longer does, and the script's sampling runs instead."""
    with torch.no_grad():
        drawn = [sample(script, policy, queries, pad_token_id, args, stop_token_id, torch.Generator(
            queries.device).manual_seed(0)) for sample in (fast_generate, lambda script, *a: script.generate(*a))]
    (tokens, logprobs), (plain_tokens, plain_logprobs) = drawn
    return torch.equal(tokens, plain_tokens) and torch.allclose(logprobs, plain_logprobs, rtol=1e-5, atol=1e-5)


def prefill(script, policy, queries, pad_token_id, share_prefix=False):
    """Sampling's first forward: (output, attention mask, last position ids). `share_prefix`: the tokens every
    row starts with (a chat template's) run once, their KV cache is repeated for each row, and then each row's
    [padding, rest] runs; `kept_while_sampling` sees the prefix as a piece with one row."""
    inputs = script.model_inputs(queries, pad_token_id)
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


def shared_prefix_is_exact(script, policy, queries, pad_token_id: int) -> bool:
    """Whether `prefill` with the prefix these queries share run once gives the full prefill's next-token logits; a
    cache that cannot repeat its rows (a linear-attention layer's) refuses it."""
    try:
        with torch.no_grad():
            return torch.allclose(*(prefill(script, policy, queries, pad_token_id, share)[0].logits
                                    for share in (True, False)), rtol=1e-4, atol=1e-4)
    except (AttributeError, NotImplementedError):
        return False


@torch.no_grad()
def fast_generate(script, policy, queries, pad_token_id, args, stop_token_id=None, generator=None, synced=False,
                  feed_last=False, share_prefix=False, static=None):
    """`generate`, with `prefill`'s shared prefix, `feed_last`: the last tokens go through the model too, so that
    every position's states pass `kept_while_sampling`'s hooks, and `static`: a `StaticSampler` steps instead of the
    model with its dynamic KV cache. The same tokens and log-probs as `generate`, from the same random numbers."""
    out, attention_mask, position_ids = prefill(script, policy, queries, pad_token_id, share_prefix)
    step_model = static.start(policy, out.past_key_values, attention_mask, position_ids, args.response_length) if (
        static) else None
    tokens, logprobs, logits = [], [], out.logits[:, -1]
    finished = torch.zeros(queries.size(0), dtype=torch.bool, device=queries.device)
    check = stop_token_id is not None  # else no row ends early: never wait on the GPU to ask
    flag = HostFlag(queries.device)
    for step in range(args.response_length):
        token, logprob, finished, done = script.sample_next(logits, args, pad_token_id, generator, finished,
                                                            stop_token_id, synced)
        tokens.append(token)
        logprobs.append(logprob)
        final = step == args.response_length - 1
        if final and not feed_last:
            break
        if step_model is not None:  # the next forward is queued before `done` is read: no bubble between CUDA graphs
            if check:
                flag.send(done)
            logits = step_model(token)
            if final or check and flag.read():
                break
            continue
        if check and bool(done) and not feed_last:
            break
        out, attention_mask, position_ids = dynamic_step(policy, token, out, attention_mask, position_ids)
        logits = out.logits[:, -1]
        if final or check and bool(done):
            break
    return torch.cat(tokens, dim=1), torch.stack(logprobs, dim=1)


def dynamic_step(policy, token, out, attention_mask, position_ids):
    """One token through the dynamic KV cache of `out`: (the output, the attention mask and position ids grown)."""
    attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.size(0), 1)], dim=1)
    position_ids = position_ids + 1
    out = policy(input_ids=token, attention_mask=attention_mask, position_ids=position_ids,
                 past_key_values=out.past_key_values, use_cache=True)
    return out, attention_mask, position_ids


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
                          f"{self.compilations[-1][1]:.1f} s ({self.counted()})")
            elif self.compile and graph_counts() != self.graphs:  # a guard failed: dynamo compiled again
                print(f"the sampler compiled again at {rows} rows x {length} positions ({self.counted()})")
            return logits
        return step

    def counted(self) -> str:
        """The graphs dynamo compiled and the CUDA graphs inductor skipped, so far (also another model's)."""
        self.graphs = graph_counts()
        return f"{self.graphs[0]} graphs compiled, {self.graphs[1]} CUDA graph skips"

    def probe(self, script, policy, queries, pad_token_id, args, stop_token_id, share_prefix: bool,
              agree=bool) -> tuple:
        """(accepted, the banner's note). The probe's queries are sampled once (dynamic cache), then those tokens are
        fed through this sampler (compiling it) and through the dynamic cache, and each path's log-probs compared
        with a full forward's: accepted if this sampler's error is within 1e-4, twice the dynamic cache's, or the
        compute dtype's rounding of the log-probs (bf16's). `agree` makes one verdict of every process's."""
        if any(getattr(layer, "is_sliding", False) for layer in StaticCache(
                config=unpeft(policy).config, max_cache_len=2).layers):
            agree(False)
            return False, "dynamic KV cache (static refused: a sliding-window layer would recompile at every step)"
        errors, note = None, ""
        try:
            generator = torch.Generator(queries.device).manual_seed(0)
            responses = fast_generate(script, policy, queries, pad_token_id, args, stop_token_id, generator,
                                      share_prefix=share_prefix)[0]
            full = script.response_logprobs(policy, torch.cat((queries, responses), 1), pad_token_id,
                                            queries.size(1), responses, args.temperature)[0]
            errors = [(forced_logprobs(script, policy, queries, pad_token_id, responses, args, static, share_prefix)
                       - full).abs().max().item() for static in (self, None)]
            device = queries.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else full.dtype
            tolerance = max(1e-4, 2 * errors[1], torch.finfo(dtype).eps * full.abs().max().item())
        except Exception as error:  # a model whose cache or forward does not compile: the dynamic cache samples
            note = f"dynamic KV cache (the static probe failed: {type(error).__name__}: {str(error)[:200]})"
        accepted = agree(errors is not None and errors[0] <= tolerance)
        if errors is None:
            return False, note
        kind = f"static KV cache compiled in {sum(s for _, s in self.compilations):.0f} s, {self.counted()}" if \
            self.compile else "static KV cache, uncompiled"
        verdict = kind if accepted else f"dynamic KV cache (refused: {kind}" + (
            ")" if errors[0] <= tolerance else f"; over {tolerance:.1e})")
        return accepted, (f"{verdict}; probe: max |log-prob - full forward's| {errors[0]:.1e}, the dynamic "
                          f"cache's {errors[1]:.1e}, on the same tokens")


def graph_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, CUDA graphs inductor skipped) in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]


@torch.no_grad()
def forced_logprobs(script, policy, queries, pad_token_id, responses, args, static=None, share_prefix=False):
    """The log-probs of `responses` fed token by token through sampling's forwards, a `StaticSampler`'s or the dynamic
    cache's, as sampling computes them: two ways of sampling judged on the same tokens."""
    out, attention_mask, position_ids = prefill(script, policy, queries, pad_token_id, share_prefix)
    step_model = static.start(policy, out.past_key_values, attention_mask, position_ids, args.response_length) if (
        static) else None
    logits, logprobs = out.logits[:, -1], []
    for step in range(responses.size(1)):
        token = responses[:, step:step + 1]
        scaled = script.scale_logits(logits, args.temperature, pad_token_id)
        logprobs.append(script.logprobs_from_logits(scaled, token.squeeze(-1)))
        if step == responses.size(1) - 1:
            break
        if step_model is not None:
            logits = step_model(token)
            continue
        out, attention_mask, position_ids = dynamic_step(policy, token, out, attention_mask, position_ids)
        logits = out.logits[:, -1]
    return torch.stack(logprobs, dim=1)
