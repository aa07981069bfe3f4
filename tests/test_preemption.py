"""Preemption: SIGTERM (Slurm, Kubernetes, a spot instance's notice) or SIGINT in the middle of an update lets that
update finish, writes its checkpoint and exits with code 143, on one process and on two; `--resume auto` then ends
with the metrics and weights of an uninterrupted run."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, launch, launch_command, run_ppo, tiny_args, update_rows, without_wall_clock
from test_checkpoints import flat_weights

LONG = ("--total-episodes", "320", "--eval-samples", "2")  # 20 updates of 16 responses: a signal lands mid-run


def signalled(proc, out, sig, after_rows=3):
    """Send `sig` to `proc` once metrics.jsonl holds `after_rows` rows (the held-out score, then updates)."""
    metrics = out / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < after_rows:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc.communicate(timeout=180)


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    _, rows = run_ppo(tiny_args(assets, *LONG), out)
    return rows, flat_weights(out / "model.safetensors")


@pytest.mark.parametrize("sig, save_every", [(signal.SIGTERM, "0"), (signal.SIGTERM, "2"), (signal.SIGINT, "0")])
def test_a_signal_checkpoints_the_update_in_progress_and_a_resume_finishes_as_uninterrupted(
        assets, tmp_path, uninterrupted, sig, save_every):
    args, out = tiny_args(assets, *LONG, "--save-every", save_every), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "ppo.py"), "--output-dir", str(out), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"})  # as run_ppo's
    stdout, stderr = signalled(proc, out, sig)
    stopped = update_rows(out / "metrics.jsonl")[-1]["update"]
    assert proc.returncode == 143, stderr[-3000:]
    assert f"stopped by {sig.name} after update {stopped}" in " ".join(stdout.split()) and "--resume auto" in stdout
    assert (out / "checkpoints" / "latest").read_text() == f"update-{stopped:06d}" and 1 < stopped < 20
    assert not (out / "model.safetensors").exists()  # not finished: the models are written at the end only
    _, rows = run_ppo(args + ["--resume", "auto"], out)
    reference, weights = uninterrupted
    assert without_wall_clock(rows) == without_wall_clock(reference)
    assert torch.equal(flat_weights(out / "model.safetensors"), weights)


def test_sigterm_to_the_launcher_of_two_processes_stops_both_after_the_same_update(assets, tmp_path):
    """`accelerate launch` passes SIGTERM to its processes (within TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default):
    both finish the update, checkpoint it together and stop; the resume ends as the uninterrupted 2-process run."""
    args = tiny_args(assets, "--total-episodes", "320", "--eval-samples", "2", "--per-device-train-batch-size", "2")
    _, reference = launch(args, tmp_path / "whole")
    out = tmp_path / "run"
    cmd, env = launch_command(args, out, "ppo.py", "multi_cpu.yaml", (), 2)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = signalled(proc, out, signal.SIGTERM)
    stopped = update_rows(out / "metrics.jsonl")[-1]["update"]
    assert proc.returncode != 0 and (out / "checkpoints" / "latest").read_text() == f"update-{stopped:06d}"
    assert stdout.count("SIGTERM received") == 2 and f"stopped by SIGTERM after update {stopped}" in " ".join(
        stdout.split())
    assert len(list((out / "checkpoints" / f"update-{stopped:06d}").glob("random_states_*.pkl"))) == 2
    _, rows = launch(args + ["--resume", "auto"], out)
    assert without_wall_clock(rows) == without_wall_clock(reference)
    assert torch.equal(flat_weights(out / "model.safetensors"), flat_weights(tmp_path / "whole" / "model.safetensors"))


def test_a_machine_whose_launcher_is_killed_stops_the_other_within_seconds(assets, tmp_path):
    """Two machines on this host; machine 1's launcher is killed (SIGKILL), its process orphaned. That process gets
    SIGTERM from the kernel (PR_SET_PDEATHSIG), so both processes checkpoint the update in progress and stop, and
    machine 0's launcher exits at once, not after torch's 300 s exit barrier waiting for the dead one."""
    from conftest import free_port

    args = tiny_args(assets, "--total-episodes", "640", "--eval-samples", "2", "--per-device-train-batch-size", "2")
    out, port, launchers = tmp_path / "run", free_port(), []
    for rank in (0, 1):
        cmd, env = launch_command(args, out, "ppo.py", "multi_cpu.yaml", (), 2, machine=(rank, port))
        launchers.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
    metrics = out / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
        assert launchers[0].poll() is None, launchers[0].communicate()
        time.sleep(0.05)
    os.killpg(launchers[1].pid, signal.SIGKILL)
    killed = time.time()
    launchers[0].communicate(timeout=120)
    assert time.time() - killed < 60
    stopped = update_rows(metrics)[-1]["update"]
    assert (out / "checkpoints" / "latest").read_text() == f"update-{stopped:06d}"
