"""The run's jsonl logs read back: a line torn by a kill dropped, another bad line refused by
number, and the rows a resume redoes trimmed."""
import json
from pathlib import Path

from ppo_harness.writes import write_atomic

# rows with their update: trimmed on resume
LOGS = ("metrics.jsonl", "samples.jsonl", "training_samples.jsonl")


def log_rows(path: Path) -> list[tuple[str, dict]]:
    """A jsonl log's lines and rows; a last line torn by a kill is dropped, another bad line refused
    by number."""
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append((line, json.loads(line)))
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise ValueError(f"{path} line {number} is not JSON ({error.msg}): "
                                 "remove the line to resume") from None
    return rows


def keep_rows_before(path: Path, start_update: int) -> None:
    """Keep only a jsonl log's rows of updates before `start_update` (a resumed run redoes the later
    ones)."""
    if path.exists():
        write_atomic(path, "".join(line + "\n" for line, row in log_rows(path) if row["update"] < start_update))
