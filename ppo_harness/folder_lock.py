"""The run folder's lock, output_dir/.lock: the host and pid of the run that holds the folder,
refused to another run while that one lives, taken over once it is stale."""
import atexit
import contextlib
import errno
import os
import socket
import time
from pathlib import Path

import filelock
import psutil


def lock_output_dir(output_dir: Path, take: bool, stale_after: float) -> None:
    """Refuse while output_dir/.lock names a live process; `take`: then take it (host and pid),
    released at exit. A holder gone from this host (killed) left it stale: taken over; another
    host's, once neither the lock nor metrics.jsonl (written each update) changed for `stale_after`
    seconds (a Slurm requeue lands on another node); an empty or unreadable lock (a run killed while
    writing it) is stale."""
    lock, me = output_dir / ".lock", f"{socket.gethostname()} {os.getpid()}"
    if not take:
        if lock.exists():
            check_holder(lock, output_dir, stale_after)
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    # The record (host and pid) stays the lock, since only it tells another host's live run from a
    # stale one; a `filelock` lock (flock) on that same file guards its read, check and write, so
    # two runs starting at once that both find it stale cannot both take it: the second finds the
    # first's record. A flock alone could not be the lock: a run killed on another host, or a
    # network filesystem's lost client, leaves no flock for a requeued job to find, so the record
    # would still be read. The flock is held for the check only; reading the file does not change
    # its modification time, which another host's staleness is measured by.
    guard = filelock.FileLock(lock, timeout=10, preserve_lock_file=True)
    try:
        guard.acquire()
    except filelock.Timeout:
        raise ValueError(f"{lock}: could not take the lock (another "
                         "run starting at once?)") from None
    # a filesystem without flock: the record alone, checked and written as before
    except OSError as error:
        if error.errno != errno.ENOSYS:
            raise
        guard = None
    try:
        check_holder(lock, output_dir, stale_after)
        # written in place (stale, empty, or this process's own): the guard's file stays the one
        # others wait on
        try:
            with os.fdopen(os.open(lock, os.O_CREAT | os.O_WRONLY | os.O_TRUNC), "w") as f:
                f.write(me)
        except OSError:  # a full disk: no empty lock left behind
            lock.unlink(missing_ok=True)
            raise
    finally:
        if guard is not None:
            guard.release()
    atexit.register(lambda: lock.exists() and lock.read_text() == me and lock.unlink())


def check_holder(lock: Path, output_dir: Path, stale_after: float) -> None:
    """Refuse the folder while its lock names a live run other than this process
    (`lock_output_dir`)."""
    host, _, pid = lock.read_text(errors="replace").strip().partition(" ")
    last = max(p.stat().st_mtime for p in (lock, output_dir / "metrics.jsonl") if p.exists())
    readable = bool(host) and pid.isdigit()
    if readable and not (host == socket.gethostname() and (int(pid) == os.getpid() or not process_alive(
            int(pid))) or host != socket.gethostname() and time.time() - last > stale_after):
        raise ValueError(f"{output_dir} is in use by the run of process {pid} on host {host} (its "
                         f"lock {lock}): wait for it or give another --output-dir; if it is gone, "
                         f"delete {lock} (another host's is stale after --peer-timeout minutes "
                         "without an update logged)")


def release_lock(output_dir: Path) -> None:
    """Remove output_dir/.lock if this process holds it."""
    lock = output_dir / ".lock"
    with contextlib.suppress(OSError):
        if lock.read_text() == f"{socket.gethostname()} {os.getpid()}":
            lock.unlink()


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, killed but not yet reaped, does
    not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    # another user's process, whose state this one may not read: it runs
    except psutil.AccessDenied:
        return True
