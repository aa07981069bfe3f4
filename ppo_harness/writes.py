"""Files written whole: each through a temporary name beside it and a rename, so a run killed at any
moment leaves the old file or the new one; a write that fails on a full disk says so, and where."""
import errno
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path


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
