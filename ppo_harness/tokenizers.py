"""The tokenizers a run reads with, and their checks: whether the prompts go through the chat
template, the token a chat template ends a turn with, and a reward model's own tokenizer (whether it
can read the policy's token ids, its padding and truncation, the ids and positions its model takes).
Each refusal names the flag to change; what each tokenizer is used for is the scripts' choice."""
from transformers import AutoTokenizer


def is_chat(first_prompt, apply_chat_template: str) -> bool:
    """Whether the prompts go through the chat template (--apply-chat-template)."""
    if isinstance(first_prompt, list) and apply_chat_template == "false":
        raise ValueError("--apply-chat-template false: the prompts are lists of chat messages, "
                         "which need the chat template; give a text prompt column or "
                         "leave the flag at auto")
    return isinstance(first_prompt, list) or apply_chat_template == "true"


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special token a chat template closes an assistant turn with (<|im_end|>, <|eot_id|>...),
    else eos."""
    marker = "PPO_END_OF_TURN_MARKER"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                              "content": marker}], tokenize=False)
    except Exception:
        return tokenizer.eos_token_id
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    if ids and (ids[0] in tokenizer.all_special_ids or ids[0] in tokenizer.added_tokens_decoder):
        return ids[0]
    return tokenizer.eos_token_id


def same_tokenizer(policy_tokenizer, rm_tokenizer, chat: bool) -> bool:
    """Whether a reward model can read the policy's ids: the same vocabulary and (chat) the same
    template."""
    return policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab() and (
        not chat or policy_tokenizer.chat_template == rm_tokenizer.chat_template)


def prepare_reward_tokenizer(rm_tokenizer, path: str, chat: bool):
    """A reward model's own tokenizer: eos as pad if needed, right padding, left truncation; or
    refused."""
    if rm_tokenizer.pad_token_id is None:
        if rm_tokenizer.eos_token_id is None:
            raise ValueError(f"--reward-model-path {path}: its tokenizer has neither a pad nor an "
                             "eos token, so a batch cannot be padded; add a pad token to it "
                             f"(tokenizer.add_special_tokens({{'pad_token': ...}}) "
                             "and save_pretrained)")
        rm_tokenizer.pad_token = rm_tokenizer.eos_token
    if chat and rm_tokenizer.chat_template is None:
        raise ValueError(f"--reward-model-path {path}: it has its own tokenizer, with no chat "
                         "template, and the prompts are chat messages; give a reward model with "
                         "a chat template, or text prompts")
    rm_tokenizer.padding_side, rm_tokenizer.truncation_side = "right", "left"
    return rm_tokenizer


def load_reward_tokenizers(policy_tokenizer, paths: list[str], configs: list, chat: bool,
                           trust_remote_code: bool = False) -> tuple[list, list]:
    """Per reward model: None where it can read the policy's token ids (`same_tokenizer`), else its
    own tokenizer, prepared (`prepare_reward_tokenizer`); and the most tokens it reads, its
    max_position_embeddings or its tokenizer's model_max_length (None on the policy's ids). A
    tokenizer with ids past its model's embedding rows is refused: they would fail in the first
    update (an IndexError)."""
    tokenizers = []
    for path, config in zip(paths, configs):
        rm_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        tokenizers.append(None if same_tokenizer(policy_tokenizer, rm_tokenizer, chat) else
                          prepare_reward_tokenizer(rm_tokenizer, path, chat))
        top = max((tokenizers[-1] or policy_tokenizer).get_vocab().values())
        rows = config.get_text_config().vocab_size
        if top >= rows:
            raise ValueError(f"--reward-model-path {path}: the tokenizer it reads with has ids up "
                             f"to {top}, its model {rows} embedding rows: give the reward model "
                             "the tokenizer it was trained with")
    max_lengths = [None if t is None else min(filter(None, [getattr(c, "max_position_embeddings", None), (
        t.model_max_length if t.model_max_length < 1e9 else None)]), default=None)
        for c, t in zip(configs, tokenizers)]
    return tokenizers, max_lengths
