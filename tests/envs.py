"""Environments the tests pass to ppo_multiturn.py as `--env tests/envs.py:NAME`, on the tiny word-level models of
conftest.py (words w0..w28)."""
import asyncio


class SayWord:
    """Say the row's word (w7 unless the row names one): reward 1 and done when a turn holds it; else the
    observation "w3 w4" and 0. A learnable task for the tiny models."""

    def reset(self, row: dict) -> str:
        self.word = row.get("word", "w7")
        return "w1 w2"

    def step(self, text: str):
        if self.word in text.split():
            return None, 1.0, True
        return "w3 w4", 0.0, False


class AsyncSayWord(SayWord):
    """SayWord, async."""

    async def reset(self, row: dict) -> str:
        await asyncio.sleep(0)
        return super().reset(row)

    async def step(self, text: str):
        await asyncio.sleep(0)
        return super().step(text)


class TurnRewards:
    """A reward every turn (0.1 x the turn's number of w5), never done: --max-turns ends it."""

    def reset(self, row: dict) -> str:
        return "w1"

    def step(self, text: str):
        return "w6", 0.1 * text.split().count("w5"), False


class Silent:
    """No observation between turns (None), done after three."""

    def reset(self, row: dict) -> str:
        self.turns = 0
        return "w1"

    def step(self, text: str):
        self.turns += 1
        return None, float(self.turns == 3), self.turns == 3


class LongAnswers:
    """An observation of 40 words a turn: the context soon outgrows a small --max-context-length."""

    def reset(self, row: dict) -> str:
        return "w1"

    def step(self, text: str):
        return " ".join(["w9"] * 40), 0.0, False


class NoStep:
    def reset(self, row: dict) -> str:
        return "w1"


class RaisingStep(SayWord):
    def step(self, text: str):
        raise KeyError("the tool crashed")


class WrongTypes(SayWord):
    def step(self, text: str):
        return "w3", "1.0", False  # the reward a str


class ResetNotText(SayWord):
    def reset(self, row: dict):
        return ["w1"]
