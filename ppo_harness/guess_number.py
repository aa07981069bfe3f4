"""ppo_multiturn.py's default task (`--env guess-number`): guess a whole number from 1 to 8, told
"higher" or "lower" after each wrong guess. An episode ends at the right guess (reward 1) or at
--max-turns (0). Guessing at random, without reading the answers, finds it within 4 turns 41% of the
time (1 - (7/8)^4); halving the range each turn always does within 3. The rows (`build_rows`) hold
only the secret, `target`, so the held-out episodes are new secrets only in their order: what is
learnt is a way of guessing, not the rows."""
import json
import random
import re
from pathlib import Path

from ppo_harness.writes import write_atomic

DEFAULT_ROWS = "cache/guess_number_v1.jsonl"
LOW, HIGH = 1, 8


class GuessNumber:
    """reset(row) -> the first user message; step(text) -> (the next user message or None, reward,
    done)."""

    def reset(self, row: dict) -> str:
        self.target = int(row["target"])
        return (f"I am thinking of a whole number from {LOW} to {HIGH}. Guess it: answer with the number "
                "alone, and I will tell you if mine is higher or lower.")

    def step(self, text: str):
        guess = re.search(r"-?\d+", text)
        if guess is None:
            return f"Answer with a number from {LOW} to {HIGH}.", 0.0, False
        guess = int(guess.group())
        if guess == self.target:
            return None, 1.0, True
        return ("Higher." if self.target > guess else "Lower."), 0.0, False


def build_rows(path: str = DEFAULT_ROWS, n: int = 4096, seed: int = 0) -> None:
    """`n` rows of a secret each, seeded; written whole (a temporary name, then a rename)."""
    rng = random.Random(seed)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), "".join(json.dumps({"target": rng.randint(LOW, HIGH)}) + "\n" for _ in range(n)))
