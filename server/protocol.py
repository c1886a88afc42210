"""OpenAI's request bodies checked and turned into what the engine takes, and its response and error shapes. No
HTTP here: parsed JSON to a GenerationRequest, or an ApiError for anything the API refuses. Sampling fields are
checked once, by SamplingParams, whose InvalidSamplingParam becomes a 400 naming the field as the request spelled it.
"""
from __future__ import annotations

import json
import math
import reprlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.logprobs import TokenLogprobs
from engine.request import RequestOutput
from engine.sampling_params import InvalidSamplingParam, SamplingParams
from engine.sse import event

CHAT_ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system
# Fields that change what a model generates and this engine does not do, with the value that means "off":
# refused when set otherwise, never silently ignored.
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
               "tools": None, "functions": None, "tool_choice": None, "response_format": None, "echo": False,
               "suffix": None, "best_of": 1, "prompt_logprobs": None, "min_tokens": 0}
# as SamplingParams names them; ignore_eos is vLLM's extra field (fixed-length benchmarks: `vllm bench serve`)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos")
MAX_PRIORITY = 1_000_000
MIN_LOGPROB = -9999.0  # JSON has no -inf: a logprob of -inf (a logit at -inf) reports this, as vLLM's server does
# An error's message and param, cut to this: they may quote what another module raised about the client's input
# (the sampler's `got {value!r}`, a tokenizer's error), and a 3 MB model name once came back whole in a 404.
MAX_MESSAGE_CHARS = 1000
MAX_PARAM_CHARS = 120


@dataclass
class ApiError(Exception):
    """A request the API refuses, as OpenAI reports it: {"error": {"message", "type", "param", "code"}}."""
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.message = _cut(self.message, MAX_MESSAGE_CHARS)
        if self.param is not None and len(self.param) > MAX_PARAM_CHARS:  # a path through the client's own keys
            self.param = self.param[:MAX_PARAM_CHARS - 1] + "…"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


_REPR = reprlib.Repr()  # bounded: a huge list or object is never formatted whole only to be cut
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 8, 8, 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60


def excerpt(value, n: int = 80) -> str:
    """What an error message may quote of a client's value: its repr, at most `n` characters and, where that is not
    all of it, how long the whole was (`'xxxx…' (3,145,728 characters)`, `[1, 2, ...] (100,000 items)`)."""
    if isinstance(value, str):
        text = repr(value[:n])
        if len(value) <= n and len(text) <= n:
            return text
        return f"{text[:n - 1]}… ({len(value):,} characters)"
    text = _REPR.repr(value)
    if len(text) <= n and "..." not in text:
        return text
    cut = text if len(text) <= n else text[:n - 1] + "…"
    if not isinstance(value, (list, dict, tuple)):
        return cut
    return f"{cut} ({len(value):,} item{'' if len(value) == 1 else 's'})"


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else f"{text[:n - 1]}… ({len(text):,} characters in all)"


@dataclass
class GenerationRequest:
    """A checked /v1/completions or /v1/chat/completions body. `prompt` is what the engine takes (chat: the
    messages, still to go through the chat template); the sampling fields become SamplingParams once the prompt's
    length is known (max_tokens defaults to what is left of the context)."""
    chat: bool
    prompt: str | list[int] | list[dict]
    sampling: dict[str, Any]
    max_tokens_param: str | None  # the field that set max_tokens, as the request spelled it
    stream: bool
    include_usage: bool
    logprobs: int | None  # how many top logprobs per token; None: none asked for
    priority: int = 0  # lower first (the engine's priority policy); the audience of a shared engine: 0 or more
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        fields = dict(self.sampling)
        if "max_tokens" not in fields:
            # as vLLM: the rest of the context (at least 1, so that a prompt too long is refused by the engine)
            fields["max_tokens"] = max(1, max_model_len - num_prompt_tokens)
        try:
            return SamplingParams(**fields, logprobs=self.logprobs)
        except InvalidSamplingParam as exc:
            raise bad_request(str(exc), self._param_name(exc.param)) from exc

    def _param_name(self, param: str) -> str:
        if param == "max_tokens":
            return self.max_tokens_param or param
        if param == "logprobs" and self.chat:
            return "top_logprobs"
        return param


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def parse_chat(body: dict, model_name: str) -> GenerationRequest:
    messages = chat_messages(body.get("messages"))
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request(f"logprobs must be true or false, got {excerpt(logprobs)}", "logprobs")
    if top is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    num_top = (0 if top is None else top) if logprobs else None
    max_param = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    return _generation(body, model_name, True, messages, max_param, num_top)


def parse_completion(body: dict, model_name: str) -> GenerationRequest:
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):  # the chat API's flag sent here: completions take a count
        raise bad_request(f"logprobs must be an integer (how many top tokens per position), got {excerpt(logprobs)}",
                          "logprobs")
    max_param = "max_tokens" if body.get("max_tokens") is not None else None
    return _generation(body, model_name, False, completion_prompt(body.get("prompt")), max_param, logprobs)


def _generation(body: dict, model_name: str, chat: bool, prompt, max_param: str | None,
                logprobs) -> GenerationRequest:
    check_model(body.get("model"), model_name)
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise bad_request(f"n must be a positive integer, got {excerpt(n)}", "n")
    if n is not None and n > 1:
        raise bad_request(f"n={n} is not supported: this engine returns one choice per request (n=1)", "n")
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        off_too = value in ({}, []) or (name == "response_format" and _text_format(value))
        if value is not None and value != off and not off_too:
            raise bad_request(f"{name} is not supported by this engine (got {excerpt(value)})", name,
                              "unsupported_parameter")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {excerpt(stream)}", "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    include_usage = False
    if options is not None:
        include_usage = options.get("include_usage", False) if isinstance(options, dict) else None
        if not isinstance(include_usage, bool):
            raise bad_request(f"stream_options must be an object like {{\"include_usage\": true}}, got "
                              f"{excerpt(options)}", "stream_options")
    sampling = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    if max_param is not None:
        sampling["max_tokens"] = body[max_param]
    # vLLM's extra field: lower goes first under the priority policy
    priority = 0 if body.get("priority") is None else body["priority"]
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        raise bad_request(f"priority must be an integer from -{MAX_PRIORITY:,} to {MAX_PRIORITY:,}, got "
                          f"{excerpt(priority)}", "priority")
    return GenerationRequest(chat, prompt, sampling, max_param, stream, include_usage, logprobs, priority)


def _text_format(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def check_model(requested, model_name: str) -> None:
    """A request may leave the model out (this server has one); naming another is an error, as with OpenAI."""
    if requested is None or requested == model_name:
        return
    raise ApiError(404, f"The model {excerpt(requested)} does not exist: this server serves `{model_name}` "
                        f"(see GET /v1/models)", "invalid_request_error", "model", "model_not_found")


def chat_messages(value) -> list[dict]:
    """The messages as the chat template takes them: {"role", "content": str}, text parts joined by newlines."""
    if value is None:
        raise bad_request("messages is required: a list of {\"role\", \"content\"} objects", "messages")
    if not isinstance(value, list) or not value:
        raise bad_request(f"messages must be a non-empty list, got {excerpt(value)}", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with a role and a content, got {excerpt(message)}", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {excerpt(role)}",
                              f"{where}.role")
        text = content_text(message.get("content"), f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise bad_request(f"{where} must be a string or a list of text parts ({{\"type\": \"text\", \"text\": ...}}), "
                      f"got {excerpt(content)}", where)


def completion_prompt(value) -> str | list[int]:
    """A string or a list of token ids; a batch of one of either is taken as that one."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise bad_request(f"a batch of {len(value)} prompts is not supported: send one prompt per request", "prompt")
    raise bad_request(f"prompt must be a non-empty string or a non-empty list of token ids, got {excerpt(value)}",
                      "prompt")


# ---- responses ----------------------------------------------------------------------------------------------

def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


class TokenText:
    """Token ids as the text OpenAI's logprobs show (each token decoded alone)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, logprobs: list[TokenLogprobs]) -> dict:
        return {"content": [{**self.chat_entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self.chat_entry(t, v) for t, v in lp.top]} for lp in logprobs]}

    def completion_logprobs(self, logprobs: list[TokenLogprobs], text_offset: int = 0) -> dict:
        tokens = [self(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
                "top_logprobs": [{self(t): _logprob(v) for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}


class Deltas:
    """What a stream has not sent yet of a request's outputs. While stop strings may still cut the text, the
    last (longest stop - 1) characters are held back: what was sent is never taken back, so the streamed
    pieces add up to the final text exactly."""

    def __init__(self, params: SamplingParams) -> None:
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.num_chars = 0
        self.num_tokens = 0
        self.text_offset = 0  # characters of the tokens sent so far (completions' logprobs.text_offset)

    def advance(self, out: RequestOutput) -> tuple[str, list[TokenLogprobs]]:
        text = out.text if out.finished else out.text[:len(out.text) - self.holdback]
        delta = text[self.num_chars:]
        self.num_chars = max(self.num_chars, len(text))
        logprobs = (out.logprobs or [])[self.num_tokens:]
        self.num_tokens = len(out.token_ids)
        return delta, logprobs


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


sse = event  # one `data:` event (engine/sse.py: the format, written and read in one place)
