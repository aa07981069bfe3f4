"""Reward models that read text: a reward model with a tokenizer of its own (another vocabulary)
reads the decoded response, a chat rendered by ITS chat template, or prompt + response, and scores
it at its last real token. The scripts score a reward model on the policy's own token ids themselves
(`reward_model_scores`)."""
import torch

from ppo_harness.prompt_files import as_messages


def text_reward_scores(reward_model, rm_tokenizer, texts: list[str], max_length: int,
                       add_special_tokens: bool, device) -> torch.Tensor:
    """A reward model with its own tokenizer, on texts: its score at each row's last real token
    (its attention mask)."""
    batch = rm_tokenizer(texts, add_special_tokens=add_special_tokens, padding=True,
                         truncation=True, max_length=max_length, return_tensors="pt").to(device)
    # an encoder (BERT, DeBERTa) pools by itself, at its first token
    if not hasattr(reward_model, "score"):
        return reward_model(**batch).logits[:, 0].float()
    hidden = reward_model.base_model(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"],
                                     use_cache=False).last_hidden_state
    last, rows = (batch["attention_mask"].sum(1) - 1,
                  torch.arange(hidden.size(0), device=hidden.device))
    return reward_model.score(hidden[rows, last]).squeeze(-1).float()


def reward_model_texts(policy_tokenizer, rm_tokenizer, prompts: list, queries: torch.Tensor,
                       responses: torch.Tensor, chat: bool) -> list[str]:
    """What a reward model with its own tokenizer reads: a chat rendered by ITS template, or
    prompt + response."""
    if chat:
        answers = policy_tokenizer.batch_decode(responses, skip_special_tokens=True)
        return [rm_tokenizer.apply_chat_template(with_answer(as_messages(p), a), tokenize=False)
                for p, a in zip(prompts, answers)]
    return policy_tokenizer.batch_decode(torch.cat((queries, responses), 1),
                                         skip_special_tokens=True)


def with_answer(messages: list[dict], answer: str) -> list[dict]:
    """The chat with the policy's answer: a new assistant turn, or the continuation of a final
    assistant prefix."""
    if messages[-1]["role"] == "assistant":
        return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + answer}]
    return messages + [{"role": "assistant", "content": answer}]
