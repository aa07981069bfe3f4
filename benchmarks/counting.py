# A verifiable task where length matters, for ppo.py: "List the whole numbers from a to b", b - a in 7..10, rewarded 1
# only for the whole list as asked ("a, a+1, ..., b"), nothing missing or extra, in a response that ended: a correct
# response is every step of a count, 30 to 42 of SmolLM2's tokens and its end of turn (digits are single tokens), and
# one cut off at --response-length scores 0, so stopping at the right length matters. Deterministic from --seed.
# Make the data:  python benchmarks/counting.py cache/counting.jsonl [--n 3000] [--seed 0] [--eval-samples 128]
# Train:          python ppo.py --dataset-name cache/counting.jsonl --reward-fn benchmarks/counting.py:accuracy \
#                     --response-length 48 --eval-samples 128
# The last --eval-samples rows (ppo.py's held-out split: pass the same number) ask only ranges no training row asks.
import argparse
import json
import random
import re
from pathlib import Path

SYSTEM = "You are a careful assistant. Reply with the numbers only, separated by commas."
QUESTION = "List the whole numbers from {a} to {b}, in order."
STARTS, SPANS = range(10, 90), range(7, 11)  # 320 ranges of 8 to 11 two-digit numbers (30 to 42 tokens)
END_OF_TURN = 2  # SmolLM2's <|im_end|>, ppo.py's stop token for its chat prompts: another model, set its id here
HELD_OUT_FRACTION = 0.2  # of the ranges, asked only in the held-out rows


def row(a: int, b: int) -> dict:
    """One chat prompt and its solution (the numbers a correct response lists, as text)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION.format(a=a, b=b)}]
    return {"prompt": messages, "solution": ", ".join(map(str, range(a, b + 1)))}


def make_rows(n: int, seed: int, eval_samples: int) -> list[dict]:
    """n i.i.d. rows: the first n - eval_samples from the training ranges, the last eval_samples from held-out ones."""
    rng = random.Random(seed)
    ranges = [(a, a + span) for a in STARTS for span in SPANS]
    rng.shuffle(ranges)
    num_held_out = round(HELD_OUT_FRACTION * len(ranges))
    held_out, train = ranges[:num_held_out], ranges[num_held_out:]
    return ([row(*rng.choice(train)) for _ in range(n - eval_samples)] +
            [row(*rng.choice(held_out)) for _ in range(eval_samples)])


def completion_text(completion) -> str:
    """The text of a completion: a plain string, or TRL's [{"role": "assistant", "content": ...}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def accuracy(completions, solution, completion_ids, **kwargs) -> list[float]:
    """1.0 where the response holds the solution as written ("10, 11, 12"; words before or after allowed), no other
    integer, and ends with END_OF_TURN (`completion_ids` run up to the stop token: a response cut off at
    --response-length has none), else 0.0 (TRL's reward-function convention)."""
    return [float(numbers(completion_text(c)) == numbers(s) and s in completion_text(c) and ids[-1:] == [END_OF_TURN])
            for c, s, ids in zip(completions, solution, completion_ids)]


def prefix_right(completions, solution, **kwargs) -> list[float]:
    """The share of the solution's numbers the response lists right from the first one (logged, not trained)."""
    scores = []
    for c, s in zip(completions, solution):
        got, want = numbers(completion_text(c)), numbers(s)
        right = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        scores.append(right / len(want))
    return scores


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--n", type=int, default=3000, help="rows in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=128, help="held-out rows (pass the same to ppo.py)")
    args = parser.parse_args()
    if not 0 <= args.eval_samples <= args.n:
        parser.error(f"--eval-samples {args.eval_samples} must be in [0, --n {args.n}]")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in make_rows(args.n, args.seed, args.eval_samples))
