"""Reward functions used by the tests through --reward-fn tests/rewards.py:NAME, in TRL's keyword convention."""


def text(completion) -> str:
    """A completion's text: a string, or TRL's conversational form [{"role": "assistant", "content": ...}]."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def target_word_fraction(completions, **kwargs):
    """Fraction of completion words equal to 'w7' (a reward the tiny vocabulary makes learnable in seconds)."""
    return [text(c).split().count("w7") / max(1, len(text(c).split())) for c in completions]


def wrong_length(completions, **kwargs):
    return [0.0] * (len(completions) + 1)


def not_finite(completions, **kwargs):
    return [float("nan")] * len(completions)


def not_numbers(completions, **kwargs):
    return ["1.0"] * len(completions)


def positional(prompts, responses):
    """The signature ppo.py took before TRL's keyword convention."""
    return [0.0] * len(responses)


def judges_w7_only(completions, **kwargs):
    """target_word_fraction where the completion has a 'w7', else None (the row is not judged)."""
    return [f if f > 0 else None for f in target_word_fraction(completions)]


def never_judges(completions, **kwargs):
    return [None] * len(completions)


_calls = 0


def explodes_after_first_update(completions, **kwargs):
    """Finite until the third call (the start-up probe, then update 1), then 1e38: the value loss overflows."""
    global _calls
    _calls += 1
    return [1e38 if _calls > 2 else 0.0] * len(completions)


def logged_target_word_fraction(prompts, completions, **kwargs):
    """target_word_fraction, appending each call's prompts as one JSON line to $PROMPT_LOG (what each batch scored)."""
    import json
    import os

    with open(os.environ["PROMPT_LOG"], "a") as f:
        f.write(json.dumps(prompts) + "\n")
    return target_word_fraction(completions)


def nan_after_first_update(completions, **kwargs):
    """0.0 until the third call (the start-up probe, then update 1), then NaN: refused at update 2's scoring."""
    global _calls
    _calls += 1
    return [float("nan") if _calls > 2 else 0.0] * len(completions)


def accuracy(completions, solution, **kwargs):
    """Written for TRL's GRPOTrainer (the shape of open-r1's accuracy_reward): 1.0 where the completion names the row's
    `solution` column, else 0.0."""
    return [float(sol in text(c).split()) for c, sol in zip(completions, solution)]


async def served_by_env(prompts, completions, **kwargs):
    """An async function written as an LLM judge is: it awaits the reward server at $REWARD_URL."""
    import asyncio
    import json
    import os
    import urllib.request

    def post():
        request = urllib.request.Request(os.environ["REWARD_URL"], json.dumps(dict(
            prompts=prompts, completions=completions)).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["rewards"]
    return await asyncio.to_thread(post)


def progress(completions, trainer_state, log_extra, log_metric, **kwargs):
    """TRL's trainer keywords: logs the run's progress as a metric and trainer_state as columns; scores
    as target_word_fraction."""
    log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
    log_extra("global_step", [trainer_state.global_step] * len(completions))
    log_extra("epoch", [trainer_state.epoch] * len(completions))
    return target_word_fraction(completions)


def raises_inside(completions, **kwargs):
    return [1 / 0 for _ in completions]


def reward_func(queries, prompts, labels):
    """OpenRLHF's convention (a --remote_rm_url .py file): 1 where the query holds its row's label, as a tensor."""
    import torch

    return torch.tensor([float(label in query[len(prompt):].split()) for query, prompt, label in
                         zip(queries, prompts, labels)])


def reward_func_with_logs(queries, prompts, labels, **kwargs):
    """OpenRLHF's convention answering a dict: `rewards` and `extra_logs`."""
    scores = reward_func(queries, prompts, labels)
    return {"rewards": scores, "scores": scores, "extra_logs": {"query_words": [len(q.split()) for q in queries]}}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's convention: a dict whose `score` is the reward, its other keys logged."""
    return {"score": float(ground_truth in solution_str), "words": len(solution_str.split()),
            "source": data_source, "split": extra_info["split"]}


def process_index(completions, log_metric, **kwargs):
    """Logs this process's index (its mean over 2 processes is 0.5); judges every row 0."""
    from accelerate import PartialState

    log_metric("process", float(PartialState().process_index))
    return [0.0] * len(completions)


def logs_its_rows(prompts, completions, row_id, trainer_state, **kwargs):
    """Appends one line per call to the file $REWARD_CALLS (the step, the rows' row_id, whether the prompts stand in
    for the completions: the start-up check); judges every row 0."""
    import json
    import os

    with open(os.environ["REWARD_CALLS"], "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step, "rows": list(row_id),
                            "start_up": list(completions) == list(prompts)}) + "\n")
    return [0.0] * len(completions)


def signal_in_update_one_only(completions, trainer_state, **kwargs):
    """target_word_fraction for update 1's rollout (global_step 0), then 1.0 for every completion: groups that all
    score alike, once the policy has moved from the reference."""
    if trainer_state.global_step == 0:
        return target_word_fraction(completions)
    return [1.0] * len(completions)
