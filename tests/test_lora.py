"""Training in the memory of one model: LoRA through peft (the adapter-free base as reference), a value head on the
policy's trunk (--shared-value-head), and gradient checkpointing that is in effect in the training forward."""
import json
import re

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import ppo
from ppo_harness.forwards import adapter_free_trunk, frozen_trunk
from ppo_harness.saved_models import VALUE_HEAD_FILE, load_value_head
from conftest import REWARD_FN, build_models, run_ppo, tiny_args, without_wall_clock

PAD = 40  # outside the tiny vocabulary, like the [PAD] ppo.py adds
QR = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16, 17]]  # query (2 tokens) + response, left-padded


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("llama"), arch="llama")


def logprobs(model, qr, context_length=2):
    logits = ppo.scale_logits(ppo.policy_logits(model, qr, PAD, context_length)[0], 1.0, PAD)
    return ppo.logprobs_from_logits(logits, qr[:, context_length:].masked_fill(qr[:, context_length:] == PAD, 0))


def random_adapter(seed: int, **kwargs) -> LoraConfig:
    torch.manual_seed(seed)
    return LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **{"target_modules": ["q_proj", "v_proj"], **kwargs})


# ---------------------------------------------------------------------------------------------------------------
# the reference is the policy with its adapter off, or with the named reference adapter on
# ---------------------------------------------------------------------------------------------------------------
def test_adapter_disabled_gives_the_base_models_logprobs(llama):
    base = AutoModelForCausalLM.from_pretrained(llama["sft"]).eval()
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]), random_adapter(0)).eval()
    qr = ppo.left_pad(QR, PAD)
    with torch.no_grad():
        expected, adapted = logprobs(base, qr), logprobs(policy, qr)
        with ppo.reference_adapter(policy, None, "default"):
            reference = logprobs(policy, qr)
        after = logprobs(policy, qr)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-6)
    assert (adapted - expected).abs().max() > 1e-3  # the adapter does change the policy ...
    torch.testing.assert_close(after, adapted, rtol=0, atol=0)  # ... and is on again after the reference forward


def test_named_reference_adapter_is_active_inside_and_frozen(llama):
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]), random_adapter(0)).eval()
    policy.add_adapter("ref", random_adapter(1))
    only_ref = get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]), random_adapter(1)).eval()
    policy.set_adapter("default")
    qr = ppo.left_pad(QR, PAD)
    with torch.no_grad():
        adapted = logprobs(policy, qr)
        with ppo.reference_adapter(policy, "ref", "default"):
            reference = logprobs(policy, qr)
        after = logprobs(policy, qr)
    torch.testing.assert_close(reference, logprobs(only_ref, qr), rtol=0, atol=1e-6)
    torch.testing.assert_close(after, adapted, rtol=0, atol=0)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)  # the reference adapter never trains


# ---------------------------------------------------------------------------------------------------------------
# gradient checkpointing: blocks are recomputed in the backward pass, losses and gradients are unchanged
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [False, True])
def test_gradient_checkpointing_recomputes_blocks_and_keeps_gradients(llama, split):
    results = {}
    for checkpointing in (False, True):
        policy = AutoModelForCausalLM.from_pretrained(llama["sft"])
        ppo.disable_dropout(policy)
        policy = get_peft_model(policy, random_adapter(0, layers_to_transform=[1]))  # as --num-trainable-layers 1
        head = ppo.new_value_head(32)
        torch.nn.init.normal_(head.weight)
        if checkpointing:
            ppo.enable_gradient_checkpointing(policy)
        model = ppo.PolicyAndValueWrapper(policy, value_head=head).train()  # PPO's training forwards: train mode
        qr = ppo.left_pad(QR, PAD)
        with torch.no_grad():
            trunks = {"policy": (frozen_trunk(policy, qr, PAD, 1, ppo.model_inputs), 1)} if split else {}
        calls = []
        # count runs of the top block's MLP forward itself: module hooks do not fire in the recomputation
        mlp = ppo.transformer_blocks(policy)[1][1].mlp
        mlp.forward = lambda *a, forward=mlp.forward, **k: (calls.append(1), forward(*a, **k))[1]
        ids = qr[:, 2:].masked_fill(qr[:, 2:] == PAD, 0)
        logprobs, _, values = model(qr, PAD, 2, ids, 0.7, trunks)
        loss = logprobs.mean() + values.square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[checkpointing] = len(calls), loss.detach(), grads
    assert results[False][0] == 1 and results[True][0] == 2  # the top block ran again in the backward pass
    torch.testing.assert_close(results[True][1], results[False][1], rtol=0, atol=0)
    assert results[True][2].keys() == results[False][2].keys()
    assert all(".lora_" in n or n.startswith("value_head.") for n in results[False][2])  # adapter and head only
    for name, grad in results[False][2].items():
        torch.testing.assert_close(results[True][2][name], grad, rtol=1e-6, atol=1e-7)


def test_shared_value_head_reads_the_final_hidden_state_before_each_response_token(llama):
    """Values from the policy's final hidden state at the positions the separate value model reads
    (context_length - 1 .. -2), checked against a plain transformers forward one row at a time; the training forward
    gives the same values with the policy's log-probs."""
    policy = AutoModelForCausalLM.from_pretrained(llama["sft"]).eval()
    head = ppo.new_value_head(32)
    torch.nn.init.normal_(head.weight)
    qr = ppo.left_pad(QR, PAD)
    ids = qr[:, 2:].masked_fill(qr[:, 2:] == PAD, 0)
    with torch.no_grad():
        values = ppo.value_forward(policy, qr, PAD, 2, head=head)
        *with_logprobs, values_too = ppo.PolicyAndValueWrapper(policy, value_head=head)(qr, PAD, 2, ids, 0.7)
        torch.testing.assert_close(values_too, values, rtol=0, atol=0)  # one forward: the same values
        for a, b in zip(with_logprobs, ppo.response_logprobs(policy, qr, PAD, 2, ids, 0.7, with_entropy=True)[:2]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # and the policy's own log-probs and entropies
        for row, tokens in enumerate(QR):
            hidden = policy.model(torch.tensor([tokens])).last_hidden_state[0]
            real = len(tokens) - 2  # response tokens of this row; left padding shifts them right
            expected = head(hidden[1:-1]).squeeze(-1)  # the state just before each response token
            torch.testing.assert_close(values[row, -real:], expected[-real:], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# end to end: --use-peft --shared-value-head; adapter and head are the only trained weights; both reload
# ---------------------------------------------------------------------------------------------------------------
ONE_STEP = ["--total-episodes", "48", "--per-device-train-batch-size", "16", "--gradient-accumulation-steps", "1",
            "--num-mini-batches", "1", "--num-ppo-epochs", "1", "--learning-rate", "3e-2"]  # one step per update


@pytest.fixture(scope="module")
def shared_head_run(llama, assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    proc, rows = run_ppo(tiny_args({**assets, "sft": llama["sft"]}, *ONE_STEP, "--use-peft", "--shared-value-head",
                                   "--num-trainable-layers", "1", "--lora-r", "4", "--lora-alpha", "8",
                                   "--lora-target-modules", "v_proj", "o_proj", "--merge-adapter"), out)
    return out, proc, rows


def test_shared_head_run_trains_only_adapter_and_head(shared_head_run, llama):
    out, proc, rows = shared_head_run
    assert len(rows) == 3 and "value model" not in proc.stdout and "reference" not in proc.stdout  # one model
    trained = load_file(out / "checkpoints" / "update-000003" / "model.safetensors")
    initial = AutoModelForCausalLM.from_pretrained(llama["sft"]).state_dict()
    changed = set()
    for key, value in trained.items():
        base_key = key.removeprefix("policy.base_model.model.").replace(".base_layer.", ".")
        if base_key in initial:
            assert torch.equal(value, initial[base_key]), key  # every base weight is untouched
        elif ("lora_B" in key or key.startswith("value_head.")) and value.abs().sum() > 0:  # they start at 0
            changed.add(key)
    # the adapter sits on the top block only (--num-trainable-layers 1), on the chosen modules, and trained
    assert {k.split(".layers.")[1].split(".lora_B")[0] for k in changed if "lora_B" in k} == {
        "1.self_attn.v_proj", "1.self_attn.o_proj"}
    assert {"value_head.weight", "value_head.bias"} <= changed


def test_generation_uses_the_adapter_and_the_reference_does_not(shared_head_run):
    """One optimizer step per update, taken after the ratio is measured: once the adapter has trained, the ratio of
    the training forward (adapter on) to the rollout's log-probs is still 1, so the rollout sampled with the adapter
    on; and the KL to the reference is no longer 0, so the reference ran with it off."""
    _, _, rows = shared_head_run
    assert rows[0]["objective/kl"] == pytest.approx(0, abs=1e-5)  # lora_B = 0: the adapter starts as a no-op
    for row in rows[1:]:
        assert row["val/ratio"] == pytest.approx(1, abs=1e-4)
        assert abs(row["objective/kl"]) > 1e-3
    assert abs(rows[-1]["eval/kl"]) > 1e-3  # the held-out evaluation's reference too


def test_saved_adapter_and_value_head_reload(shared_head_run, llama):
    out, _, _ = shared_head_run
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["layers_to_transform"]) == (4, 8, [1])
    trained = load_file(out / "checkpoints" / "update-000003" / "model.safetensors")
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama["sft"]), out).eval()
    for name, p in policy.named_parameters():  # the adapter as trained
        if "lora_" in name:
            torch.testing.assert_close(p, trained["policy." + name], rtol=0, atol=0)
    head = load_value_head(out / VALUE_HEAD_FILE)
    torch.testing.assert_close(head.weight, trained["value_head.weight"], rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    qr = ppo.left_pad(QR, PAD)
    with torch.no_grad():
        reloaded, from_merged = logprobs(policy, qr), logprobs(merged, qr)
        base = logprobs(AutoModelForCausalLM.from_pretrained(llama["sft"]).eval(), qr)
        values = ppo.value_forward(policy, qr, PAD, 2, head=head)
    torch.testing.assert_close(from_merged, reloaded, rtol=1e-5, atol=1e-5)
    assert (reloaded - base).abs().max() > 1e-4 and values.abs().max() > 0


# ---------------------------------------------------------------------------------------------------------------
# --gradient-checkpointing changes nothing but memory: identical metrics (separate value model, cached trunk)
# ---------------------------------------------------------------------------------------------------------------
def test_gradient_checkpointing_run_matches(assets, tmp_path):
    args = tiny_args(assets, "--use-peft", "--num-trainable-layers", "1", "--lora-dropout", "0.1",
                     "--total-episodes", "16")  # held-out samples after training: eval mode
    _, plain = run_ppo(args, tmp_path / "plain")
    _, checkpointed = run_ppo(args + ["--gradient-checkpointing"], tmp_path / "gc")
    assert without_wall_clock(plain) == without_wall_clock(checkpointed)
    assert json.loads((tmp_path / "gc" / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "gc" / "value_model").num_labels == 1


# ---------------------------------------------------------------------------------------------------------------
# an SFT checkpoint that carries several adapters: train one, the other is the reference
# ---------------------------------------------------------------------------------------------------------------
def test_named_adapters_from_a_peft_checkpoint(llama, assets, tmp_path):
    sft = get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]), random_adapter(0), adapter_name="sft")
    sft.add_adapter("policy", random_adapter(0))  # the same weights: the policy starts at the reference
    sft.save_pretrained(tmp_path / "sft")  # PeftModel layout: one subdirectory per named adapter
    out = tmp_path / "run"
    _, rows = run_ppo(tiny_args({**assets, "sft": tmp_path / "sft"}, *ONE_STEP, "--use-peft", "--model-adapter-name",
                                "policy", "--ref-adapter-name", "sft", "--num-trainable-layers", "None"), out)
    assert rows[0]["objective/kl"] == pytest.approx(0, abs=1e-5)  # reference = the SFT adapter = the start
    assert abs(rows[-1]["objective/kl"]) > 1e-3
    saved = {name: load_file(out / name / "adapter_model.safetensors") for name in ("sft", "policy")}
    given = load_file(tmp_path / "sft" / "sft" / "adapter_model.safetensors")
    assert all(torch.equal(saved["sft"][k], v) for k, v in given.items())  # the reference adapter never trained
    assert any(not torch.equal(saved["policy"][k], v) for k, v in given.items())


@pytest.mark.parametrize("kind", ["lora_on_embeddings", "ia3", "modules_to_save"])
def test_an_adapter_in_the_frozen_trunk_keeps_full_forwards(llama, assets, tmp_path, kind):
    """A checkpoint adapter below the top blocks: the policy's trunk is not the reference's, so it is not shared. The
    first update's KL (before any step) equals the one of a run that has no frozen trunk at all."""
    from peft import IA3Config

    model = AutoModelForCausalLM.from_pretrained(llama["sft"])
    config = {"lora_on_embeddings": random_adapter(0, target_modules=["embed_tokens"]),
              "ia3": IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
              "modules_to_save": random_adapter(0, layers_to_transform=[1], modules_to_save=["embed_tokens"])}[kind]
    peft_model = get_peft_model(model, config)
    torch.manual_seed(0)
    with torch.no_grad():  # adapters that change the model from the start
        for n, p in peft_model.named_parameters():
            if "ia3_l" in n or "modules_to_save" in n:
                p.add_(torch.randn_like(p) * 2)
    assert not adapter_free_trunk(peft_model, 1)
    peft_model.save_pretrained(tmp_path / "sft")
    rows = {layers: run_ppo(tiny_args({**assets, "sft": tmp_path / "sft"}, *ONE_STEP, "--use-peft",
                                      "--num-trainable-layers", layers), tmp_path / layers)[1]
            for layers in ("1", "None")}
    assert abs(rows["None"][0]["objective/kl"]) > 1e-4  # the adapter moved the policy away from the reference
    assert rows["1"][0]["objective/kl"] == pytest.approx(rows["None"][0]["objective/kl"], rel=1e-5)


def test_a_fresh_adapter_on_the_top_blocks_keeps_the_trunk_shared(llama):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]),
                           random_adapter(0, layers_to_transform=[1]))
    assert adapter_free_trunk(model, 1) and not adapter_free_trunk(model, 2)


def test_a_loaded_adapter_trains_without_dropout(llama, assets, tmp_path):
    """A checkpoint adapter saved with lora_dropout: off like every other dropout, so at lr 0 the ratio stays 1."""
    get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]),
                   random_adapter(0, lora_dropout=0.5)).save_pretrained(tmp_path / "sft")
    _, rows = run_ppo(tiny_args({**assets, "sft": tmp_path / "sft"}, *ONE_STEP, "--use-peft", "--learning-rate", "0"),
                      tmp_path / "run")
    assert all(r["val/ratio"] == pytest.approx(1, abs=1e-6) and r["policy/approxkl_avg"] < 1e-10 for r in rows)


# ---------------------------------------------------------------------------------------------------------------
# bad input is refused before any model is loaded
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(use_peft=True, lora_target_modules=["no_such_proj"]), "not found in the base model"),
    (dict(use_peft=True, ref_adapter_name="sft"), "carries no such adapter"),
    (dict(shared_value_head=True, value_model_path="RM"), "drop --value-model-path"),
    (dict(merge_adapter=True), "--merge-adapter needs --use-peft"),
    (dict(model_adapter_name="a"), "--model-adapter-name needs --use-peft"),
    (dict(use_peft=True, lora_r=0), "--lora-r 0 is out of range"),
    (dict(use_peft=True, ref_adapter_name="default"), "cannot be the trained adapter"),
])
def test_bad_memory_flags_are_refused(assets, tmp_path, monkeypatch, overrides, message):
    loaded = []
    monkeypatch.setattr(ppo.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    fields = dict(sft_model_path=str(assets["sft"]), reward_fn=REWARD_FN, dataset_name=str(assets["prompts"]),
                  dataset_train_split="train", output_dir=str(tmp_path / "run"), total_episodes=16,
                  per_device_train_batch_size=4, num_trainable_layers=None)
    fields.update({k: str(assets["rm"]) if v == "RM" else v for k, v in overrides.items()})
    with pytest.raises(ValueError, match=re.escape(message)):
        ppo.main(ppo.Args(**fields))
    assert not loaded and not (tmp_path / "run").exists()


def test_a_prompt_learning_checkpoint_is_refused(llama, assets, tmp_path):
    """Prefix tuning changes what every block sees: no frozen trunk, no adapter-free reference. Refused by name."""
    from peft import PrefixTuningConfig

    get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]), PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=2)).save_pretrained(tmp_path / "sft")
    with pytest.raises(ValueError, match="adapter 'default' is PREFIX_TUNING"):
        ppo.main(ppo.Args(sft_model_path=str(tmp_path / "sft"), reward_fn=REWARD_FN, use_peft=True,
                          dataset_name=str(assets["prompts"]), dataset_train_split="train",
                          output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_a_peft_checkpoint_needs_use_peft(llama, assets, tmp_path):
    get_peft_model(AutoModelForCausalLM.from_pretrained(llama["sft"]), random_adapter(0)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="add --use-peft"):
        ppo.main(ppo.Args(sft_model_path=str(tmp_path), reward_fn=REWARD_FN, dataset_name=str(assets["prompts"]),
                          dataset_train_split="train", output_dir=str(tmp_path / "run")))


def test_full_kl_with_the_shared_head_is_zero_before_training(assets, tmp_path):
    """`full` takes the policy's logits from the forward that gives the shared head's values; the reference (adapter
    off) equals the policy while lora_B is 0, so the exact KL is 0."""
    _, rows = run_ppo(tiny_args(assets, "--use-peft", "--shared-value-head", "--kl-estimator", "full",
                                "--total-episodes", "16"), tmp_path / "run")
    assert abs(rows[0]["objective/kl"]) < 1e-5
