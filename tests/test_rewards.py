"""Any prompt, any reward: chat-format prompts, reward models with their own tokenizer, several rewards
combined with weights, and the value initialisation that follows from them. Tiny offline models (see conftest.py)."""
import json
import random
import re

import pytest
import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM,
                          GPTNeoXForSequenceClassification)

import ppo
from ppo_harness.prompt_files import encode_prompts
from ppo_harness import tokenizers
from conftest import REWARD_FN, TINY, WORDS, make_tokenizer, run_ppo

# The policy's chat format (ChatML, as SmolLM2 and Qwen): <|im_end|> ends a turn and is not the eos token.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The foreign reward model's own format, on its own vocabulary.
RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}[end]"


def word_tokenizer(vocab: dict, eos: str | None, specials: list[str], template: str | None, pad: str | None = None):
    """A whitespace word-level tokenizer over `vocab`, with `specials` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, unk_token="<unk>", pad_token=pad,
                                  additional_special_tokens=specials)
    tok.chat_template = template
    return tok


def chat_tokenizer():
    """The conftest vocabulary ('<eos>' = 0, w0..w28 = 1..29, '<unk>' = 30) plus the ChatML tokens and role words."""
    vocab = {"<eos>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}, "<unk>": 30, "<|im_start|>": 31,
             "<|im_end|>": 32, "user": 33, "assistant": 34, "system": 35}
    return word_tokenizer(vocab, "<eos>", ["<|im_start|>", "<|im_end|>"], CHAT_TEMPLATE)


def foreign_tokenizer(eos: str | None = "[end]", template: str | None = RM_TEMPLATE):
    """Another vocabulary: the same words at other ids (reversed, shifted), no pad token, '[end]' closes a text."""
    vocab = {"<s>": 0, "[end]": 1, "[user]": 2, "[assistant]": 3, "[system]": 4,
             **{w: 5 + i for i, w in enumerate(reversed(WORDS))}, "<unk>": 34}
    return word_tokenizer(vocab, eos, ["[end]"], template)


def tiny_config(vocab_size: int, max_positions: int = 128) -> GPTNeoXConfig:
    return GPTNeoXConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=max_positions, eos_token_id=0)


def chat_messages(rng: random.Random) -> list[dict]:
    """A system turn (its <|im_end|> lies inside every templated prompt) and a user turn of random words."""
    return [{"role": "system", "content": "w1 w2"},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))}]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A chat policy, a reward model on the policy's tokenizer, one on a foreign vocabulary, and chat prompts."""
    root = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    tok = chat_tokenizer()
    policy = GPTNeoXForCausalLM(tiny_config(36))
    with torch.no_grad():  # a policy that often ends its turn: <|im_end|> gets a logit of about 1.5 everywhere
        direction = torch.randn(32)
        policy.gpt_neox.final_layer_norm.bias.copy_(4 * direction / direction.norm())
        policy.get_output_embeddings().weight[32] = 0.4 * direction / direction.norm()
    paths = {"sft": root / "chat_sft", "rm_same": root / "rm_same", "rm_other": root / "rm_other"}
    policy.save_pretrained(paths["sft"])
    tok.save_pretrained(paths["sft"])
    config = tiny_config(36)
    config.num_labels = 1
    GPTNeoXForSequenceClassification(config).save_pretrained(paths["rm_same"])
    tok.save_pretrained(paths["rm_same"])
    config = tiny_config(35, max_positions=64)
    config.num_labels, config.pad_token_id, config.eos_token_id = 1, None, 1
    GPTNeoXForSequenceClassification(config).save_pretrained(paths["rm_other"])
    foreign_tokenizer().save_pretrained(paths["rm_other"])
    rng = random.Random(0)
    paths["prompts"] = root / "chat_prompts.jsonl"
    paths["prompts"].write_text("".join(json.dumps({"prompt": chat_messages(rng)}) + "\n" for _ in range(40)))
    return paths


# ---------------------------------------------------------------------------------------------------------------
# prompts: chat template, --apply-chat-template, the end-of-turn stop token
# ---------------------------------------------------------------------------------------------------------------
def test_chat_prompts_are_rendered_with_the_template():
    tok = chat_tokenizer()
    messages = [{"role": "user", "content": "w3 w4"}]
    expected = [31, 33, 4, 5, 32, 31, 34]  # <|im_start|> user w3 w4 <|im_end|> <|im_start|> assistant
    assert encode_prompts(tok, [messages]) == [expected]  # auto: message lists use the template
    assert encode_prompts(tok, ["w3 w4"]) == [[4, 5]]  # auto: text as it is
    assert encode_prompts(tok, ["w3 w4"], chat=True) == [expected]  # true: text becomes one user turn
    # a final assistant message is a prefix to continue: no end-of-turn after it, no new assistant turn
    prefix = messages + [{"role": "assistant", "content": "w5 w6"}]
    assert encode_prompts(tok, [prefix]) == [[31, 33, 4, 5, 32, 31, 34, 6, 7]]
    assert encode_prompts(tok, [prefix, messages]) == [[31, 33, 4, 5, 32, 31, 34, 6, 7], expected]  # per prompt
    assert tokenizers.is_chat([messages[0]], "auto") and tokenizers.is_chat("w3", "true") and not tokenizers.is_chat("w3", "auto")
    with pytest.raises(ValueError, match="--apply-chat-template false"):
        tokenizers.is_chat(messages, "false")
    with pytest.raises(ValueError, match="unknown role"):
        encode_prompts(tok, [[{"role": "narrator", "content": "w3"}]])
    with pytest.raises(ValueError, match="not of {'role', 'content'} messages"):
        encode_prompts(tok, [["w3", "w4"]])
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(make_tokenizer(pad=False), [messages])


def test_end_of_turn_token_is_derived_from_the_template():
    assert tokenizers.end_of_turn_token_id(chat_tokenizer()) == 32  # <|im_end|>, not the eos (0)
    assert tokenizers.end_of_turn_token_id(foreign_tokenizer()) == 1  # [end]
    plain = make_tokenizer(pad=False)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }} <eos> {% endfor %}"
    assert tokenizers.end_of_turn_token_id(plain) == 0  # the template ends turns with eos itself
    plain.chat_template = "{% for m in messages %}{{ m['content'] }} w5 {% endfor %}"
    assert tokenizers.end_of_turn_token_id(plain) == 0  # an ordinary word is no end-of-turn token: fall back to eos


def test_same_tokenizer_compares_vocabularies_and_templates():
    tok = chat_tokenizer()
    assert tokenizers.same_tokenizer(tok, chat_tokenizer(), chat=True)
    assert not tokenizers.same_tokenizer(tok, foreign_tokenizer(), chat=False)
    other_template = chat_tokenizer()
    other_template.chat_template = RM_TEMPLATE
    assert not tokenizers.same_tokenizer(tok, other_template, chat=True)
    assert tokenizers.same_tokenizer(tok, other_template, chat=False)  # text prompts never meet the template


def test_reward_names_are_unique():
    assert ppo.reward_names(["a/rm", "hub/rm/"], ["vader", "tests/rewards.py:f", "m:f"]) == [
        "rm", "rm_2", "vader", "f", "f_2"]


def test_value_init_follows_the_tokenizers():
    """The value model reads the policy's positions: a reward model only when it shares the policy's tokenizer."""
    rm_tok = foreign_tokenizer()
    choose = ppo.value_model_init
    assert choose(None, ["rm_a", "rm_b"], [rm_tok, None], "sft")[0] == "rm_b"
    path, why = choose(None, ["rm_a"], [rm_tok], "sft")
    assert path == "sft" and "own tokenizers" in why and "fresh" in why
    path, why = choose(None, [], [], "sft")
    assert path == "sft" and "functions only" in why
    assert choose("mine", ["rm_b"], [None], "sft")[0] == "mine"


# ---------------------------------------------------------------------------------------------------------------
# a reward model with its own tokenizer, against plain transformers calls
# ---------------------------------------------------------------------------------------------------------------
def plain_score(rm, rm_tok, text: str, add_special_tokens: bool = False) -> float:
    """The reward model on one unpadded text, as a user would call it."""
    with torch.no_grad():
        return rm(**rm_tok(text, add_special_tokens=add_special_tokens, return_tensors="pt")).logits[0, 0].item()


def test_reward_model_texts_and_scores_match_plain_calls(chat):
    tok, rm_tok = chat_tokenizer(), tokenizers.prepare_reward_tokenizer(foreign_tokenizer(), "rm", chat=True)
    assert rm_tok.pad_token == "[end]"  # no pad token: its eos pads (masked out)
    rm = AutoModelForSequenceClassification.from_pretrained(chat["rm_other"]).eval()
    prompts = [[{"role": "user", "content": "w3 w4 w5"}], [{"role": "system", "content": "w1"},
                                                           {"role": "user", "content": "w9"}]]
    pad = 36
    queries = ppo.left_pad(encode_prompts(tok, prompts), pad)
    responses = torch.tensor([[8, 9, 32, pad], [10, pad, pad, pad]])  # "w7 w8 <|im_end|>", "w9"
    texts = ppo.reward_model_texts(tok, rm_tok, prompts, queries, responses, chat=True)
    assert texts == ["[user] w3 w4 w5 [assistant] w7 w8 [end]", "[system] w1 [user] w9 [assistant] w9 [end]"]
    with torch.no_grad():
        scores = ppo.text_reward_scores(rm, rm_tok, texts, 64, False, "cpu")
        expected = [plain_score(rm, rm_tok, t) for t in texts]
        torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-5)
        # truncation keeps the end, where the score is read: the model on the last 4 tokens
        short = ppo.text_reward_scores(rm, rm_tok, texts, 4, False, "cpu")
        last4 = [rm(input_ids=torch.tensor([rm_tok(t, add_special_tokens=False)["input_ids"][-4:]])).logits[0, 0]
                 for t in texts]
        torch.testing.assert_close(short, torch.stack(last4), atol=1e-5, rtol=1e-5)
    # a final assistant prefix: the response continues that turn (a BPE response carries its own leading space)
    prefix = [[{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5 w6 "}]]
    queries = ppo.left_pad(encode_prompts(tok, prefix), pad)
    assert ppo.reward_model_texts(tok, rm_tok, prefix, queries, torch.tensor([[8, 9, 32]]), chat=True) == [
        "[user] w3 w4 [assistant] w5 w6 w7 w8 [end]"]
    # text prompts: prompt and response decoded together, no template
    plain = ppo.reward_model_texts(tok, rm_tok, ["w3 w4"], ppo.left_pad([[4, 5]], pad), torch.tensor([[8, pad]]),
                                   chat=False)
    assert plain == ["w3 w4 w7"]


def test_encoder_reward_model_pools_by_itself():
    """An encoder reward model (BERT, DeBERTa: OpenAssistant's reward models) reads its first token, as it does alone."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    rm = BertForSequenceClassification(BertConfig(vocab_size=35, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, intermediate_size=64, num_labels=1)).eval()
    rm_tok = tokenizers.prepare_reward_tokenizer(foreign_tokenizer(), "rm", chat=False)
    texts = ["w3 w4 w5 w7", "w9", "w1 w2"]
    with torch.no_grad():
        scores = ppo.text_reward_scores(rm, rm_tok, texts, 64, True, "cpu")
    torch.testing.assert_close(scores, torch.tensor([plain_score(rm, rm_tok, t, True) for t in texts]), atol=1e-5,
                               rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# end to end: chat prompts, a reward model on the policy's tokenizer, one on a foreign vocabulary, a rule, weights
# ---------------------------------------------------------------------------------------------------------------
WEIGHTS = (0.5, 1.5, 2.0)  # rm_same, rm_other, target_word_fraction


@pytest.fixture(scope="module")
def combined_run(chat, tmp_path_factory):
    out = tmp_path_factory.mktemp("combined") / "run"
    proc, rows = run_ppo(["--sft-model-path", str(chat["sft"]), "--reward-model-path", str(chat["rm_same"]),
                          str(chat["rm_other"]), "--reward-fn", REWARD_FN, "--reward-weights",
                          *map(str, WEIGHTS), "--dataset-name", str(chat["prompts"]), "--dataset-train-split",
                          "train", *TINY, "--apply-chat-template", "auto", "--missing-eos-penalty", "1.0"], out)
    return out, proc, rows


def test_combined_scores_are_the_weighted_sum_minus_the_missing_eos_penalty(combined_run):
    _, _, rows = combined_run
    assert len(rows) == 2
    for r in rows:
        components = [r["objective/scores/rm_same"], r["objective/scores/rm_other"],
                      r["objective/scores/target_word_fraction"]]
        # the stop token is <|im_end|>, counted in the response only: the <|im_end|> of the templated system and
        # user turns, inside every prompt, neither marks a response as ended nor hides a missing end (trl#6802)
        missing = 1 - r["val/num_eos_tokens"] / 16
        expected = sum(w * c for w, c in zip(WEIGHTS, components)) - 1.0 * missing
        assert r["objective/scores"] == pytest.approx(expected, abs=1e-5)
    assert 0 < sum(r["val/num_eos_tokens"] for r in rows) < 32  # some responses ended their turn, some did not
    assert all(r["val/response_length"] < 8 for r in rows)  # ... and stopped there


def test_banner_names_each_reward_path_and_the_value_init(combined_run, chat):
    _, proc, _ = combined_run
    out = re.sub(r"\s+", " ", proc.stdout)
    assert "prompts: chat template; stop token id 32" in out
    assert f"reward rm_same (weight 0.5): reward model {chat['rm_same']}, the policy's tokenizer" in out
    assert f"reward rm_other (weight 1.5): reward model {chat['rm_other']}, its own tokenizer" in out
    assert "reward target_word_fraction (weight 2): function" in out
    assert f"value model: the reward model {chat['rm_same']}" in out


def test_foreign_reward_model_scores_in_a_run_equal_plain_calls(combined_run, chat):
    """Every sample-table row: the run's score of the foreign reward model equals that model called with plain
    transformers on the texts rebuilt here, from the dataset's messages and the decoded response."""
    out, proc, _ = combined_run
    tok, rm_tok = AutoTokenizer.from_pretrained(chat["sft"]), AutoTokenizer.from_pretrained(chat["rm_other"])
    assert tok("w7")["input_ids"] != rm_tok("w7")["input_ids"]  # really another vocabulary
    rm = AutoModelForSequenceClassification.from_pretrained(chat["rm_other"]).eval()
    eval_prompts = [json.loads(line)["prompt"] for line in chat["prompts"].read_text().splitlines()][-4:]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and {s["update"] for s in samples} == {0, 2}  # before training, after the last update
    assert "held-out samples after update 2" in proc.stdout and "rm_other" in proc.stdout
    for i, s in enumerate(samples):
        # the table shows the user message; samples.jsonl keeps the rendered query (the template's system prompt)
        assert s["prompt"] == eval_prompts[i % 4][-1]["content"] and s["prompt"] in s["query"] != s["prompt"]
        response = tok.decode(tok(s["model response"], add_special_tokens=False)["input_ids"],
                              skip_special_tokens=True)
        text = rm_tok.apply_chat_template(eval_prompts[i % 4] + [{"role": "assistant", "content": response}],
                                          tokenize=False)
        assert s["rm_other"] == pytest.approx(plain_score(rm, rm_tok, text), abs=1e-5)
        assert s["score"] == pytest.approx(sum(w * s[n] for w, n in zip(
            WEIGHTS, ["rm_same", "rm_other", "target_word_fraction"])), abs=1e-5)
    assert len({round(s["rm_other"], 6) for s in samples}) > 1  # the scores depend on the texts


# ---------------------------------------------------------------------------------------------------------------
# bad input is refused before any model is loaded
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_assets(chat, assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    paths = {}
    for name, tok in (("rm_no_pad_no_eos", foreign_tokenizer(eos=None)), ("rm_no_template",
                                                                         foreign_tokenizer(template=None))):
        paths[name] = root / name
        AutoModelForSequenceClassification.from_pretrained(chat["rm_other"]).save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    paths["clash"] = root / "clash.jsonl"
    paths["clash"].write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "w3"}], "completions": "w4"})
                                      + "\n" for _ in range(40)))
    paths["role"] = root / "role.jsonl"
    paths["role"].write_text("".join(json.dumps({"prompt": [{"role": "narrator", "content": "w3"}]}) + "\n"
                                     for _ in range(40)))
    return paths


@pytest.mark.parametrize("overrides, message", [
    (dict(reward_model_path="RM_OTHER", reward_weights=(1.0,)), "1 weight(s) for 2 reward(s)"),
    (dict(reward_weights=(1.0, 2.0)), "2 weight(s) for 1 reward(s)"),
    (dict(reward_fn="tests/rewards.py:wrong_length"), "--reward-fn tests/rewards.py:wrong_length, called with the "
     "keywords prompts, completions, completion_ids, trainer_state, log_extra, log_metric, returned list [0.0, 0.0, "
     "0.0]; expected a list of 2 numbers"),
    (dict(reward_fn="tests/rewards.py:not_numbers"), "tests/rewards.py:not_numbers, called with the keywords prompts, "
     "completions, completion_ids, trainer_state, log_extra, log_metric, returned '1.0' (str)"),
    (dict(reward_fn="tests/rewards.py:not_finite"), "returned a non-finite score"),
    (dict(reward_fn="tests/rewards.py:positional"), "def f(completions, **kwargs)"),
    (dict(dataset_name="CLASH"), "column(s) ['completions'] would collide"),
    (dict(reward_model_path="NO_PAD", reward_fn=()), "neither a pad nor an eos token"),
    (dict(reward_model_path="NO_TEMPLATE", reward_fn=()), "with no chat template"),
    (dict(dataset_name="ROLE"), "unknown role"),
    (dict(apply_chat_template="false"), "--apply-chat-template false"),
    (dict(sft_model_path="PLAIN_SFT"), "the policy's tokenizer has no chat template"),
    (dict(sft_model_path="PLAIN_SFT", dataset_name="PLAIN_PROMPTS", apply_chat_template="true"),
     "the policy's tokenizer has no chat template"),
])
def test_bad_reward_or_prompt_input_is_refused(chat, assets, bad_assets, tmp_path, overrides, message):
    named = {"RM_OTHER": chat["rm_other"], "NO_PAD": bad_assets["rm_no_pad_no_eos"], "ROLE": bad_assets["role"],
             "CLASH": bad_assets["clash"],
             "NO_TEMPLATE": bad_assets["rm_no_template"], "PLAIN_SFT": assets["sft"], "PLAIN_PROMPTS": assets["prompts"]}
    fields = dict(sft_model_path=str(chat["sft"]), reward_fn=REWARD_FN, dataset_name=str(chat["prompts"]),
                  dataset_train_split="train", output_dir=str(tmp_path / "run"), total_episodes=16,
                  per_device_train_batch_size=4, num_mini_batches=8, num_trainable_layers=None, eval_samples=4)
    fields.update({k: str(named[v]) if isinstance(v, str) and v in named else v for k, v in overrides.items()})
    with pytest.raises(ValueError, match=re.escape(message)):
        ppo.main(ppo.Args(**fields))
    assert not (tmp_path / "run").exists()  # refused before anything was written


# ---------------------------------------------------------------------------------------------------------------
# reward functions written for TRL: keywords, the dataset's columns, None for a row not judged
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trl_fn_runs(chat, assets, tmp_path_factory):
    """`def accuracy(completions, solution, **kwargs)` on a text and on a chat dataset with a `solution` column."""
    root, rng, runs = tmp_path_factory.mktemp("trl_fn"), random.Random(1), {}
    for kind, sft, prompts in (("text", assets["sft"], assets["prompts"]), ("chat", chat["sft"], chat["prompts"])):
        rows = [{**json.loads(line), "solution": rng.choice(["w3", "w7"])}
                for line in prompts.read_text().splitlines()]
        data = root / f"{kind}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        run_ppo(["--sft-model-path", str(sft), "--reward-fn", "tests/rewards.py:accuracy", "--dataset-name",
                 str(data), *TINY, "--eval-samples", "8", "--eval-every", "1"], root / kind)
        runs[kind] = rows, sft, root / kind
    return runs


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_trl_reward_fn_sees_the_columns_and_its_scores_are_logged(trl_fn_runs, kind):
    """Every logged sample's score equals the function's own output on that sample: the completion rebuilt from the
    logged text (as TRL forms it: a string, or an assistant message) and the row's `solution`."""
    from rewards import accuracy

    rows, sft, out = trl_fn_runs[kind]
    tok = AutoTokenizer.from_pretrained(sft)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 8  # before training, after updates 1 and 2
    for i, s in enumerate(samples):
        text = tok.decode(tok(s["model response"], add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        completion = text if kind == "text" else [{"role": "assistant", "content": text}]
        assert [s["accuracy"]] == [s["score"]] == accuracy([completion], [rows[-8 + i % 8]["solution"]])
    for m in metrics:
        table = [s["accuracy"] for s in samples if s["update"] == m["update"]]
        assert m["eval/scores/accuracy"] == pytest.approx(sum(table) / 8)
    assert {s["accuracy"] for s in samples} == {0.0, 1.0}  # the solution column decides: some right, some wrong


def test_none_adds_nothing_and_its_share_is_logged(assets, tmp_path):
    """judges_w7_only returns target_word_fraction where it is above 0, else None: with None counted as 0 the two
    are equal, so the score is twice target_word_fraction's mean, and the judged rows' mean is the rest."""
    _, rows = run_ppo(["--sft-model-path", str(assets["sft"]), "--reward-fn", "tests/rewards.py:judges_w7_only",
                       "tests/rewards.py:target_word_fraction", "--dataset-name", str(assets["prompts"]), *TINY,
                       "--total-episodes", "48"], tmp_path)
    for r in rows:
        fraction, none = r["objective/scores/target_word_fraction"], r.get("objective/scores_none/judges_w7_only", 0)
        assert r["objective/scores"] == pytest.approx(2 * fraction, abs=1e-6)
        if none < 1:
            assert r["objective/scores/judges_w7_only"] * (1 - none) == pytest.approx(fraction, abs=1e-6)
        assert "objective/scores_none/target_word_fraction" not in r
    assert any(0 < r.get("objective/scores_none/judges_w7_only", 0) < 1 for r in rows)


def update_rows_with_evaluation(run):
    """metrics.jsonl's rows that hold a held-out evaluation, update 0's included."""
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/scores" in r]


def test_a_row_no_reward_judges_is_left_out_of_the_update_or_refused(assets, tmp_path):
    """As TRL: a row every reward function returned None for is left out of the update (its tokens count in neither
    loss nor whitening statistics) and counted in objective/unjudged_rows. An update with no row judged stops the run,
    naming the reward and the update, and saves no "trained" model (at c25d42a it trained on nothing, exit 0, and
    saved the SFT model). --unjudged-rows stop refuses any unjudged row before any optimizer step instead."""
    args = ["--sft-model-path", str(assets["sft"]), "--dataset-name", str(assets["prompts"]), *TINY]
    proc, rows = run_ppo([*args, "--reward-fn", "tests/rewards.py:never_judges", "--unjudged-rows", "skip",
                          "--eval-samples", "0"], tmp_path / "skip", check=False)
    assert proc.returncode != 0 and "update 1: no reward judged any of its 16 rows (never_judges returned None for " \
        "each)" in proc.stderr and rows == []
    assert not (tmp_path / "skip" / "model.safetensors").exists() and not (tmp_path / "skip" / "checkpoints").exists()
    _, rows = run_ppo([*args, "--reward-fn", "tests/rewards.py:judges_w7_only", "--eval-samples", "8"],
                      tmp_path / "some")
    assert all(0 < r["objective/unjudged_rows"] < 16 for r in rows)
    # held out: an unjudged row's score is None, and eval/scores is the mean over the judged ones
    samples = [json.loads(line) for line in (tmp_path / "some" / "samples.jsonl").read_text().splitlines()]
    evaluations = {r["update"]: r for r in update_rows_with_evaluation(tmp_path / "some")}
    mixed = 0
    for update, row in evaluations.items():
        scores = [s["score"] for s in samples if s["update"] == update]
        judged = [score for score in scores if score is not None]
        assert all(s["judges_w7_only"] is None for s in samples if s["update"] == update and s["score"] is None)
        assert row["eval/scores"] == pytest.approx(sum(judged) / len(judged) if judged else 0.0, rel=1e-6)
        mixed += 0 < len(judged) < len(scores)
    assert mixed > 0
    proc, rows = run_ppo([*args, "--reward-fn", "tests/rewards.py:never_judges", "--unjudged-rows", "stop"],
                         tmp_path / "none", check=False)
    assert proc.returncode != 0 and "every reward returned None for the prompt" in proc.stderr
    assert not (tmp_path / "none" / "checkpoints").exists()
    # a function that goes wrong later stops the run at that update's scoring; the last checkpoint stays
    proc, rows = run_ppo([*args, "--reward-fn", "tests/rewards.py:nan_after_first_update", "--save-every", "1",
                          "--eval-samples", "0", "--total-episodes", "48"], tmp_path / "nan", check=False)
    assert proc.returncode != 0 and "nan_after_first_update, called with the keywords" in proc.stderr
    assert [r["update"] for r in rows] == [1]
    assert (tmp_path / "nan" / "checkpoints" / "latest").read_text().strip() == "update-000001"
