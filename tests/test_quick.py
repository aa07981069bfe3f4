"""The quick check after an edit (about two minutes a script on 2 CPU cores): each script, or an edited copy of
it, trains short runs on tiny models. One through the README ledger's hand-written paths (ppo.py: the frozen trunk
run once per update and, asked for, the LM head over vocabulary blocks; ppo_tldr.py: the static-cache sampler,
uncompiled) and one with --no-fast-paths agree update by
update (a copier's edited forward that the trunk no longer matches is refused at start-up, so the two still agree).
A run of five updates,
evaluated after each, resumed from every checkpoint gives the rest of the run again, its final model too (what the
loop keeps across updates is in the checkpoint). At learning rate 0 the policy is the reference, so the ratio
is 1 and the KL 0 (sampling's log-probs are training's), and the tokens `sample_next` draws follow the
distribution training scores (`scale_logits`'): the rollout is on-policy.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_quick.py -q -p no:cacheprovider
    PPO_SCRIPT=my_ppo.py PPO_ARGS="--my-flag 0.3" HF_HUB_OFFLINE=1 python -m pytest tests/test_quick.py -q

A copy lives beside the original, where it finds ppo_harness/; PPO_ARGS, PPO_TLDR_ARGS and PPO_MULTITURN_ARGS add flags
to every run (PPO_TLDR_SCRIPT and PPO_MULTITURN_SCRIPT name the siblings' copies)."""
import importlib.util
import math
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tyro

from conftest import ROOT, assert_same_run, run_ppo, tiny_args
from test_tldr import tiny_args as tldr_args
from test_multiturn import chat  # noqa: F401 (the multi-turn fixture: tiny models with a chat template, rows)
from test_multiturn import tiny_args as multiturn_args
from test_tldr import tldr  # noqa: F401 (the TL;DR fixture: tiny models with a biased reward model, posts)

SCRIPTS = {"ppo": os.environ.get("PPO_SCRIPT", "ppo.py"), "tldr": os.environ.get("PPO_TLDR_SCRIPT", "ppo_tldr.py"),
           "multiturn": os.environ.get("PPO_MULTITURN_SCRIPT", "ppo_multiturn.py")}
EXTRA = {kind: shlex.split(os.environ.get(variable, "")) for kind, variable in
         [("ppo", "PPO_ARGS"), ("tldr", "PPO_TLDR_ARGS"), ("multiturn", "PPO_MULTITURN_ARGS")]}
KINDS = ["ppo", "tldr", "multiturn"]


def quick_args(request, assets, kind: str, updates: int = 2) -> list[str]:
    """`updates` updates of 16 responses on the tiny models, with the copier's flags."""
    if kind == "ppo":
        args = tiny_args(assets, "--eval-samples", "4", "--num-trainable-layers", "1", "--shared-value-head")
    elif kind == "multiturn":  # tests/envs.py's SayWord, episodes of up to 3 turns
        args = multiturn_args(request.getfixturevalue("chat"), "tests/envs.py:SayWord", "--eval-samples", "4")
    else:
        args = tldr_args(request.getfixturevalue("tldr"))
    return [*args, "--total-episodes", str(16 * updates), *EXTRA[kind]]


@pytest.mark.parametrize("kind", KINDS)
def test_a_short_run_trains_through_the_ledgers_paths_as_through_the_plain_forwards(request, assets, tmp_path, kind):
    args = quick_args(request, assets, kind)
    # TL;DR trains every block: no trunk; ppo.py's LM head over vocabulary blocks is asked for
    ledger = {"tldr": ["--sampler", "static"], "ppo": ["--fused-lm-head"]}.get(kind, [])
    fast, fast_rows = run_ppo([*args, *ledger], tmp_path / "fast", script=SCRIPTS[kind])
    plain, plain_rows = run_ppo([*args, "--no-fast-paths"], tmp_path / "plain", script=SCRIPTS[kind])
    assert len(fast_rows) == 2 and all(math.isfinite(v) for r in fast_rows for v in r.values()
                                       if isinstance(v, float))
    assert (tmp_path / "fast" / "model.safetensors").exists()
    assert kind == "multiturn" or "sampler: dynamic KV cache" in plain.stdout  # its turns sample with `generate`
    assert_same_run(plain_rows, fast_rows, rel=1e-4)
    banner = " ".join(fast.stdout.split())
    if SCRIPTS[kind] == "ppo.py":  # unedited, the trunk passes its start-up check and runs (a copy's may not)
        assert "frozen trunks: none (--no-fast-paths)" in plain.stdout
        assert "frozen trunks run once per update: policy 1 blocks, reference 1 blocks (the policy's)" in banner
        assert "kept while sampling: the policy's trunk" in banner
        assert "LM head: over vocabulary blocks in training" in banner
        assert "full forwards" not in banner
    elif SCRIPTS[kind] == "ppo_tldr.py":
        assert "sampler: static KV cache, uncompiled" in banner
    elif SCRIPTS[kind] == "ppo_multiturn.py":
        assert "frozen trunks run once per update: policy 1 blocks, reference 1 blocks (the policy's)" in banner


@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_from_every_checkpoint_gives_the_rest_of_the_run_again(request, assets, tmp_path, kind):
    """State the loop carries from one update to the next (its ALGO LOGIC markers at the checkpoint and after
    `start_run`) must be saved: a run of 5 updates, evaluated after each, resumed into a new folder from each of its
    checkpoints gives the same later updates and the same final model. State set at any period up to 4 updates (a
    reference reset every k updates, an early end decided at one update and taken at a later one) is lost by one of
    these resumes if the checkpoint lacks it. A run that ends early on purpose passes."""
    args = [*quick_args(request, assets, kind, updates=5), "--save-every", "1", "--eval-every", "1"]
    resumes_give_the_same_run(args, tmp_path, SCRIPTS[kind])


LOST_STATE = ("state the loop keeps across updates is not in the checkpoint: save it in phase 8's `state = dict(...)` "
              "and read it back after `start_run` (a model the loop changes: accelerator.register_for_checkpointing)")


def resumes_give_the_same_run(args: list[str], tmp_path, script: str) -> None:
    """A run, then resumed from each of its checkpoints before the last into new folders: the same later updates
    (metrics to 1e-6) and the same final model, each failure said with what differed and what to check."""
    _, whole = run_ppo(args, tmp_path / "whole", script=script)
    assert whole, "the run logged no update"
    last = whole[-1]["update"]  # an early end (phase 7's ALGO LOGIC marker) ends before --total-episodes
    final = load_file(tmp_path / "whole" / "model.safetensors")
    for k in range(1, last):
        checkpoint = tmp_path / "whole" / "checkpoints" / f"update-{k:06d}"
        _, resumed = run_ppo([*args, "--resume", str(checkpoint)], tmp_path / f"from-{k}", script=script)
        got, want = [r["update"] for r in resumed], list(range(k + 1, last + 1))
        assert got == want, (f"resumed from checkpoint {k}, the run logged updates {got}, the uninterrupted one "
                             f"{want}: {LOST_STATE}")
        try:
            assert_same_run(resumed, whole[k:], rel=1e-6)
        except AssertionError as e:
            raise AssertionError(f"resumed from checkpoint {k}, a metric differs from the uninterrupted run's "
                                 f"({e}): {LOST_STATE}") from None
        model = load_file(tmp_path / f"from-{k}" / "model.safetensors")
        assert model.keys() == final.keys() and all(torch.allclose(model[n], final[n], rtol=1e-6, atol=1e-7)
                                                    for n in final), (
            f"resumed from checkpoint {k}, the final model differs: {LOST_STATE}")


@pytest.mark.parametrize("kind", KINDS)
def test_at_learning_rate_0_the_rollout_is_on_policy(request, assets, tmp_path, kind):
    """The policy is the reference and does not move: the ratio is 1 and the KL 0, unless sampling's log-probs are
    not training's (a sampling rule whose log-probs differ from `scale_logits`': the rollout is off-policy)."""
    _, rows = run_ppo([*quick_args(request, assets, kind, updates=1), "--learning-rate", "0"], tmp_path / "run",
                      script=SCRIPTS[kind])
    assert rows[0]["val/ratio"] == pytest.approx(1.0, abs=1e-4), "off-policy: sampling's log-probs are not training's"
    assert abs(rows[0]["objective/kl"]) < 1e-3 and rows[0]["policy/clipfrac_avg"] == 0


def load_script(path: str):
    """A script (or a copy beside it) as a module, without running its `main`."""
    path = Path(path) if Path(path).is_absolute() else ROOT / path
    spec = importlib.util.spec_from_file_location(f"quick_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def sampled_against_scored(script, args, rows: int = 20_000, vocab: int = 40, pad: int = 3, seed: int = 0):
    """(the total variation between the tokens `sample_next` draws from one set of logits and the distribution
    training scores, softmax of `scale_logits`; the largest gap between the log-prob it returns and training's).
    Sampling alike: about 0.02 at 20,000 draws; a truncation applied in `sample_next` alone: its tail's mass."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(vocab, generator=g) * 2.0).expand(rows, vocab).clone()
    with torch.no_grad():
        token, logprob, _, _ = script.sample_next(logits.clone(), args, pad, g, torch.zeros(rows, dtype=torch.bool),
                                                  None, False)
        scored = torch.log_softmax(script.scale_logits(logits[:1].clone(), args.temperature, pad), -1)[0].double()
    drawn = torch.bincount(token.view(-1), minlength=vocab).double() / rows
    tv = 0.5 * (drawn - scored.exp()).abs().sum().item()
    return tv, (logprob.view(-1).double() - scored[token.view(-1)]).abs().max().item()


def assert_samples_what_training_scores(script, args) -> None:
    tv, gap = sampled_against_scored(script, args)
    assert gap < 1e-5, (f"off-policy: the log-prob sample_next returns differs from training's (scale_logits') by "
                        f"{gap:.3g}: return the log-prob of the distribution training scores")
    assert tv < 0.05, (f"off-policy: sample_next draws from another distribution than training scores (total "
                       f"variation {tv:.3f} over 20,000 draws): a truncation (top-k, top-p) applied while sampling "
                       "must be applied in scale_logits, which every training forward uses too")


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_draws_from_the_distribution_training_scores(kind):
    """The tokens `sample_next` draws (20,000 from one set of logits) follow softmax(scale_logits(...)), the
    distribution every training forward scores, and the log-prob it returns is that distribution's: a sampling rule
    applied in `sample_next` alone samples one distribution and trains on another (the rollout is off-policy, and a
    ratio of 1 at lr 0 cannot see it)."""
    script = load_script(SCRIPTS[kind])
    assert_samples_what_training_scores(script, tyro.cli(script.Args, args=EXTRA[kind]))



TOP_P = '''
def top_p(logits, p=0.8):
    """The nucleus: logits outside the smallest set of tokens holding p of the mass set to the lowest value."""
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    outside = (sorted_probs.cumsum(-1) - sorted_probs) >= p
    return logits.masked_fill(outside.scatter(-1, order, outside), torch.finfo(logits.dtype).min)


'''


def test_top_p_in_sample_next_alone_is_off_policy_and_in_scale_logits_is_not(tmp_path):
    """Nucleus sampling written two ways in a copy of ppo.py: truncating only what `sample_next` samples from (the
    naive edit, whose stored log-probs are the full distribution's) fails the check, naming the cause; truncating in
    `scale_logits`, where training's forwards pass too, passes it."""
    source = (ROOT / "ppo.py").read_text()
    marker = "# ALGO LOGIC: a truncation of the distribution"
    sampled = "cdf = torch.softmax(logits, dim=-1).double().cumsum(-1)"
    scaled = "logits[..., pad_token_id] = torch.finfo(logits.dtype).min\n    return logits"
    assert source.count(marker) == source.count(sampled) == source.count(scaled) == 1
    with_top_p = source.replace(marker, TOP_P + marker)
    copies = {"naive": with_top_p.replace(sampled, sampled.replace("softmax(logits", "softmax(top_p(logits)")),
              "right": with_top_p.replace(scaled, scaled.replace("return logits", "return top_p(logits)"))}
    verdicts = {}
    for name, text in copies.items():
        (tmp_path / f"ppo_{name}.py").write_text(text)
        script = load_script(str(tmp_path / f"ppo_{name}.py"))
        try:
            assert_samples_what_training_scores(script, script.Args())
            verdicts[name] = "passed"
        except AssertionError as e:
            verdicts[name] = str(e)
    assert verdicts["right"] == "passed"
    assert "sample_next draws from another distribution than training scores" in verdicts["naive"]
    assert "must be applied in scale_logits" in verdicts["naive"]
