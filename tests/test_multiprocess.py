"""Two processes on CPU (gloo) through `accelerate launch`: data parallelism, batch arithmetic, exact resume."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import REWARD_FN, ROOT, TINY, without_wall_clock


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, output_dir, num_processes=2):
    """`accelerate launch --config_file accelerate_configs/multi_cpu.yaml`, as the config file's comment says."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "multi_cpu.yaml"), "--num_processes", str(num_processes),
           "--main_process_port", str(free_port()), str(ROOT / "ppo.py"), *args, "--output-dir", str(output_dir)]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


@pytest.fixture(scope="module")
def two_process_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    args = ["--sft-model-path", str(assets["sft"]), "--reward-fn", REWARD_FN, "--dataset-name", str(assets["prompts"]),
            "--dataset-train-split", "train", *TINY, "--total-episodes", "128", "--save-every", "2",
            "--num-sample-generations", "0", "--kl-target", "0.5", "--kl-horizon", "1000", "--use-score-scaling"]
    return args, out, *launch(args, out)


def test_batch_arithmetic_scales_with_world_size(two_process_run):
    _, _, proc, rows = two_process_run
    # 4 per device x 2 accumulation x 2 minibatches x 2 processes = 32 responses per update; 128 episodes -> 4 updates
    assert "processes 2; per update 32 responses (16 per process)" in proc.stdout
    assert [r["episode"] for r in rows] == [32, 64, 96, 128]
    assert all(r["policy/optimizer_steps"] == 4 for r in rows)  # per process: 2 epochs x 2 minibatches
    assert all(0 <= r["val/num_eos_tokens"] <= 32 for r in rows)  # counted over both processes' responses


def test_every_process_checkpoints_its_rng(two_process_run):
    _, out, _, _ = two_process_run
    names = {p.name for p in (out / "checkpoints" / "update-000002").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= names


def test_two_process_resume_is_exact(two_process_run, tmp_path):
    """Both processes' RNG streams, the optimizer, the shared data order, the adaptive KL coefficient and the running
    score moments continue exactly. ppo.py itself checks after every update that both processes hold the same weights,
    coefficient and moments (a run whose processes disagree stops)."""
    args, out, _, rows = two_process_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "update-000004")
    _, again = launch(args + ["--resume", str(resumed / "checkpoints" / "update-000002")], resumed)
    assert without_wall_clock(rows) == without_wall_clock(again)


def test_two_process_lora_run_saves_one_adapter(assets, tmp_path):
    """LoRA and the shared value head under data parallelism: the processes train one adapter (ppo.py checks after
    every update that both hold the same weights), and only the main process saves it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = ["--sft-model-path", str(assets["sft"]), "--reward-fn", REWARD_FN, "--dataset-name", str(assets["prompts"]),
            "--dataset-train-split", "train", *TINY, "--num-sample-generations", "0", "--use-peft",
            "--shared-value-head", "--num-trainable-layers", "1"]
    proc, rows = launch(args, tmp_path / "run")
    assert len(rows) == 1 and proc.stdout.count("saved the policy adapter") == 1
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["sft"]), tmp_path / "run")
    assert (tmp_path / "run" / "value_head.safetensors").is_file()
