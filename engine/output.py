"""Output processing, outside the engine's core (as vLLM v1's output processor): each new token's text (incremental
detokenization) and whether the request ends there (stop tokens, stop strings, the length limit)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


@dataclass
class _DetokState:
    """A request's text so far, the offsets that decode only a short window of it, and the next stop scan's start."""
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stop_scan_from: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self._states: dict[str, _DetokState] = {}

    def add(self, request_id: str) -> None:
        self._states[request_id] = _DetokState()

    def text(self, request_id: str) -> str:
        state = self._states.get(request_id)
        return "" if state is None else state.text

    def pop(self, request_id: str) -> str:
        """The request's final text; its state is freed (a finished or aborted request)."""
        state = self._states.pop(request_id, None)
        return "" if state is None else state.text

    def __len__(self) -> int:
        return len(self._states)

    def process(self, req: Request, token: int, max_model_len: int) -> str | None:
        """`token`, already appended to req's tokens: its text added, then "stop", "length" or None (go on)."""
        state = self._states[req.request_id]
        self._detokenize(state, req.output_token_ids)
        return self._stop_reason(state, req, token, max_model_len)

    def _detokenize(self, d: _DetokState, ids: list[int]) -> None:
        prefix = self.tokenizer.decode(ids[d.prefix_offset:d.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[d.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            d.text += full[len(prefix):]
            d.prefix_offset, d.read_offset = d.read_offset, len(ids)

    def _stop_reason(self, d: _DetokState, req: Request, token: int, max_model_len: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop:
            start = max(0, d.stop_scan_from - max(len(s) for s in p.stop))
            hits = [i for i in (d.text.find(s, start) for s in p.stop) if i >= 0]
            d.stop_scan_from = len(d.text)
            if hits:
                d.text = d.text[:min(hits)]
                return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
            return "length"
        return None


def eos_token_ids(tokenizer, hf_config) -> set[int]:
    """The model's end-of-sequence ids: the HF config's and the tokenizer's (each an id or a list)."""
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
