"""A run's folder, which the run owns: `claim` finds the checkpoint a resume continues from and checks that it continues
the same run, refuses a folder another run holds (or in use: its `.lock`), a model's, or one holding files no run wrote,
and takes it; then checkpoints written aside with the flags they were trained with and verified by their sha256 before
a resume loads them, a checkpoint on SIGTERM (`Preemption`), the logs trimmed to a resume's start, and the models saved
for plain transformers at the end. Every write goes through a temporary name and a rename, so a run killed at any moment
leaves each file whole."""
import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from accelerate.utils import broadcast_object_list

from ppo_harness.writes import disk_space_named, write_atomic

CHECKSUMS = "checksums.sha256"  # in each checkpoint: every file's sha256, verified before a resume loads it
VALUE_HEAD_FILE = "value_head.safetensors"  # a value head's weight and bias (see `load_value_head`)
FORMAT = 2  # trainer_state.json's format: 2 carries the flags; such a checkpoint without its checksums is incomplete
LOGS = ("metrics.jsonl", "samples.jsonl", "training_samples.jsonl")  # rows with their update: trimmed on resume


@dataclass
class RunFolder:
    """The folder `claim` took for this run, and what a resume continues from."""
    path: Path
    run_name: str
    checkpoint: Path | None = None  # the checkpoint a resume continues from
    saved: dict | None = None  # its trainer_state.json: the update, and what the script put in it
    changes: dict = field(default_factory=dict)  # flags changed since the run began: name -> [then, now]
    notes: list[str] = field(default_factory=list)  # checkpoints passed over as damaged
    # the flags as launched, which every checkpoint carries: a schedule that later sets args.temperature (say) does
    # not make its own resume differ
    flags: dict = field(default_factory=dict)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def banner_lines(self) -> list[str]:
        """The banner's lines on a resume: checkpoints passed over, and each flag changed since the run began."""
        return self.notes + [f"resumed with --{name.replace('_', '-')} changed from {then} to {now}"
                             for name, (then, now) in self.changes.items()]


def claim(accelerator, args, run_state: dict, may_change: set[str], reads: dict | None = None) -> RunFolder:
    """The run's folder, checked and taken in one place, after every other check of the set-up (a refused run writes
    nothing): the folder a folder (not a file, nor a model's, nor one holding files no run wrote: `reads` maps a flag
    to a path the run reads); no live lock, then the lock taken before a checkpoint is chosen (a run ending meanwhile
    cannot change them); the checkpoint --resume names, verified; its `run_state` (the batch arithmetic, the data's
    size, the processes: what the data order and random streams follow) the same as this run's; a new run into another
    run's folder refused (--overwrite: the old run moved aside whole, then deleted, unless it holds what this run
    reads); a resume's flags compared with those the checkpoint was trained with (`resume_changes`: `may_change` and
    --resume-with-changes may differ); resuming an older checkpoint moves the later ones aside (`branch_at`); the
    checkpoint of the run's end (`finished`) exits at once, code 0. The main process decides for all; a refusal
    releases the lock."""
    release_on_signal()
    time_int = int(time.time())
    if accelerator.num_processes > 1:  # the same run name on every rank
        time_int = int(accelerator.gather(torch.tensor([time_int], device=accelerator.device))[0])
    run_name = f"{args.exp_name}__{args.seed}__{time_int}"
    if args.resume and args.resume != "auto":
        checkpoint_dir(args.resume)  # a path that is no checkpoint named before its folder is looked at
    output_dir = run_folder_of(args, run_name)
    result = None
    if accelerator.is_main_process:
        try:
            check_output_dir(output_dir, reads or {})
            check_overwrite(args, output_dir, reads or {})
            created = not output_dir.exists()
            try:
                with disk_space_named(output_dir):
                    lock_output_dir(output_dir, take=True, stale_after=args.peer_timeout * 60)
                result = take(args, output_dir, run_state, may_change)
            except BaseException:  # refused: the lock released, and the folder if it was made for the lock
                release_lock(output_dir)
                if created:
                    with contextlib.suppress(OSError):
                        output_dir.rmdir()
                raise
        except Finished as ended:
            result = ended
        except (ValueError, OSError) as error:
            result = ValueError(str(error) if isinstance(error, ValueError) else f"--output-dir {output_dir}: {error}")
    result = broadcast_object_list([result])[0]  # the other processes raise the same error, or go on
    if isinstance(result, ValueError):
        raise ValueError(str(result))
    if isinstance(result, Finished):  # exit code 0, the reason printed once
        if accelerator.is_main_process:
            print(result)
        raise SystemExit(0)
    return RunFolder(output_dir, run_name, **result, flags=json.loads(json.dumps(asdict(args))))


class Finished(Exception):
    """The checkpoint --resume names is the run's end: nothing is left to train (a requeued job stops, code 0)."""


def run_folder_of(args, run_name: str) -> Path:
    """--output-dir, else the folder of the run whose checkpoint --resume names, else runs/<run_name>."""
    if args.output_dir:
        return Path(args.output_dir)
    if args.resume and args.resume != "auto":
        checkpoint = checkpoint_dir(args.resume)
        if checkpoint.parent.name.startswith("abandoned-") and checkpoint.parent.parent.name == "checkpoints":
            raise ValueError(f"--resume {checkpoint}: a checkpoint its run abandoned when it resumed an earlier one; "
                             "continue it in a new folder: give --output-dir")
        return checkpoint.parent.parent  # runs/<run>/checkpoints/update-NNNNNN: a resumed run keeps its folder
    return Path(f"runs/{run_name}")


def check_overwrite(args, output_dir: Path, reads: dict[str, str | None]) -> None:
    """--overwrite deletes the folder's run: refused where that would delete what this run reads (the checkpoint
    --resume names, a model, adapter or data inside the folder; --resume auto is refused with the flags)."""
    if not args.overwrite:
        return
    inside = {}
    for flag, path in [("--resume", args.resume), *reads.items()]:
        if path and Path(path).exists() and is_within(Path(path), output_dir) and path not in inside.values():
            inside[flag] = path
    if inside:
        named = ", ".join(f"{flag} {path}" for flag, path in inside.items())
        resume = "; to continue from that checkpoint in this folder, drop --overwrite" if "--resume" in inside else ""
        raise ValueError(f"--overwrite would delete {output_dir}, which holds what this run reads ({named}): move "
                         f"{'it' if len(inside) == 1 else 'them'} out of the folder, or give another --output-dir"
                         f"{resume}")


def is_within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies inside it (links resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def take(args, output_dir: Path, run_state: dict, may_change: set[str]) -> dict:
    """`claim` on the main process, the folder locked: the checkpoint, its state, the flags changed, the notes."""
    checkpoint, notes = find_checkpoint(args.resume, output_dir) if args.resume else (None, [])
    saved = json.loads((checkpoint / "trainer_state.json").read_text()) if checkpoint is not None else None
    found = [p for p in (output_dir / "args.json", output_dir / "metrics.jsonl") if p.exists()] + [
        p for p in [output_dir / "checkpoints"] if p.is_dir() and any(p.iterdir())]
    own = checkpoint is not None and checkpoint.parent.parent.resolve() == output_dir.resolve()
    if checkpoint is not None and not own and is_within(checkpoint, output_dir):  # checkpoints/abandoned-*/update-N
        raise ValueError(f"--resume {checkpoint}: a checkpoint this run abandoned when it resumed an earlier one, so "
                         f"the logs in {output_dir} hold the other branch's updates; continue it in a new folder (the "
                         "same command with another --output-dir; its logs start after the checkpoint's update), or "
                         "continue this folder's branch with --resume auto")
    overwrite = found and not (args.resume and (checkpoint is None or own))
    if overwrite and not args.overwrite:
        raise ValueError(f"{output_dir} holds another run ({', '.join(p.name for p in found)}): continue it "
                         "with --resume auto, or give a new --output-dir (--overwrite deletes it)")
    for log in LOGS:
        if args.resume and (output_dir / log).exists():
            log_rows(output_dir / log)  # a bad line refused now, not after the models load
    # a new run compares no flags: --overwrite with other flags starts afresh
    changed = resume_changes(args, saved, checkpoint.parent.parent if checkpoint else output_dir) if (
        args.resume) else {}
    settings = {k: (saved[k], v) for k, v in run_state.items() if saved and saved.get(k, v) != v}
    if settings:  # an older checkpoint has no num_processes: taken as unchanged
        raise ValueError(f"--resume {checkpoint}: the run's settings changed (saved, now): {settings}, the "
                         f"flags that differ: {changed or 'none recorded'}. The batch flags, --total-episodes, "
                         "the data and the number of processes set the data order, the random streams and the "
                         "learning rate's anneal, so a resume cannot change them: resume with the original "
                         "ones, or start a new run from the saved policy")
    allowed = may_change | {"resume", "resume_with_changes"} | {
        name.lstrip("-").replace("-", "_") for name in args.resume_with_changes}
    refused = {name: change for name, change in changed.items() if name not in allowed}
    if refused:
        raise ValueError(f"--resume: flags differ from those {checkpoint or output_dir} was trained with "
                         f"(then, now): {refused}; they change the run, so resume with the original flags, or "
                         "name them in --resume-with-changes to go on with them")
    if saved and saved.get("finished"):  # the run's end (an early one too): a requeued job stops here
        raise Finished(f"--resume {args.resume}: the run ended after update {saved['update']} ({checkpoint}): "
                       "it is finished, nothing is left to train")
    with disk_space_named(output_dir):
        if overwrite:  # the old run moved away whole, then deleted once the new folder holds the lock
            aside = move_aside(output_dir)
            lock_output_dir(output_dir, take=True, stale_after=args.peer_timeout * 60)
            shutil.rmtree(aside)
        if own:
            notes += branch_at(checkpoint)
    changes = {name: change for name, change in changed.items() if name not in ("resume", "resume_with_changes")}
    return dict(checkpoint=checkpoint, saved=saved, changes=changes, notes=notes)


def check_output_dir(output_dir: Path, reads: dict[str, str | None]) -> None:
    """Refuse a folder that is a file or under one, the folder of what the run reads (a model: the trained model would
    be written over it), and a folder holding files no run wrote (no args.json, metrics.jsonl or checkpoints/: a
    model's, a dataset's...)."""
    for folder in (output_dir, *output_dir.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"--output-dir {output_dir}: {folder} is a file, not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ValueError(f"--output-dir {output_dir}: {folder} is not writable")
            break
    for flag, path in reads.items():
        if path and Path(path).exists() and Path(path).resolve() == output_dir.resolve():
            raise ValueError(f"--output-dir {output_dir} is the folder of {flag}: the run would write its model over "
                             "that one; give another --output-dir")
    names = sorted(p.name for p in output_dir.iterdir() if not p.name.startswith(".")) if output_dir.is_dir() else []
    if names and not {"args.json", "metrics.jsonl", "checkpoints"} & set(names):
        raise ValueError(f"--output-dir {output_dir} holds files no run wrote ({', '.join(names[:6])}"
                         f"{', ...' if len(names) > 6 else ''}): give a new or empty folder")


def move_aside(output_dir: Path) -> Path:
    """--overwrite: the old run's folder renamed, whole, to a hidden name beside it, and an empty one made: a kill
    leaves the old run or the new one, never a mix. The caller deletes the old one once it holds the new folder."""
    aside = output_dir.with_name(f".{output_dir.name}.overwritten-{socket.gethostname()}-{os.getpid()}")
    os.replace(output_dir, aside)
    output_dir.mkdir()
    return aside


def branch_at(checkpoint: Path) -> list[str]:
    """Resuming a checkpoint older than the folder's newest: the later ones (a future this run abandons) are moved,
    never deleted, into checkpoints/abandoned-<time>/, and `latest` names the resumed one, so --resume auto
    continues this branch. The banner's lines on it."""
    checkpoints = checkpoint.parent
    later = [p for p in checkpoint_dirs(checkpoints) if update_number(p) > update_number(checkpoint)]
    if later:
        aside = checkpoints / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        aside.mkdir()
        for path in later:
            os.replace(path, aside / path.name)
    write_atomic(checkpoints / "latest", checkpoint.name)
    return [f"resumed from {checkpoint.name}: the later {', '.join(p.name for p in later)} moved to {aside}"] if (
        later) else []


def lock_output_dir(output_dir: Path, take: bool, stale_after: float) -> None:
    """Refuse while output_dir/.lock names a live process; `take`: then take it (host and pid), released at exit. A
    holder gone from this host (killed) left it stale: taken over; another host's, once neither the lock nor
    metrics.jsonl (written each update) changed for `stale_after` seconds (a Slurm requeue lands on another node); an
    empty or unreadable lock (a run killed while writing it) is stale."""
    lock, me = output_dir / ".lock", f"{socket.gethostname()} {os.getpid()}"
    for _ in range(3):
        if lock.exists():
            host, _, pid = lock.read_text(errors="replace").strip().partition(" ")
            last = max(p.stat().st_mtime for p in (lock, output_dir / "metrics.jsonl") if p.exists())
            readable = bool(host) and pid.isdigit()
            if readable and not (host == socket.gethostname() and (int(pid) == os.getpid() or not process_alive(
                    int(pid))) or host != socket.gethostname() and time.time() - last > stale_after):
                raise ValueError(f"{output_dir} is in use by the run of process {pid} on host {host} (its lock "
                                 f"{lock}): wait for it or give another --output-dir; if it is gone, delete {lock} "
                                 "(another host's is stale after --peer-timeout minutes without an update logged)")
            if not take:
                return
            lock.unlink(missing_ok=True)  # stale, or this process's own
        if not take:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another run took it meanwhile: named on the next pass
            continue
        try:
            with os.fdopen(fd, "w") as f:
                f.write(me)
        except OSError:  # a full disk: no empty lock left behind
            lock.unlink(missing_ok=True)
            raise
        atexit.register(lambda: lock.exists() and lock.read_text() == me and lock.unlink())
        return
    raise ValueError(f"{lock}: could not take the lock (another run starting at once?)")


def release_lock(output_dir: Path) -> None:
    """Remove output_dir/.lock if this process holds it."""
    lock = output_dir / ".lock"
    with contextlib.suppress(OSError):
        if lock.read_text() == f"{socket.gethostname()} {os.getpid()}":
            lock.unlink()


def release_on_signal() -> None:
    """SIGTERM during start-up (models loading, minutes for a large one) ends the run as an error does, so the lock is
    released (by default SIGTERM ends a process at once: its lock, on another host, would block a requeued job for
    --peer-timeout). `Preemption` takes over once the run starts; a handler someone else set is kept."""
    def stop(signum, frame):
        print(f"{signal.Signals(signum).name} during start-up: the run stops before training, its folder released; "
              "start it again with the same command", file=sys.stderr, flush=True)
        raise SystemExit(143)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop)


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def resume_changes(args, saved: dict | None, run_dir: Path) -> dict:
    """The flags that differ (name: [then, now]) from those the checkpoint was trained with (`saved["args"]`), or for
    an older checkpoint from the run's args.json with its earlier resumes' changes (none if neither is there)."""
    path = run_dir / "args.json"
    if saved and "args" in saved:
        then = saved["args"]
    elif path.is_file():
        try:
            then = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is unreadable ({error}): the run's flags cannot be compared to resume") from None
        for resumed in then.get("resumes", []):
            then.update({name: now for name, (_, now) in resumed["changes"].items()})
    else:
        return {}
    now = json.loads(json.dumps(asdict(args)))  # tuples as lists, as JSON holds them
    return {name: [then[name], value] for name, value in now.items() if name in then and then[name] != value}


def write_args(output_dir: Path, args, run_name: str, changes: dict, start_update: int) -> None:
    """args.json: a new run's flags; a resumed run's keeps the original and adds its changes under `resumes`."""
    path = output_dir / "args.json"
    if not (args.resume and path.is_file()):
        write_atomic(path, json.dumps({**asdict(args), "run_name": run_name}, indent=2))
    elif changes:
        saved = json.loads(path.read_text())
        saved["resumes"] = saved.get("resumes", []) + [{"at_update": start_update, "changes": changes}]
        write_atomic(path, json.dumps(saved, indent=2))


class Preemption:
    """SIGTERM and SIGINT (Slurm, Kubernetes, a spot instance's notice, Ctrl-C) ask the run to stop: the update in
    progress finishes, its checkpoint is written, and the run exits with code 143. `requested` is asked once an
    update, on every process together, so all stop after the same update; a second SIGINT stops at once."""

    current = None  # the run's, for what waits on something else when a signal arrives (`stop_asked`)

    def __init__(self, checkpoints: Path | None = None):
        self.signal, self.checkpoints = None, checkpoints
        Preemption.current = self
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)
        if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":  # a process of accelerate launch
            # its launcher killed (a machine lost): SIGTERM here too, so every process checkpoints this update and
            # stops, and no other machine's launcher waits out torch's 300 s exit barrier
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:  # it died before that
                self.signal = signal.SIGTERM

    def handle(self, signum, frame):
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = self.signal or signum
        print(f"{signal.Signals(signum).name} received: the update in progress finishes, its checkpoint is written, "
              "then the run stops", flush=True)

    def requested(self, accelerator) -> bool:
        """Whether any process was signalled (one all-reduce)."""
        asked = torch.tensor(float(self.signal is not None), device=accelerator.device)
        return bool(accelerator.reduce(asked, "sum") > 0)

    def newest(self) -> str:
        """Which checkpoint a resume continues from, for a stop that cannot finish its update."""
        latest = self.checkpoints / "latest" if self.checkpoints else None
        name = latest.read_text().strip() if latest and latest.is_file() else ""
        if not name:
            return "no checkpoint is written yet: the same command starts the run again"
        return f"the newest checkpoint is {self.checkpoints / name}: continue with the same command and --resume auto"

    def exit(self, console, update: int, checkpoint: Path) -> None:
        """The line a scheduler's log shows, then exit 143 (as a process SIGTERM ended): not finished."""
        name = signal.Signals(self.signal).name if self.signal else "a signal to another process"
        console.print(f"stopped by {name} after update {update}, checkpointed in {checkpoint}: continue with the "
                      "same command and --resume auto", highlight=False)
        raise SystemExit(143)


def stop_asked() -> str | None:
    """Once SIGTERM or SIGINT asked the run to stop: which, and what to do if the update in progress cannot finish
    (a served reward not answering); else None."""
    preemption = Preemption.current
    if preemption is None or preemption.signal is None or signal.getsignal(signal.SIGTERM) != preemption.handle:
        return None  # none asked, or a handler since set in its place (a test's)
    return f"{signal.Signals(preemption.signal).name} asked the run to stop, so the update cannot finish; " + (
        preemption.newest())


# ---- Checkpoints -----------------------------------------------------------------------------------------------------
def save_checkpoint(accelerator, folder: RunFolder, state: dict) -> None:
    """accelerate's save_state written aside (a name unique to this run), its trainer_state.json (`state`, the flags
    the run was launched with, the format) and checksums added, renamed into place, then `latest` moved: a kill never
    leaves a half checkpoint. --save-total-limit counts this run's checkpoints up to this one, which it keeps."""
    checkpoints = folder.checkpoints
    owner = broadcast_object_list([f"{socket.gethostname()}-{os.getpid()}"])[0]  # the main process's, on every rank
    final = checkpoints / f"update-{state['update']:06d}"
    tmp = checkpoints / f".tmp-{final.name}-{owner}"
    with disk_space_named(checkpoints):
        if accelerator.is_main_process:
            for left in checkpoints.glob(".tmp-update-*"):  # by a run killed while saving (the lock keeps others out)
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
    output_dir/checkpoints/latest names, else the newest whole one before it (None if there is none yet)."""
    if resume != "auto":
        path = checkpoint_dir(resume)
        if problem := checkpoint_problem(path):
            raise ValueError(f"--resume {resume}: the checkpoint is damaged: {problem}; resume from another one")
        return path, []
    if output_dir is None:
        raise ValueError("--resume auto needs --output-dir: the run folder to look for checkpoints in")
    checkpoints, notes = output_dir / "checkpoints", []
    candidates = sorted(checkpoint_dirs(checkpoints), key=update_number, reverse=True)
    latest = checkpoints / "latest"
    if latest.is_file():
        name = latest.read_bytes().decode(errors="replace").strip()
        if re.fullmatch(r"update-\d+", name):
            named = checkpoints / name
            candidates = [named] + [p for p in candidates if update_number(p) < update_number(named)]
        else:
            notes.append(f"{latest} is damaged ({name[:40]!r}): ignored, the checkpoints taken by their numbers")
    for candidate in candidates:
        if problem := checkpoint_problem(candidate):
            notes.append(f"checkpoint {candidate} is damaged or incomplete: {problem}")
        else:
            fallback = any(n.startswith("checkpoint ") for n in notes)
            return candidate, notes + [f"falling back to {candidate}, the newest whole checkpoint"] * fallback
    if any(n.startswith("checkpoint ") for n in notes):
        raise ValueError(f"--resume auto: no whole checkpoint in {checkpoints}: " + "; ".join(notes))
    return None, notes


def checkpoint_dir(resume: str) -> Path:
    """--resume's folder, if it looks like a checkpoint (before its run's folder is taken; verified after)."""
    path = Path(resume)
    if not path.is_dir() or not {"trainer_state.json", CHECKSUMS} & {p.name for p in path.iterdir()}:
        raise ValueError(f"--resume {resume}: not a checkpoint directory (runs/<run>/checkpoints/update-NNNNNN)")
    return path


def checkpoint_dirs(checkpoints: Path) -> list[Path]:
    """The checkpoints/update-NNNNNN folders (not `latest`, temporary or abandoned ones)."""
    return [p for p in checkpoints.glob("update-*") if re.fullmatch(r"update-\d+", p.name)] if (
        checkpoints.is_dir()) else []


def update_number(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("update-"))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (a file missing, unreadable or changed since written), or None. One
    written since checkpoints carry their flags (`FORMAT`) is incomplete without its checksums."""
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
    """The sha256 of every file of a checkpoint, in `sha256sum -c` format: a resume verifies them before loading."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    (folder / CHECKSUMS).write_text("".join(f"{file_sha256(p)}  {p.relative_to(folder)}\n" for p in files))


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---- Logs and the models at the end ----------------------------------------------------------------------------------
def log_rows(path: Path) -> list[tuple[str, dict]]:
    """A jsonl log's lines and rows; a last line torn by a kill is dropped, another bad line refused by number."""
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append((line, json.loads(line)))
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise ValueError(f"{path} line {number} is not JSON ({error.msg}): remove the line to resume") from None
    return rows


def keep_rows_before(path: Path, start_update: int) -> None:
    """Keep only a jsonl log's rows of updates before `start_update` (a resumed run redoes the later ones)."""
    if path.exists():
        write_atomic(path, "".join(line + "\n" for line, row in log_rows(path) if row["update"] < start_update))


def save_models(accelerator, model: nn.Module, args, base_model_path: str, output_dir: Path, console) -> None:
    """The policy (a peft policy: its adapters) and the value (`value_head.safetensors`, or the value model's folder),
    for plain transformers, with the base model's tokenizer as given (a [PAD] the script added is a training-time
    device, outside the model's vocabulary). ppo.py's --merge-adapter: the trained adapter also merged onto a fresh
    --dtype copy of the base, in merged/ (under ZeRO-3 the live policy holds only this process's shards)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)  # consolidates sharded (ZeRO-3) weights
    if not accelerator.is_main_process:
        return
    remote = dict(trust_remote_code=args.trust_remote_code)
    with disk_space_named(output_dir):
        tokenizer = AutoTokenizer.from_pretrained(base_model_path, **remote)
        tokenizer.save_pretrained(output_dir)
        unwrapped.policy.save_pretrained(output_dir, state_dict=sub_state(state_dict, "policy"))
        if getattr(args, "merge_adapter", False):
            from ppo_harness.models import outside_zero_init  # here: the run folder's users need no peft

            with outside_zero_init(accelerator.state.deepspeed_plugin):
                base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=args.dtype, **remote)
            adapter = args.model_adapter_name or "default"
            adapter_dir = output_dir if adapter == "default" else output_dir / adapter
            PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(output_dir / "merged")
            tokenizer.save_pretrained(output_dir / "merged")
        head = getattr(unwrapped, "value_head", None)
        value_path = output_dir / (VALUE_HEAD_FILE if head is not None else "value_model")
        if head is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in sub_state(state_dict, "value_head").items()}, value_path)
        else:
            unwrapped.value_model.save_pretrained(value_path, state_dict=sub_state(state_dict, "value_model"))
    policy_saved = "the policy adapter" if isinstance(unwrapped.policy, PeftModel) else "the policy"
    console.print(f"saved {policy_saved} to {output_dir} and the value to {value_path}")


def sub_state(state_dict: dict, name: str) -> dict:
    """The entries of one submodule (`policy`, `value_model`, `value_head`) of the wrapper's state dict."""
    return {k[len(name) + 1:]: v for k, v in state_dict.items() if k.startswith(name + ".")}


def load_value_head(path: str | Path) -> nn.Linear:
    """The head a --shared-value-head run saved: values = head(final hidden state of the saved policy)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    head = nn.Linear(state["weight"].size(1), 1, dtype=state["weight"].dtype)
    head.load_state_dict(state)
    return head
