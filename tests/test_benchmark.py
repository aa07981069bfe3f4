"""The pure parts of benchmarks/throughput.py and gpu_bench.py: the matmul weight count and the FLOP count of one PPO
update, each against a naive count (a model's nn.Linear modules; a loop over every forward and every token), and the
data and reward of the verifiable-reward recipe, benchmarks/arithmetic.py, and benchmarks/rescore.py against ppo.py's
own evaluations. No timing here."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, run_ppo, tiny_args

sys.path.insert(0, str(ROOT / "benchmarks"))
import ablation  # noqa: E402
import ablation_table  # noqa: E402
import arithmetic  # noqa: E402
import counting  # noqa: E402
import gpu_bench  # noqa: E402
import plot_runs  # noqa: E402
import rescore  # noqa: E402
import throughput  # noqa: E402


@pytest.mark.parametrize("hidden, layers, intermediate, vocab", [(32, 2, 64, 31), (128, 6, 512, 1000)])
def test_matmul_params_counts_the_models_linear_weights(hidden, layers, intermediate, vocab):
    import torch.nn as nn
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                             num_attention_heads=4, intermediate_size=intermediate,
                                             tie_word_embeddings=False))
    head = model.get_output_embeddings()
    blocks = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    assert throughput.matmul_params(hidden, layers, intermediate, vocab) == (blocks, head.weight.numel())


def naive_update_flops(blocks, head, batch, context, response, ppo_epochs):
    """Every forward, every row, every token position: 2 FLOPs per weight that the token meets; backward twice that."""
    seq = context + response
    gen = score = train = 0
    for _ in range(batch):
        for t in range(context):  # prefill: blocks at every prompt position, the head at the last one
            gen += 2 * blocks + (2 * head if t == context - 1 else 0)
        for _ in range(response - 1):  # cached decoding steps
            gen += 2 * (blocks + head)
        for t in range(seq):  # reference (head on the response positions), value model, reward model
            score += 3 * 2 * blocks + (2 * head if t >= context else 0)
        for _ in range(ppo_epochs):
            for t in range(seq):  # policy (head on the last response + 1 positions) and value, forward + backward
                train += 3 * (2 * 2 * blocks + (2 * head if t >= context - 1 else 0))
    return dict(generation=gen, scoring=score, training=train)


@pytest.mark.parametrize("batch, context, response, epochs", [(1, 1, 1, 1), (3, 5, 4, 2), (32, 64, 53, 4)])
def test_update_flops(batch, context, response, epochs):
    blocks, head = throughput.matmul_params(128, 6, 512, 49153)
    assert throughput.update_flops(blocks, head, batch, context, response, epochs) == naive_update_flops(
        blocks, head, batch, context, response, epochs)


def question(row) -> str:
    return row["prompt"][-1]["content"]


def deterministic_rows(task) -> list[dict]:
    """A task's `make_rows`: the same rows from the same seed, others from another, and the last 100 (held out) ask
    questions no training row asks."""
    rows = task.make_rows(600, seed=3, eval_samples=100)
    assert rows == task.make_rows(600, seed=3, eval_samples=100) != task.make_rows(600, 4, 100)
    train, held_out = {question(r) for r in rows[:500]}, {question(r) for r in rows[500:]}
    assert len(held_out) > 20 and not train & held_out
    return rows


def test_arithmetic_rows_are_deterministic_and_the_held_out_questions_are_new():
    rows = deterministic_rows(arithmetic)
    for r in rows:  # the solution is the sum the question asks for
        a, b = (int(x) for x in question(r).split("?")[0].removeprefix("What is ").split(" + "))
        assert r["solution"] == str(a + b)


def test_arithmetic_accuracy_reads_the_last_integer_of_either_completion_form():
    completions = ["4 + 18 = 22", [{"role": "assistant", "content": "The answer is 22."}], "22 + 1", "no number",
                   [{"role": "assistant", "content": "It costs 1,022 dollars"}]]
    assert arithmetic.accuracy(completions, ["22", "22", "22", "22", "1,022"]) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert arithmetic.accuracy(["no number"], ["none either"]) == [0.0]  # no answer is never right


def test_counting_rows_are_deterministic_and_the_held_out_ranges_are_new():
    rows = deterministic_rows(counting)
    for r in rows:  # the solution counts from a to b, as the question asks
        a, b = (int(x) for x in question(r).removeprefix("List the whole numbers from ").split(",")[0].split(" to "))
        assert r["solution"] == ", ".join(str(n) for n in range(a, b + 1)) and 8 <= b - a + 1 <= 11


def test_counting_accuracy_wants_the_whole_list_as_asked_and_an_ended_response():
    end, solution = counting.END_OF_TURN, "12, 13, 14"
    cases = [  # (completion, its last token id, right)
        ("12, 13, 14", end, 1.0),
        ([{"role": "assistant", "content": "The numbers are 12, 13, 14."}], end, 1.0),
        ("12, 13, 14, ", 7, 0.0),  # cut off at --response-length: no end of turn, it might have gone on
        ("12 13 14", end, 0.0),  # not as asked: a shorter response
        ("12, 13, 14, 15", end, 0.0),  # one too many
        ("12, 13", end, 0.0),
        ("From 10: 12, 13, 14", end, 0.0),  # another integer
    ]
    got = counting.accuracy([c for c, _, _ in cases], [solution] * len(cases),
                            completion_ids=[[5, 6, last] for _, last, _ in cases])
    assert got == [right for _, _, right in cases]
    assert counting.accuracy(["12, 13, 14"], [solution], completion_ids=[[]]) == [0.0]  # an empty response


def fake_ablation_run(folder, before, after, kl, eval_kl, explained_variance=None):
    """A finished ablation run's files: held-out accuracy at update 0 and 2, two rollouts of 256 responses of 40
    tokens."""
    folder.mkdir(parents=True)
    critic = {} if explained_variance is None else {"val/explained_variance": explained_variance}
    rows = [{"update": 0, "episode": 0, "eval/scores": before, "eval/kl": 0.0},
            {"update": 1, "episode": 256, "objective/kl": 0.0, "val/response_length": 40.0, **critic},
            {"update": 2, "episode": 512, "objective/kl": kl, "val/response_length": 30.0, **critic,
             "eval/scores": after, "eval/kl": eval_kl}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "run.json").write_text(json.dumps({"returncode": 0, "wall_s": 60.0, "commit": "abc1234"}))


def test_ablation_table_compares_each_row_with_plain_ppo_over_the_seed_ranges(tmp_path):
    for seed, (plain, grpo, clip) in enumerate([(0.10, 0.30, 0.12), (0.14, 0.25, 0.09), (0.12, 0.28, 0.20)], 1):
        fake_ablation_run(tmp_path / "length-ppo" / f"s{seed}", 0.05, plain, 0.4, 0.5, explained_variance=0.2)
        fake_ablation_run(tmp_path / "length-grpo" / f"s{seed}", 0.05, grpo, 0.3, 0.9 + seed)
        fake_ablation_run(tmp_path / "length-clip-higher" / f"s{seed}", 0.05, clip, 0.6, 0.1, explained_variance=0.3)
    (tmp_path / "length-rloo" / "s1").mkdir(parents=True)  # started, never finished: no run.json
    table = {name: ablation_table.stats(runs) for name, runs in ablation_table.rows_of(tmp_path).items()}
    assert list(table) == ["length-clip-higher", "length-grpo", "length-ppo"]
    assert table["length-grpo"]["after"]["mean"] == pytest.approx(0.83 / 3)
    assert table["length-grpo"]["ev"] is None and table["length-ppo"]["ev"]["mean"] == pytest.approx(0.2)
    assert table["length-grpo"]["max_kl"] == 3.9  # the final policy's eval/kl, above every rollout's
    assert table["length-clip-higher"]["max_kl"] == 0.6
    assert ablation_table.curve(json.loads(line) for line in
                                (tmp_path / "length-ppo" / "s1" / "metrics.jsonl").read_text().splitlines()) \
        == [(0.0, 0.05), (256 * 40 + 256 * 30, 0.10)]  # tokens sampled before each evaluation
    lines = {line.split(" | ")[0].strip("| "): line for line in ablation_table.markdown(table).splitlines()}
    assert lines["length-grpo"].endswith("| exceeds: higher |")  # [0.25, 0.30] above [0.10, 0.14]
    assert lines["length-clip-higher"].endswith("| within spread |")  # [0.09, 0.20] overlaps
    assert lines["length-ppo"].endswith("| (baseline) |") and "| - |" in lines["length-grpo"]
    ablation_table.plot(table, tmp_path / "ablation.png")
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    page, plot = tmp_path / "page" / "ablation.md", tmp_path / "page" / "ablation.png"
    subprocess.run([sys.executable, "benchmarks/ablation_table.py", "--runs", str(tmp_path), "--markdown", str(page),
                    "-o", str(plot)], cwd=ROOT, check=True, capture_output=True)
    text = page.read_text()  # a page of its own: what the columns mean, then the same table
    assert text.startswith("# The reasoning flags' ablation") and "Per row, over its finished seeds" in text
    assert ablation_table.markdown(table) in text and plot.exists()


def test_ablation_keeps_each_finished_runs_logs_and_nothing_of_a_failed_one(tmp_path, monkeypatch):
    """The table is built from the kept logs (committed), so a failed run must leave none there."""
    def fake_command(row, seed):  # ppo.py's stand-in: writes its metrics, then exits 0 for seed 1 only
        out = ablation.OUT / row / f"s{seed}"
        return [sys.executable, "-c", f"open({str(out / 'metrics.jsonl')!r}, 'w').write('{{}}\\n'); exit({seed} - 1)"]

    monkeypatch.setattr(ablation, "command", fake_command)
    monkeypatch.setattr(ablation, "OUT", tmp_path / "runs", raising=False)
    monkeypatch.setattr(ablation, "KEEP", tmp_path / "kept", raising=False)
    monkeypatch.setattr(ablation, "COMMIT", "abc1234", raising=False)
    assert ablation.run("length-ppo", 1, threads=1).startswith("length-ppo s1: rc 0")
    assert ablation.run("length-ppo", 2, threads=1).startswith("length-ppo s2: rc 1")
    kept = tmp_path / "kept" / "length-ppo"
    assert sorted(p.name for p in kept.iterdir()) == ["s1"]
    assert (kept / "s1" / "metrics.jsonl").read_text() == "{}\n"
    assert json.loads((kept / "s1" / "run.json").read_text())["commit"] == "abc1234"
    assert ablation.finished("length-ppo", 1) and not ablation.finished("length-ppo", 2)


# tiny_args without the flags that rescore.py sets itself
RESCORE_FLAGS = {"--total-episodes", "--num-mini-batches", "--learning-rate", "--eval-every"}


def rescore_extra(assets):
    args = tiny_args(assets)
    drop = {i + j for i, a in enumerate(args) if a in RESCORE_FLAGS for j in (0, 1)}
    return [a for i, a in enumerate(args) if i not in drop and a not in ("--sft-model-path", str(assets["sft"]))]


@pytest.fixture(scope="module")
def seeded_run(assets, tmp_path_factory):
    """One tiny run both rescoring tests read: 2 updates, so the last evaluation draws with seed 5 + 2."""
    run = tmp_path_factory.mktemp("rescore") / "run"
    _, updates = run_ppo(tiny_args(assets, "--seed", "5"), run)
    return run, updates


@pytest.fixture
def one_thread(monkeypatch):
    """rescore.py's ppo.py runs on one thread, as run_ppo's do (faster for the tiny models)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_rescoring_a_saved_policy_reproduces_its_runs_last_evaluation(assets, seeded_run, tmp_path, one_thread):
    run, _ = seeded_run
    logged = plot_runs.load(run)[1]
    last = [r["score"] for r in logged if r["update"] == 2]
    assert TINY[TINY.index("--eval-samples") + 1] == str(len(last))
    scores, responses = rescore.per_prompt(str(run), 1, 7, rescore_extra(assets), tmp_path / "rescored")
    assert scores == pytest.approx(last, abs=1e-6)
    assert responses == [r["model response"] for r in logged if r["update"] == 2]
    # with two evaluations, each prompt's score is the mean of its two responses, the second drawn with seed 8
    scores2, responses2 = rescore.per_prompt(str(run), 2, 7, rescore_extra(assets), tmp_path / "rescored2")
    rows = plot_runs.load(tmp_path / "rescored2")[1]
    second = [r["score"] for r in rows if r["update"] == 1]
    assert len(responses2) == 2 * len(last) and responses2[:len(last)] == responses
    assert scores2 == pytest.approx([(a + b) / 2 for a, b in zip(last, second)], abs=1e-6)


def test_rescore_table_gives_the_initial_policy_no_gain_over_itself_and_a_run_its_largest_kl(assets, seeded_run,
                                                                                            one_thread):
    sft, (run, updates) = str(assets["sft"]), seeded_run
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rescore.py"), sft, str(run), "--initial", sft,
                           "--", *rescore_extra(assets)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=True)
    initial, itself, trained = [line.split(" | ") for line in proc.stdout.splitlines()[2:]]
    assert "(8 responses)" in proc.stdout  # and the flags after -- went to ppo.py, not into the policies
    assert itself[1] == initial[1] and itself[2] == "0.000 ± 0.000" and itself[3] == "-"
    assert trained[0] == f"| {run}" and trained[3] == f"{max(r['objective/kl'] for r in updates):.2f}"


def test_gpu_bench_reads_the_steady_rate_and_compilations_from_a_run():
    """Episodes/s over updates 2.. from ppo.py's cumulative `eps` (update k ends k * batch / eps_k seconds into the
    loop), against the update end times it was made from; phases summed over the same updates; compilations parsed."""
    ends, batch = [7.0, 9.5, 11.0, 13.25], 64  # update 1 is slow: it compiles
    rows = [{"update": 0, "eval/scores": 0.0}] + [
        {"update": k, "eps": k * batch / t, **{f"time/{p}": k + i for i, p in enumerate(
            ("generation", "scoring", "gae", "training"))}} for k, t in enumerate(ends, 1)]
    eps, phases = gpu_bench.steady_rate(rows, batch)
    assert eps == pytest.approx(3 * batch / (13.25 - 7.0))
    assert phases == {"generation": 2 + 3 + 4, "scoring": 3 + 4 + 5, "gae": 4 + 5 + 6, "training": 5 + 6 + 7}
    log = "x\ncompiled the sampler for 64 rows x 117 positions in 41.5 s\ny compiled the sampler for 8 rows x 53 " \
          "positions in 3.0 s"
    assert gpu_bench.compilations(log) == [41.5, 3.0]


def test_gpu_bench_plans_the_checks_runs_in_order_and_reports_a_failed_run():
    """The GPU check's runs in PLAN's order (TRL's only with a TRL environment; the profiled run 4 updates); a failed
    run is a row with its reason and the others are still reported, with their ratios to TRL in the same precision;
    --tiny runs 2 updates; the sampler's and the training step's compilations are read from the log."""
    args = gpu_bench.Args(trl_python="python", tiny=True)
    names = [name for name, _ in gpu_bench.plan(args)]
    assert names[:3] == ["TRL 1.12 bf16", "ppo.py bf16 --compile on (cold)", "ppo.py bf16 --compile auto (cold)"]
    assert len(names) == len(gpu_bench.PLAN) and "TRL 1.12 fp32" not in [n for n, _ in gpu_bench.plan(
        gpu_bench.Args(tiny=True))]
    assert dict(gpu_bench.plan(args))["ppo.py bf16 profiled (updates 3-4)"]["episodes"] == 4 * 8
    assert gpu_bench.episodes(args) == 16 and gpu_bench.episodes(gpu_bench.Args()) == 640
    ok = dict(eps=40.0, phases={"generation": 1.0, "scoring": 1.0, "training": 1.0}, sample_tokens_per_s=12000.0,
              full_eps=12.0, compile_s=[40.0], graphs=2, cudagraph_skips=0, compiled_again=1, peak_gb=15.0,
              startup_s=20.0, first_training_s=50.0, training_s_per_update=0.4)
    results = [dict(run="TRL 1.12 bf16", eps=10.0, phases={}, full_eps=10.0, compile_s=[], peak_gb=30.0),
               dict(run="ppo.py bf16 --compile on (cold)", **ok),
               dict(run="TRL 1.12 fp32", failed="RunFailed: TRL 1.12 failed (1): OOM")]
    text = gpu_bench.report(results, args)
    assert "| TRL 1.12 fp32 | RunFailed: TRL 1.12 failed (1): OOM |" in text and "| 2, 0 (+1 again) |" in text
    assert ("ppo.py bf16 --compile on (cold) / TRL 1.12 bf16: episodes/s (updates 2..) 4.00x, full run 1.20x, peak "
            "memory 0.50x") in text
    log = "compiled the sampler for 64 rows x 117 positions in 41.5 s (3 graphs compiled, 1 CUDA graph skips)\n" \
          "the sampler compiled again at 64 rows x 117 positions (4 graphs compiled, 1 CUDA graph skips)\n" \
          "update 1: torch.compile made 3 graph(s) (1 CUDA graph skips so far); its training phase took 50.0 s\n" \
          "update 7: torch.compile made 1 graph(s) (1 CUDA graph skips so far); its training phase took 9.0 s\n"
    assert gpu_bench.graph_counts(log) == dict(graphs=4, cudagraph_skips=1, compiled_again=2)
