"""A run's folder, which the run owns: `claim` finds the checkpoint a resume continues from and checks that it continues
the same run, refuses a folder another run holds (or in use: its `.lock`), and takes it; then checkpoints written
aside and verified by their sha256 before a resume loads them, the logs trimmed to a resume's start, and the models
saved for plain transformers at the end. Every write goes through a temporary name and a rename, so a run killed at any
moment leaves each file whole."""
import atexit
import errno
import hashlib
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from accelerate.utils import broadcast_object_list

CHECKSUMS = "checksums.sha256"  # in each checkpoint: every file's sha256, verified before a resume loads it
VALUE_HEAD_FILE = "value_head.safetensors"  # a value head's weight and bias (see `load_value_head`)
LOGS = ("metrics.jsonl", "samples.jsonl")  # one row per update (metrics) or per held-out sample, each with its update


@dataclass
class RunFolder:
    """The folder `claim` took for this run, and what a resume continues from."""
    path: Path
    run_name: str
    checkpoint: Path | None = None  # the checkpoint a resume continues from
    saved: dict | None = None  # its trainer_state.json: the update, and what the script put in it
    changes: dict = field(default_factory=dict)  # flags changed since the run began: name -> [then, now]
    notes: list[str] = field(default_factory=list)  # checkpoints passed over as damaged

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def banner_lines(self) -> list[str]:
        """The banner's lines on a resume: checkpoints passed over, and each flag changed since the run began."""
        return self.notes + [f"resumed with --{name.replace('_', '-')} changed from {then} to {now}"
                             for name, (then, now) in self.changes.items()]


def claim(accelerator, args, run_state: dict, may_change: set[str]) -> RunFolder:
    """The run's folder, checked and taken in one place, after every other check of the set-up (a refused run writes
    nothing): the checkpoint --resume names, verified; its `run_state` (the batch arithmetic, the data's size, the
    processes: what the data order and random streams follow) the same as this run's; no live lock; a new run into
    another run's folder refused (--overwrite: its files deleted); a resume's flags compared with the run's args.json
    (`resume_changes`: `may_change` and --resume-with-changes may differ). The main process decides for all."""
    checkpoint, notes = find_checkpoint(args.resume, Path(args.output_dir) if args.output_dir else None) if (
        args.resume) else (None, [])
    time_int = int(time.time())
    if accelerator.num_processes > 1:  # the same run name on every rank
        time_int = int(accelerator.gather(torch.tensor([time_int], device=accelerator.device))[0])
    run_name = f"{args.exp_name}__{args.seed}__{time_int}"
    # a resumed run keeps its folder: runs/<run>/checkpoints/update-NNNNNN
    output_dir = Path(args.output_dir or (checkpoint.parent.parent if checkpoint else f"runs/{run_name}"))
    saved = json.loads((checkpoint / "trainer_state.json").read_text()) if checkpoint is not None else None
    result = None
    if accelerator.is_main_process:
        try:
            lock_output_dir(output_dir, take=False, stale_after=args.peer_timeout * 60)
            found = [p for p in (output_dir / "args.json", output_dir / "metrics.jsonl") if p.exists()] + [
                p for p in [output_dir / "checkpoints"] if p.is_dir() and any(p.iterdir())]
            overwrite = found and not (args.resume and (checkpoint is None or checkpoint.parent.parent.resolve() ==
                                                        output_dir.resolve()))
            if overwrite and not args.overwrite:
                raise ValueError(f"{output_dir} holds another run ({', '.join(p.name for p in found)}): continue it "
                                 "with --resume auto, or give a new --output-dir (--overwrite deletes it)")
            for log in LOGS:
                if args.resume and (output_dir / log).exists():
                    log_rows(output_dir / log)  # a bad line refused now, not after the models load
            result = resume_changes(args, checkpoint.parent.parent if checkpoint else output_dir, may_change) if (
                args.resume) else {}
            # an older checkpoint has no num_processes: taken as unchanged
            changed = {k: (saved[k], v) for k, v in run_state.items() if saved and saved.get(k, v) != v}
            if changed:
                raise ValueError(f"--resume {checkpoint}: the run's settings changed (saved, now): {changed}; resume "
                                 "with the original flags and number of processes, or the data order, random streams "
                                 "and learning rate would not continue")
            lock_output_dir(output_dir, take=True, stale_after=args.peer_timeout * 60)
            for p in [*found, output_dir / "samples.jsonl", *output_dir.glob("events.out.tfevents.*")] if (
                    overwrite) else []:
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        except ValueError as error:
            result = error
    result = broadcast_object_list([result])[0]  # the other processes raise the same error, or go on
    if isinstance(result, ValueError):
        raise ValueError(str(result))
    return RunFolder(output_dir, run_name, checkpoint, saved, result, notes)


def lock_output_dir(output_dir: Path, take: bool, stale_after: float) -> None:
    """Refuse while output_dir/.lock names a live process; `take`: then take it (host and pid), released at exit. A
    holder gone from this host (killed) left it stale: taken over; another host's, once neither the lock nor
    metrics.jsonl (written each update) changed for `stale_after` seconds (a Slurm requeue lands on another node)."""
    lock, me = output_dir / ".lock", f"{socket.gethostname()} {os.getpid()}"
    for _ in range(3):
        if lock.exists():
            host, _, pid = lock.read_text().partition(" ")
            last = max(p.stat().st_mtime for p in (lock, output_dir / "metrics.jsonl") if p.exists())
            if not (host == socket.gethostname() and pid.isdigit() and (int(pid) == os.getpid() or not process_alive(
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
        with os.fdopen(fd, "w") as f:
            f.write(me)
        atexit.register(lambda: lock.exists() and lock.read_text() == me and lock.unlink())
        return
    raise ValueError(f"{lock}: could not take the lock (another run starting at once?)")


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


def resume_changes(args, run_dir: Path, may_change: set[str]) -> dict:
    """The flags that differ from the run's args.json (with its earlier resumes' changes): refused unless each is
    in `may_change` (logging, saving) or named by --resume-with-changes; else (name: [then, now])."""
    path = run_dir / "args.json"
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is unreadable ({error}): the run's flags cannot be compared to resume") from None
    for resumed in saved.get("resumes", []):
        saved.update({name: now for name, (_, now) in resumed["changes"].items()})
    now = json.loads(json.dumps(asdict(args)))  # tuples as lists, as args.json holds them
    changed = {name: [saved[name], value] for name, value in now.items() if name in saved and saved[name] != value}
    named = {name.lstrip("-").replace("-", "_") for name in args.resume_with_changes}
    allowed = may_change | named | {"resume", "resume_with_changes"}
    refused = {name: change for name, change in changed.items() if name not in allowed}
    if refused:
        raise ValueError(f"--resume: flags differ from the run's {path} (then, now): {refused}; they change the run, "
                         "so resume with the original flags, or name them in --resume-with-changes to go on with them")
    return {name: change for name, change in changed.items() if name not in ("resume", "resume_with_changes")}


def write_args(output_dir: Path, args, run_name: str, changes: dict, start_update: int) -> None:
    """args.json: a new run's flags; a resumed run's keeps the original and adds its changes under `resumes`."""
    path = output_dir / "args.json"
    if not (args.resume and path.is_file()):
        write_atomic(path, json.dumps({**asdict(args), "run_name": run_name}, indent=2))
    elif changes:
        saved = json.loads(path.read_text())
        saved["resumes"] = saved.get("resumes", []) + [{"at_update": start_update, "changes": changes}]
        write_atomic(path, json.dumps(saved, indent=2))


# ---- Checkpoints -----------------------------------------------------------------------------------------------------
def save_checkpoint(accelerator, checkpoints: Path, state: dict, save_total_limit: int | None) -> None:
    """accelerate's save_state written aside (a name unique to this run), its checksums added, renamed into place,
    then `latest` moved: a kill never leaves a half checkpoint. `state` records the batch arithmetic, so a changed
    resume is refused. --save-total-limit counts this run's checkpoints up to this one, which it keeps."""
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
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            write_checksums(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_atomic(checkpoints / "latest", final.name)
            # a resume's abandoned later checkpoints are not this run's: left, to be overwritten
            earlier = sorted((p for p in checkpoints.glob("update-[0-9]*") if update_number(p) < state["update"]),
                             key=update_number)
            for old in earlier[:max(len(earlier) - save_total_limit + 1, 0)] if save_total_limit else []:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()


def find_checkpoint(resume: str, output_dir: Path | None) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, verified, and notes on those passed over. `auto`: the one that
    output_dir/checkpoints/latest names, else the newest whole one before it (None if there is none yet)."""
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir() or not {"trainer_state.json", CHECKSUMS} & {p.name for p in path.iterdir()}:
            raise ValueError(f"--resume {resume}: not a checkpoint directory (runs/<run>/checkpoints/update-NNNNNN)")
        if problem := checkpoint_problem(path):
            raise ValueError(f"--resume {resume}: the checkpoint is damaged: {problem}; resume from another one")
        return path, []
    if output_dir is None:
        raise ValueError("--resume auto needs --output-dir: the run folder to look for checkpoints in")
    checkpoints, notes = output_dir / "checkpoints", []
    candidates = sorted(checkpoints.glob("update-[0-9]*"), key=update_number, reverse=True)
    if (checkpoints / "latest").is_file():
        named = checkpoints / (checkpoints / "latest").read_text().strip()
        candidates = [named] + [p for p in candidates if update_number(p) < update_number(named)]
    for candidate in candidates:
        if problem := checkpoint_problem(candidate):
            notes.append(f"checkpoint {candidate} is damaged or incomplete: {problem}")
        else:
            return candidate, notes + [f"falling back to {candidate}, the newest whole checkpoint"] * bool(notes)
    if notes:
        raise ValueError(f"--resume auto: no whole checkpoint in {checkpoints}: " + "; ".join(notes))
    return None, []


def update_number(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("update-"))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (a file missing, unreadable or changed since written), or None."""
    if not (folder / "trainer_state.json").is_file():
        return f"{folder / 'trainer_state.json'} is missing"
    if not (folder / CHECKSUMS).is_file():
        return None  # written before checkpoints carried checksums
    for line in (folder / CHECKSUMS).read_text().splitlines():
        expected, name = line.split("  ", 1)
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
            from ppo_harness.models import outside_zero_init

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


# ---- Writing without half files --------------------------------------------------------------------------------------
def temporary_name(path: Path) -> Path:
    """A hidden name beside `path`, unique to this process among the machines sharing the disk."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def write_atomic(path: Path, text: str) -> None:
    tmp = temporary_name(path)
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def disk_space_named(folder: Path):
    """A write that fails on a full disk says so and where (torch says only "unexpected pos")."""
    try:
        yield
    except Exception as error:
        usage = shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists()))
        chain = [e for e in (error, error.__cause__, error.__context__) if e is not None]
        if any(getattr(e, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(e) for e in chain) or (
                usage.free < min(2**24, usage.total // 20)):
            raise OSError(errno.ENOSPC, f"no space left on device: writing {folder} failed, {usage.free} bytes free "
                          f"there ({type(error).__name__}: {error}); free space and resume") from error
        raise
