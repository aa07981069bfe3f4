"""Rewards from the other stacks, unchanged: OpenRLHF's reward server (its own handler, tests/openrlhf_58ec6ff) and its
`reward_func(queries, prompts, labels)` files, verl's data layout and `compute_score` (its GSM8K scorer,
tests/verl_945104d), and one judge call per row on two processes, none at start-up."""
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

import ppo
from conftest import ROOT, TINY, free_port, launch, make_tokenizer, run_ppo
from ppo_harness.reward_calls import RewardLogs, call_reward_fn, reward_components
from ppo_harness.reward_fns import load_reward_fn
from ppo_harness.reward_stacks import OpenRLHFReward, VerlComputeScore
from test_rewards import chat  # noqa: F401 (the chat policy and its prompts)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def openrlhf_server(assets):
    """OpenRLHF's serve_rm.py, unchanged, scoring a query by its token count in the policy's tokenizer."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "openrlhf_server.py"), "--reward_pretrain",
                             str(assets["sft"]), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            import socket

            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/get_reward"
    proc.kill()


def test_an_openrlhf_reward_server_scores_a_run_as_it_is(assets, tmp_path, openrlhf_server):
    """--reward-url-protocol openrlhf posts {"query", "prompts", "labels"}: each held-out score is the token count
    of its prompt and response, which the server's handler computed; its extra_logs are logged."""
    from transformers import AutoTokenizer

    _, rows = run_ppo(["--sft-model-path", str(assets["sft"]), "--dataset-name", str(assets["prompts"]),
                       "--reward-fn", openrlhf_server, "--reward-url-protocol", "openrlhf", *TINY,
                       "--eval-every", "1"], tmp_path / "run")
    tokenizer = AutoTokenizer.from_pretrained(assets["sft"])
    samples = lines(tmp_path / "run" / "samples.jsonl")
    for sample in samples:
        expected = len(tokenizer(sample["query"])["input_ids"]) + len(tokenizer(sample["model response"])["input_ids"])
        assert sample["score"] == sample["remote"] == expected
    assert all(r["objective/reward_fn/dummy_scores"] == pytest.approx(r["objective/scores/remote"]) for r in rows)


def test_our_protocol_against_an_openrlhf_server_names_the_mismatch(assets, tmp_path, openrlhf_server):
    proc, _ = run_ppo(["--sft-model-path", str(assets["sft"]), "--dataset-name", str(assets["prompts"]),
                       "--reward-fn", openrlhf_server, "--reward-url-retries", "0", *TINY], tmp_path / "run",
                      check=False)
    assert proc.returncode != 0 and "needs --reward-url-protocol openrlhf" in proc.stderr


@pytest.mark.parametrize("fn", ["reward_func", "reward_func_with_logs"])
def test_an_openrlhf_reward_func_file_runs_as_it_is(assets, tmp_path, fn):
    """`reward_func(queries, prompts, labels)` from a .py file, as OpenRLHF's --remote_rm_url loads it: `labels`
    from --label-key's column; a tensor, or a dict of `rewards` and `extra_logs`."""
    data = tmp_path / "labelled.jsonl"
    data.write_text("".join(json.dumps({**json.loads(line), "answer": "w7"}) + "\n"
                            for line in assets["prompts"].read_text().splitlines()))
    _, rows = run_ppo(["--sft-model-path", str(assets["sft"]), "--dataset-name", str(data), "--reward-fn",
                       f"tests/rewards.py:{fn}", "--label-key", "answer", *TINY, "--eval-every", "1"],
                      tmp_path / "run")
    for sample in lines(tmp_path / "run" / "samples.jsonl"):
        assert sample["score"] == float("w7" in sample["model response"].split())
    if fn == "reward_func_with_logs":
        assert all("objective/reward_fn/query_words" in r and "eval/reward_fn/query_words" in r for r in rows)


def bos_tokenizer():
    """The tiny word-level tokenizer, adding a BOS (`<unk>`, id 30) before each text, as Llama's adds <s>; [PAD] 31."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = make_tokenizer(pad=False)
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", 30)])
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


@pytest.mark.parametrize("rows_per_request, scores", [(1, [5.0, 2.0]), (2, [5.0, 2.003])])
def test_openrlhfs_protocol_sends_what_openrlhf_sends(openrlhf_server, rows_per_request, scores):
    """OpenRLHF's own handler (tests/openrlhf_58ec6ff) scores each query by its tokens: the prompt as OpenRLHF
    tokenises it, without the BOS the policy's tokenizer adds, then the response (its eos kept). One row per request
    by default, as OpenRLHF posts them: the server pads nothing; two, it pads the shorter row (0.001 a token here, as
    bf16 would). At c25d42a the BOS was sent (6 and 3) and the batch posted whole (padded)."""
    tokenizer = bos_tokenizer()
    prompts = ["w1 w2", "w3"]
    rows = {"prompt": prompts, "input_ids": tokenizer(prompts)["input_ids"]}
    assert rows["input_ids"][1] == [30, 4]  # the policy reads the BOS
    responses = torch.tensor([[5, 6, 0], [7, 31, 31]])  # "w4 w5 <eos>", "w6" then padding
    fn = load_reward_fn(openrlhf_server, 10.0, 0, "openrlhf", None, rows_per_request)
    record = SimpleNamespace(names=["remote"], model_paths=[], fn_specs=[openrlhf_server], fns=[fn],
                             policy_tokenizer=tokenizer, prompt_column="prompt", chat=False, max_steps=1,
                             updates_per_epoch=1, stop_unjudged=False)
    components = reward_components(record, rows, responses, 0, {})
    assert components["remote"].tolist() == pytest.approx(scores)
    assert components.metrics["dummy_scores"] == [pytest.approx(sum(scores) / 2)]  # extra_logs joined over the requests


def test_openrlhfs_labels_are_the_named_column_or_empty(assets, tmp_path):
    """`labels`: --label-key's column; without the flag the `label` column, else "" as OpenRLHF sends (c25d42a:
    None). A --label-key naming no column is refused at start-up, naming the columns (c25d42a: None for every row)."""
    got = []

    def reward_func(queries, prompts, labels):
        got.append(labels)
        return [0.0] * len(queries)
    kwargs = dict(queries=["a w7", "b"], rendered_prompts=["a", "b"], prompts=["a", "b"], completions=["w7", ""],
                  completion_ids=[[8], []], answer=["x", "y"], **RewardLogs(2).keywords())
    for label_key, extra, labels in [("answer", {}, ["x", "y"]), (None, {}, ["", ""]),
                                     (None, {"label": ["p", "q"]}, ["p", "q"])]:
        call_reward_fn(OpenRLHFReward(reward_func, label_key, "f"), {**kwargs, **extra}, "cpu", "f")
        assert got[-1] == labels
    args = ppo.Args(sft_model_path=str(assets["sft"]), reward_fn=("tests/rewards.py:reward_func",),
                    dataset_name=str(assets["prompts"]), label_key="answer", output_dir=str(tmp_path / "run"),
                    num_trainable_layers=None)
    with pytest.raises(ValueError, match=re.escape(f"--label-key 'answer' is not a column of --dataset-name "
                                                   f"{assets['prompts']} (columns: ['prompt'])")):
        ppo.main(args)
    assert not (tmp_path / "run").exists()


def test_verls_extra_info_carries_verls_keys_and_async_scorers_are_awaited():
    """compute_score gets `extra_info` as verl's reward loop passes it: the row's ({} where the data has none; c25d42a:
    None) with `num_turns` and `rollout_reward_scores` added; an `async def` one is awaited (c25d42a: refused)."""
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        seen.append(extra_info)
        return float(ground_truth in solution_str)

    async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return {"score": float(ground_truth in solution_str), "turns": extra_info["num_turns"]}
    rows = dict(completions=["w7", "w8"], prompts=["a", "b"], data_source=["d", "d"],
                reward_model=[{"ground_truth": "w7"}] * 2, **RewardLogs(2).keywords())
    added = {"num_turns": 2, "rollout_reward_scores": {}}
    assert call_reward_fn(VerlComputeScore(compute_score, "f"), rows, "cpu", "f").tolist() == [1.0, 0.0]
    call_reward_fn(VerlComputeScore(compute_score, "f"), {**rows, "extra_info": [{"index": 0}, None]}, "cpu", "f")
    assert seen == [added, added, {"index": 0, **added}, added]
    logs = RewardLogs(2)
    scores = call_reward_fn(VerlComputeScore(async_compute_score, "g"), {**rows, **logs.keywords()}, "cpu", "g")
    assert scores.tolist() == [1.0, 0.0] and logs.columns["turns"] == [2, 2]


def test_a_verl_dict_without_score_is_refused_naming_the_key():
    """verl raises KeyError 'score' on such a dict; read as a None, the row would count for nothing beside a reward
    model (the only trace objective/scores_none at 1.0), or alone stop the run saying the function returned None."""
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": float(ground_truth in solution_str)}
    rows = dict(completions=["w7", "w8"], prompts=["a", "b"], data_source=["d", "d"],
                reward_model=[{"ground_truth": "w7"}] * 2, **RewardLogs(2).keywords())
    with pytest.raises(RuntimeError, match=r"--reward-fn f.*dict without 'score' for row 0 \(keys: acc\)"):
        call_reward_fn(VerlComputeScore(compute_score, "f"), rows, "cpu", "f")


def verl_rows(n: int) -> list[dict]:
    """Rows in verl's layout (its gsm8k.py preprocessing): data_source, a chat prompt, ability, reward_model with the
    ground truth, extra_info."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"w{i % 9} w{(i * 7) % 29}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "w7"},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def test_a_verl_parquet_and_compute_score_train_as_they_are(chat, tmp_path):
    """A parquet file in verl's layout trains as it is; compute_score is called per row with data_source,
    solution_str (the response's text), reward_model's ground_truth and extra_info: its dict's `score` is the reward,
    its other keys are logged."""
    from datasets import Dataset

    Dataset.from_list(verl_rows(48)).to_parquet(tmp_path / "train.parquet")
    _, rows = run_ppo(["--sft-model-path", str(chat["sft"]), "--dataset-name", str(tmp_path / "train.parquet"),
                       "--reward-fn", "tests/rewards.py:compute_score", *TINY, "--eval-every", "1"], tmp_path / "run")
    for sample in lines(tmp_path / "run" / "samples.jsonl"):
        assert sample["score"] == float("w7" in sample["model response"]) and sample["source"] == "openai/gsm8k"
        assert isinstance(sample["words"], int) and sample["split"] == "train"
    assert all("objective/reward_fn/words" in r for r in rows)
    trained = lines(tmp_path / "run" / "training_samples.jsonl")
    assert trained and all("words" in row for row in trained)  # log_extra of the training batches


def test_verls_own_gsm8k_scorer_is_called_as_verl_calls_it():
    """tests/verl_945104d/gsm8k.py (verl's, unchanged): compute_score(solution_str, ground_truth) per row."""
    fn = load_reward_fn("tests/verl_945104d/gsm8k.py:compute_score")
    assert isinstance(fn, VerlComputeScore)
    completions = ["so #### 72", [{"role": "assistant", "content": "#### 1,000"}], "72"]
    kwargs = dict(completions=completions, prompts=["a", "b", "c"], reward_model=[{"ground_truth": "72"},
                  {"ground_truth": "1000"}, {"ground_truth": "72"}], data_source=["openai/gsm8k"] * 3,
                  **RewardLogs(3).keywords())
    assert call_reward_fn(fn, kwargs, "cpu", "gsm8k").tolist() == [1.0, 1.0, 0.0]  # strict: "####" required


class Counter(BaseHTTPRequestHandler):
    """A served reward (this script's keywords) that records each row it is sent, and scores it 0."""
    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Counter.seen.extend((body["trainer_state"]["global_step"], i) for i in body["row_id"])
        data = json.dumps({"rewards": [0.0] * len(body["row_id"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("config, held_out, process_mean", [("multi_cpu.yaml", 1, 0.0),
                                                             ("deepspeed_zero3.yaml", 3, 0.5)])
def test_two_processes_send_a_judge_each_row_once_and_no_fake_row(assets, tmp_path, monkeypatch, config, held_out,
                                                                   process_mean):
    """Training rows and held-out rows, on 2 processes: a served judge and a local function get each row once per
    scoring, where a process's held-out share repeats another's row so both sample as many (1 held-out row; ZeRO-3's
    3, stepping together); the start-up check calls the local function once, the served one never. log_metric's
    held-out value is the mean over the processes that judged (0 and 1: 0.5). At c25d42a the repeated row was judged
    twice and the start-up check ran on each process."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**json.loads(line), "row_id": i}) + "\n"
                            for i, line in enumerate(assets["prompts"].read_text().splitlines())))
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("REWARD_CALLS", str(calls))
    Counter.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Counter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = ["--sft-model-path", str(assets["sft"]), "--dataset-name", str(data), "--reward-fn",
                f"http://127.0.0.1:{server.server_address[1]}/score", "tests/rewards.py:process_index",
                "tests/rewards.py:logs_its_rows", *TINY, "--eval-samples", str(held_out), "--eval-every", "1",
                "--per-device-train-batch-size", "2"]
        _, rows = launch(args, tmp_path / "run", config=config)
    finally:
        server.shutdown()
    local = lines(calls)
    assert len([c for c in local if c["start_up"]]) == 1  # once per run
    held = set(range(64 - held_out, 64))
    for seen in (Counter.seen, [(c["step"], i) for c in local if not c["start_up"] for i in c["rows"]]):
        evaluations = [sorted(i for step, i in seen if step == s and i in held) for s in (0, 1, 2)]
        assert evaluations == [sorted(held)] * 3  # each held-out row once per evaluation
        training = [[i for step, i in seen if step == s and i not in held] for s in (0, 1)]
        assert [len(t) for t in training] == [16, 16] and all(len(set(t)) == 16 for t in training)
    assert all(r["objective/reward_fn/process"] == 0.5 for r in rows)
    assert all(r["eval/reward_fn/process"] == process_mean for r in rows)
    assert lines(tmp_path / "run" / "metrics.jsonl")[0]["eval/reward_fn/process"] == process_mean
