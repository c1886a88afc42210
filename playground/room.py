"""What every visitor of the page sees alike: who changed what on the shared engine, and when. One Room per
playground, written by the presenter's handlers, read by every tab's status line. Text from outside (a URL someone
typed, a remote server's model name) goes through `plain` before it reaches a Markdown component.
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass

NOTICE_SHOWN_S = 120.0  # how long the latest change stays on every status line
MAX_PLAIN_CHARS = 200
# what Markdown or HTML acts on mid-line: emphasis, code, links and images, headings, tables, tags, entities, math,
# and the colon of an address the renderer would turn into a link
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()#+!|<>~=:$&])")


def plain(text, limit: int = MAX_PLAIN_CHARS) -> str:
    """`text` safe inside Markdown: one line, at most `limit` characters, every character Markdown or HTML would
    act on escaped (a heading, a link, an image, a tag all show as their characters)."""
    flat = " ".join(str(text).split())
    if len(flat) > limit:
        flat = flat[:limit - 1] + "…"
    return _MARKDOWN.sub(r"\\\1", flat)


@dataclass(frozen=True)
class Notice:
    time: float
    who: str  # "presenter" (the only one who may change shared state), or "engine" for what it did by itself
    what: str  # "turned prefix_caching off", "restarted the engine"

    def describe(self, now: float | None = None) -> str:
        ago = max(0.0, (time.time() if now is None else now) - self.time)
        return f"{self.who} {self.what} ({ago:.0f} s ago)"


class Room:
    def __init__(self, keep: int = 64) -> None:
        self._notices: deque[Notice] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def note(self, what: str, who: str = "presenter") -> Notice:
        notice = Notice(time.time(), who, what)
        with self._lock:
            self._notices.append(notice)
        return notice

    def notices(self) -> list[Notice]:
        with self._lock:
            return list(self._notices)

    def latest(self, within_s: float = NOTICE_SHOWN_S) -> Notice | None:
        with self._lock:
            last = self._notices[-1] if self._notices else None
        return last if last is not None and time.time() - last.time <= within_s else None


def describe_changes(changes: dict) -> str:
    """A settings change in words: switches turned on/off, other fields set ("turned prefix_caching off, set
    max_num_seqs to 8")."""
    parts = []
    for name, value in changes.items():
        if isinstance(value, bool):
            parts.append(f"turned {name} {'on' if value else 'off'}")
        elif value is None:
            parts.append(f"set {name} to automatic")
        else:
            parts.append(f"set {name} to {value}")
    return ", ".join(parts)
