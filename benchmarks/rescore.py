"""Re-score saved policies against the initial policy on the held-out prompts, with more responses than one evaluation.

    python benchmarks/rescore.py runs/default-s1 runs/default-s2 runs/default-s3

Each policy, and the initial one (--initial), runs ppo.py at --learning-rate 0, which leaves it unchanged: its
evaluation before the first update and one after each of the next --evaluations - 1 updates each sample one response
per held-out prompt, with the generator seeded by --seed + update. The default, 2 evaluations of the default's 256
held-out prompts, re-scores on 512 responses. Every policy sees the same prompts and seeds, so a gain is
the mean over prompts of (policy - initial), each averaged over its responses, with that mean's standard error. The
table adds the run's largest objective/kl and the share of re-scored responses in assistant talk (plot_runs.DRIFT).
Flags after `--` go to every ppo.py run, e.g. a run's task: `-- --dataset-name cache/arithmetic.jsonl --reward-fn
benchmarks/arithmetic.py:accuracy`.
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plot_runs import DRIFT, load

ROOT = Path(__file__).resolve().parent.parent


def per_prompt(policy: str | None, evaluations: int, seed: int, extra: list[str], output_dir: Path) -> tuple:
    """Each held-out prompt's mean score over the evaluations, and every re-scored response (policy None: ppo.py's
    default --sft-model-path)."""
    # run in the caller's folder, so that relative paths read as they would for ppo.py run there
    subprocess.run([sys.executable, str(ROOT / "ppo.py"), *(["--sft-model-path", policy] if policy else []),
                    "--learning-rate", "0", "--total-episodes", str(32 * max(evaluations - 1, 1)),
                    "--num-mini-batches", "2", "--eval-every", "1", "--seed", str(seed),
                    "--output-dir", str(output_dir), *extra], check=True, stdout=subprocess.DEVNULL)
    rows = load(output_dir)[1]
    scores = [[r["score"] for r in rows if r["update"] == u] for u in range(evaluations)]
    return [statistics.fmean(s) for s in zip(*scores)], [r["model response"] for r in rows if r["update"] < evaluations]


def mean_se(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values) / len(values) ** 0.5:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="+", help="saved policies: run folders of ppo.py, or any --sft-model-path")
    parser.add_argument("--initial", help="the policy the runs started from (default: ppo.py's --sft-model-path)")
    parser.add_argument("--evaluations", type=int, default=2, help="responses per held-out prompt")
    parser.add_argument("--seed", type=int, default=1, help="the first evaluation's seed, as in ppo.py --seed")
    argv = sys.argv[1:] + ["--"] * ("--" not in sys.argv)
    args, extra = parser.parse_args(argv[:argv.index("--")]), argv[argv.index("--") + 1:]
    with tempfile.TemporaryDirectory(prefix="rescore-") as tmp:
        base, _ = per_prompt(args.initial, args.evaluations, args.seed, extra, Path(tmp) / "initial")
        n = len(base) * args.evaluations
        print(f"| policy | re-scored ({n} responses) | gain over the initial | max objective/kl | assistant talk |")
        print("|---|---|---|---|---|")
        print(f"| {args.initial or 'ppo.py default policy'} (initial) | {mean_se(base)} | - | - | - |")
        for i, policy in enumerate(args.policies):
            scores, responses = per_prompt(policy, args.evaluations, args.seed, extra, Path(tmp) / str(i))
            kl = [r["objective/kl"] for r in load(Path(policy))[0] if "objective/kl" in r]  # the updates' rows
            talk = sum(bool(DRIFT.search(r)) for r in responses) / len(responses)
            print(f"| {policy} | {mean_se(scores)} | {mean_se([s - b for s, b in zip(scores, base)])} | "
                  f"{f'{max(kl):.2f}' if kl else '-'} | {talk:.1%} |", flush=True)


if __name__ == "__main__":
    main()
