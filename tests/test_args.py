"""Every numeric flag of both scripts has a valid range, checked by `check_args` (through ppo_harness/launch.py's
`check_flags`) before anything loads."""
import dataclasses
import math
import typing

import pytest

import ppo
import ppo_tldr
from ppo_harness.launch import flag_intervals, in_interval

# one bad value per numeric flag, written from the flags' meaning (not from the intervals in Args)
BAD = {
    "common": {
        "seed": -1, "total_episodes": 0, "per_device_train_batch_size": 0, "gradient_accumulation_steps": 0,
        "num_mini_batches": 0, "num_ppo_epochs": 0, "local_rollout_forward_batch_size": 0, "response_length": 0,
        "temperature": 0.0, "missing_eos_penalty": -1.0, "kl_coef": -1.0, "cliprange": 0.0, "vf_coef": -1.0,
        "cliprange_value": 0.0, "gamma": 2.0, "lam": -0.1, "learning_rate": -1.0, "max_grad_norm": -1.0,
        "save_every": -1, "save_total_limit": 0, "peer_timeout": 0.0,
    },
    ppo: {
        "eval_samples": -1, "stop_token_id": -1, "kl_target": 0.0, "kl_horizon": 0.0, "target_kl": 0.0,
        "ratio_threshold": 0.0, "score_clip": -1.0, "num_trainable_layers": 0, "lora_r": 0, "lora_alpha": 0,
        "lora_dropout": 1.0, "eval_every": -1, "reward_weights": (1.0, math.nan), "ent_coef": -0.1,
        "num_generations": 0, "reward_url_timeout": 0.0, "reward_url_retries": -1, "reward_url_rows_per_request": 0,
        "value_warmup_updates": -1, "critic_learning_rate": -1.0, "critic_epochs": -1, "lam_critic": 1.5,
        "lam_length_alpha": 0.0, "cliprange_high": 0.0,
        "positive_lm_coef": -0.1, "positive_threshold": math.nan,
    },
    ppo_tldr: {
        "max_query_length": 0, "eval_samples": 0, "eval_every": -1, "penalty_reward_value": math.inf,
    },
}
# values at the edge of their range that must still be accepted
GOOD = {"gamma": 1.0, "lam": 0.0, "learning_rate": 0.0, "kl_coef": 0.0, "cliprange": 1.5, "seed": 2**31 - 1}


def numeric_fields(module) -> set[str]:
    """The Args fields typed int or float (alone, optional, or a tuple of them)."""
    def numeric(tp) -> bool:
        if tp in (int, float):
            return True
        return any(numeric(a) for a in typing.get_args(tp) if a is not Ellipsis and a is not type(None))

    hints = typing.get_type_hints(module.Args)
    return {f.name for f in dataclasses.fields(module.Args)
            if typing.get_origin(hints[f.name]) is not typing.Literal and numeric(hints[f.name])}


def bad_values(module) -> dict:
    return {**BAD["common"], **BAD[module]}


@pytest.mark.parametrize("module", [ppo, ppo_tldr], ids=["ppo", "ppo_tldr"])
def test_every_numeric_flag_has_a_range(module):
    missing, stale = numeric_fields(module) - set(bad_values(module)), set(bad_values(module)) - numeric_fields(module)
    assert not missing, f"a new numeric flag needs a bad value in tests/test_args.py's BAD: {sorted(missing)}"
    assert not stale, f"BAD names flags that are gone or no longer numeric: {sorted(stale)}"
    assert set(flag_intervals(module.Args)) == numeric_fields(module)
    module.check_args(module.Args())  # the defaults are valid
    for name, value in GOOD.items():
        module.check_args(dataclasses.replace(module.Args(), **{name: value}))


@pytest.mark.parametrize("module, name", [(m, n) for m in (ppo, ppo_tldr) for n in sorted(bad_values(m))],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_a_bad_value_is_refused_by_name(module, name):
    value = bad_values(module)[name]
    shown = value[-1] if isinstance(value, tuple) else value
    with pytest.raises(ValueError) as error:
        module.check_args(dataclasses.replace(module.Args(), **{name: value}))
    message = str(error.value)
    assert message.startswith(f"--{name.replace('_', '-')} {shown} is out of range"), message
    assert message.endswith(flag_intervals(module.Args)[name]), message


@pytest.mark.parametrize("value, interval, inside", [
    (0, "[0, 1)", True), (1, "[0, 1)", False), (1, "[0, 1]", True), (0, "(0, 1]", False), (0.5, "(0, 1)", True),
    (1e300, "[1, inf)", True), (math.inf, "[1, inf)", False), (-math.inf, "(-inf, inf)", False),
    (math.nan, "(-inf, inf)", False), (-1, "[0, inf)", False),
])
def test_in_interval(value, interval, inside):
    assert in_interval(value, interval) is inside


def test_bad_combinations_are_refused():
    for fields, message in [(dict(kl_estimator="k5"), "unknown --kl-estimator"),
                            (dict(reward_fn=("vader",), reward_weights=(1.0, 2.0)), "2 weight(s) for 1 reward(s)"),
                            (dict(lora_target_modules=["q"]), "--lora-target-modules needs --use-peft"),
                            (dict(shared_value_head=True, value_model_path="x"), "drop --value-model-path"),
                            (dict(kl_target=6.0, kl_coef=0.0), "--kl-target steers --kl-coef")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ppo.check_args(ppo.Args(**fields))
