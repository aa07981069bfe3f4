"""Reward functions as TRL 1.12's GRPOTrainer calls them, so that `trl.rewards` and open-r1's run as they are: loaded
from a built-in name, `module:function`, `file.py:function` or a served reward's URL; called with the keywords
`prompts`, `completions`, `completion_ids`, every other column of the rows, and TRL's `trainer_state`, `log_extra` and
`log_metric`; `async def` ones awaited together; each output checked to be one number or None per row. A training
script scores with its reward models itself and calls `function_scores` for the functions."""
import asyncio
import copy
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import threading
import urllib.error
import urllib.request
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

TRAINER_KEYWORDS = ("trainer_state", "log_extra", "log_metric")  # TRL's, beside the data's keywords


# ---- Loading: a built-in name, module:function, file.py:function, or a served reward's URL ---------------------------
def reward_names(model_paths, fn_specs) -> list[str]:
    """Names of the reward components: a reward model's folder (or hub name), a function's name, `remote` for a URL;
    repeats get _2, _3."""
    names, seen = [], {}
    for base in [Path(p.rstrip("/")).name for p in model_paths] + [
            "remote" if "://" in s else s.rpartition(":")[2] for s in fn_specs]:
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


def load_reward_fn(spec: str, url_timeout: float = 60.0, url_retries: int = 3) -> Callable:
    """A built-in name (`vader`), `module:function` (importable), `path/to/file.py:function`, or a served reward's
    URL."""
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    if spec.startswith(("http://", "https://")):
        return ServedReward(spec, url_timeout, url_retries)
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"--reward-fn {spec!r}: expected `module:function`, `path/to/file.py:function` or a URL")
    try:
        if module_name.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if module_spec is None or not Path(module_name).is_file():
                raise FileNotFoundError(module_name)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise ValueError(f"--reward-fn {spec!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:  # a SyntaxError, NameError... while the file runs
        raise ValueError(f"--reward-fn {spec!r}: loading {module_name!r} raised {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: {module_name!r} has no callable {fn_name!r}")
    return fn


_vader = None

def vader_sentiment(prompts: list, completions: list, **kwargs) -> list[float]:
    """VADER compound sentiment, in [-1, 1], of what the policy wrote: a chat completion less the assistant prefix its
    prompt gave (the default run scores the continuation only). A rule, no model (Hutto & Gilbert 2014)."""
    global _vader
    if _vader is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _vader = SentimentIntensityAnalyzer()
    texts = [c if isinstance(c, str) else c[0]["content"][len(assistant_prefix(p)):]
             for p, c in zip(prompts, completions)]
    return [_vader.polarity_scores(t)["compound"] for t in texts]


BUILTIN_REWARD_FNS = {"vader": vader_sentiment}  # built when the file loads: define a new one above it


class ServedReward:
    """--reward-fn URL: an async reward function that POSTs a batch's keywords (a function's, `trainer_state` as a
    dict) as one JSON object and reads back `{"rewards": [one number or null per row]}` or that list alone."""

    def __init__(self, url: str, timeout: float, retries: int, backoff: float = 1.0):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def post(self, body: bytes):
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as reply:
            text = reply.read()
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"{self.url} answered with no JSON: {text[:200]!r}") from None

    async def __call__(self, prompts, completions, completion_ids, trainer_state=None, log_extra=None,
                       log_metric=None, **columns):
        body = json.dumps(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                               trainer_state=asdict(trainer_state) if trainer_state else None), default=str).encode()
        for attempt in range(self.retries + 1):
            try:
                reply = await asyncio.to_thread(self.post, body)
                return reply.get("rewards") if isinstance(reply, dict) else reply
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read()[:200]!r}"
                if e.code < 500:  # the request itself is wrong: a retry gets the same answer
                    break
            except OSError as e:  # no connection, a reset, a timeout
                error = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                await asyncio.sleep(self.backoff * 2**attempt)
        raise ConnectionError(f"{self.url} failed after {attempt + 1} tries, the last with {error}")


# ---- Calling: TRL 1.12 GRPOTrainer's keywords, async functions awaited together, each output checked -----------------
@dataclass
class TrainerState:
    """TRL's `trainer_state` keyword, ours with transformers' names: global_step counts the updates done (as TRL: an
    update's rollout is scored at update - 1, the evaluation after it at update), epoch the passes over the prompts."""
    global_step: int
    max_steps: int
    epoch: float


class RewardLogs:
    """What reward functions log through TRL's keywords while one batch is scored: `log_extra(column, values)`, one
    value per row (sample tables and samples.jsonl), and `log_metric(name, value)` (averaged over calls, then
    processes)."""

    def __init__(self, rows: int, taken=()):
        self.rows, self.taken, self.columns, self.metrics = rows, set(taken), {}, {}

    def keywords(self) -> dict:
        def log_extra(column: str, values: list) -> None:
            values = list(values)
            if len(values) != self.rows:
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {self.rows} rows")
            key, n = str(column), 1
            while key in self.columns or key in self.taken:  # a column logged twice, or a table's own: _2, _3...
                n += 1
                key = f"{column}_{n}"
            self.columns[key] = [v.tolist() if hasattr(v, "tolist") else v for v in values]  # tensors, numpy: JSON

        def log_metric(name: str, value: float) -> None:
            if not math.isfinite(float(value)):
                raise ValueError(f"log_metric({name!r}, {value}): not a finite number")
            self.metrics.setdefault(str(name), []).append(float(value))
        return dict(log_extra=log_extra, log_metric=log_metric)


class RewardComponents(dict):
    """Each reward's scores by name (NaN: a function's None), and what the functions logged (`RewardLogs`)."""

    def __init__(self, scores: dict, logs: RewardLogs | None = None):
        super().__init__(scores)
        self.columns, self.metrics = (logs.columns, logs.metrics) if logs else ({}, {})


def reward_fn_kwargs(tokenizer, rows: dict, prompt_column: str, responses: torch.Tensor) -> dict:
    """A reward function's data keywords, in TRL's convention (GRPOTrainer, trl.rewards): `prompts` as the dataset
    gives them, `completions` (decoded; for message-list prompts `[{"role": "assistant", "content": ...}]`, a continued
    assistant prefix included: README), `completion_ids` (up to the stop token) and every other column of the rows."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    prompts = rows[prompt_column]
    completions = [[{"role": "assistant", "content": assistant_prefix(p) + t}] if isinstance(p, list) else t
                   for p, t in zip(prompts, texts)]
    # as TRL, neither the prompt nor a reference `completion` column; input_ids is this script's tokenised prompt
    columns = {k: v for k, v in rows.items() if k not in (prompt_column, "input_ids", "completion", "completion_ids")}
    return dict(prompts=prompts, completions=completions,
                completion_ids=[r[r != tokenizer.pad_token_id].tolist() for r in responses], **columns)


def function_scores(rewards, rows: dict, responses: torch.Tensor, global_step: int, logs: RewardLogs) -> dict:
    """Each reward function's scores of `responses` to `rows` by name (on the responses' device), called with
    `reward_fn_kwargs` and TRL's trainer keywords, logging into `logs`. `rewards`: a script's record of them (`names`,
    reward models first; `fn_specs`, `fns`, `model_paths`, `policy_tokenizer`, `prompt_column`, `max_steps`,
    `updates_per_epoch`)."""
    kwargs = reward_fn_kwargs(rewards.policy_tokenizer, rows, rewards.prompt_column, responses)
    state = TrainerState(global_step, rewards.max_steps, global_step / rewards.updates_per_epoch)
    trainer = dict(trainer_state=state, **logs.keywords())
    names = rewards.names[len(rewards.model_paths):]
    return dict(zip(names, call_reward_fns([(fn, {**kwargs, **trainer}, spec)
                                            for spec, fn in zip(rewards.fn_specs, rewards.fns)], responses.device)))


def call_reward_fns(calls: list, device) -> list[torch.Tensor]:
    """(fn, kwargs, name) calls in the order given, the async ones' coroutines then awaited together; each checked to
    return, per completion, a finite number or None (the row is not judged: NaN, see `score_responses`)."""
    started = []
    try:
        started.extend((*start_reward_fn(fn, kwargs, name), name) for fn, kwargs, name in calls)
    except Exception:  # the async functions started before it will not be awaited
        for out in (out for out, _, _ in started if inspect.iscoroutine(out)):
            out.close()
        raise
    waiting = [i for i, (out, _, _) in enumerate(started) if inspect.isawaitable(out)]
    for i, out in zip(waiting, await_together([started[i][0] for i in waiting]) if waiting else []):
        if isinstance(out, BaseException):
            _, kwargs, name = started[i]
            raise RuntimeError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, raised "
                               f"{type(out).__name__}: {out}") from out
        started[i] = (out, *started[i][1:])
    return [checked_scores(out, kwargs, device, name) for out, kwargs, name in started]


def start_reward_fn(fn: Callable, kwargs: dict, name: str) -> tuple:
    """Call a reward function with `reward_fn_kwargs` (and TRL's trainer keywords, where its signature takes them):
    (its output, or an async function's coroutine; the keywords, for messages). Errors name the function."""
    try:
        params = inspect.signature(fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):  # a function that never took them still runs
            kwargs = {k: v for k, v in kwargs.items() if k not in TRAINER_KEYWORDS or k in params}
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, cannot take them ({e}). "
                         "Reward functions take keywords, as TRL's GRPOTrainer: def f(completions, **kwargs) -> "
                         "list[float | None], a dataset column arriving as the keyword of its name, e.g. def "
                         "accuracy(completions, solution, **kwargs)") from None
    except ValueError:  # no signature to read (some builtins): the call itself will tell
        pass
    data = {k: v for k, v in kwargs.items() if k not in TRAINER_KEYWORDS}
    try:  # a copy: a function may edit its inputs (TRL's own code pops prompts)
        return fn(**copy.deepcopy(data), **{k: kwargs[k] for k in TRAINER_KEYWORDS if k in kwargs}), kwargs
    except Exception as e:
        raise RuntimeError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, raised "
                           f"{type(e).__name__}: {e}") from e


_event_loop = None

def await_together(coroutines: list) -> list:
    """Results (or exceptions) of coroutines awaited together (asyncio.gather), as TRL, on one event loop kept for the
    run in a thread of its own: an async client a function keeps between calls stays on its loop."""
    global _event_loop
    if _event_loop is None:
        _event_loop = asyncio.new_event_loop()
        threading.Thread(target=_event_loop.run_forever, daemon=True).start()

    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)
    return asyncio.run_coroutine_threadsafe(gather(), _event_loop).result()


def call_reward_fn(fn: Callable, kwargs: dict, device, name: str) -> torch.Tensor:
    """One reward function's scores (`call_reward_fns`)."""
    return call_reward_fns([(fn, kwargs, name)], device)[0]


def checked_scores(out, kwargs: dict, device, name: str) -> torch.Tensor:
    """A reward function's output as scores, NaN for None; refused unless one finite number or None per completion."""
    called = f"--reward-fn {name}, called with the keywords {', '.join(kwargs)},"
    values, n = out.tolist() if isinstance(out, (np.ndarray, torch.Tensor)) else out, len(kwargs["completions"])
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ValueError(f"{called} returned {type(out).__name__} {str(out)[:200]}; expected a list of {n} numbers "
                         "(or None), one per completion")
    values = [v.item() if isinstance(v, np.generic) or isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 else v
              for v in values]  # numpy's and torch's scalars (np.bool_ too) as Python numbers
    if not all(v is None or isinstance(v, numbers.Real) for v in values):
        bad = next(v for v in values if not (v is None or isinstance(v, numbers.Real)))
        raise ValueError(f"{called} returned {bad!r} ({type(bad).__name__}); expected a number or None per completion")
    scores = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
    scores = scores.to(device=device, dtype=torch.float32)
    if not torch.isfinite(scores[[v is not None for v in values]]).all():
        raise ValueError(f"{called} returned a non-finite score (return None for a row it does not judge): {values}")
    return scores


def check_every_row_judged(components: dict, functions: list[str], prompts: list, when: str = "") -> None:
    """Refuse a batch with a row that no reward judged (every reward a function, every function's None)."""
    if len(functions) != len(components):  # a reward model judges every row: its NaN is no None
        return
    unjudged = torch.stack([components[n].isnan() for n in functions]).all(0)
    if unjudged.any():
        prompt = prompt_text(prompts[unjudged.nonzero()[0].item()])
        raise ValueError(f"every reward returned None for the prompt {prompt!r:.300}{when}: each row needs a reward "
                         "that judges it")


def check_reward_fns(rewards, rows: dict, queries: torch.Tensor) -> None:
    """Call each reward function once, on `rows` with their rendered prompts standing in for completions, so a broken
    one fails before any model loads (a paid or stateful judge sees this call)."""
    if rewards.fns:
        components = function_scores(rewards, rows, queries, 0, RewardLogs(len(queries)))
        if not rewards.model_paths:  # a reward model judges every row
            check_every_row_judged(components, list(components), rows[rewards.prompt_column],
                                   " at start-up (the prompts standing in for completions)")


# ---- Metrics and text: each reward's mean, what functions logged, a prompt for people --------------------------------
def reward_means(components: dict, prefix: str, total: Callable) -> dict:
    """Each reward's mean over the rows it judged (`total` sums over processes), and for each that returned None
    (NaN) the share of rows it did not judge, as `{prefix}/scores_none/<name>`; what functions logged with
    `log_metric`, averaged over processes, as `{prefix}/reward_fn/<name>`."""
    if not components:  # ppo_tldr.py's one reward model: objective/scores says it all
        return {}
    logged = getattr(components, "metrics", {})
    names, device = sorted(logged), next(iter(components.values())).device
    tag = float(zlib.crc32(repr(names).encode()) % 4096)  # the same on every process (sums exact in float32)
    sums = total(torch.stack([torch.stack([c.nansum(), c.isnan().float().sum(), torch.ones_like(c).sum()])
                              for c in components.values()] + [torch.tensor([tag, 1.0, 0.0], device=device)]))
    if sums[-1, 0] != tag * sums[-1, 1]:
        raise ValueError(f"log_metric: reward functions logged other metric names on other processes (here {names}); "
                         "log each name on every process, as TRL requires")
    means = {f"{prefix}/scores/{n}": (s / (size - none)).item() for n, (s, none, size) in zip(components, sums)
             if none < size}
    if names:
        logged_sums = total(torch.tensor([[sum(logged[n]) / len(logged[n]), 1.0] for n in names],
                                          dtype=torch.float64, device=device))
        means.update({f"{prefix}/reward_fn/{n}": (s / count).item() for n, (s, count) in zip(names, logged_sums)})
    return {**means, **{f"{prefix}/scores_none/{n}": (none / size).item() for n, (_, none, size) in
                        zip(components, sums) if none > 0}}


def assistant_prefix(prompt) -> str:
    """The final assistant message a chat prompt leaves for the policy to continue, or ""."""
    return prompt[-1]["content"] if isinstance(prompt, list) and prompt[-1]["role"] == "assistant" else ""


def prompt_text(prompt) -> str:
    """A prompt as the dataset gave it, for people: the text, or a chat prompt from its last user message on."""
    if isinstance(prompt, str):
        return prompt
    users = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
    return " ".join(m["content"] for m in prompt[users[-1] if users else -1:])
