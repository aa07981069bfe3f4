"""Two processes on CPU (gloo) through `accelerate launch`: data parallelism, batch arithmetic, exact resume,
DeepSpeed ZeRO-2/3 with the shipped configs, and two machines on this host sharing its disk."""
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ROOT, TINY, assert_same_run, launch, launch_machines, run_ppo, tiny_args, without_wall_clock

REPLICAS_AGREE = "tests/replicas_agree.py"  # ppo.py, checking that the processes agree at every checkpoint


@pytest.fixture(scope="module")
def two_process_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    args = tiny_args(assets, "--total-episodes", "128", "--save-every", "2", "--kl-target", "0.5", "--kl-horizon",
                     "1000", "--use-score-scaling")
    return args, out, *launch(args, out, script=REPLICAS_AGREE)


def test_batch_arithmetic_scales_with_world_size(two_process_run):
    _, _, proc, rows = two_process_run
    # 4 per device x 2 accumulation x 2 minibatches x 2 processes = 32 responses per update; 128 episodes -> 4 updates
    assert "processes 2; per update 32 responses (16 per process)" in proc.stdout
    assert [r["episode"] for r in rows] == [32, 64, 96, 128]
    assert all(r["policy/optimizer_steps"] == 4 for r in rows)  # per process: 2 epochs x 2 minibatches
    assert all(0 <= r["val/num_eos_tokens"] <= 32 for r in rows)  # counted over both processes' responses


def test_processes_hold_the_same_weights_and_controller_state(two_process_run):
    """tests/replicas_agree.py compares both processes' weight checksums, KL coefficient and score moments at every
    checkpoint (updates 2 and 4) and stops the run if they differ."""
    _, _, proc, _ = two_process_run
    assert "replicas agree after update 2" in proc.stdout and "replicas agree after update 4" in proc.stdout


def test_every_process_checkpoints_its_rng(two_process_run):
    _, out, _, _ = two_process_run
    names = {p.name for p in (out / "checkpoints" / "update-000002").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= names


def test_two_process_resume_is_exact(two_process_run, tmp_path):
    """Both processes' RNG streams, the optimizer, the shared data order, the adaptive KL coefficient and the running
    score moments continue exactly."""
    args, out, _, rows = two_process_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "update-000004")
    _, again = launch(args + ["--resume", str(resumed / "checkpoints" / "update-000002")], resumed)
    assert without_wall_clock(rows) == without_wall_clock(again)


@pytest.fixture(scope="module")
def lora_ddp_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_ddp") / "run"
    args = tiny_args(assets, "--use-peft", "--shared-value-head", "--num-trainable-layers", "1", "--merge-adapter")
    return args, out, *launch(args, out, script=REPLICAS_AGREE)


def lora_trained(assets, run_dir):
    """The saved adapter on a fresh copy of the SFT model, merged, and the saved value head; checks that the saved
    merged model (--merge-adapter) is that same model."""
    from peft import PeftModel
    from safetensors.torch import load_file

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["sft"]), run_dir).merge_and_unload()
    saved = AutoModelForCausalLM.from_pretrained(run_dir / "merged").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in merged.state_dict().items())
    return merged.state_dict(), load_file(run_dir / "value_head.safetensors")


def test_two_process_lora_run_saves_one_adapter(assets, lora_ddp_run):
    """LoRA and the shared value head under data parallelism: the processes train one adapter (the same weights on
    both: tests/replicas_agree.py), and only the main process saves it."""
    _, out, proc, rows = lora_ddp_run
    assert len(rows) == 1 and proc.stdout.count("saved the policy adapter") == 1
    assert "replicas agree after update 1" in proc.stdout
    weights, _ = lora_trained(assets, out)
    base = AutoModelForCausalLM.from_pretrained(assets["sft"]).state_dict()
    assert any(not torch.equal(weights[k], base[k]) for k in base)  # the adapter learnt something


@pytest.mark.parametrize("config, sampler", [("deepspeed_zero2.yaml", "dynamic"),
                                             ("deepspeed_zero3.yaml", "static refused under ZeRO-3")])
def test_lora_under_deepspeed_reproduces_data_parallel_run(assets, lora_ddp_run, tmp_path, config, sampler):
    """The same LoRA + shared-head run under ZeRO-2 and ZeRO-3: the same metrics, and one adapter, merged model and
    value head saved (under ZeRO-3 gathered from the shards) that equal the data-parallel run's. ZeRO-3 refuses the
    static-cache sampler by name (on one process it is checked whole in test_ppo.py; uncompiled on the CPU, it cost this
    ZeRO-2 run 40 s more)."""
    args, out, _, reference = lora_ddp_run
    proc, rows = launch([*args, "--sampler", sampler.split()[0]], tmp_path / "run", config=config)
    assert sampler == "dynamic" or sampler in " ".join(proc.stdout.split())
    assert_same_run(rows, reference, rel=1e-4)
    assert proc.stdout.count("saved the policy adapter") == 1
    (ours, our_head), (theirs, their_head) = lora_trained(assets, tmp_path / "run"), lora_trained(assets, out)
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-5) for k in theirs)
    assert all(torch.allclose(our_head[k], their_head[k], atol=1e-5) for k in their_head)


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2 and ZeRO-3 (the shipped configs, 2 CPU processes): the same run as plain data parallelism
# ---------------------------------------------------------------------------------------------------------------
def policy_weights(run_dir):
    model = AutoModelForCausalLM.from_pretrained(run_dir)
    return {k: v.float() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ddp_reference(assets, tmp_path_factory):
    """A reward model (ZeRO-3 shards it as a frozen engine), a value model from the SFT policy with a fresh head (under
    ZeRO-3 its sharded head is zeroed in place), one frozen bottom block (whose cache policy and value share, except
    under ZeRO-3), a checkpoint after each update, and a sample table, under plain data parallelism."""
    out = tmp_path_factory.mktemp("ddp_rm") / "run"
    args = ["--sft-model-path", str(assets["sft"]), "--reward-model-path", str(assets["rm"]), "--value-model-path",
            str(assets["sft"]), "--dataset-name",
            str(assets["prompts"]), "--dataset-train-split", "train", *TINY, "--total-episodes", "64",
            "--num-trainable-layers", "1", "--save-every", "1"]
    return args, out, launch(args, out)[1]


@pytest.mark.parametrize("config, flags", [("deepspeed_zero2.yaml", []),
                                           ("deepspeed_zero3.yaml", ["--ds3-gather-for-generation"])])
def test_deepspeed_reproduces_data_parallel_run(ddp_reference, tmp_path, config, flags):
    """ZeRO-2 shards gradients and optimizer state; ZeRO-3 the weights too (policy and value trained, reference and
    reward model as inference engines), and the policy is gathered for generation. The updates, metrics and saved
    (consolidated) weights are those of the unsharded run."""
    args, ddp_out, reference = ddp_reference
    proc, rows = launch([*args, *flags], tmp_path / "run", config=config)
    assert_same_run(rows, reference)
    assert "pytorch_model" in {p.name for p in (tmp_path / "run" / "checkpoints" / "update-000001").iterdir()}
    ours, theirs = policy_weights(tmp_path / "run"), policy_weights(ddp_out)
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-5) for k in theirs)


def test_zero2_value_warmup_reproduces_data_parallel_run(ddp_reference, tmp_path):
    """DeepSpeed's engine steps inside backward, so during --value-warmup-updates the policy's AdamW counts steps on
    zero gradients; its state is dropped when the warm-up ends, so update 2 is the unsharded run's update 2."""
    args, _, _ = ddp_reference
    warmup = [*args, "--value-warmup-updates", "1"]
    _, reference = launch(warmup, tmp_path / "ddp")
    _, rows = launch(warmup, tmp_path / "zero2", config="deepspeed_zero2.yaml")
    assert rows[0]["lr"] == 0 and rows[1]["lr"] > 0
    assert_same_run(rows, reference)


def test_zero3_resume_with_sharded_generation(ddp_reference, tmp_path):
    """ZeRO-3 from the update-1 checkpoint of a ZeRO-3 run, sampling from the sharded weights (processes step together
    until every process's responses are done): update 2 is the unsharded run's update 2."""
    args, _, reference = ddp_reference
    first = tmp_path / "first"
    launch(args, first, config="deepspeed_zero3.yaml")
    shutil.rmtree(first / "checkpoints" / "update-000002")
    resume = ["--resume", str(first / "checkpoints" / "update-000001"), "--no-ds3-gather-for-generation"]
    _, rows = launch([*args, *resume], first, config="deepspeed_zero3.yaml")
    assert_same_run(rows, reference)


def test_zero2_bf16_scores_reference_in_policy_precision(ddp_reference, tmp_path):
    """DeepSpeed keeps the trained models in bf16; the reference and reward model are cast to match, so the KL of the
    first rollout (no step taken yet) is 0 up to bf16 rounding, as in fp32."""
    args, _, _ = ddp_reference
    _, rows = launch(args, tmp_path / "run", config="deepspeed_zero2.yaml", launch_flags=["--mixed_precision", "bf16"])
    assert abs(rows[0]["objective/kl"]) < 1e-3
    assert rows and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))


def test_deepspeed_config_whose_accumulation_disagrees_is_refused(assets, tmp_path):
    """accelerate would quietly take a DeepSpeed config's gradient_accumulation_steps over the flag's, and the optimizer
    would no longer step once per minibatch: refused before any model loads."""
    config = tmp_path / "deepspeed_ga4.yaml"
    config.write_text((ROOT / "accelerate_configs" / "deepspeed_zero2.yaml").read_text().replace(
        "  zero_stage: 2", "  zero_stage: 2\n  gradient_accumulation_steps: 4"))
    proc, _ = launch(tiny_args(assets), tmp_path / "run", config=config, num_processes=1, check=False)
    assert proc.returncode != 0
    assert "the launcher or DeepSpeed config says 4, --gradient-accumulation-steps says 2" in proc.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# Two machines on this host (--num_machines 2, one process each, one shared disk): the run of one machine with two
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_machine_run(two_process_run, tmp_path_factory):
    args, _, _, _ = two_process_run
    out = tmp_path_factory.mktemp("machines") / "run"
    return out, *launch_machines(args, out, script=REPLICAS_AGREE)


def test_two_machines_reproduce_one_machine_with_two_processes(two_process_run, two_machine_run):
    """The same metrics; the processes agree at each checkpoint; metrics.jsonl, each checkpoint and the banner are
    written once for the run, not once per machine."""
    _, _, one_machine, reference = two_process_run
    out, procs, rows = two_machine_run
    assert_same_run(rows, reference)
    stdout = "".join(p.stdout for p in procs)
    for line in ("processes 2; per update 32 responses", "replicas agree after update 2",
                 "replicas agree after update 4", "saved the policy to"):
        assert stdout.count(line) == one_machine.stdout.count(line) == 1, line
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5  # held-out row + 4 updates
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "update-000002", "update-000004"]
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in (checkpoints / "update-000004").iterdir()}


def test_two_machines_resume_exactly(two_process_run, two_machine_run, tmp_path):
    args, _, _, _ = two_process_run
    out, _, rows = two_machine_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "update-000004")
    _, again = launch_machines([*args, "--resume", str(resumed / "checkpoints" / "update-000002")], resumed)
    assert without_wall_clock(again) == without_wall_clock(rows)


def test_resume_with_another_number_of_processes_is_refused(two_machine_run, two_process_run, tmp_path):
    """Each process's data shard and random stream belong to its rank, and DeepSpeed's shards to the world size:
    refused before any model loads."""
    args, _, _, _ = two_process_run
    out, _, _ = two_machine_run
    proc, _ = run_ppo([*args, "--resume", str(out / "checkpoints" / "update-000002")], tmp_path / "one", check=False)
    assert proc.returncode != 0 and "'num_processes': (2, 1)" in proc.stderr
    assert "number of processes" in proc.stderr and "Loading weights" not in proc.stderr + proc.stdout


def test_two_machine_zero2_reproduces_data_parallel_run(ddp_reference, tmp_path):
    args, _, reference = ddp_reference
    _, rows = launch_machines(args, tmp_path / "run", config="deepspeed_zero2.yaml")
    assert_same_run(rows, reference)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "latest", "update-000001", "update-000002"]


@pytest.mark.parametrize("num_processes, extra, message", [
    ((2, 2), ((), ("--learning-rate", "2e-3")), "processes [1] were launched with other flags than process 0"),
    ((2, 4), ((), ()), "the machines run different numbers of processes ([1, 2])")])
def test_machines_launched_differently_are_refused(assets, tmp_path, num_processes, extra, message):
    """Different flags would train each machine's replicas apart without an error (each steps with its own learning
    rate); different process counts would run a world nobody asked for. Both machines stop, naming the cause."""
    procs, _ = launch_machines(tiny_args(assets), tmp_path / "run", num_processes=num_processes, extra=extra,
                               check=False)
    assert all(p.returncode != 0 and message in p.stderr for p in procs)
    assert not (tmp_path / "run").exists()
