"""Reward functions loaded as TRL 1.12's GRPOTrainer takes them, so that `trl.rewards` and open-r1's
run as they are: a built-in name, `module:function`, `file.py:function` or a served reward's URL
(`reward_server`); a function in OpenRLHF's or verl's convention wrapped to be called as TRL calls
one (`reward_stacks`). How they are called is `reward_calls`, what they log `reward_logs`."""
import inspect
from pathlib import Path
from typing import Callable

from ppo_harness.reward_server import ServedReward
from ppo_harness.reward_stacks import OpenRLHFReward, VerlComputeScore
from ppo_harness.user_code import import_user_module


def reward_names(model_paths, fn_specs) -> list[str]:
    """Names of the reward components: a reward model's folder (or hub name), a function's name,
    `remote` for a URL; repeats get _2, _3."""
    names, seen = [], {}
    for base in [Path(p.rstrip("/")).name for p in model_paths] + [
            "remote" if "://" in s else s.rpartition(":")[2] for s in fn_specs]:
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


def load_reward_fn(spec: str, url_timeout: float = 60.0, url_retries: int = 3, url_protocol: str = "keywords",
                   label_key: str | None = None, rows_per_request: int = 1) -> Callable:
    """A built-in name (`vader`), `module:function` (importable), `path/to/file.py:function`, or a
    served reward's URL (`url_protocol` "keywords": ours; "openrlhf": OpenRLHF's remote reward
    model, `rows_per_request` rows a request). A function in OpenRLHF's convention
    (`reward_func(queries, prompts, labels)`) or verl's (`compute_score(data_source, solution_str,
    ground_truth, extra_info)`) is wrapped to be called as TRL calls one."""
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    if spec.startswith(("http://", "https://")):
        served = ServedReward(spec, url_timeout, url_retries, rows_per_request=rows_per_request)
        return OpenRLHFReward(served.openrlhf, label_key, spec) if url_protocol == "openrlhf" else served
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"--reward-fn {spec!r}: expected `module:function`, "
                         "`path/to/file.py:function` or a URL")
    module = import_user_module(module_name, "--reward-fn", spec)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: {module_name!r} has no callable {fn_name!r}")
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # no signature to read (some builtins): TRL's convention
        return fn
    if "solution_str" in params and "ground_truth" in params:
        return VerlComputeScore(fn, spec)
    if "queries" in params and "completions" not in params:
        return OpenRLHFReward(fn, label_key, spec)
    return fn


_vader = None

def vader_sentiment(prompts: list, completions: list, **kwargs) -> list[float]:
    """VADER compound sentiment, in [-1, 1], of what the policy wrote: a chat completion less the
    assistant prefix its prompt gave (the default run scores the continuation only). A rule, no
    model (Hutto & Gilbert 2014)."""
    global _vader
    if _vader is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _vader = SentimentIntensityAnalyzer()
    texts = [c if isinstance(c, str) else c[0]["content"][len(assistant_prefix(p)):]
             for p, c in zip(prompts, completions)]
    return [_vader.polarity_scores(t)["compound"] for t in texts]


# built when the file loads: define a new one above it
BUILTIN_REWARD_FNS = {"vader": vader_sentiment}


def assistant_prefix(prompt) -> str:
    """The final assistant message a chat prompt leaves for the policy to continue, or ""."""
    return prompt[-1]["content"] if isinstance(prompt, list) and prompt[-1]["role"] == "assistant" else ""


def prompt_text(prompt) -> str:
    """A prompt as the dataset gave it, for people: the text, or a chat prompt from its last user
    message on."""
    if isinstance(prompt, str):
        return prompt
    users = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
    return " ".join(m["content"] for m in prompt[users[-1] if users else -1:])
