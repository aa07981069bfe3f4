"""The critic's own training (--critic-learning-rate, --critic-epochs, the warm-up that waits, a warm start from
--value-model-path) and the critic bugs other frameworks shipped in 2026, each a test that fails on the bug.

The schedule and the two-group AdamW step against plain Python loops in float64 (never the helper's own arithmetic),
then short tiny-model runs: what the extra critic epochs move and what they leave, what the warm-up holds still, the
critic's optimizer state over a resume and on a warm start, and the value loss's gradient over micro-batches."""
import math

import pytest
import torch
from safetensors.torch import load_file

import ppo
from conftest import resumed_after_update_1, run_ppo, without_wall_clock
from conftest import tiny_args as args_for

EXACT = ["--max-grad-norm", "None"]  # no clipping, which would couple the policy's step to the value's


def naive_lr(initial, update, num_updates, waited):
    """A group's lr at `update`: 0 while it waits, then linear from `initial` to 0 over the updates it trains."""
    if update <= waited:
        return 0.0
    trained_before = update - 1 - waited
    return initial * (1.0 - trained_before / (num_updates - waited))


def optimizer_for(policy_lr, value_lr, dtype=torch.float64):
    torch.manual_seed(0)
    policy, value = torch.nn.Linear(3, 2).to(dtype), torch.nn.Linear(2, 1).to(dtype)
    groups = ppo.param_groups(policy_lr, policy=policy) + ppo.param_groups(value_lr, value=value)
    return policy, value, torch.optim.AdamW(groups, eps=1e-5, weight_decay=0.0)


@pytest.mark.parametrize("num_updates, warmup", [(5, 0), (5, 2), (7, 3), (2, 1)])
def test_each_group_anneals_from_its_own_lr_and_the_policy_waits_for_the_warm_up(num_updates, warmup):
    """The policy's lr at each update of a warm-up run is the unwarmed run's (over the updates it trains), shifted by
    the warm-up, and 0 before; the critic's anneals over the whole run from --critic-learning-rate."""
    _, _, optimizer = optimizer_for(1e-3, 5e-3)
    _, _, unwarmed = optimizer_for(1e-3, 5e-3)
    for update in range(1, num_updates + 1):
        lr, trains = ppo.set_learning_rates(optimizer, update, num_updates, warmup)
        groups = {g["name"]: g["lr"] for g in optimizer.param_groups}
        assert trains == (update > warmup) and lr == groups["policy"]
        assert groups["policy"] == pytest.approx(naive_lr(1e-3, update, num_updates, warmup), rel=1e-15, abs=0)
        assert groups["value"] == pytest.approx(naive_lr(5e-3, update, num_updates, 0), rel=1e-15, abs=0)
        if update > warmup:  # exactly the unwarmed schedule of the updates the policy trains, shifted
            ppo.set_learning_rates(unwarmed, update - warmup, num_updates - warmup, 0)
            assert groups["policy"] == unwarmed.param_groups[0]["lr"]


def naive_adamw(params, grads, lr, state, betas=(0.9, 0.999), eps=1e-5):
    """One AdamW step (no weight decay) on lists of floats, in place; `state` holds step, m and v per entry."""
    state["step"] = state.get("step", 0) + 1
    m, v = state.setdefault("m", [0.0] * len(params)), state.setdefault("v", [0.0] * len(params))
    for i, g in enumerate(grads):
        m[i] = betas[0] * m[i] + (1 - betas[0]) * g
        v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
        m_hat, v_hat = m[i] / (1 - betas[0] ** state["step"]), v[i] / (1 - betas[1] ** state["step"])
        params[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)


@pytest.mark.parametrize("warmup", [0, 1])
def test_the_two_group_adamw_steps_against_a_loop(warmup):
    """The critic at 5x the policy's lr (SAO's ratio), annealed, over 4 updates of 2 steps each: every weight equals
    a float64 loop's AdamW with each group's own lr. During the warm-up the policy's group steps at lr 0 and its Adam
    state is dropped when it ends (as `set_learning_rates` says); the loop does the same."""
    policy, value, optimizer = optimizer_for(1e-2, 5e-2)
    flat = {name: [x for p in m.parameters() for x in p.detach().flatten().tolist()]
            for name, m in (("policy", policy), ("value", value))}
    states = {"policy": {}, "value": {}}
    g = torch.Generator().manual_seed(1)
    num_updates = 4
    for update in range(1, num_updates + 1):
        ppo.set_learning_rates(optimizer, update, num_updates, warmup)
        if warmup and update == warmup + 1:
            states["policy"] = {}
        for _ in range(2):
            grads = {}
            for name, m in (("policy", policy), ("value", value)):
                for p in m.parameters():
                    p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
                grads[name] = [x for p in m.parameters() for x in p.grad.flatten().tolist()]
            optimizer.step()
            for name, initial, waited in (("policy", 1e-2, warmup), ("value", 5e-2, 0)):
                naive_adamw(flat[name], grads[name], naive_lr(initial, update, num_updates, waited), states[name])
    for name, m in (("policy", policy), ("value", value)):
        got = [x for p in m.parameters() for x in p.detach().flatten().tolist()]
        assert got == pytest.approx(flat[name], rel=1e-12, abs=1e-14), name


def adam_steps(run_dir, update):
    """{group name: the set of AdamW step counts of its parameters} in a run's checkpoint."""
    saved = torch.load(run_dir / "checkpoints" / f"update-{update:06d}" / "optimizer.bin", weights_only=False)
    return {g["name"]: {float(saved["state"][i]["step"]) for i in g["params"] if i in saved["state"]}
            for g in saved["param_groups"]}


def policy_weights(run_dir):
    return load_file(run_dir / "model.safetensors")


@pytest.mark.parametrize("shared", [False, True])
def test_critic_epochs_step_the_value_parameters_alone(assets, tmp_path, shared):
    """--critic-epochs 1 adds one epoch of the value loss alone after the 2 PPO epochs: the value group takes 6 AdamW
    steps per update where the policy takes 4, and the policy after the run is the one the run without it trains (the
    gradient the value loss leaves in the shared trunk is dropped: the extra epochs move the head alone), while the
    critic differs. One update, so the rollouts are the same."""
    head = ["--shared-value-head", "--num-trainable-layers", "1"] if shared else []
    flags = [*EXACT, *head, "--total-episodes", "16", "--save-every", "1"]
    plain, extra = tmp_path / "plain", tmp_path / "extra"
    rows_plain = run_ppo(args_for(assets, *flags), plain)[1]
    rows_extra = run_ppo(args_for(assets, *flags, "--critic-epochs", "1"), extra)[1]
    assert adam_steps(plain, 1) == {"policy": {4.0}, "value": {4.0}}
    assert adam_steps(extra, 1) == {"policy": {4.0}, "value": {6.0}}
    assert rows_extra[0]["policy/optimizer_steps"] == rows_plain[0]["policy/optimizer_steps"] == 4
    # the PPO epochs' statistics are the same; the critic epoch comes after them
    assert rows_extra[0]["loss/value_avg"] == rows_plain[0]["loss/value_avg"]
    a, b = policy_weights(plain), policy_weights(extra)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    critic = "value_head.safetensors" if shared else "value_model/model.safetensors"
    va, vb = load_file(plain / critic), load_file(extra / critic)
    assert any(not torch.equal(va[k], vb[k]) for k in va)


def test_the_critics_own_lr_is_logged_and_reaches_the_head_alone_under_the_shared_head(assets, tmp_path):
    """Under --shared-value-head the value group is the head (its weight and bias); the trunk is the policy's group.
    Both lrs are logged (lr/policy, lr/value; TRL's `lr` is the policy's) and anneal from their own start."""
    rows = run_ppo(args_for(assets, *EXACT, "--shared-value-head", "--num-trainable-layers", "1",
                            "--learning-rate", "1e-3", "--critic-learning-rate", "5e-3", "--save-every", "1"),
                   tmp_path)[1]
    for update, row in enumerate(rows, 1):
        assert row["lr"] == row["lr/policy"] == pytest.approx(naive_lr(1e-3, update, 2, 0), rel=1e-12)
        assert row["lr/value"] == pytest.approx(naive_lr(5e-3, update, 2, 0), rel=1e-12)
    saved = torch.load(tmp_path / "checkpoints" / "update-000001" / "optimizer.bin", weights_only=False)
    sizes = {g["name"]: len(g["params"]) for g in saved["param_groups"]}
    assert sizes["value"] == 2 and sizes["policy"] > 2  # the head's weight and bias; the policy's top block
    assert {g["name"]: g["initial_lr"] for g in saved["param_groups"]} == {"policy": 1e-3, "value": 5e-3}


def test_the_warm_up_holds_the_policys_schedule_and_the_kl_controller(assets, tmp_path):
    """During --value-warmup-updates the adaptive KL controller does not move (the policy has not changed) and the
    policy's anneal has not started: its first trained update runs at the full --learning-rate."""
    flags = [*EXACT, "--total-episodes", "48", "--kl-target", "0.01", "--kl-horizon", "100"]
    warm = run_ppo(args_for(assets, *flags, "--value-warmup-updates", "1"), tmp_path / "warm")[1]
    cold = run_ppo(args_for(assets, *flags), tmp_path / "cold")[1]
    assert [r["lr"] for r in warm] == pytest.approx([0.0, 1e-3, 1e-3 / 2], rel=1e-12)
    assert [r["lr"] for r in cold] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3], rel=1e-12)
    assert warm[1]["objective/kl_coef"] == warm[0]["objective/kl_coef"] == 0.05  # held through the warm-up
    assert cold[1]["objective/kl_coef"] != 0.05  # the controller moves after a trained update


@pytest.mark.parametrize("layout", ["full, value model", "lora, shared head"])
def test_resume_with_the_critic_flags_gives_the_uninterrupted_run(assets, tmp_path, layout):
    """Nothing the critic flags keep lives outside the checkpoint: the critic's lr is in the optimizer's groups, the
    warm-up and the critic epochs are counted from `update`. The value weights and their AdamW state come back
    exactly too (NeMo-RL lost the critic's optimizer state on resume), with full fine-tuning and a value model, and
    with a LoRA adapter and the shared head."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    shape = [] if layout.startswith("full") else ["--use-peft", "--shared-value-head", "--num-trainable-layers", "1"]
    args = args_for(assets, *EXACT, *shape, "--total-episodes", "48", "--save-every", "1",
                    "--value-warmup-updates", "1", "--critic-learning-rate", "5e-3", "--critic-epochs", "1",
                    "--kl-target", "0.01")
    uninterrupted, proc, rows = resumed_after_update_1(args, full, resumed)
    assert "continuing at update 2" in proc.stdout
    assert without_wall_clock(rows) == without_wall_clock(uninterrupted)
    a, b = (torch.load(d / "checkpoints" / "update-000003" / "optimizer.bin", weights_only=False)
            for d in (full, resumed))
    for i, state in a["state"].items():
        assert all(torch.equal(state[k], b["state"][i][k]) for k in state), i
    critic = "value_model/model.safetensors" if layout.startswith("full") else "value_head.safetensors"
    va, vb = (load_file(d / critic) for d in (full, resumed))
    assert va.keys() == vb.keys() and all(torch.equal(va[k], vb[k]) for k in va)


def test_a_warm_started_critic_starts_a_fresh_optimizer(assets, tmp_path):
    """--value-model-path takes the weights of a trained run's value model and nothing of its optimizer (NeMo-RL's
    warm start carried the donor run's Adam state): the first update's AdamW steps are the new run's own 4."""
    donor = tmp_path / "donor"
    run_ppo(args_for(assets, *EXACT, "--save-every", "1"), donor)
    assert adam_steps(donor, 2)["value"] == {8.0}
    run_ppo(args_for(assets, *EXACT, "--save-every", "1", "--total-episodes", "16",
                     "--value-model-path", str(donor / "value_model")), tmp_path / "warm")
    assert adam_steps(tmp_path / "warm", 1) == {"policy": {4.0}, "value": {4.0}}


def test_a_fresh_value_head_is_the_same_on_every_process():
    """A fresh head (--shared-value-head's, and a value model's new `score`) is zero, whatever each process's seed
    (NeMo-RL initialised it differently per worker): bitwise the same everywhere before the first step."""
    heads = []
    for seed in (0, 100003):  # rank 0's and rank 1's seeds at --seed 0
        torch.manual_seed(seed)
        heads.append(ppo.new_value_head(16))
    assert torch.equal(heads[0].weight, heads[1].weight) and torch.equal(heads[0].bias, heads[1].bias)
    assert not heads[0].weight.any() and not heads[0].bias.any()


@pytest.mark.parametrize("aggregation", ["micro-batch", "token"])
def test_the_value_losss_gradient_does_not_grow_with_the_micro_batch_count(aggregation):
    """verl normalised the critic's loss per micro-batch without dividing by their number, so its effective lr grew
    with --gradient-accumulation-steps. Here the value head's gradient over 4 micro-batches (each loss divided by 4,
    as accelerate's backward does) equals the gradient of the whole minibatch as one micro-batch, in float64, where
    the responses are equally long (with unequal lengths the micro-batch mean weighs each micro-batch alike: TRL's
    rule, as the policy loss's)."""
    torch.manual_seed(0)
    n, t, hidden = 8, 5, 4
    head = torch.nn.Linear(hidden, 1).double()
    states = torch.randn(n, t, hidden, dtype=torch.float64)

    def model(qr, pad, context_length, ids, temperature, trunks):
        rows = qr[:, 0]  # the rows' indices, carried in the first column
        return (torch.zeros(len(rows), t, dtype=torch.float64), torch.zeros(len(rows), t, dtype=torch.float64),
                head(states[rows]).squeeze(-1))

    mask = torch.zeros(n, t, dtype=torch.bool)
    mask[:, 4:] = True  # every response 4 tokens: the score one past the last lands on the 5th
    from value_gradient import rollout  # the 2-process test's rollout of the same shape

    values, returns = torch.randn(n, t, dtype=torch.float64), torch.randn(n, t, dtype=torch.float64)
    r = rollout(torch.arange(n), values, returns, mask)
    args = ppo.Args(loss_aggregation=aggregation, cliprange_value=0.2)

    def gradient(pieces):
        head.zero_grad()
        for rows in torch.arange(n).chunk(pieces):
            denominators = (None if aggregation == "micro-batch"
                            else torch.tensor([float((~mask[rows]).sum()), 1.0], dtype=torch.float64) / pieces)
            loss, _ = ppo.ppo_loss(model, rows, r, args, 0, False, denominators)
            (loss / pieces).backward()
        return torch.cat([head.weight.grad.flatten(), head.bias.grad])

    whole = gradient(1)
    assert whole.abs().sum() > 0
    torch.testing.assert_close(gradient(4), whole, rtol=1e-12, atol=1e-14)


def test_an_lr_written_outside_the_schedule_is_refused_and_initial_lr_is_honoured():
    """Every group's lr is set each update from its `initial_lr`, so an lr written into a group elsewhere (after
    `prepare`, before the loop or inside it) would do nothing: it is refused, naming the group and the key to write.
    A new `initial_lr` is the schedule's own source, and is honoured."""
    _, _, optimizer = optimizer_for(1e-2, 5e-2)
    ppo.set_learning_rates(optimizer, 1, 4)
    optimizer.param_groups[1]["lr"] = 0.123  # the critic's lr, as an edit would set it
    with pytest.raises(ValueError, match=r"'value' has lr 0.123, written outside.*initial_lr"):
        ppo.set_learning_rates(optimizer, 2, 4)
    _, _, optimizer = optimizer_for(1e-2, 5e-2)
    optimizer.param_groups[0]["lr"] = 0.5  # before the first update
    with pytest.raises(ValueError, match="'policy' has lr 0.5"):
        ppo.set_learning_rates(optimizer, 1, 4)
    _, _, optimizer = optimizer_for(1e-2, 5e-2)
    ppo.set_learning_rates(optimizer, 1, 4)
    optimizer.param_groups[1]["initial_lr"] = 0.2
    ppo.set_learning_rates(optimizer, 2, 4)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(naive_lr(0.2, 2, 4, 0), rel=1e-15)


def test_a_resume_that_shortens_the_warm_up_drops_the_policys_adam_state(assets, tmp_path):
    """A run warming its critic for 3 updates, resumed from update 2 with --value-warmup-updates 1: its first
    trained update (3) starts the policy's AdamW afresh, as the end of a warm-up does (its zero-gradient steps
    dropped): 4 steps in checkpoint 3, not 12. The group records whether the policy trained (in the checkpoint); the
    reset used to fire only at update warm-up + 1 (2 here), which the resumed run never runs."""
    from conftest import copy_cut_after

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = args_for(assets, *EXACT, "--total-episodes", "64", "--save-every", "1")
    run_ppo(args + ["--value-warmup-updates", "3"], full)
    assert adam_steps(full, 4) == {"policy": {4.0}, "value": {16.0}}  # reset when the warm-up ended
    copy_cut_after(full, resumed, 2)
    run_ppo(args + ["--value-warmup-updates", "1", "--resume", "auto", "--resume-with-changes",
                    "value-warmup-updates"], resumed)
    assert adam_steps(resumed, 3) == {"policy": {4.0}, "value": {12.0}}
    assert adam_steps(resumed, 4) == {"policy": {8.0}, "value": {16.0}}


@pytest.mark.parametrize("aggregation", ["micro-batch", "token"])
def test_the_value_losss_gradient_on_two_processes_is_the_single_process_full_batch_gradient(aggregation, tmp_path):
    """The critic's effective lr does not depend on how a minibatch is split (verl PR#6957 scaled it by the number of
    micro-batches): on 2 data-parallel processes, each with 4 micro-batches of its half (accelerate's accumulate and
    backward, DDP's average), the value head's gradient equals the gradient of the whole minibatch as one
    micro-batch on one process, in float64 (tests/value_gradient.py), under both aggregations (the value loss is a
    micro-batch's token mean under each: --loss-aggregation reshapes the policy's terms). A value loss normalised per
    micro-batch by a constant instead (a sum / 4) fails it, as it fails the one-process test above."""
    from conftest import launch

    proc, _ = launch(["--aggregation", aggregation, "--accumulation", "4"], tmp_path, script="tests/value_gradient.py")
    assert f"AGREE: 2 processes x 4 micro-batches, {aggregation}" in proc.stdout, proc.stdout[-2000:]


def test_the_critic_epochs_draw_their_minibatches_as_a_naive_loop_does(assets, tmp_path):
    """With --num-ppo-epochs 2 --critic-epochs 1 every epoch of an update draws its own permutation of the rollout's
    rows from numpy's generator (seeded by --seed) and walks it minibatch by minibatch, micro-batch by micro-batch;
    the third trains the value loss alone. The rows of every training step (recorded by tests/epoch_order.py) equal a
    naive loop's, over both updates."""
    import json

    import numpy as np
    import tyro

    argv = args_for(assets, *EXACT, "--num-ppo-epochs", "2", "--critic-epochs", "1", "--seed", "3")
    proc, rows = run_ppo(argv, tmp_path, script="tests/epoch_order.py")
    calls = [json.loads(line[len("RECORD "):]) for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    a = tyro.cli(ppo.Args, args=argv)
    n, mini, micro = (a.per_device_train_batch_size * a.gradient_accumulation_steps * a.num_mini_batches,
                      a.per_device_train_batch_size * a.gradient_accumulation_steps, a.per_device_train_batch_size)
    rng, expected = np.random.RandomState(3), []  # accelerate's set_seed(3) seeds numpy's global generator so
    for _ in rows:
        for epoch in range(3):
            order = rng.permutation(n)
            for start in range(0, n, micro):  # minibatches of `mini` rows, each in micro-batches of `micro`
                expected.append({"rows": order[start:start + micro].tolist(), "train_policy": epoch < 2})
    assert len(rows) == 2 and n % mini == 0 and len(calls) == len(expected) == 2 * 3 * (n // micro)
    assert calls == expected
