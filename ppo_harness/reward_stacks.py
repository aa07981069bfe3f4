"""The other stacks' reward conventions, called as TRL calls a function: OpenRLHF's
`reward_func(queries, prompts, labels)` (a .py file, or its remote reward protocol through
`reward_server`) and verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`."""
import asyncio
import inspect
import numbers
from typing import Callable

import numpy as np
import torch


class OpenRLHFReward:
    """OpenRLHF's convention, called as TRL calls a function: `reward_func(queries, prompts,
    labels)` from a .py file (OpenRLHF's --remote_rm_url file) or a server posted {"query",
    "prompts", "labels"}, given what OpenRLHF gives it (`openrlhf_texts`): `queries` each prompt
    with its response, `prompts` the prompts as OpenRLHF renders them, `labels` the rows'
    `label_key` column (None: the `label` column, else "" as OpenRLHF without --label_key). The
    reply: scores, or a dict of `rewards` (else `scores`) and `extra_logs` (each logged as a metric,
    its mean over the rows)."""
    rendered = True  # `reward_components` passes it OpenRLHF's texts

    def __init__(self, fn: Callable, label_key: str | None, spec: str):
        self.fn, self.label_key, self.spec = fn, label_key or "label", spec

    async def __call__(self, queries, rendered_prompts, log_metric=None, **columns):
        labels = columns[self.label_key] if self.label_key in columns else [""] * len(queries)
        out = self.fn(queries=list(queries), prompts=list(rendered_prompts), labels=list(labels))
        out = await out if inspect.isawaitable(out) else out
        if isinstance(out, dict):
            for name, values in (out.get("extra_logs") or {}).items():
                values = torch.as_tensor(values, dtype=torch.float64)
                if log_metric is not None and values.numel():
                    log_metric(name, values.mean().item())
            out = out["rewards"] if "rewards" in out else out.get("scores")
        return out.tolist() if isinstance(out, (torch.Tensor, np.ndarray)) else out


def openrlhf_texts(tokenizer, prompts: list, prompt_ids: list, chat: bool,
                   responses: torch.Tensor) -> dict:
    """OpenRLHF's `prompts` and `queries` (its PromptDataset and experience maker): a text prompt as
    it is, a chat prompt as its template renders it (the template's special tokens kept); the prompt
    tokenised without the tokenizer's own special tokens (a BOS: OpenRLHF passes
    add_special_tokens=False), then with the response decoded with special tokens kept, padding
    removed."""
    ids = ([list(i) for i in prompt_ids] if chat
           else tokenizer(list(prompts), add_special_tokens=False)["input_ids"])
    return dict(rendered_prompts=[tokenizer.decode(i) for i in ids] if chat else list(prompts),
                queries=[tokenizer.decode(i + r[r != tokenizer.pad_token_id].tolist())
                         for i, r in zip(ids, responses)])


def check_label_key(label_key: str | None, columns: list[str], source: str) -> None:
    """Refuse a --label-key that names no column (every label would be None: a judge grading against
    nothing)."""
    if label_key is not None and label_key not in columns:
        raise ValueError(f"--label-key {label_key!r} is not a column of {source} (columns: "
                         f"{columns}): name the column OpenRLHF's rewards get as `labels`, or "
                         "leave the flag out (then the `label` column, or \"\" for every row "
                         "where there is none, as OpenRLHF without --label_key)")


class VerlComputeScore:
    """verl's convention, called as TRL calls a function: `compute_score(data_source, solution_str,
    ground_truth, extra_info)` once per row, as verl's reward manager calls it, with the row's
    `data_source`, the response's text, `reward_model["ground_truth"]` and `extra_info` (each only
    if the function takes it): the row's dict ({} if none) with the keys verl adds, `num_turns` (2:
    verl's single-turn agent loop's prompt and response) and `rollout_reward_scores` ({}: no rollout
    scored a row). An `async def` one is awaited, the rows together, as verl's reward loop awaits
    it. A dict's `score` is the reward, its other keys are logged (`log_extra` columns, and their
    means as metrics)."""

    def __init__(self, fn: Callable, spec: str):
        self.fn, self.spec = fn, spec
        self.params = inspect.signature(fn).parameters

    def __call__(self, completions, log_extra=None, log_metric=None, **columns):
        n, outs = len(completions), []
        try:
            for i, completion in enumerate(completions):
                text = completion if isinstance(completion, str) else completion[0]["content"]
                extra_info = {**(columns.get("extra_info", [None] * n)[i] or {}), "num_turns": 2,
                              "rollout_reward_scores": {}}
                reward_model = columns.get("reward_model", [None] * n)[i] or {}
                row = dict(data_source=columns.get("data_source", [None] * n)[i], solution_str=text,
                           ground_truth=reward_model.get("ground_truth"), extra_info=extra_info)
                outs.append(self.fn(**{k: v for k, v in row.items() if k in self.params}))
        except BaseException:  # the rows' coroutines started before it will not be awaited
            for out in outs:
                if inspect.iscoroutine(out):
                    out.close()
            raise
        if any(inspect.isawaitable(out) for out in outs):
            return self.awaited(outs, log_extra, log_metric)
        return self.scores(outs, log_extra, log_metric)

    async def awaited(self, outs: list, log_extra, log_metric) -> list:
        async def value(out):
            return await out if inspect.isawaitable(out) else out
        return self.scores(await asyncio.gather(*map(value, outs)), log_extra, log_metric)

    @staticmethod
    def scores(outs: list, log_extra, log_metric) -> list:
        """Each row's score, a dict's `score`; the dicts' other keys logged. A dict without `score`
        is refused, as verl refuses it (KeyError 'score'), not read as a None."""
        scores, extra = [], {}
        for i, out in enumerate(outs):
            if isinstance(out, dict) and "score" not in out:
                raise ValueError(f"compute_score returned a dict without 'score' for row {i} (keys: "
                                 f"{', '.join(map(str, out)) or 'none'}); verl reads the row's score from "
                                 "out['score']: return {'score': value, ...} (None: the row is not judged)")
            if isinstance(out, dict):
                for key, value in out.items():
                    if key != "score":
                        extra.setdefault(key, [None] * len(outs))[i] = value
                out = out.get("score")
            scores.append(out)
        for key, values in extra.items():
            if log_extra is not None:
                log_extra(key, values)
            numbers_ = [float(v) for v in values if isinstance(v, numbers.Real)]
            if log_metric is not None and numbers_:
                log_metric(key, sum(numbers_) / len(numbers_))
        return scores
