"""Reward functions used by the tests through --reward-fn tests/rewards.py:NAME."""


def target_word_fraction(prompts, responses):
    """Fraction of response words equal to 'w7' (a reward the tiny vocabulary makes learnable in seconds)."""
    return [r.split().count("w7") / max(1, len(r.split())) for r in responses]


def wrong_length(prompts, responses):
    return [0.0] * (len(responses) + 1)


def not_finite(prompts, responses):
    return [float("nan")] * len(responses)


_calls = 0


def explodes_after_first_update(prompts, responses):
    """Finite until the third call (the start-up probe, then update 1), then 1e38: the value loss overflows."""
    global _calls
    _calls += 1
    return [1e38 if _calls > 2 else 0.0] * len(responses)


def logged_target_word_fraction(prompts, responses):
    """target_word_fraction, appending each call's prompts as one JSON line to $PROMPT_LOG (what each batch scored)."""
    import json
    import os

    with open(os.environ["PROMPT_LOG"], "a") as f:
        f.write(json.dumps(prompts) + "\n")
    return target_word_fraction(prompts, responses)
