"""What reward functions report, and what a run logs of its rewards: the columns and metrics
functions log through TRL's `log_extra` and `log_metric` (`RewardLogs`), each reward's scores by
name (`RewardComponents`), each reward's mean and share of rows it did not judge, the sample tables'
rows, the held-out evaluation's metrics."""
import math
import zlib
from typing import Callable

import torch

from ppo_harness.reward_fns import prompt_text


class RewardLogs:
    """What reward functions log through TRL's keywords while one batch is scored:
    `log_extra(column, values)`, one value per row (sample tables and samples.jsonl), and
    `log_metric(name, value)` (averaged over calls, then processes)."""

    def __init__(self, rows: int, taken=()):
        self.rows, self.taken, self.columns, self.metrics = rows, set(taken), {}, {}

    def keywords(self) -> dict:
        def log_extra(column: str, values: list) -> None:
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

        def log_metric(name: str, value: float) -> None:
            if not math.isfinite(float(value)):
                raise ValueError(f"log_metric({name!r}, {value}): not a finite number")
            self.metrics.setdefault(str(name), []).append(float(value))
        return dict(log_extra=log_extra, log_metric=log_metric)

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
    """Each reward's scores by name (NaN: a function's None), what the functions logged
    (`RewardLogs`), and the rows no reward judged (`unjudged`: every reward a function, each
    returning None)."""

    def __init__(self, scores: dict, logs: RewardLogs | None = None, unjudged: torch.Tensor | None = None):
        super().__init__(scores)
        self.columns, self.metrics = (logs.columns, logs.metrics) if logs else ({}, {})
        self.unjudged = unjudged


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
    sums = total(torch.stack([torch.stack([c.nansum(), c.isnan().float().sum(), torch.ones_like(c).sum()])
                              for c in components.values()] + [torch.tensor([tag, 1.0, 0.0], device=device)]))
    if sums[-1, 0] != tag * sums[-1, 1]:
        raise ValueError("log_metric: reward functions logged other metric names on other "
                         f"processes (here {names}); log each name on every "
                         "process, as TRL requires")
    means = {f"{prefix}/scores/{n}": (s / (size - none)).item() for n, (s, none, size) in zip(components, sums)
             if none < size}
    if names:
        logged_sums = total(torch.tensor([[sum(logged[n]) / len(logged[n]), 1.0] for n in names],
                                          dtype=torch.float64, device=device))
        means.update({f"{prefix}/reward_fn/{n}": (s / count).item() for n, (s, count) in zip(names, logged_sums)})
    return {**means, **{f"{prefix}/scores_none/{n}": (none / size).item() for n, (_, none, size) in
                        zip(components, sums) if none > 0}}


def sample_rows(prompts: list, texts: list[str], scores: torch.Tensor, components: dict) -> list[dict]:
    """Sample-table rows: the prompt as the dataset gave it (`prompt_text`), the response, the score
    (None for a row no reward judged), each reward's score (a None stays None), then the functions'
    `log_extra` columns."""
    unjudged = getattr(components, "unjudged", None)
    values = torch.stack(list(components.values()), 1).tolist() if components else [[]] * len(texts)
    return [{"prompt": prompt_text(p), "model response": t,
             "score": None if unjudged is not None and unjudged[i] else s,
             **{n: None if math.isnan(v) else v for n, v in zip(components, c)},
             **{column: column_values[i] for column, column_values in getattr(components, "columns", {}).items()}}
            for i, (p, t, s, c) in enumerate(zip(prompts, texts, scores.tolist(), values))]


def held_out_metrics(rows: list[dict], names: list[str], logged: list[dict]) -> dict:
    """The held-out evaluation's metrics from every process's rows (`sample_rows`' form):
    eval/scores and its standard error over the rows some reward judged, each reward's mean and None
    share (`reward_means`), and what the functions logged with `log_metric` (`logged`: each
    process's `RewardLogs.metrics`), the mean over processes."""
    judged = torch.tensor([row["score"] for row in rows if row["score"] is not None])
    every = RewardComponents({name: torch.tensor([math.nan if row[name] is None else row[name] for row in rows])
                              for name in names})
    every.metrics = {name: [sum(m[name]) / len(m[name]) for m in logged if name in m]
                     for name in sorted(set().union(*logged))}
    n = judged.numel()
    return {"eval/scores": judged.mean().item() if n else 0.0,
            "eval/scores_se": (judged.std() / n**0.5).item() if n > 1 else 0.0,
            **reward_means(every, "eval", lambda t: t)}
