"""A run's folder, which the run owns: `claim` finds the checkpoint a resume continues from and
checks that it continues the same run, refuses a folder another run holds (or in use: its lock,
`folder_lock`), a model's, or one holding files no run wrote, and takes it; a resume's flags
compared with those its checkpoint was trained with; args.json. The checkpoints are `checkpoints`',
the logs `log_files`', a stop on SIGTERM `preemption`'s, the models at the end `saved_models`'.
Every write goes through a temporary name and a rename, so a run killed at any moment leaves each
file whole."""
import contextlib
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list

from ppo_harness.checkpoints import branch_at, checkpoint_dir, find_checkpoint
from ppo_harness.folder_lock import lock_output_dir, release_lock
from ppo_harness.log_files import LOGS, log_rows
from ppo_harness.preemption import release_on_signal
from ppo_harness.saved_models import load_value_head  # noqa: F401 (the README names ppo_harness.run_folder's)
from ppo_harness.writes import disk_space_named, write_atomic


@dataclass
class RunFolder:
    """The folder `claim` took for this run, and what a resume continues from."""
    path: Path
    run_name: str
    checkpoint: Path | None = None  # the checkpoint a resume continues from
    saved: dict | None = None  # its trainer_state.json: the update, and what the script put in it
    # flags changed since the run began: name -> [then, now]
    changes: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # checkpoints passed over as damaged
    # the flags as launched, which every checkpoint carries: a schedule that later sets
    # args.temperature (say) does not make its own resume differ
    flags: dict = field(default_factory=dict)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def banner_lines(self) -> list[str]:
        """The banner's lines on a resume: checkpoints passed over, and each flag changed since the
        run began."""
        return self.notes + [f"resumed with --{name.replace('_', '-')} changed from {then} to {now}"
                             for name, (then, now) in self.changes.items()]


def claim(accelerator, args, run_state: dict, may_change: set[str], reads: dict | None = None) -> RunFolder:
    """The run's folder, checked and taken in one place, after every other check of the set-up (a
    refused run writes nothing): the folder a folder (not a file, nor a model's, nor one holding
    files no run wrote: `reads` maps a flag to a path the run reads); no live lock, then the lock
    taken before a checkpoint is chosen (a run ending meanwhile cannot change them); the checkpoint
    --resume names, verified; its `run_state` (the batch arithmetic, the data's size, the processes:
    what the data order and random streams follow) the same as this run's; a new run into another
    run's folder refused (--overwrite: the old run moved aside whole, then deleted, unless it holds
    what this run reads); a resume's flags compared with those the checkpoint was trained with
    (`resume_changes`: `may_change` and --resume-with-changes may differ); resuming an older
    checkpoint moves the later ones aside (`branch_at`); the checkpoint of the run's end
    (`finished`) exits at once, code 0. The main process decides for all; a refusal releases the
    lock."""
    release_on_signal()
    time_int = int(time.time())
    if accelerator.num_processes > 1:  # the same run name on every rank
        time_int = int(accelerator.gather(torch.tensor([time_int], device=accelerator.device))[0])
    run_name = f"{args.exp_name}__{args.seed}__{time_int}"
    if args.resume and args.resume != "auto":
        # a path that is no checkpoint named before its folder is looked at
        checkpoint_dir(args.resume)
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
            # refused: the lock released, and the folder if it was made for the lock
            except BaseException:
                release_lock(output_dir)
                if created:
                    with contextlib.suppress(OSError):
                        output_dir.rmdir()
                raise
        except Finished as ended:
            result = ended
        except (ValueError, OSError) as error:
            result = ValueError(str(error) if isinstance(error, ValueError) else f"--output-dir {output_dir}: {error}")
    # the other processes raise the same error, or go on
    result = broadcast_object_list([result])[0]
    if isinstance(result, ValueError):
        raise ValueError(str(result))
    if isinstance(result, Finished):  # exit code 0, the reason printed once
        if accelerator.is_main_process:
            print(result)
        raise SystemExit(0)
    return RunFolder(output_dir, run_name, **result, flags=json.loads(json.dumps(asdict(args))))


class Finished(Exception):
    """The checkpoint --resume names is the run's end: nothing is left to train (a requeued job
    stops, code 0)."""


def run_folder_of(args, run_name: str) -> Path:
    """--output-dir, else the folder of the run whose checkpoint --resume names, else
    runs/<run_name>."""
    if args.output_dir:
        return Path(args.output_dir)
    if args.resume and args.resume != "auto":
        checkpoint = checkpoint_dir(args.resume)
        if checkpoint.parent.name.startswith("abandoned-") and checkpoint.parent.parent.name == "checkpoints":
            raise ValueError(f"--resume {checkpoint}: a checkpoint its run abandoned when it "
                             "resumed an earlier one; continue it in a new "
                             "folder: give --output-dir")
        # runs/<run>/checkpoints/update-NNNNNN: a resumed run keeps its folder
        return checkpoint.parent.parent
    return Path(f"runs/{run_name}")


def check_overwrite(args, output_dir: Path, reads: dict[str, str | None]) -> None:
    """--overwrite deletes the folder's run: refused where that would delete what this run reads
    (the checkpoint --resume names, a model, adapter or data inside the folder; --resume auto is
    refused with the flags)."""
    if not args.overwrite:
        return
    inside = {}
    for flag, path in [("--resume", args.resume), *reads.items()]:
        if path and Path(path).exists() and is_within(Path(path), output_dir) and path not in inside.values():
            inside[flag] = path
    if inside:
        named = ", ".join(f"{flag} {path}" for flag, path in inside.items())
        resume = "; to continue from that checkpoint in this folder, drop --overwrite" if "--resume" in inside else ""
        raise ValueError(f"--overwrite would delete {output_dir}, which holds what this run reads "
                         f"({named}): move {'it' if len(inside) == 1 else 'them'} out of the "
                         f"folder, or give another --output-dir{resume}")


def is_within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies inside it (links resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def take(args, output_dir: Path, run_state: dict, may_change: set[str]) -> dict:
    """`claim` on the main process, the folder locked: the checkpoint, its state, the flags changed,
    the notes."""
    checkpoint, notes = find_checkpoint(args.resume, output_dir) if args.resume else (None, [])
    saved = json.loads((checkpoint / "trainer_state.json").read_text()) if checkpoint is not None else None
    found = [p for p in (output_dir / "args.json", output_dir / "metrics.jsonl") if p.exists()] + [
        p for p in [output_dir / "checkpoints"] if p.is_dir() and any(p.iterdir())]
    own = checkpoint is not None and checkpoint.parent.parent.resolve() == output_dir.resolve()
    # checkpoints/abandoned-*/update-N
    if checkpoint is not None and not own and is_within(checkpoint, output_dir):
        raise ValueError(f"--resume {checkpoint}: a checkpoint this run abandoned when it resumed "
                         f"an earlier one, so the logs in {output_dir} hold the other branch's "
                         "updates; continue it in a new folder (the same command with another "
                         "--output-dir; its logs start after the checkpoint's update), or "
                         "continue this folder's branch with --resume auto")
    overwrite = found and not (args.resume and (checkpoint is None or own))
    if overwrite and not args.overwrite:
        raise ValueError(f"{output_dir} holds another run ({', '.join(p.name for p in found)}): "
                         "continue it with --resume auto, or give a new --output-dir "
                         "(--overwrite deletes it)")
    for log in LOGS:
        if args.resume and (output_dir / log).exists():
            log_rows(output_dir / log)  # a bad line refused now, not after the models load
    # a new run compares no flags: --overwrite with other flags starts afresh
    changed = resume_changes(args, saved, checkpoint.parent.parent if checkpoint else output_dir) if (
        args.resume) else {}
    settings = {k: (saved[k], v) for k, v in run_state.items() if saved and saved.get(k, v) != v}
    if settings:  # an older checkpoint has no num_processes: taken as unchanged
        raise ValueError(f"--resume {checkpoint}: the run's settings changed (saved, now): "
                         f"{settings}, the flags that differ: {changed or 'none recorded'}. The "
                         "batch flags, --total-episodes, the data and the number of processes "
                         "set the data order, the random streams and the learning rate's anneal, "
                         "so a resume cannot change them: resume with the original ones, or "
                         "start a new run from the saved policy")
    allowed = may_change | {"resume", "resume_with_changes"} | {
        name.lstrip("-").replace("-", "_") for name in args.resume_with_changes}
    refused = {name: change for name, change in changed.items() if name not in allowed}
    if refused:
        raise ValueError(f"--resume: flags differ from those {checkpoint or output_dir} was "
                         f"trained with (then, now): {refused}; they change the run, so resume "
                         "with the original flags, or name them in "
                         "--resume-with-changes to go on with them")
    # the run's end (an early one too): a requeued job stops here
    if saved and saved.get("finished"):
        raise Finished(f"--resume {args.resume}: the run ended after update {saved['update']} "
                       f"({checkpoint}): it is finished, nothing is left to train")
    with disk_space_named(output_dir):
        # the old run moved away whole, then deleted once the new folder holds the lock
        if overwrite:
            aside = move_aside(output_dir)
            lock_output_dir(output_dir, take=True, stale_after=args.peer_timeout * 60)
            shutil.rmtree(aside)
        if own:
            notes += branch_at(checkpoint)
    changes = {name: change for name, change in changed.items() if name not in ("resume", "resume_with_changes")}
    return dict(checkpoint=checkpoint, saved=saved, changes=changes, notes=notes)


def check_output_dir(output_dir: Path, reads: dict[str, str | None]) -> None:
    """Refuse a folder that is a file or under one, the folder of what the run reads (a model: the
    trained model would be written over it), and a folder holding files no run wrote (no args.json,
    metrics.jsonl or checkpoints/: a model's, a dataset's...)."""
    for folder in (output_dir, *output_dir.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"--output-dir {output_dir}: {folder} is a file, not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ValueError(f"--output-dir {output_dir}: {folder} is not writable")
            break
    for flag, path in reads.items():
        if path and Path(path).exists() and Path(path).resolve() == output_dir.resolve():
            raise ValueError(f"--output-dir {output_dir} is the folder of {flag}: the run would "
                             "write its model over that one; give another --output-dir")
    names = sorted(p.name for p in output_dir.iterdir() if not p.name.startswith(".")) if output_dir.is_dir() else []
    if names and not {"args.json", "metrics.jsonl", "checkpoints"} & set(names):
        raise ValueError(f"--output-dir {output_dir} holds files no run wrote "
                         f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}): give "
                         "a new or empty folder")


def move_aside(output_dir: Path) -> Path:
    """--overwrite: the old run's folder renamed, whole, to a hidden name beside it, and an empty
    one made: a kill leaves the old run or the new one, never a mix. The caller deletes the old one
    once it holds the new folder. Through a symlink, the folder it points to is the run's: that one
    moves aside, on its own disk, and the link stays, pointing at the new folder."""
    real = output_dir.resolve() if output_dir.is_symlink() else output_dir
    aside = real.with_name(f".{real.name}.overwritten-{socket.gethostname()}-{os.getpid()}")
    os.replace(real, aside)
    real.mkdir()
    return aside



def resume_changes(args, saved: dict | None, run_dir: Path) -> dict:
    """The flags that differ (name: [then, now]) from those the checkpoint was trained with
    (`saved["args"]`), or for an older checkpoint from the run's args.json with its earlier resumes'
    changes (none if neither is there)."""
    path = run_dir / "args.json"
    if saved and "args" in saved:
        then = saved["args"]
    elif path.is_file():
        try:
            then = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is unreadable ({error}): the run's flags cannot "
                             "be compared to resume") from None
        for resumed in then.get("resumes", []):
            then.update({name: now for name, (_, now) in resumed["changes"].items()})
    else:
        return {}
    now = json.loads(json.dumps(asdict(args)))  # tuples as lists, as JSON holds them
    return {name: [then[name], value] for name, value in now.items() if name in then and then[name] != value}


def write_args(output_dir: Path, args, run_name: str, changes: dict, start_update: int) -> None:
    """args.json: a new run's flags; a resumed run's keeps the original and adds its changes under
    `resumes`."""
    path = output_dir / "args.json"
    if not (args.resume and path.is_file()):
        write_atomic(path, json.dumps({**asdict(args), "run_name": run_name}, indent=2))
    elif changes:
        saved = json.loads(path.read_text())
        saved["resumes"] = saved.get("resumes", []) + [{"at_update": start_update, "changes": changes}]
        write_atomic(path, json.dumps(saved, indent=2))
