"""--push-to-hub without the Hub: the start-up refusals (offline, no token, the Hub not answering, the Hub flags
without --push-to-hub) before any model loads, and whole runs of both scripts through tests/hub_recorded.py, which
records the calls huggingface_hub receives and keeps what `upload_folder` would upload: the repository, its privacy,
no checkpoints (with --hub-strategy all_checkpoints each, as a branch), a model card with the command and the held-out scores, and a folder that loads with `from_pretrained`
(policy and value) to the trained weights. A push that fails loses nothing and names the command that pushes later."""
import json
from types import SimpleNamespace as NS

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from conftest import run_ppo, tiny_args
from ppo_harness import hub


def flags(**overrides):
    return NS(**{**dict(push_to_hub=True, hub_model_id=None, hub_private_repo=False, save_at_end=True), **overrides})


def test_the_hub_is_checked_before_anything_loads(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1 is set"):
        hub.check_hub(flags())
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ValueError, match="no Hugging Face token"):
        hub.check_hub(flags())
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_x")

    def unreachable(self, *args, **kwargs):
        raise ConnectionError("no route to host")
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", unreachable)
    with pytest.raises(ValueError, match="the Hub did not answer \\(ConnectionError: no route to host\\)"):
        hub.check_hub(flags())
    with pytest.raises(ValueError, match="--no-save-at-end skips"):
        hub.check_hub(flags(save_at_end=False))
    with pytest.raises(ValueError, match="--hub-model-id and --hub-private-repo name the Hub repository"):
        hub.check_hub(flags(push_to_hub=False, hub_model_id="me/x", hub_private_repo=True))
    hub.check_hub(flags(push_to_hub=False))  # nothing asked, nothing checked


def test_a_run_refuses_push_to_hub_offline_before_loading(assets, tmp_path):
    proc, _ = run_ppo(tiny_args(assets, "--push-to-hub"), tmp_path / "run", check=False)
    assert proc.returncode != 0 and "--push-to-hub: HF_HUB_OFFLINE=1 is set" in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout


def recorded_run(args, tmp_path, monkeypatch, script="ppo.py", fail=False):
    record, remote = tmp_path / "calls.jsonl", tmp_path / "remote"
    remote.mkdir()
    monkeypatch.setenv("PPO_HUB_RECORD", str(record))
    monkeypatch.setenv("PPO_HUB_REMOTE", str(remote))
    monkeypatch.setenv("PPO_HUB_SCRIPT", script)
    if fail:
        monkeypatch.setenv("PPO_HUB_FAIL", "1")
    proc, rows = run_ppo(args, tmp_path / "run", script="tests/hub_recorded.py")
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, rows, calls, remote


def test_push_to_hub_uploads_the_final_models_and_a_card_that_load(assets, tmp_path, monkeypatch):
    proc, rows, calls, remote = recorded_run(
        tiny_args(assets, "--push-to-hub", "--hub-model-id", "me/ppo-tiny", "--hub-private-repo", "--save-every", "1"),
        tmp_path, monkeypatch)
    assert [c["call"] for c in calls] == ["whoami", "create_repo", "upload_folder"]  # the check, then the push
    assert calls[1]["repo_id"] == "me/ppo-tiny" and calls[1]["private"] is True and calls[1]["exist_ok"] is True
    assert "checkpoints/*" in calls[2]["ignore_patterns"] and calls[2]["repo_id"] == "me/ppo-tiny"
    assert "pushed to https://huggingface.co/me/ppo-tiny" in proc.stdout
    assert (tmp_path / "run" / "checkpoints").is_dir() and not (remote / "checkpoints").exists()
    card = (remote / "README.md").read_text()
    assert "--hub-model-id me/ppo-tiny" in card and "| 2 |" in card  # the command; the held-out score after update 2
    final = [r for r in rows if "eval/scores" in r][-1]["eval/scores"]
    assert f"{final:.4f}" in card
    policy = AutoModelForCausalLM.from_pretrained(remote)
    trained = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(p, trained[n]) for n, p in policy.state_dict().items() if n in trained)
    value = AutoModelForSequenceClassification.from_pretrained(remote / "value_model")
    assert value.score.weight.abs().sum() > 0  # the trained critic, not a fresh zero head
    assert (remote / "metrics.jsonl").exists() and (remote / "args.json").exists()


def test_push_to_hub_defaults_to_the_users_namespace(assets, tmp_path, monkeypatch):
    """Without --hub-model-id the repository is the user's (whoami) and the run's name, public (TRL's default)."""
    proc, _, calls, remote = recorded_run(tiny_args(assets, "--push-to-hub"), tmp_path, monkeypatch)
    assert [c["call"] for c in calls] == ["whoami", "whoami", "create_repo", "upload_folder"]  # the check; the name
    repo = calls[2]["repo_id"]
    assert repo.startswith("tester/ppo__") and calls[2]["private"] is False and (remote / "model.safetensors").exists()
    assert f"pushed to https://huggingface.co/{repo}" in proc.stdout


def test_a_failed_push_loses_nothing_and_says_how_to_push_later(assets, tmp_path, monkeypatch):
    proc, _, calls, _ = recorded_run(tiny_args(assets, "--push-to-hub", "--hub-model-id", "me/x"), tmp_path,
                                     monkeypatch, fail=True)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "--push-to-hub failed (ConnectionError: the Hub went away)" in out
    assert f"hf upload me/x {tmp_path / 'run'} . --exclude 'checkpoints/*'" in out
    assert (tmp_path / "run" / "model.safetensors").exists() and (tmp_path / "run" / "value_model").is_dir()


def test_all_checkpoints_pushes_each_checkpoint_as_a_branch_that_resumes(assets, tmp_path, monkeypatch):
    """--hub-strategy all_checkpoints: each checkpoint, when it is written, goes to the branch of its name (the final
    push to main as without it); what the branch holds is the whole checkpoint (its checksums verify), and a run
    resumes from it. Without --push-to-hub the flag is refused, as the other Hub flags."""
    from ppo_harness.checkpoints import checkpoint_problem

    proc, rows, calls, remote = recorded_run(
        tiny_args(assets, "--push-to-hub", "--hub-model-id", "me/ppo-tiny", "--save-every", "1", "--hub-strategy",
                  "all_checkpoints"), tmp_path, monkeypatch)
    assert [c["call"] for c in calls] == ["whoami", *["create_repo", "create_branch", "upload_folder"] * 2,
                                          "create_repo", "upload_folder"]
    assert [c["branch"] for c in calls if c["call"] == "create_branch"] == ["update-000001", "update-000002"]
    assert [c.get("revision") for c in calls if c["call"] == "upload_folder"] == ["update-000001", "update-000002",
                                                                                None]
    out = " ".join(proc.stdout.split())
    assert "pushed checkpoint update-000001 to https://huggingface.co/me/ppo-tiny/tree/update-000001" in out, out
    downloaded = tmp_path / "downloaded" / "update-000001"  # as `hf download me/ppo-tiny --revision update-000001`
    downloaded.parent.mkdir()
    (remote / "@update-000001").rename(downloaded)
    assert checkpoint_problem(downloaded) is None
    assert (remote / "model.safetensors").exists() and not (remote / "checkpoints").exists()
    resumed, rows_resumed = run_ppo(tiny_args(assets, "--resume", str(downloaded)), tmp_path / "resumed")
    assert "continuing at update 2" in resumed.stdout and [r["update"] for r in rows_resumed] == [2]
    with pytest.raises(ValueError, match="--hub-strategy all_checkpoints name the Hub repository"):
        hub.check_hub(flags(push_to_hub=False, hub_strategy="all_checkpoints"))


def test_a_checkpoint_push_that_fails_says_how_and_the_run_goes_on(assets, tmp_path, monkeypatch):
    proc, rows, _, _ = recorded_run(tiny_args(assets, "--push-to-hub", "--hub-model-id", "me/x", "--save-every", "1",
                                              "--hub-strategy", "all_checkpoints"), tmp_path, monkeypatch, fail=True)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and [r["update"] for r in rows] == [1, 2]
    assert "checkpoint update-000001 was not pushed (ConnectionError: the Hub went away)" in out
    checkpoint = tmp_path / "run" / "checkpoints" / "update-000001"
    # the console wraps the long path: its pieces are there
    assert "Push it later with: hf upload me/x" in out and ". --revision update-000001" in out and checkpoint.is_dir()
