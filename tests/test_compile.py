"""The training step compiled (--compile): the page's own `ppo_loss` (the training forward, the clipped policy and
value losses) traced whole by torch.compile with fullgraph=True, so a graph break fails here, gives the eager step's
loss, statistics and gradients. One configuration goes through inductor, the compiler CUDA runs use (about a minute
on 2 CPU cores); the others through aot_eager, which traces the same graphs, forward and backward, and runs them
without generating kernels (seconds).

Tolerances: float32 losses and statistics to 1e-5 (relative), gradients to 1e-4 of each tensor's largest element
(inductor fuses and reorders reductions); under bf16 autocast 2e-2 and 2e-2."""
import dataclasses
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification)

import ppo
import ppo_tldr
from conftest import assert_same_run, run_ppo, tiny_args
from ppo_harness import speed
from ppo_harness.forwards import frozen_trunk

PAD, CONTEXT, RESPONSE = 31, 5, 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (3 blocks, so that a frozen trunk leaves trained blocks above it) and a classifier of its shape."""
    root = tmp_path_factory.mktemp("compile")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, pad_token_id=PAD,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(root / "sft")
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(root / "value")
    return root


def rollout(seed: int = 0, rows: int = 4) -> ppo.Rollout:
    """A rollout as phases 1-5 leave it: left-padded queries, responses that stop early (right padding), old
    log-probs and values near the model's, whitened advantages."""
    g = torch.Generator().manual_seed(seed)
    queries = torch.randint(1, 30, (rows, CONTEXT), generator=g)
    queries[0, :2] = PAD  # a shorter prompt
    responses = torch.randint(1, 30, (rows, RESPONSE), generator=g)
    responses[1, 3:] = PAD  # a response that ended early
    responses[2, 1:] = PAD
    sequence_lengths = ppo.first_true_indices(responses == PAD) - 1
    positions = torch.arange(RESPONSE)[None]  # main's masks
    padding_mask, padding_mask_p1 = positions > sequence_lengths[:, None], positions > sequence_lengths[:, None] + 1
    noise = lambda scale: scale * torch.randn(rows, RESPONSE, generator=g)  # noqa: E731
    zeros = torch.zeros(rows, RESPONSE)
    return ppo.Rollout(
        query_responses=torch.cat((queries, responses), 1), response_ids=responses.masked_fill(responses == PAD, 0),
        trunks={}, responses=responses, sequence_lengths=sequence_lengths, padding_mask=padding_mask,
        padding_mask_p1=padding_mask_p1, logprobs=(noise(0.3) - 3.4).masked_fill(padding_mask, ppo.INVALID_LOGPROB),
        ref_logprobs=zeros, values=noise(0.5).masked_fill(padding_mask_p1, 0), kl=zeros, non_score_reward=zeros,
        rewards=zeros, advantages=noise(1.0).masked_fill(padding_mask, 0), returns=noise(1.0), scores=zeros[:, 0],
        trained_scores=zeros[:, 0], contain_eos_token=None, score_components={},
        dropped=torch.zeros(rows, dtype=torch.bool), positive=torch.zeros(rows, RESPONSE, dtype=torch.bool))


def models(llama, kind: str):
    """(PolicyAndValueWrapper, the frozen trunk's size or None) for a configuration of the page's training forward."""
    policy = AutoModelForCausalLM.from_pretrained(llama / "sft")
    ppo.disable_dropout(policy)
    num_frozen = None
    if kind in ("lora_head_checkpointing_trunk", "bf16_head_trunk"):
        num_frozen = 2
        ppo.freeze_bottom_layers(policy, 1)
    if kind == "lora_head_checkpointing_trunk":
        policy = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   layers_to_transform=[2], init_lora_weights=False))
        ppo.enable_gradient_checkpointing(policy)
    if kind in ("value_model", "tldr"):
        value = AutoModelForSequenceClassification.from_pretrained(llama / "value", num_labels=1)
        ppo.disable_dropout(value)
        wrapper = (ppo_tldr if kind == "tldr" else ppo).PolicyAndValueWrapper(policy, value)
    else:
        head = ppo.new_value_head(32)
        torch.nn.init.normal_(head.weight, std=0.1)
        wrapper = ppo.PolicyAndValueWrapper(policy, value_head=head)
    speed.ready_to_compile(wrapper)  # as the scripts do before compiling: transformers' output hooks installed
    return wrapper.train(), num_frozen


def step(loss_fn, model, r, args, autocast: bool):
    """(loss, stats, the trained parameters' gradients) of one micro-batch, rows 0-3 in a shuffled order."""
    for p in model.parameters():
        p.grad = None
    rows = torch.tensor([2, 0, 3, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, stats = loss_fn(model, rows, r, args, PAD)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), {k: v.detach() for k, v in stats.items()}, grads


@pytest.mark.parametrize("kind, backend", [
    ("lora_head_checkpointing_trunk", "inductor"),  # LoRA, the shared value head, gradient checkpointing, a trunk
    ("value_model", "aot_eager"),  # a separate value model, every block trained
    ("bf16_head_trunk", "aot_eager"),  # bf16 autocast, the shared value head from the trunk
    ("tldr", "aot_eager"),  # ppo_tldr.py's step: a value model with its score bias
])
def test_the_compiled_training_step_gives_the_eager_steps_loss_and_gradients(llama, kind, backend):
    torch._dynamo.reset()
    model, num_frozen = models(llama, kind)
    script = ppo_tldr if kind == "tldr" else ppo
    args = dataclasses.replace(script.Args(), temperature=0.7, cliprange=0.2, cliprange_value=0.2, vf_coef=0.5,
                               **({} if kind == "tldr" else {"ent_coef": 0.01}))
    r = rollout()
    if kind == "tldr":
        r = ppo_tldr.Rollout(**{k: v for k, v in r._asdict().items() if k in ppo_tldr.Rollout._fields})
    if num_frozen is not None:
        with torch.no_grad():
            trunk = frozen_trunk(model.policy, r.query_responses, PAD, num_frozen, ppo.model_inputs)
        r = r._replace(trunks={"policy": (trunk, num_frozen)})
    autocast = kind.startswith("bf16")
    eager = step(script.ppo_loss, model, r, args, autocast)
    compiled = step(torch.compile(script.ppo_loss, fullgraph=True, dynamic=False, backend=backend), model, r, args,
                    autocast)
    rtol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(compiled[0], eager[0], rtol=rtol, atol=rtol * 1e-2)
    assert compiled[1].keys() == eager[1].keys()
    for key in eager[1]:
        torch.testing.assert_close(compiled[1][key], eager[1][key], rtol=rtol, atol=rtol * 1e-2, msg=key)
    assert compiled[2].keys() == eager[2].keys() and eager[2]
    for name, grad in eager[2].items():
        worst = (compiled[2][name] - grad).abs().max().item()
        assert worst <= (2e-2 if autocast else 1e-4) * grad.abs().max().item() + 1e-7, (name, worst)
    if num_frozen is not None:  # the trunk's blocks were not run: only the blocks above it carry gradients
        assert not any(".layers.0." in n or ".layers.1." in n for n in eager[2])


def eos_prone(sft: Path, out: Path) -> Path:
    """A copy of the tiny SFT model that ends a response (eos, id 0) with probability near 0.4 a token: every response
    of a batch ends before --response-length, so sampling stops early and the eager rollout is narrower."""
    import shutil

    shutil.copytree(sft, out)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        direction = torch.nn.functional.normalize(torch.randn(model.config.hidden_size,
                                                              generator=torch.Generator().manual_seed(0)), dim=0)
        model.gpt_neox.final_layer_norm.bias += 3.0 * direction  # every final hidden state along `direction`
        model.get_output_embeddings().weight[0] += direction  # ... raises eos's logit by about 3
    model.save_pretrained(out)
    return out


def test_a_compiled_run_trains_as_the_eager_one(assets, tmp_path):
    """--compile on in a whole run (the CPU's inductor; the sampler left dynamic to keep the test short): every update
    has the run's widest prompt and the full --response-length, so the step compiles once and is never compiled
    again, and the run is the eager one's to float rounding. The responses end early, so the eager rollout is as wide
    as the longest and one column past it: the score lands one past every eos in both (N+ detail 25). --tf32 is a CUDA
    setting: on the CPU it changes nothing."""
    sft = eos_prone(assets["sft"], tmp_path / "sft")
    args = tiny_args(assets, "--num-trainable-layers", "1", "--shared-value-head", "--eval-samples", "0",
                     "--sampler", "dynamic", "--total-episodes", "32", "--response-length", "16",
                     "--sft-model-path", str(sft))
    compiled, compiled_rows = run_ppo([*args, "--compile", "on", "--tf32"], tmp_path / "compiled")
    _, eager_rows = run_ppo([*args, "--compile", "off"], tmp_path / "eager")
    out = " ".join(compiled.stdout.split())
    assert "training step: compiled (torch.compile, fullgraph) (--compile on)" in out
    assert "update 1: torch.compile made 1 graph(s)" in out and "update 2: torch.compile made" not in out
    assert all(r["val/num_eos_tokens"] == 16 for r in eager_rows)  # every response ended: the batch stopped early
    assert_same_run(compiled_rows, eager_rows, rel=1e-4)


DAMAGED_CACHE_STEP = """
import sys
import torch
from ppo_harness.speed import CompiledOrEager

def step(x):
    return torch.sin(x) * 2 + x.cos()

said = []
out = CompiledOrEager(torch.compile(step, fullgraph=True, dynamic=False), step, strict=True, console=said.append)(
    torch.ones(8))
assert torch.allclose(out, step(torch.ones(8)))
print("SAID", *said)
"""


def test_a_damaged_compile_cache_is_named_and_the_step_compiles_without_it(tmp_path):
    """A compile cache whose kernel files no longer load (a torn write; another torch's files) used to stop a compiled
    run with inductor's "Failed to import <cache>/....py UnicodeDecodeError" and no word of the cache. The step is
    compiled again without reading or writing the cache, and the console names the folder and says to delete it;
    under --compile on too (`strict`), since the step itself compiles. A real cache, damaged: two runs of inductor."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "torch_compile"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = subprocess.run([sys.executable, "-c", DAMAGED_CACHE_STEP], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "SAID" in first.stdout and "compile cache" not in first.stdout  # warm now, and nothing to say
    kernels = [p for p in cache.rglob("*.py")]
    assert kernels
    for path in kernels:
        path.write_bytes(b"\xff\xfe\x00 not python")
    second = subprocess.run([sys.executable, "-c", DAMAGED_CACHE_STEP], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"the compile cache {cache} holds a file that does not load" in second.stdout
    assert "delete the folder" in second.stdout
