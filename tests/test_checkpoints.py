"""Checkpoints, exact resume, a SIGKILL during a checkpoint write, and the guards that protect a long run."""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import tyro

import ppo
from conftest import ROOT, run_ppo, tiny_args, without_wall_clock
from conftest import tiny_args as args_for


def test_rollout_indices_shard_each_pass_over_the_data():
    num_prompts, sizes = 50, ppo.batch_sizes(2, 1, 2, 3, 10_000)  # 3 ranks x 4 = 12 prompts per update
    per_epoch = num_prompts // sizes.batch_size  # 4 updates, 2 prompts left out of each pass
    for epoch in range(3):
        seen = []
        for update in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1):
            shards = [ppo.rollout_indices(num_prompts, sizes, update, 7, rank).tolist() for rank in range(3)]
            assert all(len(s) == sizes.local_batch_size for s in shards)
            seen += [i for s in shards for i in s]
            assert shards[0] == ppo.rollout_indices(num_prompts, sizes, update, 7, 0).tolist()  # a pure function
        assert len(seen) == len(set(seen)) == per_epoch * sizes.batch_size  # no prompt twice within a pass
    assert ppo.rollout_indices(num_prompts, sizes, 1, 7, 0).tolist() != ppo.rollout_indices(
        num_prompts, sizes, per_epoch + 1, 7, 0).tolist()  # each pass is a new permutation
    assert ppo.rollout_indices(num_prompts, sizes, 1, 7, 0).tolist() != ppo.rollout_indices(
        num_prompts, sizes, 1, 8, 0).tolist()


def test_rollout_indices_name_a_source_smaller_than_an_update():
    with pytest.raises(ValueError, match="11 prompts: fewer than the 12 one update samples"):
        ppo.rollout_indices(11, ppo.batch_sizes(2, 1, 2, 3, 10_000), 1, 7, 0)


@pytest.mark.parametrize("k", [2, 4])
def test_rollout_indices_sample_each_prompt_k_times_in_a_row(k):
    """--num-generations k: a process's responses are whole groups of one prompt each; a pass over the data samples
    every prompt it reaches k times, no prompt in two groups; k = 1 is the one-response data order."""
    num_prompts, sizes = 50, ppo.batch_sizes(2, 2, 2, 3, 10_000)  # 3 ranks x 8 responses = 24 per update
    per_epoch = num_prompts // (sizes.batch_size // k)
    seen = []
    for update in range(1, per_epoch + 1):
        for rank in range(3):
            shard = ppo.rollout_indices(num_prompts, sizes, update, 7, rank, k).tolist()
            groups = [shard[i:i + k] for i in range(0, len(shard), k)]
            assert len(shard) == sizes.local_batch_size and all(len(set(g)) == 1 for g in groups)
            seen += [g[0] for g in groups]
    assert len(seen) == len(set(seen)) == per_epoch * sizes.batch_size // k
    one = ppo.batch_sizes(2, 2, 2, 3, 10_000)._replace(batch_size=24 // k, local_batch_size=8 // k)
    assert seen[:8 // k] == ppo.rollout_indices(num_prompts, one, 1, 7, 0).tolist()  # the same prompts, k times each


def test_resume_gives_the_metrics_of_an_uninterrupted_run(assets, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = args_for(assets, "--total-episodes", "64", "--save-every", "2",  # 4 updates, checkpoints at 2 and 4
                    "--kl-target", "0.5", "--kl-horizon", "100", "--use-score-norm",  # controller state resumes too
                    "--eval-every", "1", "--eval-samples", "2")  # a held-out evaluation after every update
    _, uninterrupted = run_ppo(args, full)
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["latest", "update-000002", "update-000004"]
    shutil.copytree(full, resumed)  # the same folder, as a run killed after update 3 would have left it
    shutil.rmtree(resumed / "checkpoints" / "update-000004")
    for log in ("metrics.jsonl", "samples.jsonl"):  # and its logs up to update 3
        lines = (resumed / log).read_text().splitlines()
        (resumed / log).write_text("".join(line + "\n" for line in lines if json.loads(line)["update"] <= 3))
    proc, rows = run_ppo(args + ["--resume", str(resumed / "checkpoints" / "update-000002"),
                                 "--output-dir", str(resumed)], resumed)
    assert "continuing at update 3" in proc.stdout
    assert [r["update"] for r in rows] == [1, 2, 3, 4]
    assert without_wall_clock(rows) == without_wall_clock(uninterrupted)
    samples, expected = ([json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
                         for run in (resumed, full))  # update 3's table dropped and written again, once
    assert [r["update"] for r in expected] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4] and samples == expected
    for name in ("model.safetensors", "value_model/model.safetensors"):  # and the same final weights
        assert torch.equal(flat_weights(full / name), flat_weights(resumed / name))
    # --resume-with-changes learning-rate: the optimizer's saved groups would bring back the old starting lr; the
    # resumed updates anneal from the new one (updates 3 and 4 of 4: a half and a quarter of it)
    changed = tmp_path / "changed"
    shutil.copytree(full, changed)
    shutil.rmtree(changed / "checkpoints" / "update-000004")
    _, rows = run_ppo(args + ["--resume", "auto", "--output-dir", str(changed), "--learning-rate", "0.5",
                              "--resume-with-changes", "learning-rate"], changed)
    assert [r["lr"] for r in rows] == [1e-3, 7.5e-4, 0.25, 0.125]


def flat_weights(path):
    from safetensors.torch import load_file

    return torch.cat([t.flatten() for _, t in sorted(load_file(path).items())])


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(assets, tmp_path):
    out = tmp_path / "run"
    args = args_for(assets, "--total-episodes", "480", "--save-every", "1", "--save-total-limit", "2",
                    "--output-dir", str(out))
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}  # as run_ppo's runs
    proc = subprocess.Popen([sys.executable, str(ROOT / "ppo.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints, deadline = out / "checkpoints", time.time() + 240
    try:
        while proc.poll() is None and time.time() < deadline:
            # wait until a previous checkpoint exists and the next one is being written, then kill at once
            if (checkpoints / "latest").exists() and any(checkpoints.glob(".tmp-update-*")):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.0005)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run ended before a checkpoint write could be interrupted"
    assert any(checkpoints.glob(".tmp-update-*"))  # killed mid-write ...
    assert (out / ".lock").read_text().split() == [socket.gethostname(), str(proc.pid)]  # a stale lock, taken over
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    assert (latest / "model.safetensors").exists() and (latest / "optimizer.bin").exists()  # ... the last one whole
    _, rows = run_ppo(args + ["--resume", "auto"], out)
    assert [r["update"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(list(checkpoints.glob("update-*"))) == 2 and not any(checkpoints.glob(".tmp-update-*"))
    assert not (out / ".lock").exists()  # released at exit


def test_a_failed_last_checkpoint_still_leaves_the_trained_models(assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the folder goes, so the checkpoint write fails (as on a full disk)")
    proc, rows = run_ppo(args_for(assets, "--total-episodes", "16"), out, check=False)
    assert proc.returncode != 0 and [r["update"] for r in rows] == [1]  # trained, then failed at the checkpoint
    assert (out / "model.safetensors").is_file() and (out / "value_model" / "model.safetensors").is_file()


def test_resume_auto_starts_fresh_and_refuses_other_batch_settings(assets, tmp_path):
    _, rows = run_ppo(args_for(assets, "--total-episodes", "16", "--resume", "auto"), tmp_path / "run")
    assert [r["update"] for r in rows] == [1]  # no checkpoint yet: a fresh run
    other = args_for(assets, "--total-episodes", "16", "--per-device-train-batch-size", "2", "--resume", "auto")
    proc, _ = run_ppo(other, tmp_path / "run", check=False)
    # the batch arithmetic the checkpoint assumed refuses it, naming the flag, and offers no --resume-with-changes
    assert proc.returncode != 0 and "the run's settings changed" in proc.stderr
    assert "per_device_train_batch_size" in proc.stderr and "--resume-with-changes" not in proc.stderr
    # named on purpose, it is still refused
    proc, _ = run_ppo(other + ["--resume-with-changes", "per-device-train-batch-size"], tmp_path / "run", check=False)
    assert proc.returncode != 0 and "the run's settings changed" in proc.stderr and "batch_size" in proc.stderr


def test_non_finite_loss_stops_the_run_naming_the_update(assets, tmp_path):
    proc, rows = run_ppo(args_for(assets, "--reward-fn", "tests/rewards.py:explodes_after_first_update",
                                  "--save-every", "1", "--total-episodes", "48", "--eval-samples", "0"),
                         tmp_path / "run", check=False)  # no held-out evaluation: it would call the reward too
    assert proc.returncode != 0 and "FloatingPointError: update 2" in proc.stderr
    assert [r["update"] for r in rows] == [1]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "update-000001"


@pytest.mark.parametrize("resume, output_dir, message", [
    ("auto", None, "--resume auto needs --output-dir"),
    ("TMP", "x", "not a checkpoint directory"),
])
def test_bad_resume_is_refused(assets, tmp_path, resume, output_dir, message):
    args = tyro.cli(ppo.Args, args=args_for(assets, "--resume", str(tmp_path) if resume == "TMP" else resume))
    args.output_dir = str(tmp_path / output_dir) if output_dir else None
    with pytest.raises(ValueError, match=message):
        ppo.main(args)
    assert not (tmp_path / "x").exists()  # refused before the folder is taken


def test_remote_code_runs_only_when_allowed(tmp_path):
    """A repository that ships its own configuration code: refused by default, run with --trust-remote-code."""
    repo, marker = tmp_path / "remote", tmp_path / "remote_code_ran"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"model_type": "remote_x", "architectures": ["XForSequenceClassification"], "num_labels": 1,
                                                  "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    (repo / "configuration_x.py").write_text(
        "from pathlib import Path\nfrom transformers import PretrainedConfig\n"
        f"Path({str(marker)!r}).write_text('ran')\n"
        "class XConfig(PretrainedConfig):\n    model_type = 'remote_x'\n")
    with pytest.raises(ValueError):
        ppo.check_scalar_model(str(repo), "value model", require_head=False)
    assert not marker.exists()
    ppo.check_scalar_model(str(repo), "value model", require_head=False, trust_remote_code=True)
    assert marker.exists()


@pytest.mark.parametrize("period", [2, 3, 4])
def test_the_quick_checks_resume_finds_a_reference_reset_left_out_of_the_checkpoint(assets, tmp_path, period):
    """The quick check's resume case on a copy whose reference is reset to the policy every `period` updates without
    being checkpointed (`accelerator.register_for_checkpointing`): the run resumed from the checkpoint of a reset
    update trains the next against the SFT reference, and the check fails, saying what to check."""
    from test_quick import resumes_give_the_same_run

    reset = (f"        if update % {period} == 0:\n"
             "            models.ref_policy.load_state_dict(models.policy.state_dict())\n")
    with edited_copy("        # ALGO LOGIC: schedules (lr, args.temperature, kl_coef)", reset, before=True) as script:
        with pytest.raises(AssertionError, match="not in the checkpoint: save it in phase 8's"):
            resumes_give_the_same_run(quick_resume_args(assets), tmp_path, script.name)


def test_the_quick_checks_resume_finds_an_early_end_whose_state_is_lost_and_passes_a_stateless_one(assets, tmp_path):
    """An early end decided at update 2 and taken at update 4, its decision not checkpointed: resumed from checkpoint 2
    or 3, the run goes on to update 5 and the check fails by name. An early end read from `update` alone passes."""
    from test_quick import resumes_give_the_same_run

    decided = ("        if update == 2:\n            stop_at = 4\n"
               "        last = last or (stop_at is not None and update >= stop_at)\n")
    init = "    stop_at = None  # an early end's decision, kept across updates (not checkpointed)\n"
    with edited_copy(EARLY_END, decided, before=False, also=(STATE_MARKER, init)) as script:
        with pytest.raises(AssertionError, match="the run logged updates \\[3, 4, 5\\], the uninterrupted one \\[3, 4\\]"):
            resumes_give_the_same_run(quick_resume_args(assets), tmp_path / "lost", script.name)
    with edited_copy(EARLY_END, "        last = last or update >= 3\n", before=False) as script:
        resumes_give_the_same_run(quick_resume_args(assets), tmp_path / "kept", script.name)


EARLY_END = "        # saved as the last (a condition on held-out eval/* metrics: after `evaluate` below)\n"
STATE_MARKER = "    score_moments = RunningMoments(**(run.saved or {}).get(\"score_moments\", {}))\n"


def quick_resume_args(assets):
    return tiny_args(assets, "--eval-samples", "4", "--num-trainable-layers", "1", "--shared-value-head",
                     "--total-episodes", "80", "--save-every", "1", "--eval-every", "1")


@contextlib.contextmanager
def edited_copy(marker: str, text: str, before: bool, also=None):
    """A copy of ppo.py beside it (as a copier makes one) with `text` put before or after the line `marker`."""
    source = (ROOT / "ppo.py").read_text()
    for m, t, b in [(marker, text, before), *([(also[0], also[1], False)] if also else [])]:
        assert source.count(m) == 1, m
        source = source.replace(m, t + m if b else m + t)
    script = ROOT / f"ppo_edited_{os.getpid()}.py"
    script.write_text(source)
    try:
        yield script
    finally:
        script.unlink()
