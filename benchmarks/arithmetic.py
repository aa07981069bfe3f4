# A verifiable task for ppo.py: "What is a + b?" with a, b in [0, 20], rewarded 1 for the right integer.
# Make the data:  python benchmarks/arithmetic.py arithmetic.jsonl [--n 4000] [--seed 0] [--eval-samples 256]
# Train:          python ppo.py --dataset-name arithmetic.jsonl --reward-fn benchmarks/arithmetic.py:accuracy
# The last --eval-samples rows (ppo.py's held-out split: pass the same number) ask only pairs no training row asks.
import argparse
import json
import random
import re
from pathlib import Path

SYSTEM = "You are a calculator. Reply with the number only."
QUESTION = "What is {a} + {b}? Answer with the number only."
MAX_OPERAND = 20  # 441 pairs; SmolLM2-135M-Instruct: 33% right sampled at T=0.7, 51% greedy
HELD_OUT_FRACTION = 0.2  # of the pairs, asked only in the held-out rows


def row(a: int, b: int) -> dict:
    """One chat prompt and its integer answer (as a string)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION.format(a=a, b=b)}]
    return {"prompt": messages, "solution": str(a + b)}


def make_rows(n: int, seed: int, eval_samples: int) -> list[dict]:
    """n i.i.d. rows: the first n - eval_samples from the training pairs, the last eval_samples from held-out ones."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    rng.shuffle(pairs)
    num_held_out = round(HELD_OUT_FRACTION * len(pairs))
    held_out, train = pairs[:num_held_out], pairs[num_held_out:]
    return ([row(*rng.choice(train)) for _ in range(n - eval_samples)] +
            [row(*rng.choice(held_out)) for _ in range(eval_samples)])


def completion_text(completion) -> str:
    """The text of a completion: a plain string, or TRL's [{"role": "assistant", "content": ...}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def extract_answer(text: str) -> int | None:
    """The last integer (thousands commas allowed, as GSM8K's "1,200"): the model writes "a + b = c" or "The answer is
    c" (the first integer is an operand)."""
    numbers = re.findall(r"-?\d+(?:,\d{3})*", text)
    return int(numbers[-1].replace(",", "")) if numbers else None


def accuracy(completions, solution, **kwargs) -> list[float]:
    """1.0 where the completion's last integer equals the solution, else 0.0 (TRL GRPOTrainer convention)."""
    answers = [extract_answer(completion_text(c)) for c in completions]
    return [float(a is not None and a == extract_answer(s)) for a, s in zip(answers, solution)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--n", type=int, default=4000, help="rows in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=256, help="held-out rows at the end (ppo.py's default)")
    args = parser.parse_args()
    if not 0 <= args.eval_samples <= args.n:
        parser.error(f"--eval-samples {args.eval_samples} must be in [0, --n {args.n}]")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in make_rows(args.n, args.seed, args.eval_samples))
