"""What the API refuses before it spends anything on a request: a wrong key, a body too large or not JSON, a prompt
that cannot fit, a list or object longer than its cap, text that cannot be encoded.

Each check is cheap and comes before tokenizing (a 10 MB prompt tokenized for seconds before its refusal stalled
every stream: docs/measurements.md, "The API under abuse"). They run on the event loop, so the caps are counted with
len() alone, before anything walks the body.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from .protocol import ApiError, bad_request, excerpt

MB = 1 << 20


@dataclass(frozen=True)
class ApiLimits:
    max_body_bytes: int = 4 * MB  # a request body; more is refused (413) before it is read whole
    # Every list or object the API reads has a cap (vLLM has none but the body's size; OpenAI refuses an array past
    # its maximum as array_above_max_length, as these do):
    max_stop_sequences: int = 32  # OpenAI takes 4; vLLM takes any number
    max_stop_chars: int = 1000  # one stop string
    max_stop_token_ids: int = 128  # vLLM's extra field: a model has a few end tokens; each is looked up per token
    max_messages: int = 1000  # a chat's messages (each costs template tokens: 1,000 fill most contexts served here)
    max_content_parts: int = 100  # a message's content given as a list of text parts
    # a prompt given as token ids (then checked against max_model_len) or as a list of prompts (refused past one):
    # 128K, the longest context of the llama-family models this engine loads
    max_prompt_items: int = 128 * 1024
    max_logit_bias: int = 300  # refused as unsupported when set, but by its size first: never repr'd or walked whole
    # a text prompt's first (max_model_len + 1) * this many characters are tokenized first: a prompt whose start
    # already holds more tokens than the context is refused without tokenizing the rest
    probe_chars_per_token: int = 4


def bearer_ok(header: str | None, api_key: str) -> bool:
    """`Authorization: Bearer KEY`, compared in constant time."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode("utf-8", "replace"), api_key.encode("utf-8"))


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY` (the server was "
                         "started with --api-key)", "invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def check_content_type(value: str | None) -> None:
    """JSON only: a browser sends text/plain or a form to any address without asking (no CORS preflight), so a web
    page could otherwise drive generation on a server listening on a visitor's own machine."""
    media = (value or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {excerpt(value) if value else 'none'}",
                       "invalid_request_error", code="unsupported_media_type")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({limit // MB} MB)",
                    "invalid_request_error", code="request_too_large")


def check_sizes(body: dict, limits: ApiLimits) -> None:
    """Every list and object the API reads within its cap (a 400 naming the field and the cap)."""
    _check_len(body.get("messages"), "messages", limits.max_messages)
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                _check_len(message.get("content"), f"messages[{i}].content", limits.max_content_parts)
    prompt = body.get("prompt")
    _check_len(prompt, "prompt", limits.max_prompt_items)
    if isinstance(prompt, list) and prompt:  # a batch of one prompt given as token ids: [[1, 2, 3]]
        _check_len(prompt[0], "prompt[0]", limits.max_prompt_items)
    _check_len(body.get("stop_token_ids"), "stop_token_ids", limits.max_stop_token_ids)
    _check_len(body.get("logit_bias"), "logit_bias", limits.max_logit_bias)
    check_stop(body.get("stop"), limits)


def _check_len(value, param: str, cap: int) -> None:
    if isinstance(value, (list, dict)) and len(value) > cap:
        kind = "array" if isinstance(value, list) else "object"
        raise bad_request(f"{param} is an {kind} of {len(value):,} items; this server takes at most {cap:,}", param,
                          "array_above_max_length" if isinstance(value, list) else "object_above_max_size")


def check_encodable(value, where: str = "body") -> None:
    """Every string in the body encodable as UTF-8: a lone UTF-16 surrogate ("\\ud800", valid JSON) cannot be
    tokenized or sent back in a response, and gave a plain-text 500. The whole body is tried at once in C; only a
    body that fails is walked, to name where."""
    try:
        json.dumps(value, ensure_ascii=False, check_circular=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    stack = [(value, where)]  # containers only, each with its path: a path is made for no scalar in a long list
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _encodable(item, path)
            continue
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for k, v in pairs:
            if isinstance(v, (str, list, dict)):
                if isinstance(k, str):
                    _encodable(k, f"{path} key")
                    name = k if len(k) <= 40 else excerpt(k, 40)
                    child = name if path == "body" else f"{path}.{name}"
                else:
                    child = f"{path}[{k}]"
                stack.append((v, child))
            elif isinstance(k, str):
                _encodable(k, f"{path} key")


def _encodable(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{path} holds text that is not valid Unicode (a lone surrogate at character "
                          f"{exc.start})", path, "invalid_text") from exc


def check_stop(stop, limits: ApiLimits) -> None:
    items = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(items) > limits.max_stop_sequences:
        raise bad_request(f"stop has {len(items):,} sequences; this server takes at most {limits.max_stop_sequences}",
                          "stop", "too_many_stop_sequences")
    for i, s in enumerate(items):
        if isinstance(s, str) and len(s) > limits.max_stop_chars:
            raise bad_request(f"stop[{i}] is {len(s):,} characters long ({excerpt(s, 40)}); at most "
                              f"{limits.max_stop_chars}", "stop", "stop_too_long")


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of this vocabulary can stand for (its byte-level spelling is at least as long
    as the text it decodes to): a text longer than max_model_len times this cannot fit the context."""
    try:
        vocab = tokenizer.get_vocab()
        return max(16, max(map(len, vocab)))
    except Exception:  # a tokenizer without a vocabulary to read: a generous bound
        return 128


def check_prompt_size(text_chars: int, num_ids: int | None, max_model_len: int, longest_token: int,
                      param: str) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit the context whatever its tokens turn out to be."""
    if num_ids is not None and num_ids > max_model_len:
        raise bad_request(f"the prompt has {num_ids} tokens; this model's context is {max_model_len} tokens",
                          param, "context_length_exceeded")
    if text_chars > max_model_len * longest_token:
        raise bad_request(f"the prompt has {text_chars:,} characters: more than fit in this model's context of "
                          f"{max_model_len} tokens, whatever its tokens", param, "context_length_exceeded")


def probe_too_long(text: str, tokenize, max_model_len: int, limits: ApiLimits) -> bool:
    """A long text whose first part already tokenizes to more than the context (a token or two of slack for the
    cut): refused without tokenizing the rest."""
    probe_chars = (max_model_len + 1) * limits.probe_chars_per_token
    if len(text) <= probe_chars:
        return False
    return len(tokenize(text[:probe_chars])) > max_model_len + 2
