"""Speed that is not the page's own: `torch.compile`'s settings for the training step the scripts
compile in plain sight (`should_compile`, the compile cache, `CompiledOrEager`, `CompileWatch`), and
the one hand-written sampler that stays until a GPU has measured the page's own compiled decode step
against it (README: the ledger):

- `StaticSampler`: on CUDA, sampling's next-token forward through transformers' `StaticCache`,
  compiled into CUDA graphs. It stands in for the policy in the script's `generate`, which calls it
  as it calls the policy (the prefill goes to the policy itself; each later step replays the
  graphs); `static_sampler` builds it where its start-up probe, on tokens the script's own
  `generate` sampled, finds its log-probs equal to a full forward's.

This module imports no script: the probe calls the script's `left_pad`, `model_inputs`, `generate`,
`response_logprobs`, `scale_logits` and `logprobs_from_logits` through `script`.
"""
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import StaticCache

from ppo_harness.forwards import unpeft


def should_compile(args, accelerator, num_updates: int, pays_back_after: int = 40) -> bool:
    """--compile: on, off, or auto: on for one CUDA process, without DeepSpeed, in a run of at least
    `pays_back_after` updates, where compiling pays back (benchmarks/README.md#gpu). Several
    processes are refused by name, before any model loads: DeepSpeed's engine runs its own forward
    hooks, and dynamo fails on DDP's forward at the first training step (its Logger's
    set_runtime_stats_and_log). Sets the compile cache's folder (`compile_cache`)."""
    deepspeed = accelerator.state.deepspeed_plugin is not None
    if args.compile == "on" and deepspeed:
        raise ValueError("--compile on: DeepSpeed's engine runs its own forward hooks, which are "
                         "not compiled here; use --compile off (or auto) with DeepSpeed")
    if args.compile == "on" and accelerator.num_processes > 1:
        raise ValueError(f"--compile on: {accelerator.num_processes} processes (DDP), whose forward "
                         "torch.compile cannot trace here (it fails at the first training step); "
                         "use --compile off (or auto, which compiles one process only)")
    compiled = args.compile == "on" or (args.compile == "auto" and accelerator.device.type == "cuda"
                                        and not deepspeed and accelerator.num_processes == 1
                                        and num_updates >= pays_back_after)
    if compiled:
        compile_cache()
    return compiled


# ---- The compiled training step ------------------------------------------------------------------
class CompileWatch:
    """What torch.compile compiled during each update (the graphs dynamo made, the CUDA graphs
    inductor skipped): after the first update with compiled code, what compiling cost; after a later
    one, a recompilation (a failed guard)."""

    def __init__(self):
        self.seen, self.first = graph_counts(), None

    def report(self, update: int, seconds: float, console=None) -> None:
        now = graph_counts()
        graphs, self.seen = now[0] - self.seen[0], now
        if graphs and console is not None:
            first, self.first = self.first is None, self.first or update
            console.print(f"update {update}: torch.compile made {graphs} graph(s) ({now[1]} CUDA "
                          f"graph skips so far); its training phase took {seconds:.1f} s" + (
                              "" if first
                              else " (a recompilation: TORCH_LOGS=recompiles says why)"),
                          highlight=False)


def compile_cache(root: str = "cache/torch_compile") -> str:
    """Where torch.compile keeps its artefacts (inductor's FX graph cache, autotuning, kernels), so
    that a second run of the same shapes starts warm: TORCHINDUCTOR_CACHE_DIR if the user set it,
    else `root` beside the run's other caches. Importing peft already exported inductor's default
    (under /tmp), so that value counts as unset. A folder that cannot be written is refused by
    name (else the compiled files would go nowhere a second run finds)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        given = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(root).resolve())
    try:
        Path(given).mkdir(parents=True, exist_ok=True)
        probe = Path(given) / f".writable-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--compile: the compile cache {given} cannot be written ({e.strerror}); make it "
                         "writable, or set TORCHINDUCTOR_CACHE_DIR to a folder that is") from None
    return given


def damaged_cache(cache: str, error: Exception) -> str:
    """The console's line for a compile cache whose files failed to load (a partial write, a disk
    error, another torch's files): which folder, and what to do."""
    first = next((line for line in str(error).splitlines() if cache in line), str(error))[:300]
    return (f"the compile cache {cache} holds a file that does not load ({first}); this run compiles "
            "again without reading or writing that cache: delete the folder (or set "
            "TORCHINDUCTOR_CACHE_DIR to another) so that later runs start warm")


def forget_compile_cache() -> None:
    """Compile from nothing from here on: inductor's FX graph cache and AOTAutograd's cache off, and
    what dynamo compiled so far dropped."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()


def ready_to_compile(*models) -> None:
    """transformers installs the hooks that record hidden states (`output_hidden_states`) on the
    first forward that asks for them, under a lock dynamo cannot trace: install them before the
    training step is compiled."""
    from transformers.utils.output_capturing import (_CAN_RECORD_REGISTRY,
                                                     maybe_install_capturing_hooks)

    for model in models:
        for module in model.modules():
            if _CAN_RECORD_REGISTRY.get(module):
                maybe_install_capturing_hooks(module)


class CompiledOrEager:
    """A compiled training step that falls back to the eager one where the compiler fails on its
    first call (an operator it cannot trace whole, a kernel that does not build), saying so once:
    with --compile auto the run goes on eagerly; with --compile on the error is raised. A failure
    that names the compile cache's folder is tried once more without the cache, whichever the
    setting; where that compiles, a file there was damaged, and the console names the folder."""

    def __init__(self, compiled, eager, strict: bool, console=print):
        self.compiled, self.eager, self.strict, self.console, self.first = (compiled, eager, strict,
                                                                            console, True)
        self.without_cache = False  # set once a damaged compile cache was met: compiled without it

    def __call__(self, *args, **kwargs):
        if not self.first:
            return self.compiled(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        # the compiler's errors are of many kinds (dynamo's, inductor's, triton's)
        except Exception as error:
            cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            # the error names the cache: compiled once more without it; if that compiles, a file
            # there was damaged, and the console says which folder
            if cache and cache in str(error) and not self.without_cache:
                self.without_cache = True
                forget_compile_cache()
                out = self(*args, **kwargs)
                if self.compiled is not self.eager:
                    self.console(damaged_cache(cache, error))
                return out
            if self.strict:
                raise
            self.console(f"the training step did not compile ({type(error).__name__}: "
                         f"{str(error)[:300]}); it runs eagerly (--compile off skips the attempt)")
            self.compiled = self.eager
            out = self.eager(*args, **kwargs)
        self.first = False
        return out


# ---- The static sampler (CUDA) -------------------------------------------------------------------
def static_sampler(script, args, accelerator, setup, models) -> "StaticSampler | None":
    """--sampler: a `StaticSampler` around the prepared policy (`models.policy`) where it applies
    (CUDA with --compile, or asked for by name) and its probe passes on every process, else None:
    the script's `generate` steps the policy's own dynamic cache. The banner's line is appended to
    `models.notes`."""
    policy, notes = models.policy, models.notes
    mode = args.sampler if args.sampler != "auto" else "compiled" if setup.compiled else "dynamic"
    if mode == "dynamic" or not args.fast_paths or setup.zero3:
        refused = (f" ({mode} refused under ZeRO-3: weights gathered per rollout)"
                   if setup.zero3 and mode != "dynamic" else "")
        notes.append(f"sampler: dynamic KV cache{refused}")
        return None
    pad_token_id, device = setup.tokenizer.pad_token_id, accelerator.device
    queries = script.left_pad(setup.train_dataset[:8]["input_ids"], pad_token_id).to(device)
    queries = queries[:args.local_rollout_forward_batch_size]
    # one cache width for the run, its widest prompt's: one compilation
    widest = max(len(ids) for part in (setup.train_dataset, setup.eval_rows) if len(part)
                 for ids in part["input_ids"])
    sampler = StaticSampler(policy, args.local_rollout_forward_batch_size, args.response_length,
                            compile=mode == "compiled", width=widest)
    with torch.no_grad(), accelerator.autocast():
        responses, logprobs = script.generate(policy, queries, pad_token_id, args,
                                              setup.stop_token_id,
                                              torch.Generator(device).manual_seed(0), False)
        full = script.response_logprobs(policy, torch.cat((queries, responses), 1), pad_token_id,
                                        queries.size(1), responses, args.temperature)[0]

        def every_process(ok):  # all sample alike, or none
            return bool(accelerator.gather(torch.tensor([float(ok)], device=device)).min() > 0)
        accepted, note = sampler.probe(script, queries, pad_token_id, args, responses,
                                       (logprobs - full).abs().max().item(), full, every_process)
    notes.append(f"sampler: {note}")
    if accepted:  # its compiled steps run no module hooks: the trunk is not kept while it samples
        models.keep_trunk = None
    return sampler if accepted else None


def stored_as_allocated(layer) -> None:
    """A static cache layer that casts what it stores to its own dtypes. Under autocast RoPE leaves
    the keys in float32 while a step's values come out of their projection in bf16, and the layer
    allocated both as the prefill's keys: storing bf16 in float32 is exact, and attention's autocast
    casts both back as it does the dynamic cache's."""
    update = layer.update

    def update_in_the_caches_dtype(key_states, value_states, *args, **kwargs):
        return update(key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype),
                      *args, **kwargs)
    layer.update = update_in_the_caches_dtype


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with copies of its first row appended up to `rows` rows (rows nobody reads: a static
    shape)."""
    return torch.cat((tensor, tensor[:1].expand(rows - tensor.size(0), *tensor.shape[1:]))) \
        if rows > len(tensor) else tensor


class StaticSampler:
    """Sampling's next-token forwards through transformers' `StaticCache`, compiled into CUDA graphs
    (torch.compile, mode "reduce-overhead"). With a dynamic cache a small model's loop is bound by
    kernel launches (about 36 ms a token at batch 64 for 135M parameters on an H100); a graph
    replays them all at once. Static shapes recompile, so a chunk is padded to `rows` rows and its
    cache to `width` (the run's widest prompt) rounded up to `bucket`, plus the response: one
    compilation per run and dtype, its seconds in `compilations`, and any later one reported.

    Called as `generate` calls the policy: a call without `past_key_values` is the prefill, run by
    the policy itself into a dynamic cache; the first step after it copies that cache into the
    static one, and every step replays."""

    def __init__(self, policy, rows: int, response_length: int, bucket: int = 64,
                 compile: bool = True, width: int = 0):
        self.policy, self.rows, self.response_length = policy, rows, response_length
        self.bucket, self.compile, self.width = bucket, compile, width
        self.caches, self.compilations, self.forward = {}, [], None
        self.graphs = graph_counts()

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values=None,
                 use_cache=True, logits_to_keep=0):
        if past_key_values is None:  # the prefill
            return self.policy(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=True,
                               logits_to_keep=logits_to_keep)
        # a chunk's first step: the prefill's mask and positions
        if not isinstance(past_key_values, StaticSteps):
            past_key_values = StaticSteps(self.start(past_key_values, attention_mask[:, :-1],
                                                     position_ids - 1))
        return SimpleNamespace(logits=past_key_values.advance(input_ids)[:, None],
                               past_key_values=past_key_values)

    def start(self, prefilled, attention_mask, position_ids):
        """A step function for one chunk, token (n, 1) -> the next token's logits (n, vocab), after
        copying the prefill's dynamic cache `prefilled` into a static one."""
        n, width = attention_mask.shape
        rows = max(self.rows, n)
        length = -(-max(width, self.width) // self.bucket) * self.bucket + self.response_length
        key = (rows, length, prefilled.layers[0].keys.dtype)
        new_shape = key not in self.caches
        if new_shape:
            self.caches[key] = StaticCache(config=unpeft(self.policy).config, max_cache_len=length)
        cache = self.caches[key]
        for layer, source in zip(cache.layers, prefilled.layers):
            keys, values = pad_rows(source.keys, rows), pad_rows(source.values, rows)
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
                stored_as_allocated(layer)
            layer.keys[:, :, :width].copy_(keys)
            layer.values[:, :, :width].copy_(values)
            # the next token's slot; the stale ones after it are masked
            layer.cumulative_length.fill_(width)
        mask = attention_mask.new_zeros(rows, length)
        mask[:, :width] = pad_rows(attention_mask, rows)
        positions, column = pad_rows(position_ids, rows), width
        if self.forward is None:
            self.forward = (torch.compile(self.policy, mode="reduce-overhead", dynamic=False)
                            if self.compile else self.policy)

        def step(token):
            nonlocal positions, column, new_shape
            mask[:, column] = 1
            positions, column, timer, graphs = (positions + 1, column + 1, time.perf_counter(),
                                                graph_counts()[0])
            if self.compile:
                # the last step's outputs are read: the graph may rerun
                torch.compiler.cudagraph_mark_step_begin()
            # contiguous: a column of the probe's responses is strided, and a stride is one of the
            # compiled guards
            logits = self.forward(input_ids=pad_rows(token, rows).contiguous(), attention_mask=mask,
                                  position_ids=positions, past_key_values=cache,
                                  use_cache=True).logits
            # a CUDA graph's output is overwritten by its next replay
            logits = logits[:n, -1].clone()
            if new_shape:
                self.compilations.append((key, time.perf_counter() - timer))
                new_shape = False
                if self.compile:  # benchmarks/gpu_bench.py reads this line
                    print(f"compiled the sampler for {rows} rows x {length} positions in "
                          f"{self.compilations[-1][1]:.1f} s ({self.counted()})")
            # a guard failed: dynamo compiled again
            elif self.compile and graph_counts()[0] != graphs:
                print(f"the sampler compiled again at {rows} rows x {length} "
                      f"positions ({self.counted()})")
            return logits
        return step

    def counted(self) -> str:
        """The graphs dynamo compiled and the CUDA graphs inductor skipped, so far (also another
        model's)."""
        self.graphs = graph_counts()
        return f"{self.graphs[0]} graphs compiled, {self.graphs[1]} CUDA graph skips"

    def probe(self, script, queries, pad_token_id, args, responses, dynamic_error: float, full,
              agree=bool) -> tuple:
        """(accepted, the banner's note). The tokens sampling drew (with the dynamic cache, whose
        error against a full forward is `dynamic_error`) are fed through this sampler (compiling
        it), and its log-probs compared with the full forward's `full`: accepted if its error is
        within 1e-4, twice the dynamic cache's, or the compute dtype's rounding of the log-probs
        (bf16's). `agree` makes one verdict of every process's."""
        if any(getattr(layer, "is_sliding", False) for layer in StaticCache(
                config=unpeft(self.policy).config, max_cache_len=2).layers):
            agree(False)
            return False, ("dynamic KV cache (static refused: a sliding-window layer would "
                           "recompile at every step)")
        error, note = None, ""
        try:
            error = (forced_logprobs(script, self, queries, pad_token_id, responses, args)
                     - full).abs().max().item()
            device = queries.device.type
            dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else full.dtype)
            tolerance = max(1e-4, 2 * dynamic_error,
                            torch.finfo(dtype).eps * full.abs().max().item())
        # a model whose cache or forward does not compile: the dynamic cache samples
        except Exception as failure:
            note = (f"dynamic KV cache (the static probe failed: {type(failure).__name__}: "
                    f"{str(failure)[:200]})")
        accepted = agree(error is not None and error <= tolerance)
        if error is None:
            return False, note
        kind = (f"static KV cache compiled in {sum(s for _, s in self.compilations):.0f} s, "
                f"{self.counted()}"
                if self.compile else "static KV cache, uncompiled")
        verdict = kind if accepted else f"dynamic KV cache (refused: {kind}" + (
            ")" if error <= tolerance else f"; over {tolerance:.1e})")
        return accepted, (f"{verdict}; probe: max |log-prob - full forward's| {error:.1e}, the "
                          f"dynamic cache's {dynamic_error:.1e}, on the same tokens")


class StaticSteps:
    """What a `StaticSampler` hands back as `past_key_values`: `advance`, the chunk's step over its
    static cache, token (n, 1) -> the next token's logits (n, vocab)."""

    def __init__(self, advance):
        self.advance = advance


def graph_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, CUDA graphs inductor skipped) in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]


@torch.no_grad()
def forced_logprobs(script, sampler, queries, pad_token_id, responses, args):
    """The log-probs of `responses` fed token by token through `sampler` (a model, or a
    `StaticSampler` around one) as the script's `generate` feeds its own tokens."""
    inputs = script.model_inputs(queries, pad_token_id)
    out = sampler(**inputs, use_cache=True,
                  logits_to_keep=torch.tensor([-1], device=queries.device))
    attention_mask, position_ids, logprobs = (inputs["attention_mask"],
                                              inputs["position_ids"][:, -1:], [])
    for step in range(responses.size(1)):
        token = responses[:, step:step + 1]
        scaled = script.scale_logits(out.logits[:, -1], args.temperature, pad_token_id)
        logprobs.append(script.logprobs_from_logits(scaled, token.squeeze(-1)))
        if step == responses.size(1) - 1:
            break
        attention_mask = torch.cat([attention_mask,
                                    attention_mask.new_ones(attention_mask.size(0), 1)], dim=1)
        position_ids = position_ids + 1
        out = sampler(input_ids=token, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(logprobs, dim=1)
