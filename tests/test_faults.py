"""Nothing lost, nothing silently wrong: a run owns its folder, a resume refuses what would change the run,
checkpoints are verified before loading, and every bad file or flag is named before any model loads."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import tyro

import ppo
import ppo_tldr
from ppo_harness import folder_lock, run_folder
from ppo_harness.checkpoints import CHECKSUMS, checkpoint_problem, find_checkpoint, save_checkpoint
from conftest import ROOT, make_tokenizer, run_ppo, tiny_args, without_wall_clock
from test_checkpoints import flat_weights


def set_up(assets, out, *extra):
    """ppo.py's set-up alone (every check, no model loaded) on the tiny assets, into `out`: it takes the folder last
    (the lock, --overwrite's deletions)."""
    args = tyro.cli(ppo.Args, args=[*tiny_args(assets), "--output-dir", str(out), *extra])
    return ppo.set_up(args)[1]


def finished_run(out):
    """A folder as a finished run leaves it (the files that matter here)."""
    (out / "checkpoints" / "update-000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"update": 1}\n{"update": 2}\n')
    return out


def test_a_new_run_into_another_runs_folder_is_refused_and_nothing_emptied(assets, tmp_path):
    out = finished_run(tmp_path / "run")
    with pytest.raises(ValueError, match="holds another run") as error:
        set_up(assets, out)
    assert str(out) in str(error.value) and "--resume auto" in str(error.value) and "--output-dir" in str(error.value)
    assert (out / "metrics.jsonl").read_text() == '{"update": 1}\n{"update": 2}\n' and not (out / ".lock").exists()
    set_up(assets, out, "--overwrite")  # on purpose: the other run's logs and checkpoints are deleted
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert (out / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}"


def test_the_lock_refuses_a_second_run_and_a_stale_one_is_taken_over(assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for holder in (f"{socket.gethostname()} {os.getppid()}", "other-host 4242"):  # a live process; another host's
        (out / ".lock").write_text(holder)
        host, pid = holder.split()
        with pytest.raises(ValueError, match=f"in use by the run of process {pid} on host {host}"):
            set_up(assets, out)
    stale = time.time() - 31 * 60  # another host's lock, untouched longer than --peer-timeout (30 min): taken over
    os.utime(out / ".lock", (stale, stale))
    set_up(assets, out)
    assert (out / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}"
    gone = subprocess.Popen(["true"])
    gone.wait()
    (out / ".lock").write_text(f"{socket.gethostname()} {gone.pid}")  # a killed run's
    set_up(assets, out)
    assert (out / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}"


@pytest.mark.parametrize("change, field", [
    (["--learning-rate", "0.5"], "learning_rate"), (["--temperature", "0.9"], "temperature"),
    (["--response-length", "4"], "response_length"), (["--reward-fn", "vader"], "reward_fn"),
    (["--num-mini-batches", "4", "--per-device-train-batch-size", "2"], "num_mini_batches"),  # the same batch
    (["--cliprange", "0.3"], "cliprange"), (["--sft-model-path", "RM"], "sft_model_path"),
])
def test_a_resume_refuses_a_flag_that_changes_the_run(assets, tmp_path, change, field):
    out = tmp_path / "run"
    out.mkdir()
    run_folder.write_args(out, tyro.cli(ppo.Args, args=[*tiny_args(assets), "--output-dir", str(out)]), "run", {}, 1)
    change = [str(assets["rm"]) if c == "RM" else c for c in change]
    with pytest.raises(ValueError, match="flags differ from those") as error:
        set_up(assets, out, "--resume", "auto", *change)
    assert field in str(error.value) and "--resume-with-changes" in str(error.value)


def test_a_resume_records_the_changes_it_may_make(assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    run_folder.write_args(out, tyro.cli(ppo.Args, args=[*tiny_args(assets), "--output-dir", str(out)]), "run", {}, 1)
    extra = ["--resume", "auto", "--save-every", "3", "--learning-rate", "0.5", "--resume-with-changes",
             "learning-rate"]
    setup = set_up(assets, out, *extra)
    assert setup.folder.changes == {"learning_rate": [1e-3, 0.5], "save_every": [0, 3]}
    assert "resumed with --learning-rate changed from 0.001 to 0.5" in setup.folder.banner_lines()
    resumed = tyro.cli(ppo.Args, args=[*tiny_args(assets), "--output-dir", str(out), *extra])
    run_folder.write_args(out, resumed, "run 2", setup.folder.changes, 3)
    saved = json.loads((out / "args.json").read_text())
    assert saved["learning_rate"] == 1e-3 and saved["run_name"] == "run" and saved["resumes"] == [
        {"at_update": 3, "changes": {"learning_rate": [1e-3, 0.5], "save_every": [0, 3]}}]
    set_up(assets, out, "--resume", "auto", "--learning-rate", "0.5")  # the run now goes on at 0.5
    with pytest.raises(ValueError, match="--resume-with-changes learning_ratee: no such flag"):
        ppo.check_args(ppo.Args(resume_with_changes=("learning-ratee",)))


@pytest.mark.parametrize("flags, message", [
    (dict(resume_with_changes=("learning-rate",)), "no --resume, so no flags are compared; add --resume auto"),
    (dict(overwrite=True, resume="auto", output_dir="runs/x"), "drop --overwrite to continue it, or --resume"),
    (dict(eval_samples=0, eval_every=2), "--eval-every 2: --eval-samples 0 holds no prompts out"),
    (dict(reward_url_rows_per_request=4), "add --reward-url-protocol openrlhf, or drop it"),
])
def test_a_flag_that_cannot_act_is_refused_saying_what_to_do(flags, message):
    """Ignored without a word at c25d42a."""
    with pytest.raises(ValueError, match=re.escape(message)):
        ppo.check_args(ppo.Args(**flags))
    ppo.check_args(ppo.Args(eval_samples=0))  # --eval-every's default: not given, nothing to refuse


def squeezed(text):
    return "".join(text.split())


def flip_bytes(path, offset=200, count=8):
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(255 - b for b in data[offset:offset + count])
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_named_and_resume_auto_falls_back_to_a_whole_one(assets, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(assets, "--save-every", "1", "--eval-samples", "2", "--eval-every", "1")
    _, uninterrupted = run_ppo(args, out)  # 2 updates, a checkpoint after each
    weights = flat_weights(out / "model.safetensors")
    checkpoints = out / "checkpoints"
    assert subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS], cwd=checkpoints / "update-000002").returncode \
        == 0  # the checksums are in the standard tool's format
    flip_bytes(checkpoints / "update-000002" / "optimizer.bin")  # the newest: 8 bytes flipped
    with pytest.raises(ValueError, match="update-000002/optimizer.bin differs from its checksum"):
        find_checkpoint(str(checkpoints / "update-000002"), None)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"update": 3, "objective/sc')  # a last line torn by a kill
    proc, rows = run_ppo(args + ["--resume", "auto", "--save-every", "2"], out)
    stdout = squeezed(proc.stdout)  # rich wraps the banner's long lines
    assert squeezed("update-000002/optimizer.bin differs from its checksum") in stdout
    assert squeezed(f"falling back to {checkpoints / 'update-000001'}") in stdout
    assert squeezed("continuing at update 2") in stdout
    assert squeezed("resumed with --save-every changed from 1 to 2") in stdout  # an allowed change, in the banner
    assert without_wall_clock(rows) == without_wall_clock(uninterrupted)  # each update once, as uninterrupted
    assert torch.equal(flat_weights(out / "model.safetensors"), weights)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out))
    events.Reload()  # the redone update's first points purged: each step once
    assert [e.step for e in events.Scalars("objective/scores")] == [1, 2]
    assert [e.step for e in events.Scalars("eval/scores")] == [0, 1, 2]
    assert checkpoint_problem(checkpoints / "update-000002") is None  # written anew
    (checkpoints / "update-000002" / "model.safetensors").unlink()  # a file deleted
    assert find_checkpoint("auto", out) == (checkpoints / "update-000001", [
        f"checkpoint {checkpoints / 'update-000002'} is damaged or incomplete: "
        f"{checkpoints / 'update-000002' / 'model.safetensors'}: No such file or directory",
        f"falling back to {checkpoints / 'update-000001'}, the newest whole checkpoint"])
    (checkpoints / "update-000001" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match="no whole checkpoint"):  # none left: refused, not started afresh
        find_checkpoint("auto", out)


def test_save_total_limit_prunes_this_runs_history_by_update_number(tmp_path):
    """Resumed from update 5 in a folder that also holds 8 (a later, abandoned history): writing 6 with
    --save-total-limit 1 keeps 6, which `latest` names, and leaves 8 to be overwritten."""
    from accelerate import Accelerator

    accelerator, checkpoints = Accelerator(cpu=True), tmp_path / "checkpoints"
    kept = lambda limit: run_folder.RunFolder(tmp_path, "run", flags={"save_total_limit": limit})  # noqa: E731
    for update in (5, 8):
        (checkpoints / f"update-00000{update}").mkdir(parents=True)
        (checkpoints / f"update-00000{update}" / "trainer_state.json").write_text("{}")
    save_checkpoint(accelerator, kept(1), {"update": 6})
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "update-000006", "update-000008"]
    assert (checkpoints / "latest").read_text() == "update-000006"
    assert checkpoint_problem(checkpoints / "update-000006") is None
    save_checkpoint(accelerator, kept(2), {"update": 7})
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "update-000006", "update-000007",
                                                             "update-000008"]


def test_a_full_disk_says_so_and_where(assets, tmp_path):
    """A real full file system: a 64 KiB tmpfs on the checkpoints folder, mounted in a private mount namespace."""
    out, probe = tmp_path / "run", tmp_path / "probe"
    probe.mkdir()
    if subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "none", str(probe)],
                      capture_output=True).returncode != 0:
        pytest.skip("no tmpfs mount here (unshare -rm mount needs user namespaces or root)")
    (out / "checkpoints").mkdir(parents=True)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k none "$0" && exec "$@"',
                           str(out / "checkpoints"), sys.executable, str(ROOT / "ppo.py"), "--output-dir", str(out),
                           *tiny_args(assets, "--total-episodes", "16")], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode != 0 and "no space left on device" in proc.stderr
    assert f"writing {out / 'checkpoints'} failed" in proc.stderr
    assert (out / "model.safetensors").is_file()  # the models were saved before the checkpoint


def jsonl(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return path


def bad_inputs(root):
    good = [{"prompt": f"w{i} w2 w3"} for i in range(40)]
    chat = {"prompt": [{"role": "user", "content": "w1 w2"}]}
    return {
        "invalid JSON": (jsonl(root / "bad.jsonl", good[:6] + [b'{"prompt": "w1}'] + good), "line 7 is not valid JSON"),
        "duplicate key": (jsonl(root / "dup.jsonl", good[:2] + [b'{"prompt": "w1", "prompt": "w2"}'] + good),
                          "line 3 is not valid JSON (the key 'prompt' appears twice)"),
        "not UTF-8": (jsonl(root / "latin.jsonl", good[:4] + [b'{"prompt": "caf\xe9"}'] + good),
                      "line 5 is not UTF-8 (byte 0xe9)"),
        "null prompt": (jsonl(root / "null.jsonl", good[:4] + [{"prompt": None}] + good), "row 4's prompt is None"),
        "integer prompt": (jsonl(root / "int.jsonl", good[:2] + [{"prompt": 7}] + good), "row 2's prompt is 7 (int)"),
        "text after chat": (jsonl(root / "mixed.jsonl", [chat, *good]), "row 1's prompt is 'w0 w2 w3' (str)"),
    }


@pytest.mark.parametrize("case", ["invalid JSON", "duplicate key", "not UTF-8", "null prompt", "integer prompt",
                                  "text after chat"])
def test_a_bad_prompt_file_is_named_by_line_or_row(assets, tmp_path, case):
    path, message = bad_inputs(tmp_path)[case]
    with pytest.raises(ValueError, match="--dataset-name") as error:
        set_up(assets, tmp_path / "run", "--dataset-name", str(path))
    assert str(path) in str(error.value) and message in str(error.value), str(error.value)
    assert not (tmp_path / "run").exists()


def test_bad_weights_and_flags_are_named_at_start_up(assets, tmp_path):
    sft = tmp_path / "sft"
    shutil.copytree(assets["sft"], sft)
    weights = sft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # truncated
    with pytest.raises(ValueError, match=f"{weights} cannot be read"):
        set_up(assets, tmp_path / "run", "--sft-model-path", str(sft))
    with pytest.raises(ValueError, match="--stop-token-id 999999: the policy has 31 tokens"):
        set_up(assets, tmp_path / "run", "--stop-token-id", "999999")
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification

    small = tmp_path / "rm_small"  # 20 embedding rows, read with the 31-token tokenizer
    GPTNeoXForSequenceClassification(GPTNeoXConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32, num_labels=1,
                                                   eos_token_id=0)).save_pretrained(small)
    make_tokenizer(False).save_pretrained(small)
    with pytest.raises(ValueError, match="tokenizer it reads with has ids up to 30, its model 20 embedding rows"):
        set_up(assets, tmp_path / "run", "--reward-model-path", str(small))
    out = tmp_path / "killed"  # a run killed before its first checkpoint, restarted with --resume auto
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"update": 1}\n{"upd\n{"update": 2}\n')  # a bad line that is not the last
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        set_up(assets, out, "--resume", "auto")


def test_ppo_tldr_names_a_bad_json_line_too(tmp_path):
    path, message = bad_inputs(tmp_path)["invalid JSON"]
    with pytest.raises(ValueError, match=f"--eval-dataset-name {path}: {message}"):
        ppo_tldr.load_tldr_split(str(path), None, "train", "--eval-dataset-name")


def test_ppo_tldr_names_a_row_that_is_not_text(tmp_path):
    rows = [{"subreddit": "a", "title": "t", "post": "p", "summary": "s"} for _ in range(4)]
    rows[2]["post"] = None
    path = jsonl(tmp_path / "posts.jsonl", rows)
    with pytest.raises(ValueError, match="row 2's post is None, not text"):
        ppo_tldr.load_tldr_split(str(path), None, "train", "--dataset-name")


def test_a_models_folder_or_a_folder_of_other_files_is_never_a_runs(assets, tmp_path):
    """--output-dir equal to the SFT (or reward) model's folder, or holding files no run wrote, is refused before any
    model loads, and its files are left as they were; so are a file, or a file as the folder's parent."""
    sft = tmp_path / "sft"
    shutil.copytree(assets["sft"], sft)
    before = {p.name: p.read_bytes() for p in sft.iterdir()}
    for folder, extra, message in [(sft, ["--sft-model-path", str(sft)], "is the folder of --sft-model-path"),
                                   (sft, [], "holds files no run wrote (config.json"),
                                   (sft, ["--overwrite"], "holds files no run wrote")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            set_up(assets, folder, *extra)
        assert {p.name: p.read_bytes() for p in sft.iterdir()} == before  # untouched, no .lock either
    (tmp_path / "a_file").write_text("x")
    for folder in (tmp_path / "a_file", tmp_path / "a_file" / "run"):
        with pytest.raises(ValueError, match=f"{tmp_path / 'a_file'} is a file, not a folder"):
            set_up(assets, folder)


def test_overwrite_moves_the_old_run_aside_whole(assets, tmp_path):
    """--overwrite renames the old run's folder away in one step before deleting it: its model files go with its logs
    (a kill midway leaves the old run or the new one, never the new run's logs beside the old run's model)."""
    out = finished_run(tmp_path / "run")
    (out / "model.safetensors").write_text("old weights")
    (out / "args.json").write_text("{}")
    set_up(assets, out, "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    assert not list(tmp_path.glob(".run.overwritten-*"))  # deleted once the new folder was taken


def test_overwrite_through_a_symlinked_folder_replaces_the_run_it_points_to(assets, tmp_path):
    """--output-dir a symlink: the folder it points to is moved aside and deleted, the link kept and pointing at the
    new run's folder (the link itself renamed, an empty folder in its place and rmtree refusing a link: the old
    run never deleted, its lock left behind)."""
    real = finished_run(tmp_path / "disk" / "run")
    (real / "args.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(real)
    set_up(assets, link, "--overwrite")
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert sorted(p.name for p in real.iterdir()) == [".lock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link"] and os.listdir(tmp_path / "disk") == ["run"]


def test_a_resume_from_an_older_checkpoint_continues_its_own_branch(assets, tmp_path):
    """A finished run resumed from an earlier checkpoint: the later checkpoints (the abandoned future) are moved aside,
    not deleted, and `latest` names the resumed one, so a kill in the next update resumes this branch."""
    out = tmp_path / "run"
    args = tiny_args(assets, "--save-every", "1", "--total-episodes", "48", "--eval-samples", "2")
    run_ppo(args, out)  # 3 updates, a checkpoint after each
    checkpoints = out / "checkpoints"
    setup = ppo.set_up(tyro.cli(ppo.Args, args=[*args, "--output-dir", str(out), "--resume",
                                                 str(checkpoints / "update-000001")]))[1]
    assert setup.folder.checkpoint == checkpoints / "update-000001"
    assert (checkpoints / "latest").read_text() == "update-000001"
    assert find_checkpoint("auto", out)[0] == checkpoints / "update-000001"
    abandoned = list(checkpoints.glob("abandoned-*"))
    assert len(abandoned) == 1 and sorted(p.name for p in abandoned[0].iterdir()) == ["update-000002",
                                                                                      "update-000003"]
    assert any("moved to" in line for line in setup.folder.banner_lines())


def test_a_resume_compares_the_flags_the_checkpoint_was_trained_with(assets, tmp_path):
    """Each checkpoint carries its flags: with args.json deleted, a resume at another learning rate is still refused."""
    out = tmp_path / "run"
    args = tiny_args(assets, "--save-every", "1", "--total-episodes", "16", "--eval-samples", "2")
    run_ppo(args, out)
    assert json.loads((out / "checkpoints" / "update-000001" / "trainer_state.json").read_text())["args"][
        "learning_rate"] == 1e-3
    (out / "args.json").unlink()
    with pytest.raises(ValueError, match="flags differ from those .* was trained with .*learning_rate"):
        set_up(assets, out, "--resume", "auto", "--save-every", "1", "--total-episodes", "16", "--eval-samples", "2",
               "--learning-rate", "0.5")


def test_total_episodes_cannot_change_on_resume_and_no_flag_says_otherwise(assets, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(assets, "--save-every", "1", "--total-episodes", "16", "--eval-samples", "2")
    run_ppo(args, out)
    with pytest.raises(ValueError) as error:
        set_up(assets, out, *args[len(tiny_args(assets)):], "--resume", "auto", "--total-episodes", "48",
               "--resume-with-changes", "total-episodes")
    assert "a resume cannot change them" in str(error.value) and "total_episodes" in str(error.value)


def test_held_out_prompts_that_also_train_are_counted_in_the_banner(assets, tmp_path):
    repeated = tmp_path / "repeated.jsonl"
    repeated.write_text(assets["prompts"].read_text() + assets["prompts"].read_text())  # every row twice
    setup = set_up(assets, tmp_path / "run", "--dataset-name", str(repeated))
    assert setup.notes == [f"warning: 4 of the 4 held-out prompts also appear among the training prompts (repeated "
                           f"rows in {repeated})"]
    assert ppo.set_up(tyro.cli(ppo.Args, args=[*tiny_args(assets), "--output-dir", str(tmp_path / "r2")]))[1].notes == []


def test_an_empty_lock_is_stale_and_a_full_disk_leaves_none(assets, tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("")  # a run killed while writing its lock
    set_up(assets, out)
    assert (out / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}"
    full = tmp_path / "full"

    def no_space(fd, mode):
        os.close(fd)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(folder_lock.os, "fdopen", no_space)
    with pytest.raises(ValueError, match="no space left on device"):
        set_up(assets, full)
    assert not (full / ".lock").exists()


def test_a_reward_tokenizer_is_checked_by_its_largest_id_not_its_size(assets, tmp_path):
    """32 tokens whose largest id is 70,000, for a reward model of 902 embedding rows: refused at start-up (it would
    fail with IndexError in update 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification, PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i + 1 for i in range(30)}, "<unk>": 70000}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rm = tmp_path / "rm_sparse"
    GPTNeoXForSequenceClassification(GPTNeoXConfig(vocab_size=902, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32, num_labels=1,
                                                   eos_token_id=0)).save_pretrained(rm)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>").save_pretrained(rm)
    with pytest.raises(ValueError, match="has ids up to 70000, its model 902 embedding rows"):
        set_up(assets, tmp_path / "run", "--reward-model-path", str(rm))
