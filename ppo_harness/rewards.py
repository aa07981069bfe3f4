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
from dataclasses import asdict
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


def load_reward_fn(spec: str, url_timeout: float = 60.0, url_retries: int = 3, url_protocol: str = "keywords",
                   label_key: str = "label") -> Callable:
    """A built-in name (`vader`), `module:function` (importable), `path/to/file.py:function`, or a served reward's
    URL (`url_protocol` "keywords": ours; "openrlhf": OpenRLHF's remote reward model). A function in OpenRLHF's
    convention (`reward_func(queries, prompts, labels)`) or verl's (`compute_score(data_source, solution_str,
    ground_truth, extra_info)`) is wrapped to be called as TRL calls a function."""
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    if spec.startswith(("http://", "https://")):
        served = ServedReward(spec, url_timeout, url_retries)
        return OpenRLHFReward(served.openrlhf, label_key, spec) if url_protocol == "openrlhf" else served
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
    dict) as one JSON object and reads back `{"rewards": [one number or null per row]}` or that list alone. A failed
    request (no connection, a timeout, a 5xx) is retried, 1, 2, 4... s apart."""

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

    async def send(self, body: dict, hint: str):
        """The reply to one batch, retried; `hint` closes the error when every try failed (the other protocol)."""
        data = json.dumps(body, default=str).encode()
        for attempt in range(self.retries + 1):
            try:
                return await asyncio.to_thread(self.post, data)
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read()[:200]!r}"
                if e.code < 500:  # the request itself is wrong: a retry gets the same answer
                    break
            except OSError as e:  # no connection, a reset, a timeout
                error = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                await asyncio.sleep(self.backoff * 2**attempt)
        raise ConnectionError(f"{self.url} failed after {attempt + 1} tries, the last with {error}{hint}")

    async def __call__(self, prompts, completions, completion_ids, trainer_state=None, log_extra=None,
                       log_metric=None, **columns):
        body = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                    trainer_state=asdict(trainer_state) if trainer_state else None)
        reply = await self.send(body, ". An OpenRLHF reward server (it reads \"query\", \"prompts\" and \"labels\") "
                                      "needs --reward-url-protocol openrlhf")
        return reply.get("rewards") if isinstance(reply, dict) else reply

    async def openrlhf(self, queries, prompts, labels):
        """OpenRLHF's remote reward protocol (its --remote_rm_url): {"query", "prompts", "labels"} posted."""
        reply = await self.send(dict(query=queries, prompts=prompts, labels=labels),
                                " (posted in OpenRLHF's protocol: --reward-url-protocol openrlhf)")
        if not (isinstance(reply, dict) and ("rewards" in reply or "scores" in reply)):
            raise ValueError(f"{self.url} answered {str(reply)[:200]} with no \"rewards\" or \"scores\", as OpenRLHF's "
                             "protocol reads them; a server of this script's keywords needs --reward-url-protocol "
                             "keywords")
        return reply


class OpenRLHFReward:
    """OpenRLHF's convention, called as TRL calls a function: `reward_func(queries, prompts, labels)` from a .py file
    (OpenRLHF's --remote_rm_url file) or a server posted {"query", "prompts", "labels"}. `queries` are each prompt, as
    rendered for the policy, with its response (special tokens kept, padding removed), `prompts` the rendered
    prompts, `labels` the rows' `label_key` column. The reply: scores, or a dict of `rewards` (else `scores`) and
    `extra_logs` (each logged as a metric, its mean over the rows)."""
    rendered = True  # `function_scores` passes it the rendered texts

    def __init__(self, fn: Callable, label_key: str, spec: str):
        self.fn, self.label_key, self.spec = fn, label_key, spec

    async def __call__(self, queries, rendered_prompts, log_metric=None, **columns):
        labels = columns.get(self.label_key, [None] * len(queries))
        out = self.fn(queries=list(queries), prompts=list(rendered_prompts), labels=list(labels))
        out = await out if inspect.isawaitable(out) else out
        if isinstance(out, dict):
            for name, values in (out.get("extra_logs") or {}).items():
                values = torch.as_tensor(values, dtype=torch.float64)
                if log_metric is not None and values.numel():
                    log_metric(name, values.mean().item())
            out = out["rewards"] if "rewards" in out else out.get("scores")
        return out.tolist() if isinstance(out, (torch.Tensor, np.ndarray)) else out


class VerlComputeScore:
    """verl's convention, called as TRL calls a function: `compute_score(data_source, solution_str, ground_truth,
    extra_info)` once per row, as verl's reward manager calls it, with the row's `data_source`, the response's text,
    `reward_model["ground_truth"]` and `extra_info` (each only if the function takes it). A dict's `score` is the
    reward, its other keys are logged (`log_extra` columns, and their means as metrics)."""

    def __init__(self, fn: Callable, spec: str):
        self.fn, self.spec = fn, spec
        self.params = inspect.signature(fn).parameters

    def __call__(self, completions, log_extra=None, log_metric=None, **columns):
        n, scores, extra = len(completions), [], {}
        for i, completion in enumerate(completions):
            text = completion if isinstance(completion, str) else completion[0]["content"]
            row = dict(data_source=columns.get("data_source", [None] * n)[i], solution_str=text,
                       ground_truth=(columns.get("reward_model", [None] * n)[i] or {}).get("ground_truth"),
                       extra_info=columns.get("extra_info", [None] * n)[i])
            out = self.fn(**{k: v for k, v in row.items() if k in self.params})
            if isinstance(out, dict):
                for key, value in out.items():
                    if key != "score":
                        extra.setdefault(key, [None] * n)[i] = value
                out = out.get("score")
            scores.append(out)
        for key, values in extra.items():
            if log_extra is not None:
                log_extra(key, values)
            numbers_ = [float(v) for v in values if isinstance(v, numbers.Real)]
            if log_metric is not None and numbers_:
                log_metric(key, sum(numbers_) / len(numbers_))
        return scores


# ---- Calling: TRL 1.12 GRPOTrainer's keywords, async functions awaited together, each output checked -----------------
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
    """Each reward's scores by name (NaN: a function's None), what the functions logged (`RewardLogs`), and the rows
    no reward judged (`unjudged`: every reward a function, each returning None)."""

    def __init__(self, scores: dict, logs: RewardLogs | None = None, unjudged: torch.Tensor | None = None):
        super().__init__(scores)
        self.columns, self.metrics = (logs.columns, logs.metrics) if logs else ({}, {})
        self.unjudged = unjudged


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
    tokenizer = rewards.policy_tokenizer
    kwargs = reward_fn_kwargs(tokenizer, rows, rewards.prompt_column, responses)
    trainer = dict(trainer_state=trainer_state(global_step, rewards.max_steps, rewards.updates_per_epoch,
                                               len(responses)), **logs.keywords())
    if any(getattr(fn, "rendered", False) for fn in rewards.fns):  # OpenRLHF's texts: rendered, special tokens kept
        rendered = dict(rendered_prompts=[tokenizer.decode(ids) for ids in rows["input_ids"]], queries=[
            tokenizer.decode(list(ids) + r[r != tokenizer.pad_token_id].tolist())
            for ids, r in zip(rows["input_ids"], responses)])
    names = rewards.names[len(rewards.model_paths):]
    return dict(zip(names, call_reward_fns([
        (fn, {**kwargs, **trainer, **(rendered if getattr(fn, "rendered", False) else {})}, spec)
        for spec, fn in zip(rewards.fn_specs, rewards.fns)], responses.device)))


def trainer_state(global_step: int, max_steps: int, updates_per_epoch: int, rows: int):
    """TRL's `trainer_state` keyword: transformers' TrainerState, as TRL passes its trainer's. Here `global_step` counts
    the updates done (TRL: optimizer steps): an update's rollout is scored at update - 1, the evaluation after it at
    update; `epoch` counts the passes over the prompts."""
    from accelerate import PartialState
    from transformers import TrainerState

    process = PartialState()
    return TrainerState(epoch=global_step / updates_per_epoch, global_step=global_step, max_steps=max_steps,
                        num_train_epochs=math.ceil(max_steps / updates_per_epoch), train_batch_size=rows,
                        is_local_process_zero=process.is_local_main_process,
                        is_world_process_zero=process.is_main_process)


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


def unjudged_rows(components: dict, functions: list[str]) -> torch.Tensor:
    """The rows no reward judged: every reward is a function, and each returned None (a reward model judges every row:
    its NaN is no None)."""
    if functions and len(functions) == len(components):
        return torch.stack([components[n].isnan() for n in functions]).all(0)
    return torch.zeros_like(next(iter(components.values())), dtype=torch.bool)


def check_every_row_judged(components: dict, functions: list[str], prompts: list, when: str = "") -> None:
    """Refuse a batch with a row that no reward judged (--unjudged-rows stop)."""
    unjudged = unjudged_rows(components, functions)
    if unjudged.any():
        prompt = prompt_text(prompts[unjudged.nonzero()[0].item()])
        raise ValueError(f"every reward returned None for the prompt {prompt!r:.300}{when}: each row needs a reward "
                         "that judges it (--unjudged-rows stop)")


def served(fn) -> bool:
    """Whether a reward function is a server's (`ServedReward`, or OpenRLHF's protocol posted to one)."""
    return isinstance(fn, ServedReward) or isinstance(getattr(getattr(fn, "fn", None), "__self__", None),
                                                      ServedReward)


def check_reward_fns(rewards, rows: dict, queries: torch.Tensor, stop_unjudged: bool = False) -> None:
    """Call each local reward function once, on `rows` with their rendered prompts standing in for completions, so a
    broken one fails before any model loads; a served reward is not called (a paid judge would bill a fake row)."""
    local = [(name, spec, fn) for name, spec, fn in zip(rewards.names[len(rewards.model_paths):], rewards.fn_specs,
                                                         rewards.fns) if not served(fn)]
    if local:
        record = copy.copy(rewards)
        record.names, record.fn_specs, record.fns = (list(column) for column in zip(*local))
        record.model_paths = []
        components = function_scores(record, rows, queries, 0, RewardLogs(len(queries)))
        if stop_unjudged and len(local) == len(rewards.fns) and not rewards.model_paths:
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


def sample_rows(prompts: list, texts: list[str], scores: torch.Tensor, components: dict) -> list[dict]:
    """Sample-table rows: the prompt as the dataset gave it (`prompt_text`), the response, the score (None for a row no
    reward judged), each reward's score (a None stays None), then the functions' `log_extra` columns."""
    unjudged = getattr(components, "unjudged", None)
    values = torch.stack(list(components.values()), 1).tolist() if components else [[]] * len(texts)
    return [{"prompt": prompt_text(p), "model response": t,
             "score": None if unjudged is not None and unjudged[i] else s,
             **{n: None if math.isnan(v) else v for n, v in zip(components, c)},
             **{column: column_values[i] for column, column_values in getattr(components, "columns", {}).items()}}
            for i, (p, t, s, c) in enumerate(zip(prompts, texts, scores.tolist(), values))]


def held_out_metrics(rows: list[dict], names: list[str], logged: list[dict]) -> dict:
    """The held-out evaluation's metrics from every process's rows (`sample_rows`' form): eval/scores and its standard
    error over the rows some reward judged, each reward's mean and None share (`reward_means`), and what the
    functions logged with `log_metric` (`logged`: each process's `RewardLogs.metrics`), the mean over processes."""
    judged = torch.tensor([row["score"] for row in rows if row["score"] is not None])
    every = RewardComponents({name: torch.tensor([math.nan if row[name] is None else row[name] for row in rows])
                              for name in names})
    every.metrics = {name: [sum(m[name]) / len(m[name]) for m in logged if name in m]
                     for name in sorted(set().union(*logged))}
    n = judged.numel()
    return {"eval/scores": judged.mean().item() if n else 0.0,
            "eval/scores_se": (judged.std() / n**0.5).item() if n > 1 else 0.0,
            **reward_means(every, "eval", lambda t: t)}


def assistant_prefix(prompt) -> str:
    """The final assistant message a chat prompt leaves for the policy to continue, or ""."""
    return prompt[-1]["content"] if isinstance(prompt, list) and prompt[-1]["role"] == "assistant" else ""


def prompt_text(prompt) -> str:
    """A prompt as the dataset gave it, for people: the text, or a chat prompt from its last user message on."""
    if isinstance(prompt, str):
        return prompt
    users = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
    return " ".join(m["content"] for m in prompt[users[-1] if users else -1:])
