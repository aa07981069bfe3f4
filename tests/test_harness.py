"""ppo_harness/ tested directly, without a training run: it imports neither script and holds no algorithm; the run
folder (claim, lock, resume check, checkpoints, logs), the run log, the flags' intervals and the prompt files."""
import ast
import dataclasses
import graphlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Annotated, Literal

import pytest
import torch
from accelerate import Accelerator

from conftest import ROOT
from ppo_harness import launch, prompt_files, run_folder, run_log, writes
from ppo_harness.checkpoints import CHECKSUMS, checkpoint_problem, find_checkpoint, save_checkpoint
from ppo_harness.log_files import keep_rows_before, log_rows
from ppo_harness.preemption import Preemption

HARNESS = sorted((ROOT / "ppo_harness").glob("*.py"))


@pytest.mark.parametrize("path", HARNESS, ids=lambda p: p.name)
def test_the_harness_imports_neither_script_and_holds_no_algorithm(path):
    tree = ast.parse(path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        (n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"ppo", "ppo_tldr", "ppo_multiturn"}, f"{path.name} imports a script"
    # an optimizer's step; `environments` calls an environment's `step` (its protocol's name), on an instance
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and not (path.name == "environments.py" and n.func.attr == "step"
                      and isinstance(n.func.value, ast.Name) and n.func.value.id in ("obj", "self"))}
    assert not calls & {"backward", "step", "zero_grad", "clip_grad_norm_"}, f"{path.name} trains: {calls}"
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not names & {"policy_loss", "value_loss", "compute_gae", "compute_rewards"}


def harness_imports(path: Path) -> set[str]:
    """The ppo_harness modules a harness file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "ppo_harness":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ppo_harness."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("ppo_harness.")}
    return found


def test_the_harness_has_no_import_cycle():
    """Each module reads alone, down an order: none imports one that imports it back (graphlib names a cycle)."""
    graph = {path.stem: harness_imports(path) for path in HARNESS}
    assert graph["run_folder"] and graph["reward_calls"]  # the reader sees imports (a broken reader finds none)
    list(graphlib.TopologicalSorter(graph).static_order())


@dataclasses.dataclass
class Flags:  # what the run folder reads of a script's Args
    exp_name: str = "test"
    seed: int = 1
    output_dir: str | None = None
    resume: str | None = None
    resume_with_changes: tuple[str, ...] = ()
    overwrite: bool = False
    peer_timeout: float = 30.0
    learning_rate: Annotated[float, "[0, inf)"] = 1e-3
    save_every: Annotated[int, "[0, inf)"] = 0
    save_total_limit: int | None = None
    track: bool = False
    kl_estimator: Literal["k1", "k3"] = "k1"
    stop_token: Literal["eos"] | None = "eos"


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


STATE = dict(seed=1, batch_size=8, num_updates=4, num_prompts=40, num_processes=1)


def claim(accelerator, out, **flags):
    return run_folder.claim(accelerator, Flags(output_dir=str(out), **flags), STATE, {"save_every"})


def folder_of(path, **flags):
    """A run folder at `path` as `claim` leaves it, launched with `flags`."""
    return run_folder.RunFolder(path, "run", flags=dataclasses.asdict(Flags(**flags)))


def test_claim_takes_a_new_folder_and_refuses_another_runs(accelerator, tmp_path):
    out = tmp_path / "run"
    folder = claim(accelerator, out)
    assert folder.path == out and folder.checkpoint is None and folder.run_name.startswith("test__1__")
    assert (out / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}"
    (out / "metrics.jsonl").write_text('{"update": 1}\n')
    with pytest.raises(ValueError, match="holds another run"):
        claim(accelerator, out)
    assert (out / "metrics.jsonl").exists()
    claim(accelerator, out, overwrite=True)
    assert not (out / "metrics.jsonl").exists()
    (out / ".lock").write_text("other-host 4242")  # another host's live lock
    with pytest.raises(ValueError, match="in use by the run of process 4242 on host other-host"):
        claim(accelerator, out)


def test_runs_starting_at_once_take_a_stale_lock_once(tmp_path):
    """Four processes lock one folder at the same moment, its lock left by a killed run: one takes it and the three
    others are refused with its pid (a flock guards the record's read, check and write, so no two find it stale)."""
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (out / ".lock").write_text(f"{socket.gethostname()} {gone.pid}")
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from ppo_harness.folder_lock import lock_output_dir

        time.sleep(max({time.time() + 3} - time.time(), 0))  # every process started: all lock at once
        try:
            lock_output_dir(Path({str(out)!r}), take=True, stale_after=1800)
            print("took", flush=True)
        except ValueError as error:
            print(error, flush=True)
        sys.stdin.read()  # alive until every answer is in: a refused run must find the taker live
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    try:
        answers = [proc.stdout.readline().strip() for proc in procs]
    finally:
        for proc in procs:
            proc.communicate("", timeout=60)
    takers = [proc for proc, answer in zip(procs, answers) if answer == "took"]
    assert len(takers) == 1, answers
    assert all(f"in use by the run of process {takers[0].pid} on host" in answer for answer in answers
               if answer != "took"), answers
    assert not (out / ".lock").exists()  # released by the taker at its exit


def test_a_resume_continues_its_checkpoint_and_compares_the_flags(accelerator, tmp_path):
    out = tmp_path / "run"
    folder = claim(accelerator, out)
    run_folder.write_args(out, Flags(output_dir=str(out)), folder.run_name, {}, 1)
    save_checkpoint(accelerator, folder, dict(update=2, **STATE))
    resumed = claim(accelerator, out, resume="auto", save_every=2)
    assert resumed.checkpoint == out / "checkpoints" / "update-000002" and resumed.saved["update"] == 2
    assert resumed.changes == {"save_every": [0, 2]} and resumed.banner_lines() == [
        "resumed with --save-every changed from 0 to 2"]
    with pytest.raises(ValueError, match="flags differ from those"):
        claim(accelerator, out, resume="auto", learning_rate=0.5)
    assert claim(accelerator, out, resume="auto", learning_rate=0.5,
                 resume_with_changes=("learning-rate",)).changes == {"learning_rate": [1e-3, 0.5]}
    with pytest.raises(ValueError, match=r"the run's settings changed \(saved, now\): \{'num_prompts': \(40, 41\)\}"):
        run_folder.claim(accelerator, Flags(output_dir=str(out), resume="auto"), {**STATE, "num_prompts": 41}, set())


def test_a_checkpoint_carries_the_flags_the_run_was_launched_with(accelerator, tmp_path):
    """A schedule that sets a flag as the run goes (here args.learning_rate) changes no checkpoint's flags: a resume
    with the flags the run was launched with differs in none. A finished run's checkpoint ends a resume at once."""
    out, flags = tmp_path / "run", Flags(output_dir=str(tmp_path / "run"))
    folder = run_folder.claim(accelerator, flags, STATE, set())
    flags.learning_rate = 0.5  # as a schedule in the loop would set it
    save_checkpoint(accelerator, folder, dict(update=2, finished=False, **STATE))
    assert claim(accelerator, out, resume="auto").changes == {}
    save_checkpoint(accelerator, folder, dict(update=3, finished=True, **STATE))
    with pytest.raises(SystemExit) as stopped:
        claim(accelerator, out, resume="auto")
    assert stopped.value.code == 0


def branched_run(accelerator, out):
    """A run that resumed update 1 after update 2: update-000002 is abandoned (checkpoints/abandoned-*/)."""
    folder = claim(accelerator, out)
    run_folder.write_args(out, Flags(output_dir=str(out)), folder.run_name, {}, 1)
    (out / "metrics.jsonl").write_text('{"update": 1}\n')
    for update in (1, 2):
        save_checkpoint(accelerator, folder, dict(update=update, finished=False, **STATE))
    claim(accelerator, out, resume=str(out / "checkpoints" / "update-000001"))
    return next((out / "checkpoints").glob("abandoned-*")) / "update-000002"


def test_overwrite_never_deletes_what_the_run_reads(accelerator, tmp_path):
    """--overwrite refuses to delete a folder that holds the checkpoint --resume names (an abandoned one too) or a
    model the run reads, nested at any depth; the folder stays whole. At c25d42a both were deleted."""
    out = tmp_path / "run"
    abandoned = branched_run(accelerator, out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(ValueError, match=re.escape(f"--overwrite would delete {out}, which holds what this run reads "
                                                   f"(--resume {abandoned})")):  # as the scripts, it may change
        run_folder.claim(accelerator, Flags(output_dir=str(out), resume=str(abandoned), overwrite=True), STATE,
                         {"overwrite"})
    sft = out / "models" / "sft"
    sft.mkdir(parents=True)
    (sft / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=re.escape(f"(--sft-model-path {sft}): move it out of the folder")):
        run_folder.claim(accelerator, Flags(output_dir=str(out), overwrite=True), STATE, set(),
                         {"--sft-model-path": str(sft), "--value-model-path": None})
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(before + [Path("models"), Path(
        "models/sft"), Path("models/sft/config.json")]) and (out / ".lock").exists()
    run_folder.claim(accelerator, Flags(output_dir=str(out), overwrite=True), STATE, set(),
                     {"--sft-model-path": str(tmp_path / "elsewhere")})  # nothing it reads inside: deleted
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_overwrite_starts_a_new_run_with_new_flags(accelerator, tmp_path):
    """A new run with other flags into another run's folder, with --overwrite: no flags compared (no resume asked).
    At c25d42a it was refused with the resume's message."""
    out = tmp_path / "run"
    folder = claim(accelerator, out)
    run_folder.write_args(out, Flags(output_dir=str(out)), folder.run_name, {}, 1)
    (out / "metrics.jsonl").write_text('{"update": 1}\n')
    new = claim(accelerator, out, overwrite=True, learning_rate=0.5)
    assert new.checkpoint is None and new.changes == {} and new.banner_lines() == []
    assert not (out / "metrics.jsonl").exists()


def test_an_abandoned_checkpoint_continues_in_a_new_folder_and_says_so(accelerator, tmp_path):
    """Resuming one of the run's own abandoned checkpoints into its folder would mix two branches' logs: refused,
    saying how to continue it (another --output-dir), which then works. At c25d42a: "holds another run"."""
    out = tmp_path / "run"
    abandoned = branched_run(accelerator, out)
    before = sorted(p.relative_to(out) for p in out.rglob("*") if p.name != ".lock")
    for flags in (dict(output_dir=str(out)), dict(output_dir=None)):
        with pytest.raises(ValueError, match="abandoned when it resumed an earlier one") as refused:
            run_folder.claim(accelerator, Flags(resume=str(abandoned), **flags), STATE, set())
        assert "--output-dir" in str(refused.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*") if p.name != ".lock") == before  # nothing moved
    branch = run_folder.claim(accelerator, Flags(output_dir=str(tmp_path / "branch"), resume=str(abandoned)), STATE,
                              {"output_dir"})
    assert branch.checkpoint == abandoned and branch.saved["update"] == 2 and abandoned.is_dir()


def test_the_lock_is_taken_before_a_checkpoint_is_chosen(accelerator, tmp_path, monkeypatch, capsys):
    """A start while the run still holds its folder, in its last update, is refused with the running pid, whatever
    the checkpoints then; once that run has finished, a start says so and moves nothing. At c25d42a the checkpoint was
    chosen first (update 1), the run then ended (writing update 2, the final one, and freeing its lock), and the
    start moved update 2 aside and trained it again."""
    out = tmp_path / "run"
    folder = claim(accelerator, out)
    save_checkpoint(accelerator, folder, dict(update=1, finished=False, **STATE))
    running = subprocess.Popen(["sleep", "60"])
    (out / ".lock").write_text(f"{socket.gethostname()} {running.pid}")  # the first run, in its last update
    find_checkpoint = run_folder.find_checkpoint

    def the_run_ends_meanwhile(resume, output_dir):
        found = find_checkpoint(resume, output_dir)
        save_checkpoint(accelerator, folder, dict(update=2, finished=True, **STATE))
        (out / ".lock").unlink()
        return found
    monkeypatch.setattr(run_folder, "find_checkpoint", the_run_ends_meanwhile)
    try:
        with pytest.raises(ValueError, match=f"in use by the run of process {running.pid} "):
            claim(accelerator, out, resume="auto")
    finally:
        running.kill()
        running.wait()
    monkeypatch.undo()
    save_checkpoint(accelerator, folder, dict(update=2, finished=True, **STATE))  # the run ends
    (out / ".lock").unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        claim(accelerator, out, resume="auto")
    assert stopped.value.code == 0 and "it is finished, nothing is left to train" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "update-000001", "update-000002"]
    assert not (out / ".lock").exists()


def test_a_signal_during_start_up_releases_the_lock(tmp_path):
    """SIGTERM after the folder is taken and before the run's own handler (models loading): the process exits 143,
    saying what to do, and its lock is gone. At c25d42a SIGTERM killed it at once and the lock stayed."""
    out = tmp_path / "run"
    code = textwrap.dedent(f"""
        import dataclasses, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from accelerate import Accelerator
        from ppo_harness import run_folder

        @dataclasses.dataclass
        class Flags:
            exp_name: str = "t"
            seed: int = 1
            output_dir: str = {str(out)!r}
            resume: str | None = None
            resume_with_changes: tuple = ()
            overwrite: bool = False
            peer_timeout: float = 30.0

        run_folder.claim(Accelerator(cpu=True), Flags(), {{}}, set())
        print("claimed", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "claimed\n" and (out / ".lock").exists()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "start it again with the same command" in stderr
    assert not (out / ".lock").exists()


def test_checkpoints_are_verified_and_pruned(accelerator, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for update in (1, 2, 3):
        save_checkpoint(accelerator, folder_of(tmp_path, save_total_limit=2), {"update": update})
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "update-000002", "update-000003"]
    assert find_checkpoint("auto", tmp_path) == (checkpoints / "update-000003", [])
    state = checkpoints / "update-000003" / "trainer_state.json"
    state.write_text(state.read_text().replace("3", "4"))  # changed since written
    found, notes = find_checkpoint("auto", tmp_path)
    assert found == checkpoints / "update-000002" and "differs from its checksum" in notes[0]
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        find_checkpoint(str(tmp_path), None)


def test_logs_keep_the_rows_before_a_resume_and_name_a_bad_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"update": 1}\n{"update": 2}\n{"update": 3, "obj')  # the last line torn by a kill
    keep_rows_before(log, 2)
    assert log.read_text() == '{"update": 1}\n'
    log.write_text('{"update": 1}\n{"upd\n{"update": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        log_rows(log)


def test_a_full_disk_is_named_with_the_folder(tmp_path):
    with pytest.raises(OSError, match=f"no space left on device: writing {tmp_path} failed"):
        with writes.disk_space_named(tmp_path):
            raise OSError(28, "No space left on device")
    with pytest.raises(KeyError):  # another error passes through as it is
        with writes.disk_space_named(tmp_path):
            raise KeyError("x")


def test_the_run_log_writes_args_metrics_and_tensorboard(accelerator, tmp_path):
    folder = claim(accelerator, tmp_path / "run")
    from rich.console import Console

    log = run_log.RunLog(Flags(output_dir=str(folder.path)), accelerator, folder, 2, 1, Console(quiet=True))
    log.log(1, {"objective/scores": 0.5})
    log.close()
    assert json.loads((folder.path / "args.json").read_text())["run_name"] == folder.run_name
    rows = [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"update": 1, "objective/scores": 0.5, "time/startup": rows[0]["time/startup"]}]
    assert 0 < rows[0]["time/startup"] < 3600  # since this process started, logged once, with the first update
    assert list(folder.path.glob("events.out.tfevents.*"))


def test_the_banner_estimates_each_models_memory(capsys):
    from rich.console import Console

    sizes = type("Sizes", (), dict(world_size=2, batch_size=8, local_batch_size=4, mini_batch_size=4,
                                   local_mini_batch_size=2, num_updates=3))
    flags = type("Args", (), dict(num_ppo_epochs=1, num_mini_batches=2, gradient_accumulation_steps=1,
                                  per_device_train_batch_size=2, total_episodes=24))
    model = torch.nn.Linear(1000, 1000, bias=False)  # 1M float32 weights, trained: 4 + 4 + 8 bytes each
    run_log.print_banner(Console(width=200), "run", flags, sizes, {"policy": model, "none": None}, 2, ["a note"])
    out = capsys.readouterr().out
    # ZeRO-2 shards the gradient and Adam's moments over 2 processes: 4 MB + 12 MB / 2 = 10 MB
    assert "a note" in out and f"{(4e6 + 12e6 / 2) / 2**30:.2f} GiB" in out and "1.0M" in out


def test_flags_out_of_their_interval_are_refused_by_name():
    launch.check_flags(Flags())
    with pytest.raises(ValueError, match=r"--learning-rate -1.0 is out of range: it must lie in \[0, inf\)"):
        launch.check_flags(Flags(learning_rate=-1.0))
    with pytest.raises(ValueError, match="--resume-with-changes learning_ratee: no such flag"):
        launch.check_flags(Flags(resume_with_changes=("learning-ratee",)))
    assert launch.flag_intervals(Flags) == {"learning_rate": "[0, inf)", "save_every": "[0, inf)"}
    # a Literal flag's choices come from its annotation alone (None where the flag may be None)
    assert launch.flag_choices(Flags) == {"kl_estimator": ("k1", "k3"), "stop_token": ("eos", None)}
    launch.check_flags(Flags(stop_token=None))
    for bad, message in ((dict(kl_estimator="k2"), "unknown --kl-estimator 'k2': choose one of ('k1', 'k3')"),
                         (dict(stop_token="."), "unknown --stop-token '.'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            launch.check_flags(Flags(**bad))


def test_a_table_prints_every_key_of_a_row():
    """A key a script adds to its rows (a copier's new column) is printed too, and a long text is cut."""
    from rich.console import Console

    console = Console(record=True, width=200)
    rows = [{"query": "q" * 8, "reference": "r", "response": "s", "score": 0.5, "length": 7}]
    run_log.print_rows(console, rows, "validation", cut={"query": 5})
    text = console.export_text()
    assert all(word in text for word in ("length", "qqqqq [...]", "0.5000", " 7 ")) and "q" * 6 not in text


@pytest.mark.parametrize("n, world, in_step", [(5, 2, False), (5, 2, True), (1, 3, False), (0, 2, True), (7, 3, True)])
def test_each_held_out_item_is_handled_once(n, world, in_step):
    """process_share gives every item to one process (ZeRO-3's stepping together, or fewer items than processes:
    every process as many, the extra ones wrapped round), and gather_once keeps each once, in order."""
    from types import SimpleNamespace

    shares = [launch.process_share(n, SimpleNamespace(process_index=rank, num_processes=world), in_step)
              for rank in range(world)]
    assert sorted(set(i for share in shares for i in share)) == list(range(n))
    if in_step or n < world:
        assert len({len(share) for share in shares}) == 1
    else:
        assert sum(len(share) for share in shares) == n
    held = [(i, f"row {i} from {rank}") for rank, share in enumerate(shares) for i in share]
    first = {}
    for i, row in held:
        first.setdefault(i, row)
    index, rows = [i for i, _ in held], [row for _, row in held]
    assert launch.gather_once(index, rows) == [first[i] for i in range(n)]  # one process: its gather is the list


def test_prompt_files_load_and_name_what_is_wrong(tmp_path):
    path = tmp_path / "posts.jsonl"
    path.write_text("".join(json.dumps({"title": "t", "post": p}) + "\n" for p in ("a", None, "c")))
    dataset = prompt_files.load_prompt_dataset(str(path), None, "ignored", "--eval-dataset-name")
    assert len(dataset) == 3
    with pytest.raises(ValueError, match=f"--x {path}: row 1's post is None, not text"):
        prompt_files.check_text_columns(dataset, f"--x {path}", ("title", "post"))
    with pytest.raises(ValueError, match=r"columns \['summary'\] are missing"):
        prompt_files.check_text_columns(dataset, "x", ("summary",))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows could be read"):
        prompt_files.load_prompt_dataset(str(tmp_path / "empty.jsonl"), None, "train")
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        (tmp_path / "a.txt").write_text("x")
        prompt_files.load_prompt_dataset(str(tmp_path / "a.txt"), None, "train")


def test_writes_are_whole_or_absent(tmp_path):
    path = tmp_path / "f.json"
    writes.write_atomic(path, "one")
    writes.write_atomic(path, "two")
    assert path.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    assert writes.temporary_name(path).parent == tmp_path and writes.temporary_name(path).name.startswith(".")


def test_damage_to_latest_or_the_checksums_is_named_and_an_older_whole_checkpoint_taken(accelerator, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for update in (1, 2):
        save_checkpoint(accelerator, folder_of(tmp_path), {"update": update})
    (checkpoints / "latest").write_bytes(b"\xff\xfe garbage")
    found, notes = find_checkpoint("auto", tmp_path)
    assert found == checkpoints / "update-000002" and "latest is damaged" in notes[0]
    sums = checkpoints / "update-000002" / CHECKSUMS
    sums.write_text(sums.read_text().replace("  ", " ", 1))  # a malformed line
    found, notes = find_checkpoint("auto", tmp_path)
    assert found == checkpoints / "update-000001" and f"{sums} line 1 is damaged" in notes[1]
    sums.write_bytes(b"\xff" * 10)  # not text
    assert checkpoint_problem(checkpoints / "update-000002") == f"{sums} is damaged (not text)"
    sums.unlink()  # written with checksums (format 2): without them it is incomplete, not trusted unverified
    assert checkpoint_problem(checkpoints / "update-000002") == f"{sums} is missing"
    state = checkpoints / "update-000001" / "trainer_state.json"
    (checkpoints / "update-000001" / CHECKSUMS).unlink()
    state.write_text(json.dumps({"update": 1}))  # an older checkpoint, from before checksums: taken as it is
    assert checkpoint_problem(checkpoints / "update-000001") is None


def test_a_signal_asks_every_process_to_stop_after_the_update(accelerator):
    import signal

    preemption = Preemption()
    try:
        assert not preemption.requested(accelerator)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested(accelerator) and preemption.signal == signal.SIGTERM
        with pytest.raises(SystemExit) as stop:
            preemption.exit(_quiet(), 3, Path("x"))
        assert stop.value.code == 143
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _quiet():
    from rich.console import Console

    return Console(quiet=True)


def test_numpy_scalars_and_bools_are_scores():
    import numpy as np

    from ppo_harness.reward_calls import call_reward_fn

    out = [np.bool_(True), np.float32(0.5), True, None]
    scores = call_reward_fn(lambda completions: out, {"completions": [0] * 4}, "cpu", "f")
    assert scores[:3].tolist() == [1.0, 0.5, 1.0] and scores[3].isnan()


@pytest.mark.parametrize("script", ["ppo.py", "ppo_tldr.py", "ppo_multiturn.py"])
def test_a_compile_cache_folder_that_cannot_be_made_is_refused_by_name_before_any_import_meets_it(script, tmp_path):
    """torch's compiler makes TORCHINDUCTOR_CACHE_DIR when it is imported (peft's import does it), so a folder that
    cannot be made used to end every run, --compile off too, in a 25-frame traceback from inside `import peft`. The
    harness package, imported first, refuses it in a sentence that names the variable and what to do."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(a_file / "cache")}
    proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"TORCHINDUCTOR_CACHE_DIR={a_file / 'cache'}: that folder cannot be made" in proc.stderr
    assert "unset it" in proc.stderr


def test_a_compile_error_naming_the_cache_is_tried_once_more_without_it(monkeypatch, tmp_path):
    """An error that names the compile cache's folder is tried once more without the cache: where that compiles, the
    console names the folder as holding a damaged file (--compile on too); where it fails again, the cache was not
    the cause, so nothing is said of it and the usual rule holds (auto: eager, said; on: raised)."""
    from ppo_harness import speed

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(speed, "forget_compile_cache", lambda: None)  # the real one: test_compile's damaged cache

    def always(x):
        raise RuntimeError(f"C++ compile error in {tmp_path}/k.cpp")
    said = []
    assert speed.CompiledOrEager(always, lambda x: x + 1, strict=False, console=said.append)(1) == 2
    assert len(said) == 1 and "the training step did not compile" in said[0] and "holds a file" not in said[0]
    with pytest.raises(RuntimeError, match="C\\+\\+ compile error"):
        speed.CompiledOrEager(always, lambda x: x + 1, strict=True, console=said.append)(1)
    calls = []

    def damaged_once(x):
        calls.append(x)
        if len(calls) == 1:
            raise RuntimeError(f"Failed to import {tmp_path}/k.py\nUnicodeDecodeError: ...")
        return 10 * x
    said = []
    step = speed.CompiledOrEager(damaged_once, lambda x: x + 1, strict=True, console=said.append)
    assert step(1) == 10 and step(2) == 20 and calls == [1, 1, 2]
    assert said == [speed.damaged_cache(str(tmp_path), RuntimeError(f"Failed to import {tmp_path}/k.py"))]


def test_compile_auto_compiles_one_cuda_process_in_a_long_enough_run_and_deepspeed_never(monkeypatch):
    """--compile auto: on for one CUDA process without DeepSpeed in a run of at least 40 updates; off on the CPU, for
    several processes, under DeepSpeed or in a short run. --compile on under DeepSpeed or on several processes is
    refused by name; on sets the compile cache's folder."""
    from types import SimpleNamespace as NS

    from ppo_harness.speed import should_compile

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    def accelerator(device="cuda", processes=1, deepspeed=None):
        return NS(device=torch.device(device), num_processes=processes, state=NS(deepspeed_plugin=deepspeed))
    assert should_compile(NS(compile="auto"), accelerator(), 40)
    assert not should_compile(NS(compile="auto"), accelerator(), 39)
    assert not should_compile(NS(compile="auto"), accelerator("cpu"), 1000)
    assert not should_compile(NS(compile="auto"), accelerator(processes=2), 1000)
    assert not should_compile(NS(compile="auto"), accelerator(deepspeed=object()), 1000)
    assert not should_compile(NS(compile="off"), accelerator(), 1000)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert should_compile(NS(compile="on"), accelerator("cpu"), 1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("torch_compile")
    # importing peft exports inductor's default (under /tmp): that counts as unset, and the project's cache applies
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert should_compile(NS(compile="on"), accelerator("cpu"), 1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("torch_compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/proc/no-such-cache")  # a folder that cannot be written
    with pytest.raises(ValueError, match="the compile cache /proc/no-such-cache cannot be written"):
        should_compile(NS(compile="on"), accelerator("cpu"), 1)
    with pytest.raises(ValueError, match="--compile on: DeepSpeed"):
        should_compile(NS(compile="on"), accelerator(deepspeed=object()), 1000)
    with pytest.raises(ValueError, match=r"--compile on: 2 processes \(DDP\)"):  # dynamo fails on DDP's forward
        should_compile(NS(compile="on"), accelerator(processes=2), 1000)


