"""The ablation's table and plot from benchmarks/ablation_runs/<row>/s<seed>/ (benchmarks/ablation.py's runs, kept).

    python benchmarks/ablation_table.py                       # the Markdown table, printed; the plot in runs/ablation/
    python benchmarks/ablation_table.py --markdown benchmarks/ablation.md -o benchmarks/ablation.png   # the READMEs'
    python benchmarks/ablation_table.py --runs runs/ablation     # the runs as they finish, before they are kept

Per row, over its finished seeds: held-out accuracy (eval/scores: the reward, 1 for a right answer) before training and
after the last update, as mean ± SD [min, max]; the gain; the mean response length of the last rollout; the critic's
explained variance at the last update; the largest KL to the reference of any seed (each rollout's objective/kl and each
evaluated policy's eval/kl, the final one's among them); wall time per run (2 runs at once, 1 thread each).
"vs plain PPO" compares the final accuracy with the task's plain-PPO row: "exceeds" where the seed ranges do not
overlap, else "within spread" (3 seeds: only a large effect can show). The plot: held-out accuracy against the response
tokens sampled so far, one line per row (the seeds' mean; the band is their range).
"""
import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load(run: Path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    record = json.loads((run / "run.json").read_text())
    return rows, record


def curve(rows) -> list[tuple[float, float]]:
    """(response tokens sampled so far, held-out accuracy) at each evaluation."""
    tokens, previous_episode, points = 0.0, 0, []
    for r in rows:
        if r["update"] > 0 and "val/response_length" in r:
            tokens += (r["episode"] - previous_episode) * r["val/response_length"]
            previous_episode = r["episode"]
        if "eval/scores" in r:
            points.append((tokens, r["eval/scores"]))
    return points


def summary(values):
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return dict(mean=statistics.fmean(values), sd=sd, lo=min(values), hi=max(values), n=len(values))


def fmt(s, digits=3):
    if s is None:
        return "-"
    return f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f} [{s['lo']:.{digits}f}, {s['hi']:.{digits}f}]"


def rows_of(folder: Path):
    table = {}
    for row_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        runs = []
        for run in sorted(row_dir.glob("s*")):
            if (run / "run.json").exists() and json.loads((run / "run.json").read_text())["returncode"] == 0:
                runs.append(load(run))
        if runs:
            table[row_dir.name] = runs
    return table


def stats(runs):
    before = [next(r["eval/scores"] for r in rows if r["update"] == 0) for rows, _ in runs]
    after = [[r for r in rows if "eval/scores" in r][-1]["eval/scores"] for rows, _ in runs]
    updates = [[r for r in rows if r["update"] > 0] for rows, _ in runs]
    return dict(
        before=summary(before), after=summary(after), gain=summary([a - b for a, b in zip(after, before)]),
        length=summary([u[-1]["val/response_length"] for u in updates]),
        ev=summary([u[-1]["val/explained_variance"] for u in updates if "val/explained_variance" in u[-1]]),
        # each rollout's KL (objective/kl) and the evaluated policies' (eval/kl: the final one's too)
        max_kl=max(r[k] for rows, _ in runs for r in rows for k in ("objective/kl", "eval/kl") if k in r),
        wall=statistics.fmean(record["wall_s"] for _, record in runs), seeds=len(runs),
        commits=sorted({record.get("commit", "?") for _, record in runs}),
        curves=[curve(rows) for rows, _ in runs])


def verdict(row, base):
    if row is base:
        return "(baseline)"
    a, b = row["after"], base["after"]
    if a["n"] < 2 or b["n"] < 2:
        return "too few seeds"
    if a["lo"] > b["hi"]:
        return "exceeds: higher"
    if a["hi"] < b["lo"]:
        return "exceeds: lower"
    return "within spread"


def markdown(table):
    lines = ["| row | seeds | held-out accuracy before | after | gain | response length | explained variance | "
             "max KL | wall time | final accuracy vs plain PPO |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in table.items():
        base = table.get(name.split("-")[0] + "-ppo")
        lines.append(f"| {name} | {s['seeds']} | {fmt(s['before'])} | {fmt(s['after'])} | {fmt(s['gain'])} | "
                     f"{fmt(s['length'], 1)} | {fmt(s['ev'], 2)} | {s['max_kl']:.2f} | {s['wall'] / 60:.1f} min | "
                     f"{verdict(s, base) if base else '-'} |")
    commits = sorted({c for s in table.values() for c in s["commits"]})
    lines.append(f"\nruns at commit(s) {', '.join(commits)}")
    return "\n".join(lines)


def plot(table, output: Path):
    tasks = sorted({name.split("-")[0] for name in table})
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [name for name in table if name.startswith(task + "-")]
        others = [name for name in rows if name != task + "-ppo"]  # plain PPO, the baseline, in black
        colors = {task + "-ppo": "black", **dict(zip(others, plt.get_cmap("tab20").colors))}  # 12 rows: tab20
        for name in rows:
            s = table[name]
            points = min(len(c) for c in s["curves"])
            xs = [statistics.fmean(c[i][0] for c in s["curves"]) for i in range(points)]
            ys = [[c[i][1] for c in s["curves"]] for i in range(points)]
            style = "-" if name.endswith(("-ppo", "-vapo", "-grpo", "-rloo", "-sao")) else ":"
            ax.plot(xs, [statistics.fmean(y) for y in ys], style, marker="o", color=colors[name],
                            label=name[len(task) + 1:])
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=colors[name], alpha=0.08)
        ax.set(title=f"{task} task", xlabel="response tokens sampled", ylabel="held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=str(ROOT / "benchmarks" / "ablation_runs"))
    parser.add_argument("-o", "--output", default=str(ROOT / "runs" / "ablation" / "ablation.png"))
    parser.add_argument("--markdown", help="also write a page here: what the columns mean, then the table")
    args = parser.parse_args()
    table = {name: stats(runs) for name, runs in rows_of(Path(args.runs)).items()}
    if not table:
        raise SystemExit(f"no finished runs under {args.runs}")
    text = markdown(table)
    print(text)
    for path in filter(None, (args.output, args.markdown)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.markdown:  # a page of its own: what the columns mean (this docstring's), then the table
        about = " ".join(__doc__.split("\n\n")[2].split())
        how = ("The tasks, rows and commands: [benchmarks/README.md](README.md#the-reasoning-flags-an-ablation-on-two-"
               "verifiable-tasks). Built from the kept runs by `python benchmarks/ablation_table.py --markdown "
               "benchmarks/ablation.md -o benchmarks/ablation.png`.")
        Path(args.markdown).write_text(f"# The reasoning flags' ablation\n\n{how}\n\n{about}\n\n{text}\n")
    plot(table, Path(args.output))
    print(f"plot: {args.output}")


if __name__ == "__main__":
    main()
