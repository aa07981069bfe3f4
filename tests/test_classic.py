"""The classic PPO controls (adaptive KL, every KL penalty, early stop, ratio guard, score scaling) and TensorBoard."""
import math
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import ppo
from conftest import run_ppo
from conftest import tiny_args as args_for


# ---------------------------------------------------------------------------------------------------------------
# the pieces, against naive float64 computations
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kl, target, horizon, n", [(3.0, 6.0, 10000, 128), (12.0, 6.0, 10000, 128),
                                                    (6.3, 6.0, 500, 64), (0.0, 1.0, 100, 100)])
def test_adaptive_kl_coef_matches_a_hand_computation(kl, target, horizon, n):
    error = kl / target - 1
    error = -0.2 if error < -0.2 else 0.2 if error > 0.2 else error
    assert ppo.adaptive_kl_coef(0.1, kl, target, horizon, n) == pytest.approx(0.1 * (1 + error * n / horizon), 1e-15)


def naive_penalty(lp, ref, estimator):
    d = lp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d, "abs": abs(d)}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_kl_penalties_against_naive(estimator):
    gen = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 4, -torch.rand(3, 5, generator=gen,
                                                                                     dtype=torch.float64) * 4
    got = ppo.kl_penalty(lp, ref, estimator)
    for i in range(3):
        for t in range(5):
            assert got[i, t].item() == pytest.approx(naive_penalty(lp[i, t].item(), ref[i, t].item(), estimator),
                                                     rel=1e-12, abs=1e-14)
    invalid = torch.full((2, 2), ppo.INVALID_LOGPROB, dtype=torch.float64)
    assert torch.equal(ppo.kl_penalty(invalid, invalid, estimator), torch.zeros(2, 2, dtype=torch.float64))


def test_full_kl_is_the_exact_kl_and_the_mean_of_k1():
    gen = torch.Generator().manual_seed(1)
    logits, ref_logits = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64), torch.randn(
        2, 3, 6, generator=gen, dtype=torch.float64)
    got = ppo.full_kl(logits, ref_logits)
    for i in range(2):
        for t in range(3):
            zp = sum(math.exp(x) for x in logits[i, t].tolist())
            zq = sum(math.exp(x) for x in ref_logits[i, t].tolist())
            expected = sum(math.exp(a) / zp * ((a - math.log(zp)) - (b - math.log(zq)))
                           for a, b in zip(logits[i, t].tolist(), ref_logits[i, t].tolist()))
            assert got[i, t].item() == pytest.approx(expected, rel=1e-12)
    # k1 at tokens sampled from pi averages to the full KL
    p, q = torch.softmax(logits[0, 0], -1), torch.softmax(ref_logits[0, 0], -1)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    k1 = ppo.kl_penalty(p.log()[samples], q.log()[samples], "k1")
    assert k1.mean().item() == pytest.approx(got[0, 0].item(), abs=5 * k1.std().item() / math.sqrt(200_000))


def test_running_moments_equal_numpy_on_the_concatenated_batches():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3, 2, size=n) for n in (5, 17, 1, 40)]
    moments = ppo.RunningMoments()
    for i, batch in enumerate(batches):
        moments.update(torch.tensor(batch, dtype=torch.float32))
        seen = np.concatenate(batches[: i + 1]).astype(np.float32).astype(np.float64)
        assert moments.mean == pytest.approx(seen.mean(), rel=1e-9)
        assert moments.var == pytest.approx(seen.var(), rel=1e-9)
        if len(seen) > 1:
            assert moments.std == pytest.approx(seen.std(ddof=1), rel=1e-9)


def test_whitened_rewards_never_leak_from_padding():
    """Real tokens' advantages do not depend on how much padding follows (right) or precedes (left) them."""
    rnd = random.Random(0)

    def advantages(rewards, values, mask_p1):
        whitened = ppo.whiten_rewards(rewards, mask_p1)
        assert torch.all(whitened[mask_p1] == 0)
        return ppo.compute_gae(whitened, values.masked_fill(mask_p1, 0), 1.0, 0.95)[0]

    real = [[rnd.uniform(-1, 1) for _ in range(n)] for n in (3, 5, 2)]
    values = [[rnd.uniform(-1, 1) for _ in range(n)] for n in (3, 5, 2)]
    base = None
    for pad in (0, 4):  # right padding: extra pad columns after every response
        width = 5 + pad
        r = torch.tensor([x + [9.0] * (width - len(x)) for x in real], dtype=torch.float64)
        v = torch.tensor([x + [7.0] * (width - len(x)) for x in values], dtype=torch.float64)
        mask = torch.tensor([[t >= len(x) for t in range(width)] for x in real])
        adv = advantages(r, v, mask)
        got = [adv[i, :len(x)] for i, x in enumerate(real)]
        base = base or got
        for a, b in zip(got, base):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # left padding: masked positions before the real tokens carry nothing into them either
    r = torch.tensor([[9.0, 9.0] + real[0]], dtype=torch.float64)
    v = torch.tensor([[7.0, 7.0] + values[0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False, False]])
    adv_left = advantages(r, v, mask)[0, 2:]
    r_plain, v_plain = torch.tensor([real[0]], dtype=torch.float64), torch.tensor([values[0]], dtype=torch.float64)
    torch.testing.assert_close(adv_left, advantages(r_plain, v_plain, torch.zeros(1, 3, dtype=torch.bool))[0],
                               rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# the controls in real runs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target, direction", [(1e-3, 1), (1e4, -1)])
def test_adaptive_beta_moves_toward_the_target_from_both_sides(assets, tmp_path, target, direction):
    _, rows = run_ppo(args_for(assets, "--kl-target", str(target), "--kl-horizon", "100", "--total-episodes", "80",
                               "--kl-coef", "0.1", "--kl-estimator", "k3"), tmp_path / "run")
    betas = [r["objective/kl_coef"] for r in rows]
    assert betas[0] == 0.1
    for row, beta, following in zip(rows, betas, betas[1:]):  # the rule, from each update's logged rollout KL
        error = min(max(row["objective/kl"] / target - 1, -0.2), 0.2)
        assert following == pytest.approx(beta * (1 + error * 16 / 100), rel=1e-12)
    # update 1 samples from the reference itself (KL 0), so beta first falls; from then on it moves toward the target
    steps = [b - a for a, b in zip(betas[1:], betas[2:])]
    assert all(direction * step > 0 for step in steps), betas


def test_fixed_beta_without_a_target(assets, tmp_path):
    _, rows = run_ppo(args_for(assets, "--total-episodes", "32", "--kl-estimator", "k2", "--kl-horizon", "50",
                               "--kl-coef", "0.05"), tmp_path / "run")
    assert [r["objective/kl_coef"] for r in rows] == [0.05, 0.05]


@pytest.mark.parametrize("estimator", ["abs", "full"])
def test_every_kl_estimator_runs_and_is_zero_before_training(assets, tmp_path, estimator):
    _, rows = run_ppo(args_for(assets, "--kl-estimator", estimator, "--learning-rate", "0", "--total-episodes", "16"),
                      tmp_path / "run")
    assert abs(rows[0]["objective/kl"]) < 1e-4  # policy == reference


def test_early_stop_after_the_first_minibatch_over_target(assets, tmp_path):
    """The first minibatch starts at the rollout policy (approx KL 0); after one step the second exceeds a tiny target,
    so every update takes 2 of its 4 optimizer steps."""
    _, rows = run_ppo(args_for(assets, "--target-kl", "1e-12", "--total-episodes", "32"), tmp_path / "run")
    assert [r["policy/optimizer_steps"] for r in rows] == [2, 2]


def test_ratio_guard_skips_without_stepping(assets, tmp_path):
    """Every minibatch's ratio (about 1) exceeds 0.5: all are skipped, and the weights do not move at all."""
    _, rows = run_ppo(args_for(assets, "--ratio-threshold", "0.5", "--total-episodes", "16"), tmp_path / "run")
    assert rows[0]["policy/skipped_minibatches"] == 4 and rows[0]["policy/optimizer_steps"] == 0
    initial = AutoModelForCausalLM.from_pretrained(assets["sft"]).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run").state_dict()
    assert all(torch.equal(initial[k], trained[k]) for k in initial)
    _, rows = run_ppo(args_for(assets, "--ratio-threshold", "100", "--total-episodes", "16"), tmp_path / "loose")
    assert rows[0]["policy/skipped_minibatches"] == 0 and rows[0]["policy/optimizer_steps"] == 4


def test_score_scaling_logs_and_checkpoints_the_running_moments(assets, tmp_path):
    import json

    _, rows = run_ppo(args_for(assets, "--use-score-scaling", "--use-score-norm", "--score-clip", "0.5",
                               "--total-episodes", "32"), tmp_path / "run")
    assert all(math.isfinite(r["objective/score_running_mean"]) and r["objective/score_running_std"] > 0
               for r in rows)
    for r in rows:  # rlhf_reward is what PPO trained on (the scaled, clipped scores); objective/scores stays raw
        assert -0.5 <= r["objective/scaled_scores"] <= 0.5
        assert r["objective/rlhf_reward"] == pytest.approx(r["objective/non_score_reward"] + r["objective/scaled_scores"])
    assert any(abs(r["objective/scores"] - r["objective/scaled_scores"]) > 1e-3 for r in rows)
    state = json.loads((tmp_path / "run" / "checkpoints" / "update-000002" / "trainer_state.json").read_text())
    assert state["score_moments"]["count"] == pytest.approx(32)
    assert state["score_moments"]["mean"] == pytest.approx(rows[-1]["objective/score_running_mean"])


def test_tensorboard_event_files_hold_the_metrics(assets, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, rows = run_ppo(args_for(assets, "--total-episodes", "32"), tmp_path / "run")
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    for key in ("objective/scores", "objective/kl", "val/ratio", "objective/kl_coef"):
        logged = events.Scalars(key)
        assert [e.step for e in logged] == [1, 2]
        assert [e.value for e in logged] == pytest.approx([r[key] for r in rows], rel=1e-6)
