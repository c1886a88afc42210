"""Server-sent events, written and read in one place: the API's streams (server/) and every client that reads them.

The SSE spec ends a line at CR, LF or CRLF only, but a JSON chunk may hold U+2028, U+2029 or U+0085 raw (a reply
sampled at temperature 1 did), and readers that split lines as str.splitlines does (httpx's iter_lines) cut the
chunk there. So the writer escapes those three (the same JSON to any parser), and the readers split at CR, LF and
CRLF alone, whatever a server sends: vLLM's streams hold them raw.
"""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable, Iterator

_LINE_END = re.compile(r"\r\n|\r|\n")
_ESCAPES = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}
_UNSAFE = re.compile("[\u2028\u2029\x85]")


def event(data: dict | str) -> str:
    """One `data:` event: a string as it is, anything else as JSON (non-ASCII kept, but for the three characters
    line splitters take for line ends)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    if _UNSAFE.search(text):
        text = _UNSAFE.sub(lambda m: _ESCAPES[m.group()], text)
    return f"data: {text}\n\n"


class _Splitter:
    """Text pieces in, whole lines out (CR, LF, CRLF ends; a CR at a piece's end waits for a possible LF)."""

    def __init__(self) -> None:
        self.rest = ""

    def feed(self, piece: str) -> list[str]:
        text = self.rest + piece
        parts = _LINE_END.split(text)
        self.rest = parts.pop()
        if text.endswith("\r"):  # perhaps the first half of a CRLF: the next piece says
            parts, self.rest = parts[:-1], parts[-1] + "\r" if parts else self.rest
        return parts

    def end(self) -> list[str]:
        rest, self.rest = self.rest.rstrip("\r"), ""
        return [rest] if rest else []


def lines(pieces: Iterable[str]) -> Iterator[str]:
    """The lines of a stream read as text pieces (httpx's iter_text)."""
    splitter = _Splitter()
    for piece in pieces:
        yield from splitter.feed(piece)
    yield from splitter.end()


async def alines(pieces: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of a stream read as text pieces (httpx's aiter_text)."""
    splitter = _Splitter()
    async for piece in pieces:
        for line in splitter.feed(piece):
            yield line
    for line in splitter.end():
        yield line
