"""Precision where users train: trained weights stay float32 whatever dtype the checkpoint was saved in, and
`accelerate launch --mixed_precision bf16` (CPU autocast here) runs end to end."""
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ppo
from conftest import build_models, launch, run_ppo, tiny_args

ONE_UPDATE = ["--total-episodes", "8", "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "1",
              "--num-mini-batches", "1", "--num-ppo-epochs", "1", "--learning-rate", "3e-6"]


def changed_share(before: dict, after: dict) -> float:
    """The share of the policy's weights (every tensor both hold) that differ after training."""
    changed = total = 0
    for name, weight in before.items():
        changed += (after[name].float() != weight.float()).sum().item()
        total += weight.numel()
    return changed / total


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_bf16_saved_checkpoint_trains_in_float32(assets, tmp_path, arch):
    """transformers 5 loads a checkpoint in its saved dtype by default. At lr 3e-6 an Adam step is far below half a
    bf16 ulp of most weights, so bf16 weights would barely move (3.5% changed here); --dtype float32, the default,
    trains the bf16-saved checkpoint like the float32-saved one."""
    paths = build_models(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(paths["sft"], dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model.to(torch.float32).save_pretrained(tmp_path / "fp32")  # the same (bf16-rounded) values, saved in float32
    shares = {}
    for saved in ("bf16", "fp32"):
        (tmp_path / saved / "tokenizer.json").write_bytes((paths["sft"] / "tokenizer.json").read_bytes())
        (tmp_path / saved / "tokenizer_config.json").write_bytes((paths["sft"] / "tokenizer_config.json").read_bytes())
        proc, rows = run_ppo(tiny_args({**assets, "sft": tmp_path / saved}, *ONE_UPDATE), tmp_path / f"run_{saved}")
        before = load_file(tmp_path / saved / "model.safetensors")
        after = load_file(tmp_path / f"run_{saved}" / "model.safetensors")
        value = load_file(tmp_path / f"run_{saved}" / "value_model" / "model.safetensors")
        assert all(t.dtype == torch.float32 for t in (*after.values(), *value.values()))
        assert "float32" in proc.stdout and "bfloat16" not in proc.stdout  # the banner's dtype column
        shares[saved] = changed_share(before, after)
    assert shares["fp32"] > 0.5
    assert shares["bf16"] == pytest.approx(shares["fp32"], abs=0.01)


def test_dtype_auto_keeps_the_saved_dtype(assets, tmp_path):
    """--dtype auto is transformers' own default, and what the scripts did before: the banner says so."""
    model = AutoModelForCausalLM.from_pretrained(assets["sft"])
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bf16" / name).write_bytes((assets["sft"] / name).read_bytes())
    proc, rows = run_ppo(tiny_args({**assets, "sft": tmp_path / "bf16"}, *ONE_UPDATE, "--dtype", "auto"),
                         tmp_path / "run")
    assert "bfloat16" in proc.stdout
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "run" / "model.safetensors").values())


@pytest.mark.parametrize("extra", [[], ["--use-peft", "--shared-value-head", "--num-trainable-layers", "1"]],
                         ids=["default", "lora_shared_head"])
def test_bf16_autocast_run_on_one_cpu_process(assets, tmp_path, extra):
    """`accelerate launch --mixed_precision bf16` on CPU: forwards under autocast, weights and Adam in float32. Policy
    and reference are the same model, so the first KL is 0 up to bf16 rounding; every metric is finite."""
    proc, rows = launch(tiny_args(assets, *extra), tmp_path / "run", num_processes=1,
                        launch_flags=["--mixed_precision", "bf16"])
    assert rows and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert abs(rows[0]["objective/kl"]) < 1e-3  # bf16 rounding: the rollout's KV-cached forward vs the full one
    saved = load_file(tmp_path / "run" / ("adapter_model.safetensors" if extra else "model.safetensors"))
    value = load_file(tmp_path / "run" / ("value_head.safetensors" if extra else "value_model/model.safetensors"))
    assert all(t.dtype == torch.float32 for t in (*saved.values(), *value.values()))


def test_loha_dropouts_are_off(assets):
    """LoHa and LoKr keep their rank and module dropouts as floats, not nn.Dropout: disable_dropout sets them to 0, so
    two training-mode forwards agree, as for every other module."""
    from peft import LoHaConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(assets["sft"]), LoHaConfig(
        r=4, target_modules=["query_key_value"], rank_dropout=0.5, module_dropout=0.5, init_weights=False))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout at work
    ppo.disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)
