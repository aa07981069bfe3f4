# The reasoning flags' ablation: every row x 3 seeds of ppo.py on two verifiable tasks, each run's logs kept in
# runs/ablation/<task>-<row>/s<seed>/ (git-ignored). Resumable: a finished run (its last update logged) is skipped, an
# unfinished one starts again from nothing. The table and plot: benchmarks/ablation_table.py.
#   python benchmarks/ablation.py                      # everything, 2 runs at once on 1 thread each
#   python benchmarks/ablation.py --list               # the rows, their flags and what is finished
#   python benchmarks/ablation.py --only length-ppo --seeds 1 --jobs 1 --threads 2    # one run, to time it
# To keep the code fixed while the tree changes, run it from a snapshot of one commit (as the README's table was):
#   mkdir -p runs/ablation-src && git archive COMMIT | tar -x -C runs/ablation-src && echo COMMIT > runs/ablation-src/COMMIT
#   ln -s $PWD/cache runs/ablation-src/cache
#   (cd runs/ablation-src && nohup python benchmarks/ablation.py --out ../ablation --keep ../../benchmarks/ablation_runs \
#        > ../ablation.log 2>&1 &)
# Each finished run's metrics.jsonl and run.json are also kept in benchmarks/ablation_runs/<row>/s<seed>/ (--keep),
# committed: the README's table is built from them. To resume on another machine, copy them into --out first.
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "ablation"
KEEP = ROOT / "benchmarks" / "ablation_runs"  # the logs the table reads, committed
SEEDS = (1, 2, 3)

# the tasks: data built once into cache/, and the flags every row of the task shares (the same sampled tokens each)
TASKS = {
    "length": dict(
        data=["benchmarks/counting.py", "cache/counting.jsonl", "--eval-samples", "128"],
        flags=["--dataset-name", "cache/counting.jsonl", "--reward-fn", "benchmarks/counting.py:accuracy",
               "benchmarks/counting.py:prefix_right", "--reward-weights", "1", "0", "--eval-samples", "128",
               "--response-length", "48", "--total-episodes", "768", "--num-mini-batches", "16",
               "--eval-every", "0"]),  # 3 updates of 256 responses of at most 48 tokens; evaluated at 0 and 3
    "arithmetic": dict(
        data=["benchmarks/arithmetic.py", "cache/arithmetic_eval128.jsonl", "--eval-samples", "128"],
        flags=["--dataset-name", "cache/arithmetic_eval128.jsonl", "--reward-fn", "benchmarks/arithmetic.py:accuracy",
               "--eval-samples", "128", "--total-episodes", "1024", "--num-mini-batches", "16",
               "--eval-every", "0"]),  # the README's recipe cut to 4 updates of 256 (not 7 of 512) and 128
    # held-out prompts (not 256), evaluated at 0 and 4: its figures are not the recipe's
}
GROUP = ["--num-generations", "4"]
VAPO = ["--value-warmup-updates", "1", "--lam", "0.95", "--lam-critic", "1.0", "--lam-length-alpha", "0.05",
        "--cliprange-high", "0.28", "--loss-aggregation", "token", "--positive-lm-coef", "0.1", *GROUP]
# the critic trained as SAO trains it (arXiv 2607.07508: one response per prompt, the critic at 5x the policy's lr, two
# critic updates per policy update) and the warm-up that waits; "better critic": the same without the warm-up
BETTER_CRITIC = ["--critic-learning-rate", "3.5e-4", "--critic-epochs", "1"]  # 5 x the default 7e-5
SAO = [*BETTER_CRITIC, "--value-warmup-updates", "1"]
ROWS = {  # name: flags beyond the task's (plain PPO: today's defaults)
    "length-ppo": [],
    "length-value-warmup": ["--value-warmup-updates", "1"],
    "length-decoupled-gae": ["--lam", "0.95", "--lam-critic", "1.0"],
    "length-adaptive-gae": ["--lam-length-alpha", "0.05"],
    "length-clip-higher": ["--cliprange-high", "0.28"],
    # one micro-batch a minibatch on one process: the same runs as length-ppo (they differ under accumulation)
    "length-token-loss": ["--loss-aggregation", "token"],
    "length-positive-lm": ["--positive-lm-coef", "0.1"],
    "length-group-sampling": GROUP,
    "length-dynamic-sampling": [*GROUP, "--dynamic-sampling"],
    "length-vapo": VAPO,
    "length-grpo": ["--advantage-estimator", "grpo", *GROUP],
    "length-rloo": ["--advantage-estimator", "rloo", *GROUP],
    "length-sao": SAO,
    "length-better-critic": BETTER_CRITIC,
    "length-decoupled-gae-better-critic": ["--lam", "0.95", "--lam-critic", "1.0", *BETTER_CRITIC],
    "length-adaptive-gae-better-critic": ["--lam-length-alpha", "0.05", *BETTER_CRITIC],
    # plain PPO again, at the commit of the critic rows' later seeds (length-ppo's seeds ran at e45b849)
    "length-ppo-again": [],
    "arithmetic-ppo": [],
    "arithmetic-vapo": VAPO,
    "arithmetic-grpo": ["--advantage-estimator", "grpo", *GROUP],
    "arithmetic-rloo": ["--advantage-estimator", "rloo", *GROUP],
    "arithmetic-sao": SAO,
    "arithmetic-better-critic": BETTER_CRITIC,
}


def command(row: str, seed: int) -> list[str]:
    """ppo.py with the task's flags, the row's, the seed; logs only (--no-save-at-end)."""
    task = TASKS[row.split("-")[0]]
    return [sys.executable, "ppo.py", *task["flags"], *ROWS[row], "--seed", str(seed), "--no-save-at-end",
            "--output-dir", str(OUT / row / f"s{seed}"), "--overwrite"]


def finished(row: str, seed: int) -> bool:
    """The run's last update is logged (--no-save-at-end: its logs are all it leaves)."""
    run = OUT / row / f"s{seed}"
    if not (run / "run.json").exists():
        return False
    return json.loads((run / "run.json").read_text()).get("returncode") == 0


def run(row: str, seed: int, threads: int) -> str:
    out = OUT / row / f"s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "PYTHONHASHSEED": "0"}
    (out / "run.json").unlink(missing_ok=True)
    start = time.time()
    with open(out.parent / f"s{seed}.log", "w") as log:
        proc = subprocess.run(command(row, seed), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    record = dict(row=row, seed=seed, returncode=proc.returncode, wall_s=round(time.time() - start, 1),
                  threads=threads, command=command(row, seed)[1:], commit=COMMIT, finished_at=time.ctime())
    (out / "run.json").write_text(json.dumps(record, indent=1))  # after the run, so a killed one is not finished
    if proc.returncode == 0:
        kept = KEEP / row / f"s{seed}"
        kept.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "run.json"):
            shutil.copy(out / name, kept / name)
    return f"{row} s{seed}: rc {proc.returncode}, {record['wall_s']:.0f} s"


def git_commit() -> str:
    """HEAD's, or a snapshot's (git archive writes no .git): its COMMIT file."""
    if (ROOT / "COMMIT").exists():
        return (ROOT / "COMMIT").read_text().strip()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return git.stdout.strip()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="these rows only (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--out", default=str(OUT), help="where the runs go (default runs/ablation)")
    parser.add_argument("--keep", default=str(KEEP), help="where the finished runs' logs are kept")
    args = parser.parse_args()
    OUT = Path(args.out).resolve()
    KEEP = Path(args.keep).resolve()
    rows = args.only or list(ROWS)
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}: choose from {list(ROWS)}")
    todo = [(row, seed) for seed in args.seeds for row in rows if not finished(row, seed)]  # seed 1 of all first
    if args.list:
        for row in rows:
            done = [s for s in args.seeds if finished(row, s)]
            print(f"{row:26} finished seeds {done}  flags: {' '.join(ROWS[row]) or '(defaults)'}")
        print(f"{len(todo)} runs to go")
        sys.exit(0)
    for task in {row.split("-")[0] for row, _ in todo}:
        data = TASKS[task]["data"]
        if not (ROOT / data[1]).exists():
            subprocess.run([sys.executable, *data], cwd=ROOT, check=True)
    COMMIT = git_commit()
    print(f"{len(todo)} runs to go, {args.jobs} at once, {args.threads} thread(s) each; commit {COMMIT}",
          flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda rs: run(*rs, args.threads), todo):
            print(time.strftime("%H:%M:%S"), line, flush=True)
