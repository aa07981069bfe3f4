"""Reward functions called as TRL 1.12's GRPOTrainer calls them: the keywords `prompts`,
`completions`, `completion_ids`, every other column of the rows, and TRL's `trainer_state`,
`log_extra` and `log_metric`; `async def` ones awaited together; each output checked to be one
number or None per row; each local function tried once at start-up. What one batch's calls give
back is `RewardComponents`: each reward's scores by name, what the functions logged (`RewardLogs`)
and the rows no reward judged. A training script scores with its reward models itself and hands
their scores to `reward_components`, which adds the functions'."""
import copy
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ppo_harness.event_loop import await_together
from ppo_harness.keywords import TRAINER_KEYWORDS
from ppo_harness.reward_fns import assistant_prefix, prompt_text
from ppo_harness.reward_server import served
from ppo_harness.reward_stacks import openrlhf_texts


@dataclass
class RewardLogs:
    """What reward functions log through TRL's keywords while one batch is scored:
    `log_extra(column, values)`, one value per row (sample tables and samples.jsonl), and
    `log_metric(name, value)` (averaged over calls, then processes). A column is named apart from
    the others and from `taken` (the sample table's own columns)."""
    rows: int
    taken: tuple | set = ()
    columns: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def log_extra(self, column: str, values: list) -> None:
        values = list(values)
        if len(values) != self.rows:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values "
                             f"for {self.rows} rows")
        key, n = str(column), 1
        # a column logged twice, or a table's own: _2, _3...
        while key in self.columns or key in self.taken:
            n += 1
            key = f"{column}_{n}"
        # tensors, numpy: JSON
        self.columns[key] = [v.tolist() if hasattr(v, "tolist") else v for v in values]

    def log_metric(self, name: str, value: float) -> None:
        if not math.isfinite(float(value)):
            raise ValueError(f"log_metric({name!r}, {value}): not a finite number")
        self.metrics.setdefault(str(name), []).append(float(value))

    def keywords(self) -> dict:
        """TRL's two logging keywords, as a function is called with them."""
        return dict(log_extra=self.log_extra, log_metric=self.log_metric)

    def spread(self, part: "RewardLogs", rows: list[int]) -> None:
        """What functions logged on some of the rows (`part`, their `rows` here): a column None on
        the others."""
        for column, values in part.columns.items():
            self.columns[column] = [None] * self.rows
            for i, value in zip(rows, values):
                self.columns[column][i] = value
        for name, values in part.metrics.items():
            self.metrics.setdefault(name, []).extend(values)


class RewardComponents(dict):
    """Each reward's scores by name (NaN: a function's None), as `reward_components` hands them back
    with three attributes: `columns` and `metrics`, what the functions logged (`RewardLogs`), and
    `unjudged`, the rows no reward judged (every reward a function, each returning None). The
    readers of a plain dict of scores take it as nothing logged."""


def reward_components(rewards, rows: dict, responses: torch.Tensor, global_step: int, scores: dict,
                      judged: list[bool] | None = None, taken=()) -> RewardComponents:
    """Every reward's scores of `responses` to `rows` by name: the reward models' `scores`, then
    each function's (on the responses' device, NaN for a None), called by `call_reward_fns` with
    TRL's data keywords and its trainer keywords; what they log is kept, a column named apart from
    the rewards and from `taken`. `rewards`: a script's record of them (`names`, reward models
    first; `fn_specs`, `fns`, `model_paths`, `policy_tokenizer`, `prompt_column`, `chat`,
    `max_steps`, `updates_per_epoch`, `stop_unjudged`). `judged`: the rows the functions see (a
    process's own held-out rows: not the ones its share repeats so that every process samples as
    many, which another process's judge sees), the others' scores NaN; None: a training batch,
    which stops the run where no process has a row that some reward judged."""
    from accelerate import PartialState
    from accelerate.utils import reduce
    from transformers import TrainerState

    n, names = len(responses), rewards.names[len(rewards.model_paths):]
    seen = list(range(n)) if judged is None else [i for i, own in enumerate(judged) if own]
    logs, scores, values = RewardLogs(len(seen), (*taken, *rewards.names)), dict(scores), {}
    if rewards.fns and (seen or len(seen) == n):  # a share with no row of its own calls nothing
        whole = len(seen) == n
        part = rows if whole else {k: [v[i] for i in seen] for k, v in rows.items()}
        mine = responses if whole else responses[seen]
        tokenizer, process = rewards.policy_tokenizer, PartialState()
        # TRL's data keywords (GRPOTrainer, trl.rewards): `prompts` as the dataset gives them,
        # `completions` decoded (for message-list prompts `[{"role": "assistant", "content": ...}]`,
        # a continued assistant prefix included: README), `completion_ids` up to the stop token,
        # and every other column, but neither a reference `completion` column (as TRL) nor
        # `input_ids`, this script's tokenised prompt
        prompts = part[rewards.prompt_column]
        texts = tokenizer.batch_decode(mine, skip_special_tokens=True)
        keywords = dict(prompts=prompts,
                        completions=[[{"role": "assistant", "content": assistant_prefix(p) + t}]
                                     if isinstance(p, list) else t for p, t in zip(prompts, texts)],
                        completion_ids=[r[r != tokenizer.pad_token_id].tolist() for r in mine],
                        **{k: v for k, v in part.items()
                           if k not in (rewards.prompt_column, "input_ids", "completion", "completion_ids")})
        # TRL's trainer_state (transformers' TrainerState, as TRL passes its trainer's), but
        # `global_step` counts the updates done (TRL: optimizer steps): an update's rollout is
        # scored at update - 1, the evaluation after it at update; `epoch` counts the passes over
        # the prompts
        per_epoch = rewards.updates_per_epoch
        state = TrainerState(epoch=global_step / per_epoch, global_step=global_step,
                             max_steps=rewards.max_steps, train_batch_size=len(seen),
                             num_train_epochs=math.ceil(rewards.max_steps / per_epoch),
                             is_local_process_zero=process.is_local_main_process,
                             is_world_process_zero=process.is_main_process)
        keywords.update(trainer_state=state, log_extra=logs.log_extra, log_metric=logs.log_metric)
        # OpenRLHF's texts, as OpenRLHF makes them
        if any(getattr(fn, "rendered", False) for fn in rewards.fns):
            rendered = openrlhf_texts(tokenizer, prompts, part["input_ids"], rewards.chat, mine)
        values = dict(zip(names, call_reward_fns([
            (fn, {**keywords, **(rendered if getattr(fn, "rendered", False) else {})}, spec)
            for spec, fn in zip(rewards.fn_specs, rewards.fns)], responses.device)))
    if len(seen) < n:  # the rows another process judges: NaN, and None in each logged column
        for name in names:
            every = torch.full((n,), math.nan, device=responses.device)
            if name in values:
                every[seen] = values[name]
            values[name] = every
        logs, logged = RewardLogs(n, logs.taken), logs
        logs.spread(logged, seen)
    scores.update(values)
    if rewards.stop_unjudged:
        check_every_row_judged(scores, names, rows[rewards.prompt_column], judged=judged)
    # a row no reward judged: every reward is a function and each returned None (a reward model
    # judges every row: its NaN is no None), of the rows the functions saw
    unjudged = torch.zeros(n, dtype=torch.bool, device=responses.device)
    if names and len(names) == len(scores):
        unjudged = torch.stack([scores[name].isnan() for name in names]).all(0)
        if judged is not None:
            unjudged &= torch.tensor(judged, device=unjudged.device)
    if judged is None:  # a batch no reward judged on any process would train on nothing
        counts = reduce(torch.stack([unjudged.sum(), torch.ones_like(unjudged).sum()]).float(),
                        "sum")
        if counts[0] == counts[1]:
            raise ValueError(no_row_judged(global_step + 1, int(counts[1]), names))
    components = RewardComponents(scores)
    components.columns, components.metrics, components.unjudged = logs.columns, logs.metrics, unjudged
    return components


def call_reward_fns(calls: list, device) -> list[torch.Tensor]:
    """(fn, keywords, name) calls in the order given, each with its keywords (the trainer's only
    where its signature takes them) and a copy of the data's (TRL's own code pops prompts), the
    async ones' coroutines then awaited together; each output checked to be, per completion, a
    finite number or None (the row is not judged: NaN, see `score_responses`). Errors name the
    function and the keywords it was called with."""
    started = []  # (output or coroutine, the keywords it was called with, name)
    try:
        for fn, kwargs, name in calls:
            try:
                params = inspect.signature(fn).parameters
                # a function that never took the trainer's keywords still runs
                if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                    kwargs = {k: v for k, v in kwargs.items() if k not in TRAINER_KEYWORDS or k in params}
                inspect.signature(fn).bind(**kwargs)
            except TypeError as e:
                raise ValueError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, "
                                 f"cannot take them ({e}). Reward functions take keywords, as TRL's "
                                 "GRPOTrainer: def f(completions, **kwargs) -> list[float | None], a "
                                 "dataset column arriving as the keyword of its name, e.g. def "
                                 "accuracy(completions, solution, **kwargs)") from None
            except ValueError:  # no signature to read (some builtins): the call itself will tell
                pass
            data = {k: v for k, v in kwargs.items() if k not in TRAINER_KEYWORDS}
            trainer = {k: kwargs[k] for k in TRAINER_KEYWORDS if k in kwargs}
            try:
                started.append((fn(**copy.deepcopy(data), **trainer), kwargs, name))
            except Exception as e:
                raise RuntimeError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, "
                                   f"raised {type(e).__name__}: {e}") from e
    except Exception:  # the async functions started before it will not be awaited
        for out in (out for out, _, _ in started if inspect.iscoroutine(out)):
            out.close()
        raise
    waiting = [i for i, (out, _, _) in enumerate(started) if inspect.isawaitable(out)]
    for i, out in zip(waiting, await_together([started[i][0] for i in waiting]) if waiting else []):
        if isinstance(out, BaseException):
            _, kwargs, name = started[i]
            raise RuntimeError(f"--reward-fn {name}, called with the keywords "
                               f"{', '.join(kwargs)}, raised {type(out).__name__}: {out}") from out
        started[i] = (out, *started[i][1:])
    scores = []
    for out, kwargs, name in started:  # one finite number or None per completion
        called = f"--reward-fn {name}, called with the keywords {', '.join(kwargs)},"
        values = out.tolist() if isinstance(out, (np.ndarray, torch.Tensor)) else out
        n = len(kwargs["completions"])
        if not isinstance(values, (list, tuple)) or len(values) != n:
            raise ValueError(f"{called} returned {type(out).__name__} {str(out)[:200]}; expected a "
                             f"list of {n} numbers (or None), one per completion")
        values = [v.item() if isinstance(v, np.generic)
                  or isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 else v
                  for v in values]  # numpy's and torch's scalars (np.bool_ too) as Python numbers
        if not all(v is None or isinstance(v, numbers.Real) for v in values):
            bad = next(v for v in values if not (v is None or isinstance(v, numbers.Real)))
            raise ValueError(f"{called} returned {bad!r} ({type(bad).__name__}); expected a number "
                             "or None per completion")
        checked = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
        checked = checked.to(device=device, dtype=torch.float32)  # a score past float32's range: inf
        if not torch.isfinite(checked[[v is not None for v in values]]).all():
            raise ValueError(f"{called} returned a non-finite score (return None for a row it does "
                             f"not judge): {values}")
        scores.append(checked)
    return scores


def call_reward_fn(fn: Callable, kwargs: dict, device, name: str) -> torch.Tensor:
    """One reward function's scores (`call_reward_fns`)."""
    return call_reward_fns([(fn, kwargs, name)], device)[0]


def unjudged_rows(components: dict, functions: list[str],
                  judged: list[bool] | None = None) -> torch.Tensor:
    """The rows no reward judged: every reward is a function, and each returned None (a reward model
    judges every row: its NaN is no None); of the rows the functions saw (`judged`, see
    `reward_components`)."""
    if functions and len(functions) == len(components):
        unjudged = torch.stack([components[n].isnan() for n in functions]).all(0)
        return unjudged if judged is None else unjudged & torch.tensor(judged,
                                                                       device=unjudged.device)
    return torch.zeros_like(next(iter(components.values())), dtype=torch.bool)


def check_every_row_judged(components: dict, functions: list[str], prompts: list, when: str = "",
                           judged: list[bool] | None = None) -> None:
    """Refuse a batch with a row that no reward judged (--unjudged-rows stop)."""
    unjudged = unjudged_rows(components, functions, judged)
    if unjudged.any():
        prompt = prompt_text(prompts[unjudged.nonzero()[0].item()])
        raise ValueError(f"every reward returned None for the prompt {prompt!r:.300}{when}: each "
                         "row needs a reward that judges it (--unjudged-rows stop)")


def no_row_judged(update: int, rows: int, names: list[str]) -> str:
    """Why a run stops at an update no reward judged any row of."""
    return (f"update {update}: no reward judged any of its {rows} rows ({', '.join(names)} "
            "returned None for each), so it would train on nothing: make the function(s) return a "
            "number for the rows they can judge (None only for the others); no model is saved, the "
            "checkpoints written so far are kept")


def check_reward_fns(rewards, rows: dict, queries: torch.Tensor,
                     stop_unjudged: bool = False) -> None:
    """Call each local reward function once per run (on the main process; the others raise its
    error), on `rows` with their rendered prompts standing in for completions, so a broken one fails
    before any model loads; a served reward is not called (a paid judge would bill a fake row)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    error = None
    if PartialState().is_main_process:
        try:
            try_local_fns(rewards, rows, queries, stop_unjudged)
        except Exception as raised:
            error = raised
    sent = (type(error).__name__, str(error)) if error else (None, None)
    kind, message = broadcast_object_list([sent])[0]
    if error is not None:
        raise error
    if kind is not None:
        raise (ValueError if kind == "ValueError" else RuntimeError)(message)


def try_local_fns(rewards, rows: dict, queries: torch.Tensor, stop_unjudged: bool) -> None:
    """`check_reward_fns` on this process."""
    names = rewards.names[len(rewards.model_paths):]
    local = [(name, spec, fn) for name, spec, fn in zip(names, rewards.fn_specs, rewards.fns)
             if not served(fn)]
    if local:
        record = copy.copy(rewards)
        record.names, record.fn_specs, record.fns = (list(column) for column in zip(*local))
        record.model_paths, record.stop_unjudged = [], False
        # every row counted as seen: only this process calls, so no other would join a stop's sum
        components = reward_components(record, rows, queries, 0, {}, [True] * len(queries))
        if stop_unjudged and len(local) == len(rewards.fns) and not rewards.model_paths:
            check_every_row_judged(components, list(components), rows[rewards.prompt_column],
                                   " at start-up (the prompts standing in for completions)")
