"""The run's rewards as one record (`Rewards`): reward models first, then reward functions, with
their weights and what scoring a response needs; `load_rewards` resolves them from the flags before
any model loads, each function tried on two prompts (a reward model with its own tokenizer renders
them once), and `reward_notes` says on the banner how each reads a response."""
from dataclasses import dataclass, field
from typing import Callable

from ppo_harness.reward_calls import check_reward_fns
from ppo_harness.reward_fns import load_reward_fn, reward_names
from ppo_harness.reward_models import reward_model_texts


@dataclass
class Rewards:
    """Every reward (reward models first, then functions) and what scoring a response with them
    needs."""
    names: list[str]
    weights: list[float]
    fn_specs: list[str]
    fns: list[Callable]
    model_paths: list[str]
    # per reward model: None (it reads the policy's token ids) or its own tokenizer
    tokenizers: list
    max_lengths: list[int | None]
    policy_tokenizer: object
    chat: bool
    prompt_column: str
    chunk: int
    max_steps: int = 1  # updates, and updates per pass over the prompts: TRL's trainer_state
    updates_per_epoch: int = 1
    stop_unjudged: bool = False  # --unjudged-rows stop
    models: list = field(default_factory=list)  # filled by `load_models`


def load_rewards(args, model_paths: list[str], tokenizers: list, max_lengths: list,
                 policy_tokenizer, chat: bool, sizes, train_dataset, first_queries) -> Rewards:
    """The rewards of the flags (`vader` where none is given), each local function called once on
    the first two training prompts (`first_queries`: their token ids) and each reward model with its
    own tokenizer rendering them, so that a broken one fails before any model loads."""
    fn_specs = list(args.reward_fn) or ([] if args.reward_model_path else ["vader"])
    names = reward_names(args.reward_model_path, fn_specs)
    fns = [load_reward_fn(spec, args.reward_url_timeout, args.reward_url_retries,
                          args.reward_url_protocol, args.label_key,
                          args.reward_url_rows_per_request) for spec in fn_specs]
    rewards = Rewards(
        names=names,
        weights=(list(args.reward_weights) if args.reward_weights is not None
                 else [1.0] * len(names)),
        fn_specs=fn_specs, fns=fns, model_paths=model_paths, tokenizers=tokenizers,
        max_lengths=max_lengths,
        policy_tokenizer=policy_tokenizer, chat=chat, prompt_column=args.dataset_prompt_column,
        chunk=args.local_rollout_forward_batch_size, max_steps=sizes.num_updates,
        updates_per_epoch=len(train_dataset) // (sizes.batch_size // args.num_generations),
        stop_unjudged=args.unjudged_rows == "stop")
    first_rows = train_dataset[:2]
    check_reward_fns(rewards, first_rows, first_queries, rewards.stop_unjudged)
    for rm_tokenizer in filter(None, tokenizers):
        reward_model_texts(policy_tokenizer, rm_tokenizer, first_rows[args.dataset_prompt_column],
                           first_queries, first_queries, chat)
    return rewards


def reward_notes(rewards: Rewards, stop_token_id) -> list[str]:
    """The banner's lines on the prompts and on how each reward reads a response."""
    rendering = "its chat template" if rewards.chat else "prompt + response"
    how = [f"reward model {p}, " + ("the policy's tokenizer (its token ids, no decode)"
                                    if t is None else
                                    f"its own tokenizer (decoded text, {rendering}, "
                                    f"the last {n} tokens)")
           for p, t, n in zip(rewards.model_paths, rewards.tokenizers, rewards.max_lengths)]
    return [f"prompts: {'chat template' if rewards.chat else 'text'}; "
            f"stop token id {stop_token_id}",
            *[f"reward {n} (weight {w:g}): {h}" for n, w, h in zip(
                rewards.names, rewards.weights,
                how + [f"function {spec}" for spec in rewards.fn_specs])]]
