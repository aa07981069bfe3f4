"""The reasoning flags of ppo.py (VC-PPO, VAPO, DAPO; GRPO and RLOO baselines) and the sums-and-counts metrics gather.

Each helper against an independent float64 loop (as tests/test_math.py: plain Python over lists, never the helper's
vectorised code), the token-level denominator over simulated processes and accumulation steps, then short tiny-model
runs that show each flag changes the update where it should and nowhere else, and a resume with every flag on."""
import math

import pytest
import torch

import ppo
from ppo_harness.reward_calls import RewardComponents
from conftest import resumed_after_update_1, run_ppo, without_wall_clock
from conftest import tiny_args as args_for


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- length-adaptive and decoupled GAE ---------------------------------------------------------------------------
def naive_gae(rewards, values, gamma, lams):
    """GAE row by row, each row its own lambda, bootstrapping with 0 past the end: (advantages, returns)."""
    advantages, returns = [], []
    for r, v, lam in zip(rewards, values, lams):
        last, row = 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            next_value = v[t + 1] if t + 1 < len(r) else 0.0
            last = r[t] + gamma * next_value - v[t] + gamma * lam * last
            row[t] = last
        advantages.append(row)
        returns.append([a + b for a, b in zip(row, v)])
    return advantages, returns


@pytest.mark.parametrize("alpha", [0.05, 0.3, 2.0])
def test_length_adaptive_lam_against_a_loop(alpha):
    lengths = torch.tensor([-1, 0, 1, 4, 19, 20, 63, 511])  # index of the last real token (-1: empty)
    got = ppo.length_adaptive_lam(lengths, alpha).tolist()
    for index, lam in zip(lengths.tolist(), got):
        l = max(index + 1, 1)
        assert lam == pytest.approx(min(max(1.0 - 1.0 / (alpha * l), 0.0), 1.0), abs=1e-7)
    assert got == sorted(got)  # longer responses get a lambda nearer 1 (VAPO: less bias where the reward is far)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_compute_gae_takes_a_lambda_per_response(gamma):
    batch, length = 5, 9
    rewards = torch.randn(batch, length, generator=gen(1), dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen(2), dtype=torch.float64)
    lengths = torch.tensor([0, 3, 8, 5, -1])
    lam = ppo.length_adaptive_lam(lengths, 0.4).double()
    advantages, returns = ppo.compute_gae(rewards, values, gamma, lam)
    want_adv, want_ret = naive_gae(rewards.tolist(), values.tolist(), gamma, lam.tolist())
    torch.testing.assert_close(advantages, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(returns, torch.tensor(want_ret, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_decoupled_gae_lambda_one_gives_the_critic_monte_carlo_returns():
    """VC-PPO's critic targets with lambda 1: the rewards-to-go, whatever the values (here gamma 1 and 0.95)."""
    rewards = torch.randn(4, 7, generator=gen(3), dtype=torch.float64)
    values = torch.randn(4, 7, generator=gen(4), dtype=torch.float64)
    for gamma in (1.0, 0.95):
        returns = ppo.compute_gae(rewards, values, gamma, 1.0)[1]
        for row, r in zip(returns.tolist(), rewards.tolist()):
            want = [sum(gamma ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))]
            assert row == pytest.approx(want, rel=1e-10, abs=1e-10)
        # and the policy's advantages at a smaller lambda are another thing
        assert not torch.allclose(ppo.compute_gae(rewards, values, gamma, 0.5)[0], returns - values)


# ---- group baselines and dynamic sampling --------------------------------------------------------------------------
def naive_group_advantages(rewards, judged, k, estimator):
    out = []
    for g in range(0, len(rewards), k):
        r, w = rewards[g:g + k], judged[g:g + k]
        kept = [x for x, j in zip(r, w) if j]
        for x, j in zip(r, w):
            if not j or len(kept) < 2:
                out.append(0.0)
            elif estimator == "rloo":
                out.append(x - (sum(kept) - x) / (len(kept) - 1))
            else:
                mean = sum(kept) / len(kept)
                std = math.sqrt(sum((y - mean) ** 2 for y in kept) / (len(kept) - 1))
                out.append((x - mean) / (std + 1e-4))
    return out


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("k", [2, 4])
def test_group_advantages_against_a_loop(estimator, k):
    rewards = torch.randn(6 * k, generator=gen(5), dtype=torch.float64)
    judged = torch.rand(6 * k, generator=gen(6)) > 0.25
    judged[:k] = True  # one whole group judged; unjudged rows elsewhere (their return is 0: not a baseline)
    judged[k:2 * k] = False
    judged[2 * k] = True
    judged[2 * k + 1:3 * k] = False  # a group with one judged row: nothing to compare with
    got = ppo.group_advantages(rewards, judged, k, estimator)
    want = naive_group_advantages(rewards.tolist(), judged.tolist(), k, estimator)
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-12)
    if estimator == "rloo":  # each judged group's advantages sum to 0
        for g in range(0, 6 * k, k):
            assert float(got[g:g + k].sum()) == pytest.approx(0.0, abs=1e-9)


def test_equal_score_groups_against_a_loop():
    k = 3
    scores = torch.tensor([1., 1., 1., 0., 1., 0., 0., 0., 0., 1., 1., 5., 2., 2., 2.])
    judged = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    got = ppo.equal_score_groups(scores, judged, k).tolist()
    want = []
    for g in range(0, len(scores), k):
        kept = [s for s, j in zip(scores.tolist()[g:g + k], judged.tolist()[g:g + k]) if j]
        want += [len(set(kept)) < 2] * k  # all the same, or fewer than 2 judged: no signal in the group
    assert got == want == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3  # 2 unjudged, last


# ---- the policy loss: clip-higher and the aggregations over processes and accumulation ----------------------------
def naive_clipped(new, old, adv, low, high):
    ratio = math.exp(new - old)
    return max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))


@pytest.mark.parametrize("high", [None, 0.28, 0.05])
def test_policy_loss_clips_higher_against_a_loop(high):
    new = torch.randn(6, 5, generator=gen(7), dtype=torch.float64) * 0.4
    old = torch.randn(6, 5, generator=gen(8), dtype=torch.float64) * 0.4
    adv = torch.randn(6, 5, generator=gen(9), dtype=torch.float64)
    pad = torch.rand(6, 5, generator=gen(10)) < 0.3
    pad[0] = False
    loss = ppo.policy_loss(new, old, adv, pad, 0.2, high)[0]
    terms = [naive_clipped(n, o, a, 0.2, 0.2 if high is None else high)
             for rn, ro, ra, rp in zip(new.tolist(), old.tolist(), adv.tolist(), pad.tolist())
             for n, o, a, p in zip(rn, ro, ra, rp) if not p]
    assert float(loss) == pytest.approx(sum(terms) / len(terms), rel=1e-10)
    if high is None:  # the default's text path: the symmetric clip, bit for bit
        assert torch.equal(loss, ppo.policy_loss(new, old, adv, pad, 0.2, 0.2)[0])


def simulated_minibatch(aggregation, processes=3, accumulation=2, micro=4, length=6, seed=0):
    """One minibatch spread over `processes` x `accumulation` micro-batches of `micro` rows: each process's
    `minibatch_counts`, summed over processes (the all-reduce), clamped and divided as main does; then every
    micro-batch's `policy_loss` backpropagated as accelerate does (the loss / accumulation steps) and DDP averages
    (the mean over processes). Returns (the summed gradient w.r.t. every new log-prob, the inputs as lists)."""
    rows = processes * accumulation * micro
    g = gen(seed)
    new = (torch.randn(rows, length, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    old = torch.randn(rows, length, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(rows, length, generator=g, dtype=torch.float64)
    lengths = torch.randint(-1, length, (rows,), generator=g)
    lengths[micro:2 * micro] = -1  # process 0's second micro-batch is empty (unjudged, or dropped)
    pad = torch.arange(length)[None] > lengths[:, None]  # main's padding_mask
    per_process = rows // processes
    counts = sum(ppo.minibatch_counts(~pad[p * per_process:(p + 1) * per_process],
                                      torch.arange(per_process).view(1, -1), aggregation)
                 for p in range(processes))
    denominator = (counts.clamp(min=1) / (accumulation * processes))[0]
    total = 0
    for p in range(processes):
        for a in range(accumulation):
            rows_here = slice(p * per_process + a * micro, p * per_process + (a + 1) * micro)
            loss = ppo.policy_loss(new[rows_here], old[rows_here], adv[rows_here], pad[rows_here], 0.2, 0.28,
                                   aggregation, denominator)[0]
            total = total + loss / accumulation / processes
    total.backward()
    return total.item(), new.grad, (new.tolist(), old.tolist(), adv.tolist(), pad.tolist(), micro)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "micro-batch"])
def test_the_minibatch_loss_over_processes_and_accumulation_against_a_loop(aggregation):
    value, grad, (new, old, adv, pad, micro) = simulated_minibatch(aggregation)
    token_terms = [[naive_clipped(n, o, a, 0.2, 0.28) for n, o, a, p in zip(*row) if not p]
                   for row in zip(new, old, adv, pad)]
    if aggregation == "token":  # every real token of the minibatch weighs 1 / (its real tokens)
        want = sum(map(sum, token_terms)) / sum(map(len, token_terms))
    elif aggregation == "sequence":  # every sequence with a real token weighs 1 / (their number)
        means = [sum(t) / len(t) for t in token_terms if t]
        want = sum(means) / len(means)
    else:  # each micro-batch's token mean, averaged over the micro-batches (an empty one counts, as 0)
        batches = [token_terms[i:i + micro] for i in range(0, len(token_terms), micro)]
        want = sum(sum(map(sum, b)) / max(sum(map(len, b)), 1) for b in batches) / len(batches)
    assert value == pytest.approx(want, rel=1e-6)  # the denominator: a float32 count / (accumulation x processes)
    if aggregation == "token":  # and the gradient: d/d new of -A r (unclipped) or 0 (clipped), over all tokens
        n_tokens, eps = sum(map(len, token_terms)), 1e-6
        for i in (0, 9, 17):
            for t in range(len(new[i])):
                if pad[i][t]:
                    assert grad[i, t] == 0
                    continue
                bumped = (naive_clipped(new[i][t] + eps, old[i][t], adv[i][t], 0.2, 0.28) -
                          naive_clipped(new[i][t] - eps, old[i][t], adv[i][t], 0.2, 0.28)) / (2 * eps)
                assert float(grad[i, t]) == pytest.approx(bumped / n_tokens, rel=1e-5, abs=1e-9)


def test_aggregate_loss_of_the_positive_examples_against_a_loop():
    """VAPO's positive-example LM loss: the NLL of the positive responses' tokens, token-level or per micro-batch."""
    logprobs = -torch.rand(4, 5, generator=gen(11), dtype=torch.float64)
    positive = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    nll = [-x for row, m in zip(logprobs.tolist(), positive.tolist()) for x, p in zip(row, m) if p]
    assert float(ppo.aggregate_loss(-logprobs, positive)) == pytest.approx(sum(nll) / len(nll), rel=1e-12)
    assert float(ppo.aggregate_loss(-logprobs, positive, "token", torch.tensor(4.0))) == pytest.approx(
        sum(nll) / 4, rel=1e-12)
    assert float(ppo.aggregate_loss(-logprobs, ~positive.any(1, keepdim=True) & positive)) == 0  # none: 0, not NaN


# ---- explained variance and the sums-and-counts gather --------------------------------------------------------------
def test_explained_variance_over_processes_against_a_loop():
    returns = torch.randn(6, 8, generator=gen(12), dtype=torch.float64)
    values = returns * 0.7 + torch.randn(6, 8, generator=gen(13), dtype=torch.float64) * 0.5
    mask = torch.rand(6, 8, generator=gen(14)) < 0.7
    sums = ppo.explained_variance_sums(values[:2], returns[:2], mask[:2]) + ppo.explained_variance_sums(
        values[2:], returns[2:], mask[2:])  # two processes' sums, as the gather adds them
    r = [x for row, m in zip(returns.tolist(), mask.tolist()) for x, k in zip(row, m) if k]
    d = [x - y for rr, vv, m in zip(returns.tolist(), values.tolist(), mask.tolist())
         for x, y, k in zip(rr, vv, m) if k]

    def var(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    assert ppo.explained_variance(sums) == pytest.approx(1 - var(d) / var(r), rel=1e-9)
    assert ppo.explained_variance(ppo.explained_variance_sums(returns, returns, mask)) == pytest.approx(1.0)
    flat = torch.ones(2, 3)
    assert ppo.explained_variance(ppo.explained_variance_sums(flat, flat, flat > 0)) == 0.0  # no variance: 0


class TwoProcesses:
    """accelerate's gather, reduce and process count as two processes see them: `peer` is the other's tensor."""
    num_processes, device = 2, torch.device("cpu")

    def __init__(self, peer=None):
        self.peer, self.sent = peer, None

    def gather(self, t):
        self.sent = t
        return torch.cat([t, t if self.peer is None else self.peer])

    def reduce(self, t, reduction):
        return 2 * t


def rollout(seed, rows=4, length=5):
    g = gen(seed)
    lengths = torch.randint(0, length, (rows,), generator=g)
    mask, mask_p1 = torch.arange(length)[None] > lengths[:, None], torch.arange(length)[None] > lengths[:, None] + 1
    t = torch.randn(rows, length, generator=g)
    responses = torch.ones(rows, length, dtype=torch.long)
    components = RewardComponents()
    components.unjudged = torch.zeros(rows, dtype=torch.bool)
    return ppo.Rollout(query_responses=responses, response_ids=responses, trunks={}, responses=responses,
                       sequence_lengths=lengths,
                       padding_mask=mask, padding_mask_p1=mask_p1, logprobs=-t.abs(), ref_logprobs=-t.abs(),
                       values=t, kl=t.abs(), non_score_reward=-t.abs(), rewards=t, advantages=t, returns=2 * t,
                       scores=torch.randn(rows, generator=g), trained_scores=None, contain_eos_token=None,
                       score_components=components,
                       dropped=torch.zeros(rows, dtype=torch.bool),
                       positive=torch.zeros(rows, length, dtype=torch.bool))


def stats(values, active):
    return [{"loss/policy_avg": torch.tensor(v), "ratio": torch.tensor(1 + v / 10),
             "active": torch.tensor(float(a))} for v, a in zip(values, active)]


def test_gathered_metrics_with_different_numbers_of_micro_batches(monkeypatch):
    """Process A held three micro-batches, process B two, one of them emptied (its statistics are 0 and left out)."""
    monkeypatch.setattr(ppo, "gather_object", lambda objects: objects * 2)
    args = ppo.Args()
    a, b = rollout(1), rollout(2)
    a, b = (r._replace(trained_scores=r.scores) for r in (a, b))
    peer = TwoProcesses()
    ppo.gathered_metrics(peer, args, b, stats([0.5, 0.0], [1, 0]))  # what B sends
    metrics = ppo.gathered_metrics(TwoProcesses(peer.sent[0:1]), args, a, stats([0.1, 0.2, 0.3], [1, 1, 1]))
    kept = [0.1, 0.2, 0.3, 0.5]  # B's emptied micro-batch is not a 0 in the mean
    assert metrics["loss/policy_avg"] == pytest.approx(sum(kept) / 4, rel=1e-6)
    ratios = [1 + v / 10 for v in kept]
    mean = sum(ratios) / 4
    assert metrics["val/ratio"] == pytest.approx(mean, rel=1e-6)
    assert metrics["val/ratio_var"] == pytest.approx(sum((x - mean) ** 2 for x in ratios) / 3, rel=1e-4)
    assert metrics["objective/scores"] == pytest.approx((a.scores.mean() + b.scores.mean()).item() / 2, rel=1e-6)
    assert metrics["val/response_length"] == pytest.approx(
        ((a.sequence_lengths + 1).float().mean() + (b.sequence_lengths + 1).float().mean()).item() / 2, rel=1e-6)
    both = [torch.cat([x, y]) for x, y in ((a.values, b.values), (a.returns, b.returns),
                                           (~a.padding_mask_p1, ~b.padding_mask_p1))]
    assert metrics["val/explained_variance"] == pytest.approx(
        ppo.explained_variance(ppo.explained_variance_sums(*both)), rel=1e-9)


# ---- the flags in short runs: each changes the update where it should --------------------------------------------
EXACT = ["--max-grad-norm", "None", "--eval-every", "1", "--num-generations", "2"]  # no clip couples policy and value


@pytest.fixture(scope="module")
def baseline(assets, tmp_path_factory):
    return run_ppo(args_for(assets, *EXACT), tmp_path_factory.mktemp("baseline"))[1]


def first_update(rows):
    return rows[0]


ROLLOUT_KEYS = ("objective/kl", "objective/scores", "val/response_length", "objective/entropy")


@pytest.mark.parametrize("flags, same, differ", [
    # the critic's targets alone: update 1's policy losses (a separate value model, no clipping) stay as they were
    (["--lam-critic", "0.5"], ["loss/policy_avg", "policy/clipfrac_avg"], ["loss/value_avg"]),
    (["--lam", "0.9", "--lam-length-alpha", "0.5"], [], ["loss/policy_avg"]),
    # the length-adaptive lambda is the policy's: the critic's targets keep --lam
    (["--lam-length-alpha", "0.5"], ["loss/value_avg", "val/clipfrac_avg"], ["loss/policy_avg"]),
    (["--cliprange-high", "0.001"], ["loss/value_avg"], ["loss/policy_avg"]),  # a tight upper clip: the policy only
    (["--loss-aggregation", "token"], ["loss/value_avg"], ["loss/policy_avg"]),
    (["--loss-aggregation", "sequence"], ["loss/value_avg"], ["loss/policy_avg"]),
    (["--positive-lm-coef", "1.0", "--positive-threshold", "0.1"], ["loss/value_avg"], ["policy/approxkl_avg"]),
    (["--dynamic-sampling"], [], ["loss/policy_avg", "loss/value_avg"]),
    (["--advantage-estimator", "rloo"], [], ["loss/policy_avg"]),
    (["--advantage-estimator", "grpo"], [], ["loss/policy_avg"]),
])
def test_a_flag_changes_the_update_where_it_acts(assets, tmp_path, baseline, flags, same, differ):
    """Update 1's rollout is the initial policy's in every run (its metrics equal the baseline's); what the flag
    acts on differs, and what it leaves alone does not."""
    rows = run_ppo(args_for(assets, *EXACT, *flags), tmp_path)[1]
    for key in (*ROLLOUT_KEYS, *same):
        assert rows[0][key] == pytest.approx(baseline[0][key], rel=1e-6, abs=1e-7), key
    for key in differ:
        assert rows[0][key] != pytest.approx(baseline[0][key], rel=1e-4, abs=1e-6), key
    if "--dynamic-sampling" in flags:
        assert 0 < rows[0]["val/dynamic_sampling_dropped"] <= 1
    if "--positive-lm-coef" in flags:
        assert rows[0]["loss/positive_lm_avg"] > 0


def test_value_warmup_leaves_the_policy_and_trains_the_critic(assets, tmp_path, baseline):
    rows = run_ppo(args_for(assets, *EXACT, "--value-warmup-updates", "1"), tmp_path)[1]
    assert rows[0]["lr"] == 0 and rows[1]["lr"] > 0  # the policy's lr: 0 while warming up
    assert rows[0]["eval/kl"] == pytest.approx(0, abs=1e-6) and baseline[0]["eval/kl"] > 1e-4  # the policy as it was
    assert rows[1]["objective/kl"] == pytest.approx(0, abs=1e-6)  # update 2 samples from the initial policy
    assert rows[0]["loss/value_avg"] == pytest.approx(baseline[0]["loss/value_avg"], rel=1e-6)  # the same critic step
    assert rows[1]["val/explained_variance"] != pytest.approx(baseline[1]["val/explained_variance"], abs=1e-6)


def test_value_warmup_starts_the_policys_adam_afresh(assets, tmp_path):
    """verl's critic_warmup never steps the actor. Here the warm-up steps the policy on zero gradients at lr 0 (as
    DeepSpeed's engine does inside backward), which counts AdamW's steps and decays its moments: the first real steps
    would be too large (bias correction out of step). So the policy's Adam state is dropped when the warm-up ends: at
    update 2 the policy has taken the 4 steps of one update, the critic those of two."""
    run_ppo(args_for(assets, *EXACT, "--value-warmup-updates", "1", "--save-every", "1"), tmp_path)
    steps = {}
    for update in (1, 2):
        saved = torch.load(tmp_path / "checkpoints" / f"update-00000{update}" / "optimizer.bin", weights_only=False)
        groups = {g["name"]: g["params"] for g in saved["param_groups"]}
        assert groups.keys() == {"policy", "value"}
        steps[update] = {name: {float(saved["state"][i]["step"]) for i in ids} for name, ids in groups.items()}
    assert steps[1] == {"policy": {4.0}, "value": {4.0}}  # 2 PPO epochs x 2 minibatches
    assert steps[2] == {"policy": {4.0}, "value": {8.0}}


def test_grpo_keeps_the_kl_out_of_its_advantages(assets, tmp_path):
    """DeepSeekMath's GRPO z-scores the outcome alone and puts its KL in the loss (section 4.1.2): in update 2, where
    every response scores the same but the policy has moved from the reference, every advantage (so the policy loss)
    is 0 while the KL term is not. With the KL in the summed rewards, the z-score would turn its noise into
    advantages of about +-1."""
    rows = run_ppo(args_for(assets, *EXACT, "--advantage-estimator", "grpo",
                            reward_fn="tests/rewards.py:signal_in_update_one_only"), tmp_path)[1]
    assert rows[0]["loss/policy_avg"] != 0 and abs(rows[1]["objective/kl"]) > 1e-4  # k1: the policy moved
    assert rows[1]["loss/policy_avg"] == 0 and rows[1]["loss/kl_avg"] > 0
    assert "val/explained_variance" not in rows[1]  # no critic to explain the returns


def test_dynamic_sampling_stops_at_an_update_whose_every_group_scored_alike(assets, tmp_path):
    """A reward that scores every response alike after update 1 leaves every group out of update 2's loss: the run
    stops there, saying why, instead of saving an untrained model with exit 0."""
    proc, rows = run_ppo(args_for(assets, *EXACT, "--dynamic-sampling", "--total-episodes", "48",
                                  reward_fn="tests/rewards.py:signal_in_update_one_only"), tmp_path, check=False)
    assert proc.returncode != 0 and "update 2: every group of --num-generations responses scored alike" in proc.stderr
    assert [r["update"] for r in rows] == [1] and not (tmp_path / "model.safetensors").exists()


def naive_k3(new, ref, mask):
    """The mean over unmasked tokens of exp(ref - new) - (ref - new) - 1 (DeepSeekMath's eq. 4), in Python floats."""
    terms = [math.exp(r - n) - (r - n) - 1 for nr, rr, mr in zip(new, ref, mask) for n, r, m in zip(nr, rr, mr) if m]
    return sum(terms) / len(terms)


def test_grpo_loss_adds_the_k3_kl_to_the_reference_against_a_loop():
    r = rollout(7)
    g = gen(8)
    r = r._replace(ref_logprobs=r.logprobs - 0.3 * torch.rand(r.logprobs.shape, generator=g),
                   kl_coef=torch.tensor(0.25))
    new = r.logprobs + 0.2 * torch.randn(r.logprobs.shape, generator=g)
    zeros = torch.zeros_like(new)

    def model(*args):
        return new, zeros, zeros

    rows = torch.arange(r.logprobs.size(0))
    plain, _ = ppo.ppo_loss(model, rows, r, ppo.Args(advantage_estimator="rloo"), 0)
    loss, stats = ppo.ppo_loss(model, rows, r, ppo.Args(advantage_estimator="grpo"), 0)
    real = (~r.padding_mask).tolist()
    want = naive_k3(new.double().tolist(), r.ref_logprobs.double().tolist(), real)
    assert float(stats["loss/kl_avg"]) == pytest.approx(want, rel=1e-5)
    assert float(loss - plain) == pytest.approx(0.25 * want, rel=1e-4)


def test_critic_free_estimators_leave_the_value_head_at_zero(assets, tmp_path):
    from safetensors.torch import load_file

    run_ppo(args_for(assets, "--advantage-estimator", "grpo", "--num-generations", "4", "--shared-value-head"),
            tmp_path)
    head = load_file(tmp_path / "value_head.safetensors")
    assert all(torch.count_nonzero(t) == 0 for t in head.values())  # the fresh head, never trained


@pytest.mark.parametrize("flags, message", [
    (["--advantage-estimator", "grpo"], "--advantage-estimator grpo compares the responses of one prompt"),
    (["--dynamic-sampling"], "--dynamic-sampling True compares"),
    (["--advantage-estimator", "rloo", "--num-generations", "2", "--lam-critic", "1"], "--lam-critic acts on"),
    (["--positive-threshold", "0.5"], "--positive-threshold selects"),
    (["--value-warmup-updates", "2"], "--value-warmup-updates 2: the run has 2 updates"),
    # flags that could not act without a critic: a value model loaded and never trained, whitening GAE never reads
    (["--advantage-estimator", "grpo", "--num-generations", "2", "--value-model-path", "M"], "--value-model-path acts"),
    (["--advantage-estimator", "rloo", "--num-generations", "2", "--whiten-rewards"], "--whiten-rewards acts on"),
    (["--advantage-estimator", "grpo", "--num-generations", "2", "--critic-epochs", "1"], "--critic-epochs acts on"),
])
def test_flag_combinations_are_refused_by_name(assets, tmp_path, flags, message):
    proc, _ = run_ppo(args_for(assets, "--total-episodes", "32", *flags), tmp_path, check=False)
    assert proc.returncode != 0 and message in proc.stderr


def test_resume_with_every_reasoning_flag_gives_the_uninterrupted_run(assets, tmp_path):
    """Nothing these flags keep lives outside the checkpoint (the warm-up is counted from `update`)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = args_for(assets, "--total-episodes", "48", "--save-every", "1", "--num-generations", "2",
                    "--value-warmup-updates", "1", "--lam", "0.9", "--lam-critic", "1.0", "--lam-length-alpha", "0.5",
                    "--cliprange-high", "0.28", "--loss-aggregation", "token", "--positive-lm-coef", "0.1",
                    "--positive-threshold", "0.1", "--dynamic-sampling")
    uninterrupted, proc, rows = resumed_after_update_1(args, full, resumed)
    assert "continuing at update 2" in proc.stdout
    assert without_wall_clock(rows) == without_wall_clock(uninterrupted)
