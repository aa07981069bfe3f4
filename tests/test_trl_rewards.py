"""Reward functions as TRL 1.12's GRPOTrainer calls them: its trainer keywords (`trainer_state`,
`log_extra`, `log_metric`), async functions awaited together, a reward served over HTTP (127.0.0.1 only), and TRL's
own `accuracy_reward` (tests/trl_1_12, unchanged) in a run."""
import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerState

import ppo
from ppo_harness.reward_fns import load_reward_fn
from ppo_harness.prompt_files import encode_prompts
from ppo_harness.reward_calls import RewardComponents, RewardLogs, call_reward_fn, call_reward_fns
from ppo_harness.preemption import Preemption, stop_asked
from conftest import ROOT, TINY, free_port, make_tokenizer, reward_fn_keywords, run_ppo
from test_rewards import chat  # noqa: F401 (the chat policy, its reward model and chat prompts)

TESTS = str(ROOT / "tests")  # on PYTHONPATH, so that trl_1_12.rewards.accuracy_rewards imports as TRL's own module


def text_rewards(fns, specs, max_steps=4, updates_per_epoch=2):
    """Rewards of functions only, on the word-level tokenizer and text prompts."""
    names = ppo.reward_names([], specs)
    return ppo.Rewards(names, [1.0] * len(names), specs, fns, [], [], [], make_tokenizer(pad=True), False, "prompt", 8,
                       max_steps, updates_per_epoch)


ROWS = {"prompt": ["w1 w2", "w3"], "input_ids": [[2, 3], [4]], "solution": ["w7", "w9"]}
RESPONSES = torch.tensor([[8, 9, 31], [7, 31, 31]])  # "w7 w8", "w6"


# ---------------------------------------------------------------------------------------------------------------
# trainer_state, log_extra, log_metric
# ---------------------------------------------------------------------------------------------------------------
def test_trainer_keywords_reach_functions_and_their_logs_come_back():
    seen = {}

    def curriculum(completions, trainer_state, log_extra, log_metric, solution, **kwargs):
        seen["state"] = trainer_state
        log_extra("solution", solution)
        log_extra("score", [9, 9])  # a column the table has already: score_2
        log_extra("length", [len(c) for c in completions])
        log_extra("length", [0, 0])  # logged twice: length_2
        log_metric("accuracy", 1.0)
        log_metric("accuracy", 0.0)  # averaged over the calls of one batch
        return [float(s in c) for c, s in zip(completions, solution)]

    def exact(prompts, completions, completion_ids, solution):  # no **kwargs: runs as before, without TRL's keywords
        return [0.5, 0.5]

    rewards = text_rewards([curriculum, exact], ["curriculum", "exact"])
    scores, components = ppo.score_responses(rewards, torch.tensor([[2, 3], [31, 4]]), RESPONSES, ROWS, 3)
    state = seen["state"]  # transformers' TrainerState, as TRL passes its trainer's
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps, state.epoch) == (3, 4, 1.5)
    assert state.num_train_epochs == 2 and state.is_world_process_zero and state.is_local_process_zero
    assert components["curriculum"].tolist() == [1.0, 0.0] and scores.tolist() == [1.5, 0.5]
    assert components.columns == {"solution": ["w7", "w9"], "score_2": [9, 9], "length": [5, 2], "length_2": [0, 0]}
    assert components.metrics == {"accuracy": [1.0, 0.0]}
    assert ppo.reward_means(components, "eval", lambda t: t)["eval/reward_fn/accuracy"] == 0.5
    with pytest.raises(RuntimeError, match=r"--reward-fn bad, called with the keywords prompts, completions, "
                       r"completion_ids, solution, trainer_state, log_extra, log_metric, raised ValueError: "
                       r"log_extra\('x', \.\.\.\) got 3 values for 2 rows"):
        ppo.score_responses(text_rewards([lambda log_extra, **kw: log_extra("x", [1, 2, 3])], ["bad"]),
                            torch.tensor([[2, 3], [31, 4]]), RESPONSES, ROWS)


def test_log_metric_is_averaged_over_processes():
    """Two processes' logged means (0.5 and 1.0) average to 0.75, as TRL's gather().mean(); a process that logged
    other names is refused rather than mixed up."""
    def components(metrics):
        c = RewardComponents({"f": torch.tensor([1.0, 0.0])})
        c.metrics = metrics
        return c

    def with_other_process(other):
        sent = []
        ppo.reward_means(other, "objective", lambda t: sent.append(t) or t)
        return lambda t: t + sent.pop(0)

    mine, other = components({"accuracy": [1.0, 0.0]}), components({"accuracy": [1.0]})
    means = ppo.reward_means(mine, "objective", with_other_process(other))
    assert means["objective/reward_fn/accuracy"] == 0.75 and means["objective/scores/f"] == 0.5
    with pytest.raises(ValueError, match="other metric names on other processes"):
        ppo.reward_means(mine, "objective", with_other_process(components({"ece": [1.0]})))


# ---------------------------------------------------------------------------------------------------------------
# async functions, errors, the shapes of a score list
# ---------------------------------------------------------------------------------------------------------------
def test_async_functions_run_together_in_the_users_order():
    """Two async functions that each wait for the other to start can only finish when awaited together; the sync ones
    run in order on the calling thread; the scores come back in the order given."""
    started, order = [], []

    def rendezvous(name, value):
        async def fn(completions, **kwargs):
            started.append(name)
            for _ in range(500):
                if len(started) == 2:
                    order.append(name)
                    return [value] * len(completions)
                await asyncio.sleep(0.01)
            raise TimeoutError(f"{name} waited 5 s alone: not awaited together")
        return fn

    def sync(value):
        def fn(completions, **kwargs):
            order.append((value, threading.current_thread() is threading.main_thread()))
            return [value] * len(completions)
        return fn

    kwargs = dict(prompts=["a", "b"], completions=["w7", "w1"], completion_ids=[[8], [2]])
    scores = call_reward_fns([(sync(1.0), kwargs, "s1"), (rendezvous("a", 2.0), kwargs, "a"),
                                  (sync(3.0), kwargs, "s2"), (rendezvous("b", 4.0), kwargs, "b")], "cpu")
    assert [s.tolist() for s in scores] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]
    assert order[:2] == [(1.0, True), (3.0, True)] and sorted(order[2:]) == ["a", "b"]


def test_async_functions_keep_one_running_loop_even_under_a_callers_loop():
    """Async functions run on the harness's own loop in its thread, as TRL runs them: a caller that already runs a
    loop (a notebook) gets its scores, and a function meets the same loop, still running, on every call."""
    loops = []

    async def fn(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        return [1.0] * len(completions)

    kwargs = dict(prompts=["a"], completions=["w7"], completion_ids=[[8]])

    async def inside_a_loop():
        return call_reward_fn(fn, kwargs, "cpu", "fn")
    assert asyncio.run(inside_a_loop()).tolist() == [1.0]
    assert call_reward_fn(fn, kwargs, "cpu", "fn").tolist() == [1.0]
    assert loops[0] is loops[1] and loops[0].is_running()


def test_a_function_that_raises_or_times_out_is_named():
    kwargs = dict(prompts=["a", "b"], completions=["w7", "w1"], completion_ids=[[8], [2]])

    async def judge(completions, **kwargs):
        await asyncio.wait_for(asyncio.sleep(10), timeout=0.05)  # an LLM judge's client timing out

    def broken(completions, **kwargs):
        return {}["missing"]

    for fn, name, error in [(judge, "judge.py:judge", "TimeoutError"), (broken, "broken", "KeyError: 'missing'")]:
        with pytest.raises(RuntimeError, match=re.escape(f"--reward-fn {name}, called with the keywords prompts, "
                                                         f"completions, completion_ids, raised {error}")):
            call_reward_fn(fn, kwargs, "cpu", name)
    with warnings.catch_warnings(record=True) as caught:  # an async function started before a sync one raised
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="--reward-fn broken, "):
            call_reward_fns([(judge, kwargs, "judge"), (broken, kwargs, "broken")], "cpu")
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]  # is closed, not left unawaited
    # TRL accepts a list of 0-d tensors (what torch ops on one row return); numpy scalars and arrays too
    assert call_reward_fn(lambda **kw: [torch.tensor(0.5), np.float32(2.0)], kwargs, "cpu", "t").tolist() == [
        0.5, 2.0]
    assert call_reward_fn(lambda **kw: [np.array(1.0), None], kwargs, "cpu", "t")[0] == 1.0


def test_a_reward_file_that_fails_to_load_is_named(tmp_path):
    (tmp_path / "syntax.py").write_text("def f(completions, **kwargs)\n    return [1.0]\n")
    (tmp_path / "name.py").write_text("SCALE = undefined_name\n")
    for file, error in [("syntax.py", "SyntaxError"), ("name.py", "NameError: name 'undefined_name'")]:
        spec = f"{tmp_path / file}:f"
        with pytest.raises(ValueError, match=re.escape(f"--reward-fn {spec!r}: loading '{tmp_path / file}' raised "
                                                       f"{error}")):
            load_reward_fn(spec)


# ---------------------------------------------------------------------------------------------------------------
# a served reward: the client against a real HTTP server on 127.0.0.1
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def server():
    """Answers by path: /ok scores each completion's length (null when empty), /flaky fails twice with a 500 first,
    /down always 500, /slow sleeps past the client's timeout, /short answers one score too few, /missing is a 404,
    /text is no JSON. Yields (base URL, the requests it got)."""
    got, fails = [], {"/flaky": 2}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, request))
            status, body = 200, None
            if self.path == "/slow":
                time.sleep(0.5)
            if self.path in ("/down", "/missing") or fails.get(self.path, 0) > 0:
                fails[self.path] = fails.get(self.path, 0) - 1
                status = 404 if self.path == "/missing" else 500
            elif self.path != "/text":
                scores = [len(c) or None for c in request["completions"]]
                body = {"rewards": scores[:-1] if self.path == "/short" else scores}
            data = (json.dumps(body) if body else "no json here").encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", got
    httpd.shutdown()
    httpd.server_close()


def test_served_reward_posts_the_keywords_and_reads_one_score_per_row(server):
    base, got = server
    served = lambda path, retries=2: load_reward_fn(base + path, 0.2, retries)  # noqa: E731
    kwargs = dict(prompts=["a", "b"], completions=["w7 w8", ""], completion_ids=[[8, 9], []], solution=["x", "y"],
                  trainer_state=TrainerState(global_step=2, max_steps=4, epoch=1.0), log_extra=print,
                  log_metric=print)
    scores = call_reward_fn(served("/ok"), kwargs, "cpu", base + "/ok")
    assert scores[0] == 5.0 and scores[1].isnan()  # null: the row is not judged
    path, body = got[-1]
    state = body.pop("trainer_state")
    assert path == "/ok" and body == dict(prompts=["a", "b"], completions=["w7 w8", ""], completion_ids=[[8, 9], []],
                                          solution=["x", "y"])
    assert (state["global_step"], state["max_steps"], state["epoch"]) == (2, 4, 1.0) and "is_world_process_zero" in state
    flaky = served("/flaky")
    flaky.backoff = 0.01
    assert call_reward_fn(flaky, kwargs, "cpu", "flaky")[0] == 5.0  # two 500s, then an answer
    assert [path for path, _ in got].count("/flaky") == 3
    for path, retries, message in [
            ("/down", 2, "/down failed after 3 tries, the last with HTTP 500"),
            ("/slow", 1, "/slow failed after 2 tries, the last with TimeoutError"),
            ("/missing", 2, "/missing failed after 1 tries, the last with HTTP 404"),  # a 4xx is not retried
            ("/text", 0, "/text answered with no JSON")]:
        fn = served(path, retries)
        fn.backoff = 0.01
        with pytest.raises(RuntimeError, match=re.escape(f"--reward-fn {base + path}, called with the keywords ")
                           + ".*" + re.escape(message)):
            call_reward_fn(fn, kwargs, "cpu", base + path)
    with pytest.raises(ValueError, match=re.escape("/short, called with the keywords") + ".* expected a list of 2"):
        call_reward_fn(served("/short"), kwargs, "cpu", base + "/short")
    assert [path for path, _ in got].count("/missing") == 1


def test_a_signal_stops_the_retries_and_names_the_newest_checkpoint(server, tmp_path):
    """SIGTERM while a served reward does not answer: no retry (a scheduler's grace period is short), and the error
    says which checkpoint a resume continues from, with no unrelated protocol hint (a timeout is no wrong protocol).
    At c25d42a: 4 tries 1, 2 and 4 s apart, then the timeout with OpenRLHF's hint."""
    import signal

    base, got = server
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "update-000003").mkdir(parents=True)
    (checkpoints / "latest").write_text("update-000003")
    fn = load_reward_fn(base + "/slow", 0.2, 3)
    kwargs = dict(prompts=["a"], completions=["w7"], completion_ids=[[8]], **RewardLogs(1).keywords())
    preemption = Preemption(checkpoints)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the run's handler notes it; the update goes on
        with pytest.raises(RuntimeError) as error:
            call_reward_fn(fn, kwargs, "cpu", base + "/slow")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    message = str(error.value)
    assert preemption.signal == signal.SIGTERM and [path for path, _ in got].count("/slow") == 1
    assert "not retried: SIGTERM asked the run to stop" in message and "TimeoutError" in message
    assert f"the newest checkpoint is {checkpoints / 'update-000003'}: continue with the same command and --resume " \
        "auto" in message and "openrlhf" not in message.lower()
    assert stop_asked() is None  # the handler replaced: no stop asked any more


def test_openrlhfs_protocol_posted_to_a_server_of_ours_names_the_flag(server):
    """--reward-url-protocol openrlhf posts {"query", "prompts", "labels"}; a server that reads this script's keywords
    fails on it, and the error names the flag."""
    base, got = server
    fn = load_reward_fn(base + "/ok", 0.2, 0, "openrlhf", "solution")
    kwargs = dict(queries=["a w7"], rendered_prompts=["a"], prompts=["a"], completions=["w7"], completion_ids=[[8]],
                  solution=["x"], **RewardLogs(1).keywords())
    with pytest.raises(RuntimeError, match=re.escape("(posted in OpenRLHF's protocol: --reward-url-protocol openrlhf)")):
        call_reward_fn(fn, kwargs, "cpu", base + "/ok")
    assert got[-1][1] == {"query": ["a w7"], "prompts": ["a"], "labels": ["x"]}


def test_reward_server_renders_rows_as_a_reward_model_with_its_own_tokenizer():
    """benchmarks/reward_server.py: a chat completion (holding its prompt's assistant prefix) is the assistant turn of
    the reward model's template, as `ppo.reward_model_texts` renders it; text is prompt + completion, as TRL's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reward_server import rendered
    from test_rewards import chat_tokenizer

    tok = chat_tokenizer()
    prefix = [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5 w6 "}]
    queries = ppo.left_pad(encode_prompts(tok, [prefix, prefix[:1]]), 36)
    answers = torch.tensor([[8, 9, 32], [8, 32, 36]])  # "w7 w8", "w7", each ending its turn
    completions = reward_fn_keywords(tok, {"prompt": [prefix, prefix[:1]], "input_ids": []}, "prompt",
                                       answers)["completions"]
    assert rendered(tok, [prefix, prefix[:1]], completions) == ppo.reward_model_texts(
        tok, tok, [prefix, prefix[:1]], queries, answers, chat=True)
    assert rendered(tok, ["w1 w2", "w3"], [" w4", " w5"]) == ["w1 w2 w4", "w3 w5"]


# ---------------------------------------------------------------------------------------------------------------
# start-up: refused before any model loads
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reward_fn, error, message", [
    ("tests/rewards.py:never_judges", ValueError, "every reward returned None for the prompt 'w"),
    ("tests/rewards.py:raises_inside", RuntimeError, "--reward-fn tests/rewards.py:raises_inside, called with the "
     "keywords prompts, completions, completion_ids, trainer_state, log_extra, log_metric, raised ZeroDivisionError"),
    ("COLUMN", ValueError, "column(s) ['log_metric'] would collide with the keywords"),  # a column named as TRL's
])
def test_start_up_refuses_before_models_load(assets, tmp_path, reward_fn, error, message):
    port = str(free_port())  # nothing listens there
    reward_fn, message = reward_fn.replace("PORT", port), message.replace("PORT", port)
    prompts = assets["prompts"]
    if reward_fn == "COLUMN":
        reward_fn, prompts = "tests/rewards.py:target_word_fraction", tmp_path / "column.jsonl"
        prompts.write_text("".join(json.dumps({**json.loads(line), "log_metric": 1}) + "\n"
                                   for line in assets["prompts"].read_text().splitlines()))
    args = ppo.Args(sft_model_path=str(assets["sft"]), reward_fn=reward_fn, dataset_name=str(prompts),
                    output_dir=str(tmp_path / "run"), total_episodes=16, per_device_train_batch_size=4,
                    num_mini_batches=4, eval_samples=4, num_trainable_layers=None, reward_url_retries=0,
                    unjudged_rows="stop")
    with pytest.raises(error, match=re.escape(message)):
        ppo.main(args)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# a run: a served reward model, TRL's accuracy_reward unchanged, an async function, the trainer keywords
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served_run(chat, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("served")
    lines = chat["prompts"].read_text().splitlines()
    data = root / "chat_solutions.jsonl"  # a solution TRL's math_verify parses, or one it cannot (None)
    data.write_text("".join(json.dumps({**json.loads(line), "solution": ["3", "w3"][i % 2]}) + "\n"
                            for i, line in enumerate(lines)))
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    server = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "reward_server.py"), "--reward-model-path",
                               str(chat["rm_same"]), "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until it answers (it loads the model first)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()
                time.sleep(0.2)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("REWARD_URL", url)
            env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
            fns = [url, "trl_1_12.rewards.accuracy_rewards:accuracy_reward", "tests/rewards.py:served_by_env",
                   "tests/rewards.py:progress"]
            proc, _ = run_ppo(["--sft-model-path", str(chat["sft"]), "--reward-fn", *fns, "--dataset-name",
                               str(data), *TINY, "--eval-samples", "8", "--reward-url-timeout", "120"], root / "run")
    finally:
        server.terminate()
        server.wait(30)
    return root / "run", data, proc


def test_a_served_reward_model_and_trl_functions_drive_a_run(served_run, chat):  # noqa: F811
    """Every held-out sample: the served reward model's score equals the model called on the rendered chat, the async
    function (awaiting the same server) agrees with it, TRL's accuracy_reward logs its columns as it logs them under
    TRL, and `progress` sees the update in trainer_state; log_metric values reach metrics.jsonl."""
    sys.path.insert(0, TESTS)
    from trl_1_12.rewards.accuracy_rewards import accuracy_reward

    out, data, proc = served_run
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in data.read_text().splitlines()][-8:]
    assert [m["update"] for m in metrics] == [0, 1, 2] and len(samples) == 16
    # TRL's trainer_state.global_step: updates done (an update's rollout is scored at update - 1), 2 updates per epoch
    assert [m.get("objective/reward_fn/progress") for m in metrics] == [None, 0.0, 0.5]
    assert [m.get("eval/reward_fn/progress") for m in metrics] == [0.0, None, 1.0]
    tok, rm_tok = AutoTokenizer.from_pretrained(chat["sft"]), AutoTokenizer.from_pretrained(chat["rm_same"])
    rm = AutoModelForSequenceClassification.from_pretrained(chat["rm_same"]).eval()
    for i, s in enumerate(samples):
        assert s["global_step"] == s["update"] and s["epoch"] == s["update"] / 2
        text = tok.decode(tok(s["model response"], add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        columns = {}
        expected = accuracy_reward([[{"role": "assistant", "content": text}]], [rows[i % 8]["solution"]],
                                   log_extra=lambda c, v: columns.update({c: v[0]}))
        assert [s["accuracy_reward"]] == expected and {c: s[c] for c in columns} == columns
        with torch.no_grad():
            ids = rm_tok.apply_chat_template(rows[i % 8]["prompt"] + [{"role": "assistant", "content": text}],
                                             return_tensors="pt", return_dict=True)["input_ids"]
            assert s["remote"] == pytest.approx(rm(input_ids=ids).logits[0, 0].item(), abs=1e-5)
        assert s["served_by_env"] == pytest.approx(s["remote"], abs=1e-6)
        assert s["score"] == pytest.approx(s["remote"] + (s["accuracy_reward"] or 0) + s["served_by_env"]
                                           + s["progress"], abs=1e-5)
    assert {s["gold_parsed"] for s in samples} == {"[3, '3']", "[unparseable]"}  # some rows judged, some None
    assert "objective/scores_none/accuracy_reward" in metrics[1] and "reward remote (weight 1): function" in re.sub(
        r"\s+", " ", proc.stdout)


def test_trl_rewards_run_as_installed(chat, tmp_path):  # noqa: F811
    """The README's line, `pip install --no-deps trl==1.12.0` (.ci/run does it): trl.rewards' own functions, imported
    from the package, score a run; accuracy_reward's None (a solution math_verify cannot parse) leaves a row out."""
    trl = pytest.importorskip("trl")
    assert trl.__version__ == "1.12.0"
    lines = chat["prompts"].read_text().splitlines()
    data = tmp_path / "solutions.jsonl"
    data.write_text("".join(json.dumps({**json.loads(line), "solution": ["3", "w3"][i % 2]}) + "\n"
                            for i, line in enumerate(lines)))
    _, rows = run_ppo(["--sft-model-path", str(chat["sft"]), "--reward-fn", "trl.rewards:accuracy_reward",
                       "trl.rewards:think_format_reward", "--dataset-name", str(data), *TINY, "--eval-samples", "8"],
                      tmp_path / "run")
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["accuracy_reward"] for s in samples} <= {0.0, 1.0, None} and None in {s["accuracy_reward"] for s in samples}
    assert {s["think_format_reward"] for s in samples} == {0.0}  # the tiny policy writes no <think>
    assert all("objective/scores/accuracy_reward" in r for r in rows)
