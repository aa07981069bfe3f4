"""What a run logs of its rewards: each reward's mean and share of rows it did not judge, what the
functions logged through TRL's `log_metric` averaged over processes, the sample tables' rows (with
the columns they logged through `log_extra`), the held-out evaluation's metrics. One batch's scores
and logs (`RewardComponents`) are what `reward_calls` gives back."""
import math
import zlib
from typing import Callable

import torch

from ppo_harness.reward_calls import RewardComponents
from ppo_harness.reward_fns import prompt_text


def reward_means(components: dict, prefix: str, total: Callable) -> dict:
    """Each reward's mean over the rows it judged (`total` sums over processes), and for each that
    returned None (NaN) the share of rows it did not judge, as `{prefix}/scores_none/<name>`; what
    functions logged with `log_metric`, averaged over processes, as `{prefix}/reward_fn/<name>`."""
    if not components:  # ppo_tldr.py's one reward model: objective/scores says it all
        return {}
    logged = getattr(components, "metrics", {})
    names, device = sorted(logged), next(iter(components.values())).device
    # the same on every process (sums exact in float32)
    tag = float(zlib.crc32(repr(names).encode()) % 4096)
    sums = total(torch.stack([torch.stack([c.nansum(), c.isnan().float().sum(),
                                           torch.ones_like(c).sum()])
                              for c in components.values()]
                             + [torch.tensor([tag, 1.0, 0.0], device=device)]))
    if sums[-1, 0] != tag * sums[-1, 1]:
        raise ValueError("log_metric: reward functions logged other metric names on other "
                         f"processes (here {names}); log each name on every "
                         "process, as TRL requires")
    means = {f"{prefix}/scores/{n}": (s / (size - none)).item()
             for n, (s, none, size) in zip(components, sums) if none < size}
    if names:
        logged_sums = total(torch.tensor([[sum(logged[n]) / len(logged[n]), 1.0] for n in names],
                                          dtype=torch.float64, device=device))
        means.update({f"{prefix}/reward_fn/{n}": (s / count).item()
                      for n, (s, count) in zip(names, logged_sums)})
    return {**means, **{f"{prefix}/scores_none/{n}": (none / size).item() for n, (_, none, size) in
                        zip(components, sums) if none > 0}}


def sample_rows(prompts: list, texts: list[str], scores: torch.Tensor,
                components: dict) -> list[dict]:
    """Sample-table rows: the prompt as the dataset gave it (`prompt_text`), the response, the score
    (None for a row no reward judged), each reward's score (a None stays None), then the functions'
    `log_extra` columns."""
    unjudged = getattr(components, "unjudged", None)
    values = torch.stack(list(components.values()), 1).tolist() if components else [[]] * len(texts)
    return [{"prompt": prompt_text(p), "model response": t,
             "score": None if unjudged is not None and unjudged[i] else s,
             **{n: None if math.isnan(v) else v for n, v in zip(components, c)},
             **{column: logged[i] for column, logged in getattr(components, "columns", {}).items()}}
            for i, (p, t, s, c) in enumerate(zip(prompts, texts, scores.tolist(), values))]


def held_out_metrics(rows: list[dict], names: list[str], logged: list[dict]) -> dict:
    """The held-out evaluation's metrics from every process's rows (`sample_rows`' form):
    eval/scores and its standard error over the rows some reward judged, each reward's mean and None
    share (`reward_means`), and what the functions logged with `log_metric` (`logged`: each
    process's `RewardLogs.metrics`), the mean over processes."""
    judged = torch.tensor([row["score"] for row in rows if row["score"] is not None])
    every = RewardComponents({name: torch.tensor([math.nan if row[name] is None else row[name]
                                                  for row in rows])
                              for name in names})
    every.metrics = {name: [sum(m[name]) / len(m[name]) for m in logged if name in m]
                     for name in sorted(set().union(*logged))}
    n = judged.numel()
    return {"eval/scores": judged.mean().item() if n else 0.0,
            "eval/scores_se": (judged.std() / n**0.5).item() if n > 1 else 0.0,
            **reward_means(every, "eval", lambda t: t)}
