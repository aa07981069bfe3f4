"""A run asked to stop: SIGTERM and SIGINT (Slurm, Kubernetes, a spot instance's notice, Ctrl-C)
during start-up end the run as an error does (`release_on_signal`); once the run starts,
`Preemption` lets the update in progress finish and be checkpointed; `stop_asked` tells what waits
on something else (a served reward) that a stop was asked."""
import ctypes
import os
import signal
import sys
import threading
from pathlib import Path

import torch


def release_on_signal() -> None:
    """SIGTERM during start-up (models loading, minutes for a large one) ends the run as an error
    does, so the lock is released (by default SIGTERM ends a process at once: its lock, on another
    host, would block a requeued job for --peer-timeout). `Preemption` takes over once the run
    starts; a handler someone else set is kept."""
    def stop(signum, frame):
        print(f"{signal.Signals(signum).name} during start-up: the run stops before training, its "
              "folder released; start it again with the same command", file=sys.stderr, flush=True)
        raise SystemExit(143)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop)


class Preemption:
    """SIGTERM and SIGINT (Slurm, Kubernetes, a spot instance's notice, Ctrl-C) ask the run to stop:
    the update in progress finishes, its checkpoint is written, and the run exits with code 143.
    `requested` is asked once an update, on every process together, so all stop after the same
    update; a second SIGINT stops at once."""

    # the run's, for what waits on something else when a signal arrives (`stop_asked`)
    current = None

    def __init__(self, checkpoints: Path | None = None):
        self.signal, self.checkpoints = None, checkpoints
        Preemption.current = self
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)
        # a process of accelerate launch
        if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
            # its launcher killed (a machine lost): SIGTERM here too, so every process checkpoints
            # this update and stops, and no other machine's launcher waits out torch's 300 s exit
            # barrier
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:  # it died before that
                self.signal = signal.SIGTERM

    def handle(self, signum, frame):
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = self.signal or signum
        print(f"{signal.Signals(signum).name} received: the update in progress finishes, its "
              "checkpoint is written, then the run stops", flush=True)

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
        """The line a scheduler's log shows, then exit 143 (as a process SIGTERM ended): not
        finished."""
        name = signal.Signals(self.signal).name if self.signal else "a signal to another process"
        console.print(f"stopped by {name} after update {update}, checkpointed in {checkpoint}: "
                      "continue with the same command and --resume auto", highlight=False)
        raise SystemExit(143)


def stop_asked() -> str | None:
    """Once SIGTERM or SIGINT asked the run to stop: which, and what to do if the update in progress
    cannot finish (a served reward not answering); else None."""
    preemption = Preemption.current
    if preemption is None or preemption.signal is None or signal.getsignal(signal.SIGTERM) != preemption.handle:
        return None  # none asked, or a handler since set in its place (a test's)
    return f"{signal.Signals(preemption.signal).name} asked the run to stop, so the update cannot finish; " + (
        preemption.newest())
