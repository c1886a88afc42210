"""Small helpers shared across the engine."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a tokens."""
    return -(-a // b)


# ordinary word pieces in the default vocabulary, and valid in the tiny test models: random prompts are drawn here
TOKEN_RANGE = (1000, 20000)


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation as prompt token ids, through the model's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
