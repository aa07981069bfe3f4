"""The run folder's lock, output_dir/.lock: the host and pid of the run that holds the folder, refused to another run
while that one lives, taken over once it is stale."""
import atexit
import contextlib
import os
import socket
import time
from pathlib import Path


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
