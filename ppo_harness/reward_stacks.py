"""The other stacks' reward conventions, called as TRL calls a function: OpenRLHF's `reward_func(queries, prompts,
labels)` (a .py file, or its remote reward protocol through `reward_server`) and verl's `compute_score(data_source,
solution_str, ground_truth, extra_info)`."""
import inspect
import numbers
from typing import Callable

import numpy as np
import torch


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
