"""Checkpoints: accelerate's state written aside with the flags the run was launched with and every
file's sha256, renamed into place, pruned to --save-total-limit; found for a resume (`latest`, else
the newest whole one) and verified before it loads; a resume of an older one moves the later ones
aside (`branch_at`)."""
import hashlib
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

from accelerate.utils import broadcast_object_list

from ppo_harness.writes import disk_space_named, write_atomic

# in each checkpoint: every file's sha256, verified before a resume loads it
CHECKSUMS = "checksums.sha256"
# trainer_state.json's format: 2 carries the flags; such a checkpoint without its checksums is
# incomplete
FORMAT = 2


def save_checkpoint(accelerator, folder, state: dict) -> None:
    """accelerate's save_state written aside (a name unique to this run), its trainer_state.json
    (`state`, the flags the run was launched with, the format) and checksums added, renamed into
    place, then `latest` moved: a kill never leaves a half checkpoint. --save-total-limit counts
    this run's checkpoints up to this one, which it keeps. `folder`: the `RunFolder` that `claim`
    took (its checkpoints folder, and the flags as launched)."""
    checkpoints = folder.checkpoints
    # the main process's, on every rank
    owner = broadcast_object_list([f"{socket.gethostname()}-{os.getpid()}"])[0]
    final = checkpoints / f"update-{state['update']:06d}"
    tmp = checkpoints / f".tmp-{final.name}-{owner}"
    with disk_space_named(checkpoints):
        if accelerator.is_main_process:
            # by a run killed while saving (the lock keeps others out)
            for left in checkpoints.glob(".tmp-update-*"):
                shutil.rmtree(left)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = {**state, "format": FORMAT, "args": folder.flags}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            write_checksums(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_atomic(checkpoints / "latest", final.name)
            earlier = sorted((p for p in checkpoint_dirs(checkpoints) if update_number(p) < state["update"]),
                             key=update_number)
            limit = folder.flags.get("save_total_limit")
            for old in earlier[:max(len(earlier) - limit + 1, 0)] if limit else []:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()


def find_checkpoint(resume: str, output_dir: Path | None) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, verified, and notes on those passed over. `auto`: the one that
    output_dir/checkpoints/latest names, else the newest whole one before it (None if there is none
    yet)."""
    if resume != "auto":
        path = checkpoint_dir(resume)
        if problem := checkpoint_problem(path):
            raise ValueError(f"--resume {resume}: the checkpoint is damaged: {problem}; "
                             "resume from another one")
        return path, []
    if output_dir is None:
        raise ValueError("--resume auto needs --output-dir: the run folder to "
                         "look for checkpoints in")
    checkpoints, notes = output_dir / "checkpoints", []
    candidates = sorted(checkpoint_dirs(checkpoints), key=update_number, reverse=True)
    latest = checkpoints / "latest"
    if latest.is_file():
        name = latest.read_bytes().decode(errors="replace").strip()
        if re.fullmatch(r"update-\d+", name):
            named = checkpoints / name
            candidates = [named] + [p for p in candidates if update_number(p) < update_number(named)]
        else:
            notes.append(f"{latest} is damaged ({name[:40]!r}): ignored, the checkpoints "
                         "taken by their numbers")
    for candidate in candidates:
        if problem := checkpoint_problem(candidate):
            notes.append(f"checkpoint {candidate} is damaged or incomplete: {problem}")
        else:
            fallback = any(n.startswith("checkpoint ") for n in notes)
            return candidate, notes + [f"falling back to {candidate}, the "
                                       "newest whole checkpoint"] * fallback
    if any(n.startswith("checkpoint ") for n in notes):
        raise ValueError("--resume auto: no whole "
                         f"checkpoint in {checkpoints}: " + "; ".join(notes))
    return None, notes


def checkpoint_dir(resume: str) -> Path:
    """--resume's folder, if it looks like a checkpoint (before its run's folder is taken; verified
    after)."""
    path = Path(resume)
    if not path.is_dir() or not {"trainer_state.json", CHECKSUMS} & {p.name for p in path.iterdir()}:
        raise ValueError(f"--resume {resume}: not a checkpoint directory "
                         "(runs/<run>/checkpoints/update-NNNNNN)")
    return path


def checkpoint_dirs(checkpoints: Path) -> list[Path]:
    """The checkpoints/update-NNNNNN folders (not `latest`, temporary or abandoned ones)."""
    return [p for p in checkpoints.glob("update-*") if re.fullmatch(r"update-\d+", p.name)] if (
        checkpoints.is_dir()) else []


def update_number(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("update-"))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (a file missing, unreadable or changed since
    written), or None. One written since checkpoints carry their flags (`FORMAT`) is incomplete
    without its checksums."""
    state = folder / "trainer_state.json"
    if not state.is_file():
        return f"{state} is missing"
    try:
        written = json.loads(state.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        return f"{state} is unreadable ({error})"
    sums = folder / CHECKSUMS
    if not sums.is_file():  # None: written before checkpoints carried checksums
        return f"{sums} is missing" if isinstance(written, dict) and written.get("format", 1) >= FORMAT else None
    try:
        lines = sums.read_text().splitlines()
    except UnicodeDecodeError:
        return f"{sums} is damaged (not text)"
    for number, line in enumerate(lines, 1):
        expected, separator, name = line.partition("  ")
        if not separator or not re.fullmatch(r"[0-9a-f]{64}", expected) or not name:
            return f"{sums} line {number} is damaged: {line[:80]!r}"
        try:
            if file_sha256(folder / name) != expected:
                return f"{folder / name} differs from its checksum in {CHECKSUMS} (damaged)"
        except OSError as error:
            return f"{folder / name}: {error.strerror or error}"
    return None


def write_checksums(folder: Path) -> None:
    """The sha256 of every file of a checkpoint, in `sha256sum -c` format: a resume verifies them
    before loading."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    (folder / CHECKSUMS).write_text("".join(f"{file_sha256(p)}  "
                                            f"{p.relative_to(folder)}\n" for p in files))


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()



def branch_at(checkpoint: Path) -> list[str]:
    """Resuming a checkpoint older than the folder's newest: the later ones (a future this run
    abandons) are moved, never deleted, into checkpoints/abandoned-<time>/, and `latest` names the
    resumed one, so --resume auto continues this branch. The banner's lines on it."""
    checkpoints = checkpoint.parent
    later = [p for p in checkpoint_dirs(checkpoints) if update_number(p) > update_number(checkpoint)]
    if later:
        aside = checkpoints / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        aside.mkdir()
        for path in later:
            os.replace(path, aside / path.name)
    write_atomic(checkpoints / "latest", checkpoint.name)
    return [f"resumed from {checkpoint.name}: the later "
            f"{', '.join(p.name for p in later)} moved to {aside}"] if (
        later) else []
