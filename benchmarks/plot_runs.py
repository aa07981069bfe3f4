"""Plot and summarise runs of ppo.py, ppo_tldr.py or ppo_multiturn.py from their metrics.jsonl (and samples.jsonl) files.

    python benchmarks/plot_runs.py -o cmp.png runs/default-seed* --label default runs/lr1e-5-* --label "lr 1e-5"

Each group of run folders (shell globs work) ends with `--label NAME`; a run without a label is a group of its own. The plot has
the held-out score (eval/scores, or ppo_tldr.py's objective/validation_score), the training score and the KL per
response against episodes: the group's mean, and its min-max range over runs. The table gives each run's figures: the
largest rollout KL (objective/kl), the last evaluated policy's (eval/kl, where logged), and the share of held-out
responses in upbeat assistant talk (DRIFT, from samples.jsonl) at the first and last evaluation.
"""
import argparse
import glob
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# a response that talks as an upbeat assistant instead of continuing the review: "I'm glad to say...", "happy to help"
DRIFT = re.compile(r"\bI(?:'m| am)\s+(?:so\s+|really\s+|very\s+)?(?:glad|happy|thrilled|excited|delighted|pleased)\b"
                   r"|\b(?:happy|glad|here) to (?:help|assist)\b|\bI'd (?:be happy|love) to\b"
                   r"|\bas an? (?:AI|assistant|language model)\b", re.IGNORECASE)
PANELS = [("held-out score", ("eval/scores", "objective/validation_score")), ("training score", ("objective/scores",)),
          ("KL per response (nats)", ("objective/kl",))]


def load(run: Path) -> tuple[list[dict], list[dict]]:
    def rows(name):
        path = run / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return rows("metrics.jsonl"), rows("samples.jsonl")


def series(rows: list[dict], keys: tuple[str, ...]) -> dict[int, float]:
    return {r["episode"]: r[k] for r in rows for k in keys[:1] + tuple(k for k in keys[1:] if k in r) if k in r}


def drift_share(samples: list[dict], update: int) -> float | None:
    # ppo_multiturn.py's tables hold whole transcripts: no single response to read
    responses = [s["model response"] for s in samples if s["update"] == update and "model response" in s]
    return sum(bool(DRIFT.search(r)) for r in responses) / len(responses) if responses else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="runs.png", help="the PNG to write (give it before the runs)")
    parser.add_argument("items", nargs=argparse.REMAINDER, help="run folders (globs), each group followed by --label NAME")
    args, groups, current = parser.parse_args(), {}, []
    items = iter(args.items)
    for item in items:  # argparse cannot interleave, so --label is read here
        if item == "--label":
            groups[next(items)], current = current, []
        else:
            current += [run for run in sorted(glob.glob(item)) if (Path(run) / "metrics.jsonl").exists()]
    groups.update({run: [run] for run in current})  # unlabelled runs: one group each

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    print("| run | updates | s/update | held-out score: first → last eval | max KL | last eval's KL | drift share: first → "
          "last |")
    print("|---|---|---|---|---|---|---|")
    for label, runs in groups.items():
        loaded = {run: load(Path(run)) for run in runs}
        for ax, (title, keys) in zip(axes, PANELS):
            curves = [series(rows, keys) for rows, _ in loaded.values()]
            episodes = sorted(set.intersection(*(set(c) for c in curves)))
            if not episodes:
                continue
            values = np.array([[c[e] for e in episodes] for c in curves])
            line, = ax.plot(episodes, values.mean(0), marker="." if len(episodes) < 20 else None,
                            label=f"{label} ({len(curves)} run{'s' * (len(curves) > 1)})")
            ax.fill_between(episodes, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
            ax.set(title=title, xlabel="episodes")
        for run, (rows, samples) in loaded.items():
            updates = [r for r in rows if r["update"] > 0]
            evals = [r for r in rows if any(k in r for k in PANELS[0][1])]
            held_out = [next(r[k] for k in PANELS[0][1] if k in r) for r in evals]
            seconds = updates[-1]["episode"] / updates[-1]["update"] / updates[-1]["eps"]  # wall clock, evaluations too
            drift = [drift_share(samples, r["update"]) for r in (evals[:1] + evals[-1:])]
            print(f"| {run} | {len(updates)} | {seconds:.1f} | {held_out[0]:.3f} → {held_out[-1]:.3f} | "
                  f"{max(r['objective/kl'] for r in updates):.2f} | " +
                  (f"{evals[-1]['eval/kl']:.2f} | " if "eval/kl" in evals[-1] else "- | ") +
                  (" → ".join(f"{d:.0%}" for d in drift) if None not in drift else "-") + " |")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
