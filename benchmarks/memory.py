"""Peak memory and seconds per update of ppo.py's memory setups, on the default model (SmolLM2-135M) and task.

Each setup runs ppo.py in its own subprocess; its peak resident memory is the child's ru_maxrss (os.wait4 gives the
rusage of that child alone), and its seconds per update the mean over updates of the run's own time/generation +
time/scoring + time/training (start-up and model loading excluded). Prints a Markdown table for the README.

    HF_HUB_OFFLINE=1 WANDB_MODE=disabled python benchmarks/memory.py --updates 1 --json runs/memory.json
    python benchmarks/memory.py --only 5 --json runs/lightest.json   # one setup; setups can run side by side
    python benchmarks/memory.py --table runs/memory.json runs/lightest.json   # one table from several runs
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ppo import Args  # noqa: E402
# the LoRA settings of the README's learning run (lr for an adapter, not full weights)
LORA = ["--use-peft", "--lora-target-modules", "all-linear", "--learning-rate", "2e-4"]
SETUPS = {
    "the default (top 6 of 30 blocks trained, one model with a value head)": [],
    "policy + reference + value model (--no-shared-value-head)": ["--no-shared-value-head"],
    "the same, all weights trained (--num-trainable-layers None)": ["--no-shared-value-head", "--num-trainable-layers",
                                                                     "None"],
    "--use-peft --no-shared-value-head": LORA + ["--no-shared-value-head"],
    "--use-peft": LORA,
    "--use-peft --gradient-checkpointing": LORA + ["--gradient-checkpointing"],
}


def measure(flags: list[str], updates: int, out: Path) -> dict:
    defaults = Args()  # the default batch on one process
    per_update = defaults.per_device_train_batch_size * defaults.gradient_accumulation_steps * defaults.num_mini_batches
    cmd = [sys.executable, str(ROOT / "ppo.py"), "--total-episodes", str(per_update * updates),
           "--eval-samples", "0", "--output-dir", str(out), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {out.with_suffix('.log')}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["time/generation"] + r["time/scoring"] + r["time/training"] for r in rows]
    return dict(peak_rss_gib=usage.ru_maxrss / 2**20,  # ru_maxrss is in KiB on Linux
                seconds_per_update=sum(seconds) / len(seconds), wall_s=time.perf_counter() - start,
                scores=[round(r["objective/scores"], 4) for r in rows])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=2, help="PPO updates per setup (one default batch each)")
    parser.add_argument("--only", type=int, nargs="+", help="run only these setups (0-based, in table order)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--table", type=Path, nargs="+", help="print the table from these --json files, run nothing")
    args = parser.parse_args()
    results = {}
    if args.table:
        for path in args.table:
            results.update(json.loads(path.read_text()))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for i, (name, flags) in enumerate(SETUPS.items()):
                if args.only is None or i in args.only:
                    results[name] = measure(flags, args.updates, Path(tmp) / f"setup{i}")
                    print(name, results[name], flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    print("\n| setup | peak RSS (GiB) | s / update |\n|---|---|---|")
    for name in SETUPS:  # table order
        if name in results:
            r = results[name]
            print(f"| `{name}` | {r['peak_rss_gib']:.2f} | {r['seconds_per_update']:.0f} |")


if __name__ == "__main__":
    main()
