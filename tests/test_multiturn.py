"""ppo_multiturn.py: the credit assignment over turns against float64 loops (skip-observation GAE, the turns'
rewards, an observation's tokens out of every loss), the episodes' layout and their log-probs against training's
forward, the chat template's turns, both environment protocols (this collection's, sync and async, and OpenRLHF's own
agent example unchanged), bad environments refused before any model loads, the turn and context limits, an exact
resume and two processes. The environments are tests/envs.py's, on conftest.py's tiny word-level models with a chat
template of their words."""
import json
import random
import shutil
import types

import pytest
import torch

import ppo_multiturn as mt
from conftest import assert_same_run, build_models, launch, resumed_after_update_1, run_ppo
from ppo_harness.environments import Environment

# user turns open with w1, assistant turns with w2, each turn closes with <eos> (id 0): the end-of-turn token
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}w1 {% else %}w2 {% endif %}{{ m['content'] }} "
                 "<eos> {% endfor %}{% if add_generation_prompt %}w2 {% endif %}")
EOS, PAD = 0, 31


@pytest.fixture(scope="session")
def chat(tmp_path_factory):
    """The tiny models with a chat template, and rows: `word` (what SayWord wants), `label`."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("multiturn")
    paths = build_models(root)
    tokenizer = AutoTokenizer.from_pretrained(paths["sft"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(paths["sft"])
    rows = root / "rows.jsonl"
    rng = random.Random(0)
    rows.write_text("".join(json.dumps({"word": rng.choice(["w7", "w8"]), "label": "x", "prompt": "w3 w4"}) + "\n"
                            for _ in range(64)))
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # as the script does: [PAD] = 31, past the vocabulary
    return {**paths, "rows": rows, "tokenizer": tokenizer, "root": root}


TINY = ["--total-episodes", "32", "--per-device-train-batch-size", "4", "--num-mini-batches", "4",
        "--local-rollout-forward-batch-size", "8", "--response-length", "4", "--eval-samples", "8",
        "--num-trainable-layers", "1", "--learning-rate", "1e-3", "--max-turns", "3"]


def tiny_args(chat, env="tests/envs.py:SayWord", *extra):
    return ["--sft-model-path", str(chat["sft"]), "--env", env, "--dataset-name", str(chat["rows"]), *TINY, *extra]


def run(chat, output_dir, *extra, env="tests/envs.py:SayWord", check=True):
    return run_ppo(tiny_args(chat, env, *extra), output_dir, script="ppo_multiturn.py", check=check)


# ---- the credit assignment, against float64 loops -----------------------------------------------------------------
def naive_skip_observation_gae(rewards, values, actions, gamma, lam):
    """GAE over each row's action tokens alone, as if the observations were not there: a Python loop in float64."""
    rows, width = len(rewards), len(rewards[0])
    advantages = [[0.0] * width for _ in range(rows)]
    returns = [[0.0] * width for _ in range(rows)]
    for b in range(rows):
        steps = [t for t in range(width) if actions[b][t]]
        last = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = values[b][steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last = delta + gamma * lam * last
            advantages[b][t] = last
            returns[b][t] = last + values[b][t]
    return advantages, returns


def episode_masks(generator):
    """Action masks of episodes with turns and observations of various lengths, padding after; a row of one token."""
    rows = []
    for b in range(6):
        mask = []
        for _ in range(1 + b % 3):
            mask += [True] * int(torch.randint(1, 5, (), generator=generator))
            mask += [False] * int(torch.randint(1, 4, (), generator=generator))
        rows.append(mask)
    rows.append([True])
    width = max(len(m) for m in rows) + 2
    return torch.tensor([m + [False] * (width - len(m)) for m in rows])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.95), (0.5, 0.0)])
def test_skip_observation_gae_is_gae_over_the_actions_alone(gamma, lam):
    g = torch.Generator().manual_seed(0)
    actions = episode_masks(g)
    rewards = torch.randn(actions.shape, generator=g, dtype=torch.float64) * actions
    values = torch.randn(actions.shape, generator=g, dtype=torch.float64) * actions
    advantages, returns = mt.skip_observation_gae(rewards, values, actions, gamma, lam)
    want_adv, want_ret = naive_skip_observation_gae(rewards.tolist(), values.tolist(), actions.tolist(), gamma, lam)
    assert torch.allclose(advantages, torch.tensor(want_adv, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(returns, torch.tensor(want_ret, dtype=torch.float64), atol=1e-12)
    # an observation's reward or value never reaches an action's advantage: the observations are skipped
    noise = torch.randn(actions.shape, generator=g, dtype=torch.float64) * ~actions
    again = mt.skip_observation_gae(rewards + noise, values + noise, actions, gamma, lam)
    assert torch.equal(again[0], advantages) and torch.equal(again[1], returns)


def test_skip_observation_gae_without_observations_is_ppo_gae():
    """Episodes of one turn and no padding: ppo.py's GAE over the whole response."""
    import ppo

    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    ours = mt.skip_observation_gae(rewards, values, torch.ones(3, 7, dtype=torch.bool), 0.9, 0.7)
    theirs = ppo.compute_gae(rewards, values, 0.9, 0.7)
    assert torch.allclose(ours[0], theirs[0], atol=1e-6) and torch.allclose(ours[1], theirs[1], atol=1e-6)


def test_the_turns_rewards_and_the_kl_penalty_per_token():
    g = torch.Generator().manual_seed(2)
    actions = episode_masks(g)
    kl = torch.randn(actions.shape, generator=g, dtype=torch.float64) * actions
    turn_scores = torch.zeros(actions.shape, dtype=torch.float64)
    for b, row in enumerate(actions.tolist()):  # a reward at each turn's last action token
        for t in range(len(row)):
            if row[t] and (t + 1 == len(row) or not row[t + 1]):
                turn_scores[b, t] = float(torch.randn((), generator=g))
    rewards, non_score = mt.compute_rewards(turn_scores, kl, 0.07)
    for b in range(actions.size(0)):
        for t in range(actions.size(1)):
            assert rewards[b, t].item() == pytest.approx(-0.07 * kl[b, t].item() + turn_scores[b, t].item(), abs=1e-12)
            assert non_score[b, t].item() == pytest.approx(-0.07 * kl[b, t].item(), abs=1e-12)


# ---- the chat template's turns ------------------------------------------------------------------------------------
def test_each_turn_is_what_the_chat_template_writes(chat):
    """First context + the policy's turns + the environment's answers, token by token, is the template's rendering of
    the conversation; a turn cut before its end-of-turn token gets it from the environment's side; no user message
    (None) leaves the next assistant header alone; OpenRLHF's raw text is its own tokens."""
    tok = chat["tokenizer"]
    first = mt.first_turn_tokens(tok, "w5 w6")
    turn1 = tok("w9 w10 <eos>", add_special_tokens=False)["input_ids"]  # closed by the stop token
    seen1 = mt.observation_tokens(tok, "w3 w4", closed=True, raw=False)
    turn2 = tok("w11", add_special_tokens=False)["input_ids"]  # cut by --response-length
    seen2 = mt.observation_tokens(tok, None, closed=False, raw=False)
    ids = first + turn1 + seen1 + turn2 + seen2
    rendered = tok.apply_chat_template([{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w9 w10"},
                                        {"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w11"}],
                                       add_generation_prompt=True, tokenize=False)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert seen2 == tok("<eos> w2", add_special_tokens=False)["input_ids"]
    assert mt.observation_tokens(tok, "w3 <eos>", closed=True, raw=True) == [4, EOS]


# ---- the episodes: layout, rewards, and log-probs as training computes them ---------------------------------------
def episode_setup(chat, env_spec, max_context=128):
    return types.SimpleNamespace(tokenizer=chat["tokenizer"], stop_token_id=EOS, env=Environment(env_spec),
                                 max_context=max_context, zero3=False)


def test_episodes_interleave_turns_and_keep_training_logprobs(chat):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(chat["sft"]).eval()
    args = mt.Args(response_length=4, max_turns=3, temperature=0.7)
    setup = episode_setup(chat, "tests/envs.py:SayWord")
    rows = [{"word": w, "label": None, "prompt": ""} for w in ["w7", "w8"] * 4]
    episodes = mt.play_episodes(policy, setup, rows, list(range(8)), args)
    tok = chat["tokenizer"]
    for e, row in zip(episodes, rows):
        assert e["query"] == mt.first_turn_tokens(tok, "w1 w2")
        # walk the turns: actions up to the stop token (or 4 tokens), then the environment's answer, until done
        t, turns = 0, 0
        while t < len(e["tokens"]):
            start = t
            while t < len(e["tokens"]) and e["actions"][t]:
                t += 1
            action, turns = e["tokens"][start:t], turns + 1
            assert 1 <= len(action) <= 4 and (EOS not in action[:-1])
            assert e["scores"][start:t] == [0.0] * (len(action) - 1) + [float(row["word"] in tok.decode(action).split())]
            seen = mt.observation_tokens(tok, "w3 w4", action[-1] == EOS, False)
            if t < len(e["tokens"]):
                assert e["tokens"][t:t + len(seen)] == seen and not any(e["actions"][t:t + len(seen)])
                t += len(seen)
        assert turns == e["turns"] <= 3
        assert e["ended"] == (0 if e["scores"][-1] == 1.0 else 1)
    # the kept log-probs are training's: the whole episode's forward, observations in the context
    queries = mt.left_pad([e["query"] for e in episodes], PAD)
    width = max(len(e["tokens"]) for e in episodes)
    responses = torch.tensor([e["tokens"] + [PAD] * (width - len(e["tokens"])) for e in episodes])
    actions = torch.tensor([e["actions"] + [False] * (width - len(e["actions"])) for e in episodes])
    kept = torch.tensor([e["logprobs"] + [1.0] * (width - len(e["logprobs"])) for e in episodes])
    with torch.no_grad():
        trained = mt.response_logprobs(policy, torch.cat((queries, responses), 1), PAD, queries.size(1),
                                       responses.masked_fill(responses == PAD, 0), 0.7)[0]
    assert torch.allclose(trained[actions], kept[actions], atol=1e-5), (trained[actions] - kept[actions]).abs().max()


def test_an_observations_tokens_carry_no_loss(chat):
    """ppo_loss and its gradients do not change when an observation token's advantage, return, old log-prob or value
    does: no policy loss, entropy, KL or value loss there."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(chat["sft"])
    mt.disable_dropout(policy)
    model = mt.PolicyAndValueWrapper(policy, value_head=mt.new_value_head(32))
    g = torch.Generator().manual_seed(3)
    actions = episode_masks(g)[:4]
    n, width = actions.shape
    queries = torch.randint(1, 30, (n, 3), generator=g)
    responses = torch.randint(1, 30, (n, width), generator=g)
    responses[:, -1] = PAD  # the padding after the longest

    def rollout(noise):
        r = lambda: torch.randn(n, width, generator=torch.Generator().manual_seed(5))
        return mt.Rollout(query_responses=torch.cat((queries, responses), 1),
                          response_ids=responses.masked_fill(responses == PAD, 0), trunks={}, responses=responses,
                          padding_mask=~actions, logprobs=-r().abs() + noise, ref_logprobs=-r().abs(),
                          values=r() + noise, kl=torch.zeros(n, width), non_score_reward=torch.zeros(n, width),
                          rewards=torch.zeros(n, width), advantages=r() + noise, returns=r() - noise,
                          scores=torch.zeros(n), num_turns=torch.ones(n), ended=torch.zeros(n))
    args = mt.Args(ent_coef=0.01)
    results = []
    for noise in (torch.zeros(n, width), 10 * torch.randn(n, width, generator=g) * ~actions):
        model.zero_grad()
        loss, stats = mt.ppo_loss(model, torch.arange(n), rollout(noise), args, PAD)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


# ---- whole runs ---------------------------------------------------------------------------------------------------
def test_a_run_is_on_policy_and_logs_the_turns(chat, tmp_path):
    """At learning rate 0 the rollout is on-policy (ratio 1, KL 0); the turns' metrics are logged; the sample tables
    hold whole transcripts."""
    _, rows = run(chat, tmp_path / "run", "--learning-rate", "0", "--kl-coef", "0.05")
    for row in rows:
        assert row["val/ratio"] == pytest.approx(1.0, abs=1e-5) and abs(row["objective/kl"]) < 1e-5
        assert 1 <= row["val/num_turns"] <= 3 and row["val/response_length"] >= row["val/num_turns"]
        assert row["val/observation_length"] > 0 and 0 <= row["val/truncated_episodes"] <= 16
        assert row["val/context_full_episodes"] == 0 and 0 <= row["objective/scores"] <= 1
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"eval/scores", "eval/num_turns", "eval/truncated_episodes", "eval/kl"} <= set(evals[0])
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["transcript"].startswith("w1 w1 w2 <eos> w2") and sample["ended"] in ("done", "max-turns")


def test_it_learns_to_say_the_word(chat, tmp_path):
    """SayWord's reward on the tiny models rises over 12 updates (held-out scores, before and after)."""
    _, rows = run(chat, tmp_path / "run", "--total-episodes", "192", "--learning-rate", "3e-3", "--kl-coef", "0.01",
                  "--eval-every", "0")
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = evals[0]["eval/scores"], evals[-1]["eval/scores"]
    assert last > first + 0.2, (first, last, [r["objective/scores"] for r in rows])


def test_sync_and_async_environments_play_alike(chat, tmp_path):
    _, sync = run(chat, tmp_path / "sync")
    _, asynchronous = run(chat, tmp_path / "async", env="tests/envs.py:AsyncSayWord")
    assert_same_run(asynchronous, sync, rel=1e-6)


def test_openrlhfs_own_agent_example_runs_unchanged(chat, tmp_path):
    """OpenRLHF's examples/python/agent_func.py (async __init__, reset and step; tensor rewards; its feedback raw):
    each episode ends when its random 1-3 steps are done, one turn later (OpenRLHF's `step_idx >= max_steps`)."""
    proc, rows = run(chat, tmp_path / "run", "--dataset-prompt-column", "prompt", "--max-turns", "5",
                     env="tests/openrlhf_agent.py:AgentInstance")
    assert "OpenRLHF protocol" in proc.stdout and "step_idx: " in proc.stdout
    for row in rows:
        assert 2 <= row["val/num_turns"] <= 4 and row["val/truncated_episodes"] == 0
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["transcript"].startswith("w3 w4")  # the prompt column, raw: OpenRLHF's observation


def test_turn_rewards_and_max_turns(chat, tmp_path):
    """An environment that never ends: --max-turns ends every episode (counted); every turn's reward is summed."""
    _, rows = run(chat, tmp_path / "run", "--max-turns", "2", env="tests/envs.py:TurnRewards")
    for row in rows:
        assert row["val/num_turns"] == 2 and row["val/truncated_episodes"] == 16
    samples = [json.loads(line) for line in (tmp_path / "run" / "training_samples.jsonl").read_text().splitlines()]
    for s in samples:  # 0.1 per w5 the policy said (the first context's words aside)
        said = s["transcript"].split("w2", 1)[1]
        assert s["score"] == pytest.approx(0.1 * said.split().count("w5"), abs=1e-6)


def test_the_context_limit_ends_episodes_or_refuses_the_first(chat, tmp_path):
    _, rows = run(chat, tmp_path / "full", "--max-context-length", "40", env="tests/envs.py:LongAnswers")
    assert all(row["val/context_full_episodes"] == 16 and row["val/num_turns"] == 1 for row in rows)
    proc, _ = run(chat, tmp_path / "first", "--max-context-length", "6", check=False)
    assert proc.returncode != 0 and "the episode of row 0 starts with" in proc.stderr and "--max-context-length" in proc.stderr
    assert not (tmp_path / "first").exists()  # refused at start-up, before any model loads
    proc, _ = run(chat, tmp_path / "positions", "--max-context-length", "4096", check=False)
    assert proc.returncode != 0 and "128 positions" in proc.stderr


@pytest.mark.parametrize("env,says", [
    ("tests/no_such_file.py:X", "cannot import"),
    ("tests/envs.py:Missing", "has no class 'Missing'"),
    ("tests/envs.py:NoStep", "NoStep has no step method"),
    ("tests/envs.py:RaisingStep", "RaisingStep.step, in the episode of row 0, raised KeyError"),
    ("tests/envs.py:WrongTypes", "WrongTypes.step, in the episode of row 0, returned tuple"),
    ("tests/envs.py:ResetNotText", "ResetNotText.reset, in the episode of row 0, returned list"),
])
def test_a_bad_environment_is_refused_before_any_model_loads(chat, tmp_path, env, says):
    proc, _ = run(chat, tmp_path / "run", env=env, check=False)
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run's folder is taken


def test_a_resume_continues_exactly(chat, tmp_path):
    """With the critic's flags on: killed after update 1 and resumed, the run ends as the uninterrupted one."""
    args = tiny_args(chat, "tests/envs.py:SayWord", "--total-episodes", "48", "--save-every", "1",
                     "--critic-epochs", "1", "--critic-learning-rate", "3e-3", "--lam-critic", "0.9",
                     "--loss-aggregation", "token")
    uninterrupted, proc, resumed = resumed_after_update_1(args, tmp_path / "full", tmp_path / "resumed",
                                                          script="ppo_multiturn.py")
    assert "resumed from" in proc.stdout
    assert_same_run(resumed, uninterrupted, rel=1e-6)


def test_two_processes(chat, tmp_path):
    """accelerate launch on 2 CPU processes: each plays its own episodes; the metrics average over both."""
    _, rows = launch(tiny_args(chat, "tests/envs.py:SayWord", "--per-device-train-batch-size", "2"), tmp_path / "run",
                     script="ppo_multiturn.py")
    assert len(rows) == 2 and all(1 <= row["val/num_turns"] <= 3 for row in rows)
    shutil.rmtree(tmp_path / "run")


@pytest.mark.parametrize("config", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_deepspeed(chat, tmp_path, config):
    """DeepSpeed ZeRO-2 and ZeRO-3 (the shipped configs, on 2 CPU processes) run the episodes as DDP does; ZeRO-3
    gathers the policy once per rollout, and sampling from its shards is refused (the processes' turns differ)."""
    args = tiny_args(chat, "tests/envs.py:SayWord", "--per-device-train-batch-size", "2")
    _, rows = launch(args, tmp_path / "run", script="ppo_multiturn.py", config=config)
    _, ddp = launch(args, tmp_path / "ddp", script="ppo_multiturn.py")
    assert len(rows) == 2 and rows[0]["objective/scores"] == ddp[0]["objective/scores"]  # the same first rollout
    if config == "deepspeed_zero3.yaml":
        proc, _ = launch(args + ["--no-ds3-gather-for-generation"], tmp_path / "shards", script="ppo_multiturn.py",
                         config=config, check=False)
        assert proc.returncode != 0 and "--no-ds3-gather-for-generation" in proc.stderr


def test_sigterm_checkpoints_the_update_and_a_resume_finishes_as_uninterrupted(chat, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT, update_rows, without_wall_clock
    from test_preemption import signalled

    args = tiny_args(chat, "tests/envs.py:SayWord", "--total-episodes", "320", "--eval-samples", "2")
    _, reference = run_ppo(args, tmp_path / "whole", script="ppo_multiturn.py")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "ppo_multiturn.py"), "--output-dir", str(out), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"})
    stdout, stderr = signalled(proc, out, signal.SIGTERM)
    stopped = update_rows(out / "metrics.jsonl")[-1]["update"]
    assert proc.returncode == 143 and 1 < stopped < 20, stderr[-3000:]
    _, rows = run_ppo(args + ["--resume", "auto"], out, script="ppo_multiturn.py")
    assert without_wall_clock(rows) == without_wall_clock(reference)
