"""Reward functions called as TRL 1.12's GRPOTrainer calls them: the keywords `prompts`,
`completions`, `completion_ids`, every other column of the rows, and TRL's `trainer_state`,
`log_extra` and `log_metric`; `async def` ones awaited together; each output checked to be one
number or None per row; each local function tried once at start-up. A training script scores with
its reward models itself and calls `function_scores` for the functions."""
import asyncio
import copy
import inspect
import math
import numbers
import threading
from typing import Callable

import numpy as np
import torch

from ppo_harness.keywords import TRAINER_KEYWORDS
from ppo_harness.reward_fns import assistant_prefix, prompt_text
from ppo_harness.reward_logs import RewardLogs
from ppo_harness.reward_server import served
from ppo_harness.reward_stacks import openrlhf_texts


def reward_fn_kwargs(tokenizer, rows: dict, prompt_column: str, responses: torch.Tensor) -> dict:
    """A reward function's data keywords, in TRL's convention (GRPOTrainer, trl.rewards): `prompts`
    as the dataset gives them, `completions` (decoded; for message-list prompts `[{"role":
    "assistant", "content": ...}]`, a continued assistant prefix included: README), `completion_ids`
    (up to the stop token) and every other column of the rows."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    prompts = rows[prompt_column]
    completions = [[{"role": "assistant", "content": assistant_prefix(p) + t}] if isinstance(p, list) else t
                   for p, t in zip(prompts, texts)]
    # as TRL, neither the prompt nor a reference `completion` column; input_ids is this script's
    # tokenised prompt
    columns = {k: v for k, v in rows.items() if k not in (prompt_column, "input_ids", "completion", "completion_ids")}
    return dict(prompts=prompts, completions=completions,
                completion_ids=[r[r != tokenizer.pad_token_id].tolist() for r in responses], **columns)


def function_scores(rewards, rows: dict, responses: torch.Tensor, global_step: int, logs: RewardLogs,
                    judged: list[bool] | None = None) -> dict:
    """Each reward function's scores of `responses` to `rows` by name (on the responses' device),
    called with `reward_fn_kwargs` and TRL's trainer keywords, logging into `logs`. `rewards`: a
    script's record of them (`names`, reward models first; `fn_specs`, `fns`, `model_paths`,
    `policy_tokenizer`, `prompt_column`, `chat`, `max_steps`, `updates_per_epoch`). `judged`: the
    rows the functions see (a process's own held-out rows: not the ones its share repeats so that
    every process samples as many, which another process's judge sees), the others' scores NaN."""
    names = rewards.names[len(rewards.model_paths):]
    if judged is not None and not all(judged):
        keep = [i for i, own in enumerate(judged) if own]
        scores = {name: torch.full((len(responses),), math.nan, device=responses.device) for name in names}
        if keep:  # no call for no row
            part = RewardLogs(len(keep), logs.taken)
            for name, values in function_scores(rewards, {k: [v[i] for i in keep] for k, v in rows.items()},
                                                responses[keep], global_step, part).items():
                scores[name][keep] = values
            logs.spread(part, keep)
        return scores
    tokenizer = rewards.policy_tokenizer
    kwargs = reward_fn_kwargs(tokenizer, rows, rewards.prompt_column, responses)
    trainer = dict(trainer_state=trainer_state(global_step, rewards.max_steps, rewards.updates_per_epoch,
                                               len(responses)), **logs.keywords())
    # OpenRLHF's texts, as OpenRLHF makes them
    if any(getattr(fn, "rendered", False) for fn in rewards.fns):
        rendered = openrlhf_texts(tokenizer, rows[rewards.prompt_column], rows["input_ids"], rewards.chat, responses)
    return dict(zip(names, call_reward_fns([
        (fn, {**kwargs, **trainer, **(rendered if getattr(fn, "rendered", False) else {})}, spec)
        for spec, fn in zip(rewards.fn_specs, rewards.fns)], responses.device)))


def trainer_state(global_step: int, max_steps: int, updates_per_epoch: int, rows: int):
    """TRL's `trainer_state` keyword: transformers' TrainerState, as TRL passes its trainer's. Here
    `global_step` counts the updates done (TRL: optimizer steps): an update's rollout is scored at
    update - 1, the evaluation after it at update; `epoch` counts the passes over the prompts."""
    from accelerate import PartialState
    from transformers import TrainerState

    process = PartialState()
    return TrainerState(epoch=global_step / updates_per_epoch, global_step=global_step, max_steps=max_steps,
                        num_train_epochs=math.ceil(max_steps / updates_per_epoch), train_batch_size=rows,
                        is_local_process_zero=process.is_local_main_process,
                        is_world_process_zero=process.is_main_process)


def call_reward_fns(calls: list, device) -> list[torch.Tensor]:
    """(fn, kwargs, name) calls in the order given, the async ones' coroutines then awaited
    together; each checked to return, per completion, a finite number or None (the row is not
    judged: NaN, see `score_responses`)."""
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
            raise RuntimeError(f"--reward-fn {name}, called with the keywords "
                               f"{', '.join(kwargs)}, raised {type(out).__name__}: {out}") from out
        started[i] = (out, *started[i][1:])
    return [checked_scores(out, kwargs, device, name) for out, kwargs, name in started]


def start_reward_fn(fn: Callable, kwargs: dict, name: str) -> tuple:
    """Call a reward function with `reward_fn_kwargs` (and TRL's trainer keywords, where its
    signature takes them): (its output, or an async function's coroutine; the keywords, for
    messages). Errors name the function."""
    try:
        params = inspect.signature(fn).parameters
        # a function that never took them still runs
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
    try:  # a copy: a function may edit its inputs (TRL's own code pops prompts)
        return fn(**copy.deepcopy(data), **{k: kwargs[k] for k in TRAINER_KEYWORDS if k in kwargs}), kwargs
    except Exception as e:
        raise RuntimeError(f"--reward-fn {name}, called with the keywords {', '.join(kwargs)}, "
                           f"raised {type(e).__name__}: {e}") from e


# The loop runs in a daemon thread, not through asyncio.Runner: TRL's GRPOTrainer runs async reward
# functions so (start_event_loop_in_daemon, run_coroutine_threadsafe), and a function written for
# it keeps that: its loop keeps running between calls, so a client's background tasks (keep-alive
# pings, a pool's clean-up) go on while the run trains, and it is called even where the caller's
# own thread already runs a loop (a notebook), where asyncio.Runner.run refuses to start.
_event_loop = None
_event_loop_started = threading.Lock()


def await_together(coroutines: list) -> list:
    """Results (or exceptions) of coroutines awaited together (asyncio.gather), as TRL, on one
    event loop kept for the run in a thread of its own: an async client a function keeps between
    calls stays on its loop."""
    global _event_loop
    with _event_loop_started:
        if _event_loop is None:
            _event_loop = asyncio.new_event_loop()
            threading.Thread(target=_event_loop.run_forever, name="reward-functions",
                             daemon=True).start()

    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)
    return asyncio.run_coroutine_threadsafe(gather(), _event_loop).result()


def call_reward_fn(fn: Callable, kwargs: dict, device, name: str) -> torch.Tensor:
    """One reward function's scores (`call_reward_fns`)."""
    return call_reward_fns([(fn, kwargs, name)], device)[0]


def checked_scores(out, kwargs: dict, device, name: str) -> torch.Tensor:
    """A reward function's output as scores, NaN for None; refused unless one finite number or None
    per completion."""
    called = f"--reward-fn {name}, called with the keywords {', '.join(kwargs)},"
    values, n = out.tolist() if isinstance(out, (np.ndarray, torch.Tensor)) else out, len(kwargs["completions"])
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ValueError(f"{called} returned {type(out).__name__} {str(out)[:200]}; expected a "
                         f"list of {n} numbers (or None), one per completion")
    values = [v.item() if isinstance(v, np.generic) or isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 else v
              for v in values]  # numpy's and torch's scalars (np.bool_ too) as Python numbers
    if not all(v is None or isinstance(v, numbers.Real) for v in values):
        bad = next(v for v in values if not (v is None or isinstance(v, numbers.Real)))
        raise ValueError(f"{called} returned {bad!r} ({type(bad).__name__}); expected a number "
                         "or None per completion")
    scores = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
    scores = scores.to(device=device, dtype=torch.float32)
    if not torch.isfinite(scores[[v is not None for v in values]]).all():
        raise ValueError(f"{called} returned a non-finite score (return None for a row it does "
                         f"not judge): {values}")
    return scores


def unjudged_rows(components: dict, functions: list[str], judged: list[bool] | None = None) -> torch.Tensor:
    """The rows no reward judged: every reward is a function, and each returned None (a reward model
    judges every row: its NaN is no None); of the rows the functions saw (`judged`, see
    `function_scores`)."""
    if functions and len(functions) == len(components):
        unjudged = torch.stack([components[n].isnan() for n in functions]).all(0)
        return unjudged if judged is None else unjudged & torch.tensor(judged, device=unjudged.device)
    return torch.zeros_like(next(iter(components.values())), dtype=torch.bool)


def check_every_row_judged(components: dict, functions: list[str], prompts: list, when: str = "",
                           judged: list[bool] | None = None) -> None:
    """Refuse a batch with a row that no reward judged (--unjudged-rows stop)."""
    unjudged = unjudged_rows(components, functions, judged)
    if unjudged.any():
        prompt = prompt_text(prompts[unjudged.nonzero()[0].item()])
        raise ValueError(f"every reward returned None for the prompt {prompt!r:.300}{when}: each "
                         "row needs a reward that judges it (--unjudged-rows stop)")


def check_some_row_judged(unjudged: torch.Tensor, names: list[str], update: int) -> None:
    """Stop the run at an update where no reward judged any row on any process (each returned None
    for each): it would train on nothing, and save the SFT model as the trained one."""
    from accelerate.utils import reduce

    counts = reduce(torch.stack([unjudged.sum(), torch.ones_like(unjudged).sum()]).float(), "sum")
    if counts[0] == counts[1]:
        raise ValueError(f"update {update}: no reward judged any of its {int(counts[1])} rows "
                         f"({', '.join(names)} returned None for each), so it would train on "
                         "nothing: make the function(s) return a number for the rows they can "
                         "judge (None only for the others); no model is saved, the checkpoints "
                         "written so far are kept")


def check_reward_fns(rewards, rows: dict, queries: torch.Tensor, stop_unjudged: bool = False) -> None:
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
    kind, message = broadcast_object_list([(type(error).__name__, str(error)) if error else (None, None)])[0]
    if error is not None:
        raise error
    if kind is not None:
        raise (ValueError if kind == "ValueError" else RuntimeError)(message)


def try_local_fns(rewards, rows: dict, queries: torch.Tensor, stop_unjudged: bool) -> None:
    """`check_reward_fns` on this process."""
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
