"""Tests of ppo_tldr.py: the TL;DR helpers against naive versions, the reward normalisation, bad input, and end-to-end
runs on tiny offline models (conftest.py) with a small TL;DR-format dataset written here."""
import dataclasses
import json
import math
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import tyro
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo_tldr
from conftest import (ROOT, WORDS, assert_same_run, build_models, launch, launch_machines, make_tokenizer, run_ppo,
                      without_wall_clock)

TRL_METRICS = ["eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
               "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr",
               "episode"]
EVAL_METRICS = ["objective/validation_score", "objective/reference_score"]
BIAS = 0.375  # the reward normalisation written into the test reward model's config (exact in binary)
MAX_QUERY = 32  # the tests' query budget, in word-level tokens


# ---------------------------------------------------------------------------------------------------------------
# data and models
# ---------------------------------------------------------------------------------------------------------------
def tldr_rows(n: int, seed: int) -> list[dict]:
    """TL;DR-format rows over the test vocabulary; row 0 has a long post of newline-separated paragraphs that the
    query budget forces to be cut."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    rows = [{"subreddit": rng.choice(WORDS), "title": words(rng.randint(1, 3)),
             "post": "\n".join(words(rng.randint(2, 5)) for _ in range(rng.randint(1, 3))),
             "summary": words(rng.randint(1, 5))} for _ in range(n)]
    rows[0]["post"] = "\n\n".join(words(8) for _ in range(6))  # 48 words: over any budget below
    return rows


def sampling(response_length: int, temperature: float):
    """What `generate` and `sample_next` read of `Args`."""
    import types

    return types.SimpleNamespace(response_length=response_length, temperature=temperature)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tldr(assets):
    """The tiny models of conftest.py plus a reward model whose config carries the N+ normalisation bias, and the
    data: train/valid jsonl files, and a dataset directory with a `tldr` configuration holding both splits."""
    root = assets["root"] / "tldr"
    root.mkdir(exist_ok=True)
    rm = AutoModelForSequenceClassification.from_pretrained(assets["rm"])
    rm.config.bias = BIAS
    rm.save_pretrained(root / "rm_bias")
    AutoTokenizer.from_pretrained(assets["rm"]).save_pretrained(root / "rm_bias")
    train, valid = tldr_rows(40, 0), tldr_rows(6, 1)
    data_dir = root / "data_dir"
    data_dir.mkdir(exist_ok=True)
    write_jsonl(data_dir / "train_posts.jsonl", train)
    write_jsonl(data_dir / "valid_posts.jsonl", valid)
    (data_dir / "README.md").write_text("---\nconfigs:\n- config_name: tldr\n  data_files:\n"
                                        "  - split: train\n    path: train_posts.jsonl\n"
                                        "  - split: valid\n    path: valid_posts.jsonl\n---\n")
    return {"sft": assets["sft"], "rm": assets["rm"], "rm_bias": root / "rm_bias", "train_rows": train,
            "valid_rows": valid, "train": write_jsonl(root / "train.jsonl", train),
            "valid": write_jsonl(root / "valid.jsonl", valid), "data_dir": data_dir, "root": root}


def word_tokenizer():
    tok = make_tokenizer(pad=False)
    return tok, (lambda text: tok(text)["input_ids"])


# ---------------------------------------------------------------------------------------------------------------
# queries: format, truncation, references, the eos rule for queries
# ---------------------------------------------------------------------------------------------------------------
def test_format_query_is_the_paper_template():
    assert ppo_tldr.format_query("tifu", "I did a thing", "It went\n\nbadly.") == (
        "SUBREDDIT: r/tifu\n\nTITLE: I did a thing\n\nPOST: It went\n\nbadly.\n\nTL;DR:")


def test_short_query_is_left_whole():
    _, encode = word_tokenizer()
    query, ids = ppo_tldr.truncate_query(encode, "w1", "w2 w3", "w4 w5\nw6", MAX_QUERY)
    assert query == ppo_tldr.format_query("w1", "w2 w3", "w4 w5\nw6") and ids == encode(query)


def test_truncation_cuts_whole_paragraphs_first():
    """The result is the longest newline-prefix of the post whose query fits (naive search over all of them)."""
    _, encode = word_tokenizer()
    rng = random.Random(5)
    for budget in (12, 17, 25, 31, 60):
        post = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(8))
        query, ids = ppo_tldr.truncate_query(encode, "w9", "w1 w2", post, budget)
        assert len(ids) <= budget and ids == encode(query)
        assert query.startswith("SUBREDDIT: r/w9\n\nTITLE: w1 w2\n\nPOST: ") and query.endswith("\n\nTL;DR:")
        kept = query[len("SUBREDDIT: r/w9\n\nTITLE: w1 w2\n\nPOST: "):-len("\n\nTL;DR:")]
        prefixes = [post[:i] for i, c in enumerate(post) if c == "\n"] + [post]  # shortest first, then uncut
        fitting = [p for p in prefixes if len(encode(ppo_tldr.format_query("w9", "w1 w2", p))) <= budget]
        assert kept == fitting[-1], (budget, kept)


def test_truncation_without_newlines_cuts_words_then_characters():
    _, encode = word_tokenizer()
    post = "w1 w2 w3 w4 w5 w6 w7 w8"
    query, ids = ppo_tldr.truncate_query(encode, "w0", "w0", post, 10)  # 6 template tokens + at most 4 words
    assert query.endswith("POST: w1 w2 w3 w4\n\nTL;DR:") and len(ids) == 10
    chars = lambda text: list(text)  # noqa: E731  (a character-level "tokenizer")
    full = len(ppo_tldr.format_query("r", "t", ""))
    query, ids = ppo_tldr.truncate_query(chars, "r", "t", "abcdefghij", full + 4)
    assert query == ppo_tldr.format_query("r", "t", "abcd") and len(ids) == full + 4


def sfd_truncation(encode, subreddit, title, post, max_query_length):
    """SFD's loop: cut at the last newline (else space, else a character) and encode again, until it fits."""
    while len(encode(ppo_tldr.format_query(subreddit, title, post))) > max_query_length:
        cut = post.rfind("\n")
        cut = post.rfind(" ") if cut < 0 else cut
        post = post[:cut] if cut >= 0 else post[:-1]
    return ppo_tldr.format_query(subreddit, title, post)


def test_truncation_is_sfds_loop_and_encodes_a_long_post_a_few_times():
    """The same query as SFD's cut-and-encode loop on random posts (paragraphs, words, one long word) at every
    budget, words or characters as tokens; a 22,000-word post without a newline (SFD's loop: an encode per word, about
    18 minutes on a real tokenizer) takes at most 40 encodes."""
    _, words = word_tokenizer()
    chars = lambda text: list(text)  # noqa: E731
    rng = random.Random(7)
    for _ in range(40):
        paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 4))]
        post = "\n".join(paragraphs) + rng.choice(["", " w1w2w3w4w5"])
        for encode in (words, chars):
            full = len(encode(ppo_tldr.format_query("w9", "w1", post)))
            for budget in range(len(encode(ppo_tldr.format_query("w9", "w1", ""))), full + 2):
                assert ppo_tldr.truncate_query(encode, "w9", "w1", post, budget)[0] == sfd_truncation(
                    encode, "w9", "w1", post, budget), (post, budget)
    calls = []

    def counted(text):
        calls.append(1)
        return words(text)
    post = [rng.choice(WORDS) for _ in range(22_000)]
    query, ids = ppo_tldr.truncate_query(counted, "w9", "w1", " ".join(post), 100)
    kept = 100 - len(words(ppo_tldr.format_query("w9", "w1", "")))  # a word a token: SFD's loop keeps these
    assert len(ids) == 100 and len(calls) <= 40 and query == ppo_tldr.format_query("w9", "w1", " ".join(post[:kept]))


def test_truncation_refuses_a_title_that_alone_overflows():
    _, encode = word_tokenizer()
    with pytest.raises(ValueError, match="--max-query-length 8 is too small"):
        ppo_tldr.truncate_query(encode, "w1", " ".join(WORDS[:10]), "w1 w2", 8)


def test_tokenize_tldr_queries_and_references(tldr):
    tok, encode = word_tokenizer()
    rows = tldr["train_rows"][:5]
    out = ppo_tldr.tokenize_tldr({c: [r[c] for r in rows] for c in ppo_tldr.TLDR_COLUMNS}, tok, MAX_QUERY)
    for row, query, ids, ref in zip(rows, out["query"], out["input_ids"], out["reference_ids"]):
        assert len(ids) <= MAX_QUERY and ids == encode(query) and ids[-1] != tok.eos_token_id
        assert ref == encode(" " + row["summary"]) + [tok.eos_token_id]  # " " + summary + eos (N+ detail 4)
    assert len(encode(ppo_tldr.format_query(rows[0]["subreddit"], rows[0]["title"], rows[0]["post"]))) > MAX_QUERY
    assert out["query"][0] != ppo_tldr.format_query(rows[0]["subreddit"], rows[0]["title"], rows[0]["post"])


def test_queries_ending_in_eos_are_refused():
    """A tokenizer that appends eos to every text would end each query with eos."""
    from tokenizers.processors import TemplateProcessing

    tok, _ = word_tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", 0)])
    batch = {"subreddit": ["w1"], "title": ["w2"], "post": ["w3"], "summary": ["w4"]}
    with pytest.raises(ValueError, match="ends in the eos token"):
        ppo_tldr.tokenize_tldr(batch, tok, MAX_QUERY)


def test_left_padding():
    assert ppo_tldr.left_pad([[1, 2, 3], [4]], 9).tolist() == [[1, 2, 3], [9, 9, 4]]  # queries: left-padded


# ---------------------------------------------------------------------------------------------------------------
# the missing-eos rule and the reward normalisation
# ---------------------------------------------------------------------------------------------------------------
def naive_missing_eos(scores, contain, rule, value, penalty):
    out = []
    for s, c in zip(scores, contain):
        if rule == "replace":
            out.append(s if c else value)
        elif rule == "subtract":
            out.append(s if c else s - penalty)
        else:
            out.append(s)
    return out


@pytest.mark.parametrize("rule", ["replace", "subtract", "none"])
def test_missing_eos_rules_against_naive(rule):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, generator=g, dtype=torch.float64) * 3
    contain = torch.rand(64, generator=g) < 0.5
    got = ppo_tldr.apply_missing_eos_rule(scores, contain, rule, -1.0, 1.5)
    want = naive_missing_eos(scores.tolist(), contain.tolist(), rule, -1.0, 1.5)
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    if rule == "replace":  # the N+ form ignores the reward model's opinion entirely
        assert set(got[~contain].tolist()) == {-1.0}
    with pytest.raises(ValueError, match="unknown --missing-eos-rule"):
        ppo_tldr.apply_missing_eos_rule(scores, contain, "clip", -1.0, 1.5)


def test_reward_bias_shifts_scores_by_exactly_minus_b(tldr):
    """A reward model whose config carries bias=b: its scores are the plain transformers scores minus b (N+ detail
    14), and so are the values of a value model initialised from it (N+ detail 18)."""
    plain = AutoModelForSequenceClassification.from_pretrained(tldr["rm"]).eval()
    biased = AutoModelForSequenceClassification.from_pretrained(tldr["rm_bias"]).eval()
    assert biased.config.bias == BIAS and ppo_tldr.score_bias(biased.config) == BIAS
    assert ppo_tldr.score_bias(plain.config) == 0.0
    g = torch.Generator().manual_seed(1)
    qr = torch.randint(1, 30, (5, 12), generator=g)  # unpadded query + response, context 7
    with torch.no_grad():
        # transformers' own forward and pooling (the last token of an unpadded row), one row at a time
        reference = torch.stack([plain(input_ids=row[None]).logits[0, 0] for row in qr])
        ours_plain = ppo_tldr.reward_model_scores(plain, qr, 31, 7)
        ours_biased = ppo_tldr.reward_model_scores(biased, qr, 31, 7)
        values_plain = ppo_tldr.value_forward(plain, qr, 31, 7)
        values_biased = ppo_tldr.value_forward(biased, qr, 31, 7)
    torch.testing.assert_close(ours_plain, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours_biased, ours_plain - BIAS)
    assert torch.equal(values_biased, values_plain - BIAS)


def test_a_boolean_bias_is_an_architecture_flag_not_a_normalisation():
    from transformers import PretrainedConfig

    assert ppo_tldr.score_bias(PretrainedConfig(bias=True)) == 0.0  # Falcon's `bias: bool`
    assert ppo_tldr.score_bias(PretrainedConfig(bias=-2)) == -2.0
    assert ppo_tldr.score_bias(PretrainedConfig()) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# the math shared with ppo.py: the copies must compute what ppo.py's (tested in test_math.py) compute
# ---------------------------------------------------------------------------------------------------------------
def test_copied_helpers_compute_what_ppo_computes():
    import ppo

    g = torch.Generator().manual_seed(2)
    b, t, v = 6, 9, 11
    responses = torch.randint(0, 5, (b, t), generator=g)
    seq = ppo.first_true_indices(responses == 0) - 1
    logits, tokens = torch.randn(b, t, v, generator=g), torch.randint(0, v, (b, t), generator=g)
    lp, ref = torch.randn(b, t, generator=g) - 2, torch.randn(b, t, generator=g) - 2
    adv, vals, rets = (torch.randn(b, t, generator=g) for _ in range(3))
    mask = torch.rand(b, t, generator=g) < 0.3
    mask[:, 0] = False
    scores = torch.randn(b, generator=g)
    cases = [("first_true_indices", (responses == 3,)), ("truncate_response", (3, 99, responses)),
             ("scale_logits", (logits, 0.7, 4)), ("logprobs_from_logits", (logits, tokens)),
             ("entropy_from_logits", (logits,)), ("masked_whiten", (adv, ~mask)),
             ("kl_penalty", (lp, ref, "k1")), ("kl_penalty", (lp, ref, "k3")),
             ("compute_rewards", (scores, lp - ref, 0.05, seq)), ("compute_gae", (adv, vals, 1.0, 0.95)),
             ("policy_loss", (lp, ref, adv, mask, 0.2)), ("value_loss", (vals, rets, adv, mask, 0.2)),
             ("batch_sizes", (4, 2, 2, 3, 1000))]
    for name, inputs in cases:
        ours, theirs = getattr(ppo_tldr, name)(*inputs), getattr(ppo, name)(*inputs)
        ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
        assert len(ours) == len(theirs), name
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    sizes = ppo_tldr.batch_sizes(2, 1, 2, 3, 10_000)
    assert all(torch.equal(ppo_tldr.rollout_indices(50, sizes, u, 7, r), ppo.rollout_indices(50, sizes, u, 7, r))
               for u in (1, 5, 9) for r in range(3))


# ---------------------------------------------------------------------------------------------------------------
# loading data
# ---------------------------------------------------------------------------------------------------------------
def test_load_tldr_split_from_files_and_directories(tldr, tmp_path):
    from datasets import Dataset, DatasetDict

    assert len(ppo_tldr.load_tldr_split(str(tldr["train"]), None, "ignored", "--dataset-name")) == 40
    assert ppo_tldr.load_tldr_split(str(tldr["data_dir"]), "tldr", "valid", "--dataset-name")["title"] == [
        r["title"] for r in tldr["valid_rows"]]
    Dataset.from_list(tldr["valid_rows"]).to_parquet(tmp_path / "v.parquet")
    assert len(ppo_tldr.load_tldr_split(str(tmp_path / "v.parquet"), None, "x", "--eval-dataset-name")) == 6
    DatasetDict({"validation": Dataset.from_list(tldr["valid_rows"][:4])}).save_to_disk(tmp_path / "saved")
    assert len(ppo_tldr.load_tldr_split(str(tmp_path / "saved"), None, "validation", "--dataset-name")) == 4
    for name, config, split, message in [(tmp_path / "saved", None, "train", "no split 'train'"),
                                         (tldr["data_dir"], "tldr", "test", "cannot load split 'test'"),
                                         (ROOT / "requirements.txt", None, "train", "unsupported file type")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ppo_tldr.load_tldr_split(str(name), config, split, "--dataset-name")
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "w1"}])
    with pytest.raises(ValueError, match=r"columns \['subreddit', 'title', 'post', 'summary'\] are missing"):
        ppo_tldr.load_tldr_split(str(tmp_path / "prompts.jsonl"), None, "train", "--dataset-name")


def test_responses_are_response_length_wide_when_every_row_stops_early():
    """Generation ends once every row has its eos; phase 1 pads the responses to --response-length (SFD), so the
    longest response's score lands one past its eos, where the value bootstraps, and not on the eos itself."""
    class AlwaysEos(torch.nn.Module):  # a policy that puts almost all probability on token 0, the eos
        def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep=None,
                    past_key_values=None):
            logits = torch.full((*input_ids.shape, 5), -20.0)
            logits[..., 0] = 20.0
            return type("Output", (), dict(logits=logits, past_key_values=None))

    responses, logprobs = ppo_tldr.generate(AlwaysEos(), torch.tensor([[1, 2], [7, 3]]), 7, sampling(6, 0.7), stop_token_id=0)
    assert responses.tolist() == [[0]] * 2  # the eos, and sampling stops
    responses, logprobs = F.pad(responses, (0, 5), value=7), F.pad(logprobs, (0, 5), value=ppo_tldr.INVALID_LOGPROB)
    assert responses.tolist() == [[0, 7, 7, 7, 7, 7]] * 2
    assert (logprobs[:, 1:] == ppo_tldr.INVALID_LOGPROB).all() and (logprobs[:, 0] <= 0).all()
    sequence_lengths = ppo_tldr.first_true_indices(responses == 7) - 1
    rewards, _ = ppo_tldr.compute_rewards(torch.ones(2), torch.zeros(2, 6), 0.0, sequence_lengths)
    assert rewards.argmax(1).tolist() == [1, 1]  # the score one past the eos
    source = (ROOT / "ppo_tldr.py").read_text()  # phase 1 pads both, before anything reads them
    assert "responses = F.pad(responses, (0, args.response_length - responses.size(1)), value=pad_token_id)" in source
    assert "logprobs = F.pad(logprobs, (0, args.response_length - logprobs.size(1)), value=INVALID_LOGPROB)" in source


# ---------------------------------------------------------------------------------------------------------------
# bad input is refused with a clear message (in-process: every check runs before any model is loaded)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(eval_dataset_name=None), "is a single file, so it has no 'validation' split"),
    (dict(missing_eos_rule="clip"), "unknown --missing-eos-rule 'clip'"),
    (dict(kl_estimator="k2"), "unknown --kl-estimator"),
    (dict(stop_token="."), "unknown --stop-token"),
    (dict(eval_every=-1), "--eval-every -1 is out of range"),
    (dict(eval_samples=0), "--eval-samples 0 is out of range"),
    (dict(max_query_length=0), "--max-query-length 0 is out of range"),
    (dict(num_mini_batches=0), "--num-mini-batches 0 is out of range"),
    (dict(per_device_train_batch_size=64), "too few for one rollout batch of 64"),
    (dict(max_query_length=5), "--max-query-length 5 is too small"),
    (dict(response_length=120), "exceeds the models' 128 positions"),
    (dict(reward_model_path="SFT"), "is not a sequence classifier"),
    (dict(whiten_rewards=True, per_device_train_batch_size=2, gradient_accumulation_steps=1), "at least 8"),
    (dict(resume="auto", output_dir=None), "--resume auto needs --output-dir"),
    (dict(response_length=0), "--response-length 0 is out of range: it must lie in [1, inf)"),
    (dict(learning_rate=-1.0), "--learning-rate -1.0 is out of range"),
    (dict(cliprange=0.0), "--cliprange 0.0 is out of range: it must lie in (0, inf)"),
    (dict(eval_dataset_name="EMPTY"), "--eval-dataset-name EMPTY: no rows could be read from this file"),
])
def test_bad_input_is_refused(tldr, tmp_path, overrides, message):
    (tmp_path / "empty.jsonl").write_text("")
    overrides = {k: str(tmp_path / "empty.jsonl") if v == "EMPTY" else v for k, v in overrides.items()}
    message = message.replace("EMPTY", str(tmp_path / "empty.jsonl"))
    fields = dict(sft_model_path=str(tldr["sft"]), reward_model_path=str(tldr["rm_bias"]),
                  dataset_name=str(tldr["train"]), eval_dataset_name=str(tldr["valid"]),
                  output_dir=str(tmp_path / "run"), total_episodes=16, per_device_train_batch_size=4,
                  gradient_accumulation_steps=1, max_query_length=MAX_QUERY, response_length=8)
    fields.update({k: str(tldr["sft"]) if v == "SFT" else v for k, v in overrides.items()})
    with pytest.raises(ValueError, match=re.escape(message)):
        ppo_tldr.main(ppo_tldr.Args(**fields))
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything


# ---------------------------------------------------------------------------------------------------------------
# end to end: a run with the reward model that carries a bias, its resume, and a second configuration
# ---------------------------------------------------------------------------------------------------------------
def tiny_args(tldr, *extra):
    return ["--sft-model-path", str(tldr["sft"]), "--reward-model-path", str(tldr["rm_bias"]), "--dataset-name",
            str(tldr["train"]), "--eval-dataset-name", str(tldr["valid"]), "--max-query-length", str(MAX_QUERY),
            "--total-episodes", "64", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
            "--num-mini-batches", "2", "--num-ppo-epochs", "2", "--local-rollout-forward-batch-size", "8",
            "--response-length", "8", "--learning-rate", "1e-3", "--eval-samples", "5", "--eval-every", "2", *extra]


@pytest.fixture(scope="module")
def tldr_run(tldr, tmp_path_factory):
    """4 updates of 16 responses (3 passes over 40 posts), validation after updates 2 and 4, a checkpoint after
    every update of which the newest 2 are kept."""
    out = tmp_path_factory.mktemp("tldr_run") / "run"
    args = tiny_args(tldr, "--stop-token", "eos", "--missing-eos-rule", "replace", "--penalty-reward-value", "-2.0",
                     "--save-every", "1", "--save-total-limit", "2", "--exp-name", "tiny_tldr", "--seed", "3",
                     "--kl-coef", "0.1", "--cliprange", "0.3", "--vf-coef", "0.5", "--cliprange-value", "0.5",
                     "--gamma", "0.99", "--lam", "0.9", "--temperature", "0.9", "--max-grad-norm", "0.5")
    proc, rows = run_tldr(args, out)
    return out, proc, rows, args


def run_tldr(args, output_dir):
    return run_ppo(args, output_dir, script="ppo_tldr.py")


def test_run_logs_every_trl_metric_and_the_validation_scores(tldr_run):
    _, _, rows, _ = tldr_run
    assert [r["update"] for r in rows] == [1, 2, 3, 4] and [r["episode"] for r in rows] == [16, 32, 48, 64]
    for row in rows:
        for key in TRL_METRICS:
            assert key in row and math.isfinite(row[key]), key
        assert row["policy/optimizer_steps"] == 4  # one per minibatch: 2 epochs x 2 minibatches
    assert [all(k in r for k in EVAL_METRICS) for r in rows] == [False, True, False, True]  # every 2 updates and last
    assert all(math.isfinite(rows[i][k]) for i in (1, 3) for k in EVAL_METRICS)
    assert rows[1]["objective/reference_score"] == rows[3]["objective/reference_score"]  # the references don't move


def test_run_logs_every_metric_to_tensorboard(tldr_run):
    """The same scalars as metrics.jsonl, validation included, in TensorBoard event files of the run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, rows, _ = tldr_run
    events = EventAccumulator(str(out)).Reload()
    assert set(events.Tags()["scalars"]) == {k for r in rows for k in r if k != "update"}
    assert [e.value for e in events.Scalars("objective/validation_score")] == pytest.approx(
        [r["objective/validation_score"] for r in rows if "objective/validation_score" in r])


def test_run_saves_eval_tables_that_match_the_logged_scores(tldr_run, tldr):
    out, proc, rows, _ = tldr_run
    first_five = tldr["valid_rows"][:5]  # --eval-samples 5: the validation file's first 5 posts
    tok, _ = word_tokenizer()
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["update-000002.jsonl", "update-000004.jsonl"]
    for update in (2, 4):
        table = [json.loads(line) for line in (out / "eval" / f"update-{update:06d}.jsonl").read_text().splitlines()]
        assert len(table) == 5 and all(list(r) == ["query", "reference", "response", "score"] for r in table)
        assert [r["reference"] for r in table] == [tok.decode(tok(" " + row["summary"])["input_ids"] + [0])
                                                    for row in first_five]  # " " + summary + eos
        assert all(r["query"].startswith("SUBREDDIT: r/") and r["query"].endswith("\n\nTL;DR:") for r in table)
        mean = sum(r["score"] for r in table) / len(table)
        assert mean == pytest.approx(rows[update - 1]["objective/validation_score"], rel=1e-6)
    assert "validation after update 4" in proc.stdout and "TL;DR:" in proc.stdout  # the rich table


def test_reference_score_is_the_biased_reward_model_on_query_plus_reference(tldr_run, tldr):
    """objective/reference_score recomputed with plain transformers: each query (truncated, as the script builds it)
    followed by " " + summary + eos, read at the last token, minus the config's bias."""
    _, _, rows, _ = tldr_run
    tok, _ = word_tokenizer()
    valid = tldr["valid_rows"][:5]
    batch = ppo_tldr.tokenize_tldr({c: [r[c] for r in valid] for c in ppo_tldr.TLDR_COLUMNS}, tok, MAX_QUERY)
    rm = AutoModelForSequenceClassification.from_pretrained(tldr["rm_bias"]).eval()
    with torch.no_grad():
        scores = [rm(input_ids=torch.tensor([q + r])).logits[0, 0].item() - BIAS
                  for q, r in zip(batch["input_ids"], batch["reference_ids"])]
    assert rows[3]["objective/reference_score"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)


def test_run_saves_loadable_policy_and_value_model_and_keeps_two_checkpoints(tldr_run, tldr):
    out, _, _, _ = tldr_run
    args = json.loads((out / "args.json").read_text())
    assert args["exp_name"] == "tiny_tldr" and args["run_name"].startswith("tiny_tldr__3__")
    policy = AutoModelForCausalLM.from_pretrained(out)
    value = AutoModelForSequenceClassification.from_pretrained(out / "value_model")
    assert value.config.num_labels == 1 and value.config.bias == BIAS  # inherited from the reward model
    initial = AutoModelForCausalLM.from_pretrained(tldr["sft"])
    assert any(not torch.equal(a, b) for a, b in zip(policy.state_dict().values(), initial.state_dict().values()))
    initial_value = AutoModelForSequenceClassification.from_pretrained(tldr["rm_bias"])
    assert any(not torch.equal(a, b) for a, b in zip(value.state_dict().values(), initial_value.state_dict().values()))
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(tldr["sft"]).get_vocab()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "update-000003", "update-000004"]


def test_resume_gives_the_metrics_and_validation_of_an_uninterrupted_run(tldr_run, tmp_path):
    out, _, uninterrupted, args = tldr_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)  # as a run killed during update 4 would have left it
    shutil.rmtree(resumed / "checkpoints" / "update-000004")
    (resumed / "checkpoints" / "latest").write_text("update-000003")
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in
                                                   (out / "metrics.jsonl").read_text().splitlines()[:3]))
    proc, rows = run_tldr(args + ["--resume", "auto"], resumed)
    assert "continuing at update 4" in proc.stdout
    assert without_wall_clock(rows) == without_wall_clock(uninterrupted)
    assert (resumed / "eval" / "update-000004.jsonl").read_text() == (out / "eval" / "update-000004.jsonl").read_text()


def test_llama_config_dataset_value_from_sft_subtract_rule_no_stop(tmp_path, tldr):
    """Another configuration end to end: Llama with an in-vocabulary pad, a dataset directory with a named
    configuration and split names, the value model from the SFT policy (fresh zero head, no bias), TRL's subtractive
    eos rule, no stop token, k3, reward whitening, no gradient clipping, wandb (disabled) and remote code allowed."""
    paths = build_models(tmp_path, arch="llama", pad=True)
    out = tmp_path / "run"
    _, rows = run_tldr(["--sft-model-path", str(paths["sft"]), "--reward-model-path", str(paths["rm"]),
                       "--value-model-path", str(paths["sft"]), "--dataset-name", str(tldr["data_dir"]),
                       "--dataset-config", "tldr", "--dataset-train-split", "train", "--dataset-eval-split", "valid",
                       "--max-query-length", str(MAX_QUERY), "--total-episodes", "16", "--per-device-train-batch-size",
                       "8", "--gradient-accumulation-steps", "1", "--num-mini-batches", "1", "--num-ppo-epochs", "1",
                       "--local-rollout-forward-batch-size", "4", "--response-length", "6", "--eval-samples", "None",
                       "--eval-every", "0", "--stop-token", "None", "--missing-eos-rule", "subtract",
                       "--missing-eos-penalty", "2.0", "--kl-estimator", "k3", "--whiten-rewards",
                       "--max-grad-norm", "None", "--track", "--wandb-project-name", "test", "--wandb-entity",
                       "nobody", "--trust-remote-code"], out)
    assert len(rows) == 2 and all(math.isfinite(rows[-1][k]) for k in TRL_METRICS + EVAL_METRICS)
    assert "objective/validation_score" not in rows[0]  # --eval-every 0: only after the last update
    assert len((out / "eval" / "update-000002.jsonl").read_text().splitlines()) == 6  # --eval-samples None: all
    assert all(r["val/response_length"] == 6 for r in rows)  # no stop token: always the full length
    value = AutoModelForSequenceClassification.from_pretrained(out / "value_model")
    assert value.config.num_labels == 1 and ppo_tldr.score_bias(value.config) == 0.0


@pytest.fixture(scope="module")
def two_process_run(tldr, tmp_path_factory):
    out = tmp_path_factory.mktemp("tldr_ddp") / "run"
    args = tiny_args(tldr, "--total-episodes", "32")
    return args, out, *launch(args, out, script="ppo_tldr.py")


def test_two_processes_share_the_validation_posts(tldr_run, two_process_run):
    """2 CPU processes (gloo): each validates its share of the 5 held-out posts (3 each, the last wrapping around to
    the first post); the gathered table keeps the file's order, one row per post, and the references score as in the
    one-process run."""
    _, out, proc, rows = two_process_run
    assert "processes 2; per update 32 responses (16 per process)" in proc.stdout
    assert len(rows) == 1 and all(math.isfinite(rows[0][k]) for k in TRL_METRICS + EVAL_METRICS)
    table = [json.loads(line) for line in (out / "eval" / "update-000001.jsonl").read_text().splitlines()]
    one_process = [json.loads(line) for line in (tldr_run[0] / "eval" / "update-000002.jsonl").read_text().splitlines()]
    assert [r["query"] for r in table] == [r["query"] for r in one_process]
    assert [r["reference"] for r in table] == [r["reference"] for r in one_process]
    assert rows[0]["objective/reference_score"] == pytest.approx(tldr_run[2][1]["objective/reference_score"], abs=1e-6)
    assert rows[0]["objective/validation_score"] == pytest.approx(sum(r["score"] for r in table) / 5, rel=1e-6)


def test_zero3_reproduces_the_two_process_run(two_process_run, tmp_path):
    """DeepSpeed ZeRO-3 (the shipped config, fp32, on 2 CPU processes): policy and value sharded, reference and
    reward model as sharded inference engines, the policy gathered for generation. Metrics, validation table and
    saved weights are those of the plain data-parallel run."""
    args, out, _, reference = two_process_run
    _, rows = launch([*args, "--ds3-gather-for-generation"], tmp_path / "run", script="ppo_tldr.py",
                     config="deepspeed_zero3.yaml")
    assert_same_run(rows, reference)
    table, expected = ([json.loads(line) for line in (run / "eval" / "update-000001.jsonl").read_text().splitlines()]
                       for run in (tmp_path / "run", out))
    assert [r["response"] for r in table] == [r["response"] for r in expected]
    ours, theirs = (AutoModelForCausalLM.from_pretrained(run).state_dict() for run in (tmp_path / "run", out))
    assert all(torch.allclose(ours[k].float(), theirs[k].float(), atol=1e-5) for k in theirs)


def test_two_machines_reproduce_the_two_process_run(two_process_run, tmp_path):
    """Two machines on this host (one process each, one shared disk, the posts tokenised by the run's first process):
    the metrics and validation table of one machine with two processes, each written once."""
    args, out, _, reference = two_process_run
    procs, rows = launch_machines(args, tmp_path / "run", script="ppo_tldr.py")
    assert_same_run(rows, reference)
    assert sum(p.stdout.count("processes 2; per update 32 responses") for p in procs) == 1
    assert (tmp_path / "run" / "eval" / "update-000001.jsonl").read_text() == (
        out / "eval" / "update-000001.jsonl").read_text()


# ---------------------------------------------------------------------------------------------------------------
# flags: the paper's defaults, every flag used by a test, --help
# ---------------------------------------------------------------------------------------------------------------
def test_defaults_are_the_papers_setup():
    a = ppo_tldr.Args()
    assert (a.sft_model_path, a.reward_model_path, a.value_model_path) == (
        "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr", "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr", None)
    assert (a.dataset_name, a.dataset_train_split, a.dataset_eval_split) == (
        "vwxyzjn/summarize_from_feedback_tldr_3_filtered", "train", "validation")
    assert (a.total_episodes, a.response_length, a.stop_token, a.learning_rate, a.temperature, a.kl_coef) == (
        1_000_000, 53, "eos", 3e-6, 0.7, 0.05)
    assert (a.num_ppo_epochs, a.num_mini_batches, a.per_device_train_batch_size, a.gradient_accumulation_steps,
            a.local_rollout_forward_batch_size, a.whiten_rewards, a.max_query_length) == (4, 1, 16, 4, 16, False, 512)
    assert (a.missing_eos_rule, a.penalty_reward_value) == ("replace", -1.0)
    sizes = ppo_tldr.batch_sizes(a.per_device_train_batch_size, a.gradient_accumulation_steps, a.num_mini_batches, 8,
                                 a.total_episodes)
    assert sizes.batch_size == 512 and sizes.num_updates == 1954  # 8 GPUs: the paper's batch of 512


def test_push_to_hub_pushes_the_tldr_run(tldr, tmp_path, monkeypatch):
    """ppo_tldr.py's --push-to-hub, --hub-model-id and --hub-private-repo, through tests/hub_recorded.py (test_hub.py:
    ppo.py's, with what the upload holds): the named private repository gets the policy, without checkpoints."""
    from test_hub import recorded_run

    proc, _, calls, remote = recorded_run(tiny_args(tldr, "--push-to-hub", "--hub-model-id", "me/tldr",
                                                    "--hub-private-repo", "--save-every", "1"),
                                          tmp_path, monkeypatch, script="ppo_tldr.py")
    assert [c["call"] for c in calls] == ["whoami", "create_repo", "upload_folder"]
    assert calls[1]["repo_id"] == "me/tldr" and calls[1]["private"] is True
    assert (remote / "model.safetensors").exists() and not (remote / "checkpoints").exists()
    assert "pushed to https://huggingface.co/me/tldr" in proc.stdout


def test_hub_strategy_all_checkpoints_pushes_each_tldr_checkpoint_as_a_branch(tldr, tmp_path, monkeypatch):
    """--hub-strategy all_checkpoints in ppo_tldr.py: each checkpoint to its branch when written, then the run."""
    from test_hub import recorded_run

    _, rows, calls, remote = recorded_run(tiny_args(tldr, "--push-to-hub", "--hub-model-id", "me/tldr", "--save-every",
                                                    "1", "--hub-strategy", "all_checkpoints"),
                                          tmp_path, monkeypatch, script="ppo_tldr.py")
    branches = [c["branch"] for c in calls if c["call"] == "create_branch"]
    assert branches == [f"update-{u:06d}" for u in range(1, len(rows) + 1)] and len(rows) >= 2
    assert all((remote / f"@{b}" / "trainer_state.json").exists() for b in branches)
    assert calls[-1]["call"] == "upload_folder" and calls[-1].get("revision") is None  # the run, to main


def test_every_flag_is_exercised_by_a_test():
    source = Path(__file__).read_text()
    missing = [f.name for f in dataclasses.fields(ppo_tldr.Args)
               if not any(form in source for form in (f"--{f.name.replace('_', '-')}", f"--no-{f.name.replace('_', '-')}",
                                                f"{f.name}="))]
    assert not missing, f"flags no test passes: {missing}"


def test_help_lists_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        tyro.cli(ppo_tldr.Args, args=["--help"], prog="ppo_tldr.py")
    out = capsys.readouterr().out
    for f in dataclasses.fields(ppo_tldr.Args):
        assert f"--{f.name.replace('_', '-')}" in out, f.name
    flat = re.sub(r"\s+", " ", out)
    assert "{replace,subtract,none}" in flat and "(default: replace)" in flat and "(default: 1000000)" in flat


def bf16_saved(tldr, root):
    """The SFT policy and the reward model saved in bf16, as most hub checkpoints are."""
    for name, cls in (("sft", AutoModelForCausalLM), ("rm_bias", AutoModelForSequenceClassification)):
        cls.from_pretrained(tldr[name]).to(torch.bfloat16).save_pretrained(root / name)
        AutoTokenizer.from_pretrained(tldr[name]).save_pretrained(root / name)
    return {**tldr, "sft": root / "sft", "rm_bias": root / "rm_bias"}


def test_bf16_autocast_run_on_one_cpu_process(tldr, tmp_path):
    """`accelerate launch --mixed_precision bf16` on CPU from bf16-saved checkpoints: forwards under autocast, the
    trained weights float32 (--dtype), every metric finite, the first KL 0 up to bf16 rounding."""
    from safetensors.torch import load_file

    _, rows = launch(tiny_args(bf16_saved(tldr, tmp_path), "--total-episodes", "32"), tmp_path / "run",
                     script="ppo_tldr.py", num_processes=1, launch_flags=["--mixed_precision", "bf16"])
    assert rows and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert abs(rows[0]["objective/kl"]) < 1e-3  # bf16 rounding: the rollout's KV-cached forward vs the full one
    for saved in (tmp_path / "run" / "model.safetensors", tmp_path / "run" / "value_model" / "model.safetensors"):
        assert all(t.dtype == torch.float32 for t in load_file(saved).values())


def test_zero2_bf16_two_processes(tldr, tmp_path):
    """The shipped ZeRO-2 config in bf16 on 2 CPU processes: DeepSpeed holds fp32 master weights, the reference and
    reward model are cast to bf16 like the policy's working copy, so the first KL is 0 up to rounding. With
    --no-save-at-end, as a benchmark runs: the logs are written and no model is saved."""
    proc, rows = launch(tiny_args(tldr, "--total-episodes", "32", "--no-save-at-end", "--compile", "auto", "--tf32"),
                        tmp_path / "run", script="ppo_tldr.py", config="deepspeed_zero2.yaml",
                        launch_flags=["--mixed_precision", "bf16"])
    assert "training step: eager (--compile auto)" in " ".join(proc.stdout.split())  # DeepSpeed: never compiled
    assert rows and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert abs(rows[0]["objective/kl"]) < 1e-3
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").exists() and not list(run.rglob("*.safetensors"))


def test_the_folder_and_resume_rules_hold_for_ppo_tldr_too(tldr, tmp_path):
    """ppo_tldr.py shares ppo.py's folder and resume rules (ppo_harness/run_folder.py; tests/test_faults.py and
    tests/test_harness.py run them): another run's folder is refused before any model loads, --overwrite and
    --peer-timeout pass the flag checks, and a misspelled --resume-with-changes is refused by name."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"update": 1}\n')
    with pytest.raises(ValueError, match="holds another run"):
        ppo_tldr.set_up(tyro.cli(ppo_tldr.Args, args=[*tiny_args(tldr), "--output-dir", str(out)]))
    assert (out / "metrics.jsonl").read_text() == '{"update": 1}\n' and not (out / ".lock").exists()
    ppo_tldr.check_args(ppo_tldr.Args(overwrite=True, peer_timeout=5.0))
    with pytest.raises(ValueError, match="--resume-with-changes learning_ratee: no such flag"):
        ppo_tldr.check_args(ppo_tldr.Args(resume_with_changes=("learning-ratee",)))


def test_the_static_sampler_trains_as_the_dynamic_cache_does(tldr, tmp_path):
    """ppo_tldr.py's one hand-written path, the static-cache sampler (here run uncompiled), against
    --no-fast-paths: the same run to the probes' tolerance, update by update, and the banner says which ran."""
    args = tiny_args(tldr, "--total-episodes", "32", "--save-every", "0")
    fast, fast_rows = run_ppo([*args, "--fast-paths", "--sampler", "static"], tmp_path / "fast", script="ppo_tldr.py")
    plain, plain_rows = run_ppo([*args, "--no-fast-paths"], tmp_path / "plain", script="ppo_tldr.py")
    banner = " ".join(fast.stdout.split())
    assert "sampler: static KV cache, uncompiled" in banner and "sampler: dynamic KV cache" in plain.stdout
    assert_same_run(plain_rows, fast_rows, rel=1e-4)
