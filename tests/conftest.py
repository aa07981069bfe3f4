"""Shared fixtures: tiny models built from config, a word-level tokenizer, prompt files, and a runner for ppo.py.

Everything is offline: models and tokenizers are written with save_pretrained into a temporary directory.
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf_home_")  # no cache shared with the user or between sessions

WORDS = [f"w{i}" for i in range(29)]  # + eos + unk: a 31-token vocabulary


def make_tokenizer(pad: bool):
    """A word-level tokenizer: '<eos>' = 0, 'w0'..'w28' = 1..29, '<unk>' = 30 (and '<pad>' = 31 if asked)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}, "<unk>": 30}
    if pad:
        vocab["<pad>"] = 31
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>" if pad else None)


def reward_fn_keywords(tokenizer, rows: dict, prompt_column: str, responses) -> dict:
    """The data keywords a reward function is called with (TRL's: ppo_harness/reward_calls.py's
    `reward_components`), recorded by a function that takes them all."""
    from types import SimpleNamespace

    from ppo_harness.keywords import TRAINER_KEYWORDS
    from ppo_harness.reward_calls import reward_components

    seen = {}

    def record(**kwargs):
        seen.update({k: v for k, v in kwargs.items() if k not in TRAINER_KEYWORDS})
        return [0.0] * len(kwargs["completions"])

    rewards = SimpleNamespace(names=["record"], model_paths=[], fn_specs=["record"], fns=[record],
                              policy_tokenizer=tokenizer, prompt_column=prompt_column, chat=False, max_steps=1,
                              updates_per_epoch=1, stop_unjudged=False)
    reward_components(rewards, rows, responses, 0, {}, [True] * len(responses))
    return seen


def build_models(root: Path, arch: str = "gpt_neox", pad: bool = False) -> dict:
    """Write a tiny causal LM (the SFT policy) and a tiny sequence classifier (the reward model) under root.

    Without a pad token, ppo.py adds [PAD] as id 31, one past the 31-token model vocabulary (as for SmolLM2); with
    one, the vocabulary is 32 and the pad id 31 lies inside it."""
    vocab_size = 32 if pad else 31
    import torch
    from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification, LlamaConfig,
                              LlamaForCausalLM, LlamaForSequenceClassification)

    torch.manual_seed(0)
    tok = make_tokenizer(pad)
    if arch == "gpt_neox":
        cfg = GPTNeoXConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=128, eos_token_id=0,
                            pad_token_id=tok.pad_token_id, hidden_dropout=0.1, attention_dropout=0.1)
        lm, cls = GPTNeoXForCausalLM, GPTNeoXForSequenceClassification
    else:
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128, eos_token_id=0,
                          pad_token_id=tok.pad_token_id, tie_word_embeddings=True, attention_dropout=0.1)
        lm, cls = LlamaForCausalLM, LlamaForSequenceClassification
    paths = {"sft": root / f"{arch}_sft", "rm": root / f"{arch}_rm"}
    lm(cfg).save_pretrained(paths["sft"])
    tok.save_pretrained(paths["sft"])
    cfg.num_labels = 1
    cls(cfg).save_pretrained(paths["rm"])
    tok.save_pretrained(paths["rm"])
    return paths


def write_prompts(path: Path, n: int = 64, column: str = "prompt") -> Path:
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({column: " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))}) + "\n")
    return path


def write_config_dataset(root: Path) -> Path:
    """A local dataset directory with two named configurations (`first`: 4 rows, `second`: 40 rows)."""
    root.mkdir()
    write_prompts(root / "first.jsonl", 4)
    write_prompts(root / "second.jsonl", 40)
    (root / "README.md").write_text("---\nconfigs:\n- config_name: first\n  data_files: first.jsonl\n"
                                    "- config_name: second\n  data_files: second.jsonl\n---\n")
    return root


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {**build_models(root), "prompts": write_prompts(root / "prompts.jsonl"), "root": root}


TINY = ["--total-episodes", "32", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
        "--num-mini-batches", "2", "--num-ppo-epochs", "2", "--local-rollout-forward-batch-size", "8",
        "--response-length", "8", "--eval-samples", "4", "--eval-every", "0", "--learning-rate", "1e-3",
        "--num-trainable-layers", "None",  # train every block of the 2-block test models
        "--no-shared-value-head", "--kl-coef", "0.05"]  # a value model and TRL's beta (the default run: shared head, 0.1)


REWARD_FN = "tests/rewards.py:target_word_fraction"  # the learnable toy reward of tests/rewards.py


def tiny_args(assets, *extra, reward_fn=REWARD_FN):
    """Flags for a short ppo.py run on the tiny assets (held-out samples before training and after the last update)."""
    return ["--sft-model-path", str(assets["sft"]), "--reward-fn", reward_fn, "--dataset-name", str(assets["prompts"]),
            "--dataset-train-split", "train", *TINY, *extra]


def without_wall_clock(rows):
    """Metrics rows without the wall-clock entries (eps, time/*), which differ between identical runs."""
    return [{k: v for k, v in r.items() if k != "eps" and not k.startswith("time/")} for r in rows]


def assert_same_run(rows, reference, rel=1e-5):
    """The same metrics, update by update, up to float rounding (DeepSpeed reduces gradients in its own order)."""
    import pytest

    assert len(rows) == len(reference)
    for row, ref in zip(without_wall_clock(rows), without_wall_clock(reference)):
        assert row.keys() == ref.keys()
        for k in ref:
            assert row[k] == pytest.approx(ref[k], rel=rel, abs=1e-6), (k, row[k], ref[k])


def resumed_after_update_1(args: list[str], full: Path, resumed: Path, script: str = "ppo.py"):
    """A 3-update run in `full`, then its folder as a run killed after update 1 would have left it (later checkpoints
    and log rows gone) resumed from checkpoint 1 in `resumed`: (the uninterrupted rows, the resumed process, its
    rows)."""
    _, uninterrupted = run_ppo(args, full, script=script)
    copy_cut_after(full, resumed, 1)
    proc, rows = run_ppo(args + ["--resume", str(resumed / "checkpoints" / "update-000001"),
                                 "--output-dir", str(resumed)], resumed, script=script)
    return uninterrupted, proc, rows


def copy_cut_after(full: Path, copy: Path, update: int) -> None:
    """`full`, a finished run's folder, copied to `copy` as a run killed after `update` would have left it: the later
    checkpoints and log rows gone."""
    import json
    import shutil

    shutil.copytree(full, copy)
    for checkpoint in (copy / "checkpoints").glob("update-*"):
        if int(checkpoint.name.split("-")[1]) > update:
            shutil.rmtree(checkpoint)
    for log in ("metrics.jsonl", "samples.jsonl"):
        lines = (copy / log).read_text().splitlines()
        (copy / log).write_text("".join(line + "\n" for line in lines if json.loads(line)["update"] <= update))


def run_ppo(args: list[str], output_dir: Path, script: str = "ppo.py", check: bool = True, timeout: int = 300):
    """Run `python ppo.py ...` in a subprocess; return (completed process, the metrics rows of its updates: the
    held-out evaluation before training, row 0 of metrics.jsonl, is left out)."""
    # one thread: faster for the tiny models, and a busy machine does not stall a run's thread pool
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = forked_run([str(ROOT / script), "--output-dir", str(output_dir), *args], [env], timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"ppo.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    metrics_path = output_dir / "metrics.jsonl"
    return proc, update_rows(metrics_path)


_SERVER = None


def forked_run(argv: list[str], envs: list[dict], timeout: int) -> subprocess.CompletedProcess:
    """`python *argv` in ROOT, once per environment in `envs` (the processes of one launch, together), as children
    of tests/fork_server.py (started once per pytest process): the same output (the processes' in rank order) and
    exit code (the first failure's), without importing torch and transformers again (about 9 of a tiny run's 12
    seconds on 2 cores)."""
    global _SERVER
    if _SERVER is None or _SERVER.poll() is not None:
        # unbuffered bytes: a line read takes nothing beyond its newline, so select() sees the next one
        _SERVER = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fork_server.py")], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, bufsize=0, cwd=ROOT, env=envs[0])
    with tempfile.TemporaryDirectory(prefix="forked_run_") as tmp:
        outputs = [(f"{tmp}/out{rank}", f"{tmp}/err{rank}") for rank in range(len(envs))]
        request = dict(script=argv[0], args=argv[1:], cwd=str(ROOT), processes=[
            dict(env=env, stdout=out, stderr=err) for env, (out, err) in zip(envs, outputs)])
        _SERVER.stdin.write(json.dumps(request).encode() + b"\n")
        pids = json.loads(_SERVER.stdout.readline())["pids"]
        ready, _, _ = select.select([_SERVER.stdout], [], [], timeout)
        if not ready:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            _SERVER.stdout.readline()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        codes = json.loads(_SERVER.stdout.readline())["returncodes"]
        stdout = "".join(Path(out).read_text() for out, _ in outputs)
        stderr = "".join(Path(err).read_text() for _, err in outputs)
        return subprocess.CompletedProcess([sys.executable, *argv], next((c for c in codes if c), 0), stdout, stderr)


def launch_environments(cmd: list[str], env: dict, num_processes: int) -> tuple[list[str], list[dict]]:
    """What `accelerate launch` (cmd: its command line) would start on this one machine: the script's argv and each
    process's environment, as accelerate computes it for torchrun, with torchrun's own variables (the rank 0 process
    holds the rendezvous store, as without torchrun's agent)."""
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    with mock.patch.dict(os.environ, env, clear=True):
        args, defaults, mp_from_config_flag = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
        if args.use_deepspeed:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config_flag)
            current = prepare_deepspeed_cmd_env(args)[1]
        else:
            current = prepare_multi_gpu_env(args)
    port = str(args.main_process_port)
    envs = [{**current, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_processes),
             "LOCAL_WORLD_SIZE": str(num_processes), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
             "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(num_processes), "ROLE_NAME": "default",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0",
             "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}
            for rank in range(num_processes)]
    return [args.training_script, *args.training_script_args], envs


def update_rows(metrics_path: Path) -> list[dict]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    return [row for row in rows if row["update"] > 0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(args, output_dir, script, config, launch_flags, num_processes, machine=None):
    """The `accelerate launch` command and environment of `launch`; `machine` = (rank, port) for one of two machines."""
    config = ROOT / "accelerate_configs" / config if "/" not in str(config) else Path(config)
    deepspeed = config.name.startswith("deepspeed")
    machines = ["--num_machines", "2", "--machine_rank", str(machine[0]), "--main_process_ip", "127.0.0.1"] if machine \
        else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), *machines,
           "--num_processes", str(num_processes), "--main_process_port", str(machine[1] if machine else free_port()),
           *(launch_flags or (["--mixed_precision", "no"] if deepspeed else [])),
           *([str(ROOT / "tests" / "deepspeed_on_cpu.py")] if deepspeed else []),
           str(ROOT / script), *args, "--output-dir", str(output_dir)]
    # DeepSpeed's every collective warns that torch renamed it: silenced, so a failure's tail shows its traceback
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    if not deepspeed:
        env["ACCELERATE_USE_CPU"] = "true"
    return cmd, env


def launch(args, output_dir, script="ppo.py", config="multi_cpu.yaml", launch_flags=(), num_processes=2, check=True):
    """`accelerate launch --config_file <config> <script>` on CPU processes; returns (completed process, metrics rows).
    `config` is a file of accelerate_configs/ or a path. multi_cpu.yaml runs as its comment says; a DeepSpeed config
    runs through tests/deepspeed_on_cpu.py, in fp32 unless `launch_flags` say otherwise."""
    cmd, env = launch_command(args, output_dir, script, config, launch_flags, num_processes)
    proc = forked_run(*launch_environments(cmd, env, num_processes), timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = output_dir / "metrics.jsonl"
    return proc, update_rows(metrics)


def launch_machines(args, output_dir, script="ppo.py", config="multi_cpu.yaml", num_processes=(2, 2),
                    extra=((), ()), cwd=ROOT, check=True):
    """Two machines on this host, sharing its disk as a cluster's nodes do: two `accelerate launch` commands started
    together with --num_machines 2, --machine_rank 0 and 1 and one rendezvous at 127.0.0.1. `num_processes` is each
    launcher's total over both machines, `extra` each machine's extra script flags; returns (both completed processes,
    metrics rows)."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        cmd, env = launch_command([*args, *extra[rank]], output_dir, script, config, (), num_processes[rank],
                                  machine=(rank, port))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                      env=env))
    done = [subprocess.CompletedProcess(p.args, None, *p.communicate(timeout=600)) for p in procs]
    for proc, p in zip(done, procs):
        proc.returncode = p.returncode
        if check:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return done, update_rows(output_dir / "metrics.jsonl")
