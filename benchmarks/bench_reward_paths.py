"""What scoring with a reward model that has its own tokenizer costs, against the token path.

SmolLM2-135M-Instruct (the default policy, converted into cache/ by a first `python ppo.py`) serves as the policy and,
with a fresh scalar head, as the reward model. The token path reads the policy's ids; the text path decodes the
responses, renders each chat with the reward model's chat template and tokenises it again (forced here by handing the
tokenizer over as if it were another one). Both score the same 64 chat prompts with 24-token responses.

    HF_HUB_OFFLINE=1 python benchmarks/bench_reward_paths.py

Measured on the 2-core CPU machine (shared with other jobs, so the forwards are slow and noisy): token path 45.7 s,
decode + render 0.009 s, text path in all 43.2 s (77 positions at most against 75). The re-rendering costs nothing
next to the reward model's forward.
"""
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ppo  # noqa: E402
from ppo_harness import tokenizers  # noqa: E402
from ppo_harness.prompt_files import encode_prompts  # noqa: E402

MODEL, BATCH, RESPONSE, REPEATS = "cache/SmolLM2-135M-Instruct.Q4_1", 64, 24, 5


def best_of(fn):
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    pad = tokenizer.pad_token_id
    prompts = [json.loads(line)["prompt"] for line in open(ppo.DEFAULT_PROMPTS)][:BATCH]
    queries = ppo.left_pad(encode_prompts(tokenizer, prompts), pad)
    responses = torch.randint(100, 10000, (BATCH, RESPONSE))
    rm = AutoModelForSequenceClassification.from_pretrained(MODEL, num_labels=1).eval()
    rm_tokenizer = tokenizers.prepare_reward_tokenizer(AutoTokenizer.from_pretrained(MODEL), MODEL, chat=True)
    with torch.no_grad():
        token = best_of(lambda: ppo.reward_model_scores(rm, torch.cat((queries, responses), 1), pad, queries.size(1)))
        render = best_of(lambda: ppo.reward_model_texts(tokenizer, rm_tokenizer, prompts, queries, responses, True))
        texts = ppo.reward_model_texts(tokenizer, rm_tokenizer, prompts, queries, responses, True)
        text = best_of(lambda: ppo.text_reward_scores(
            rm, rm_tokenizer, ppo.reward_model_texts(tokenizer, rm_tokenizer, prompts, queries, responses, True),
            2048, False, "cpu"))
    lengths = [len(rm_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    print(f"{BATCH} responses of {RESPONSE} tokens, {torch.get_num_threads()} threads, best of {REPEATS}")
    print(f"token path (forward only):                     {token:.3f} s  ({queries.size(1) + RESPONSE} positions)")
    print(f"text path, decode + render only:               {render:.3f} s")
    print(f"text path, decode + render + tokenise + forward: {text:.3f} s  (up to {max(lengths)} positions)")


if __name__ == "__main__":
    main()
