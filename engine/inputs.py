"""The input side (as vLLM v1's input processor): a new request's prompt, params and priority checked, and whether it
can ever fit the configuration, before the engine takes it. Everything here raises ValueError and changes nothing."""
from __future__ import annotations

from .config import EngineConfig
from .sampling_params import SamplingParams
from .utils import cdiv


class ContextLengthError(ValueError):
    """A request that can never fit: its prompt reaches max_model_len, or it needs more KV blocks than the pool has."""


def check_fits(num_prompt: int, params: SamplingParams, config: EngineConfig) -> None:
    if num_prompt >= config.max_model_len:
        raise ContextLengthError(f"prompt has {num_prompt} tokens but max_model_len is {config.max_model_len} "
                                 f"(room is needed for at least one generated token)")
    if config.kv_cache and config.paged_kv:
        need = cdiv(min(num_prompt + params.max_tokens, config.max_model_len), config.block_size)
        if need > config.num_kv_blocks:
            raise ContextLengthError(f"this request needs {need} KV blocks but the pool has only "
                                     f"{config.num_kv_blocks}")


def checked_inputs(prompt: str | list[int], params: SamplingParams | None, priority: int, tokenizer,
                   vocab_size: int) -> tuple[str | None, list[int], SamplingParams]:
    """(the prompt's text or None, its token ids, the params) of a request, each checked."""
    params = params or SamplingParams()
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    text = None
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt")
        text = prompt
        token_ids = tokenizer(prompt).input_ids
    elif isinstance(prompt, (list, tuple)):
        token_ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
            raise ValueError("prompt token ids must be integers")
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("empty prompt")
    if bad := [t for t in token_ids if not 0 <= t < vocab_size]:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return text, token_ids, params
