"""What of a chat the model sees: the playground's own notes left out (a refused message kept in got every later
one refused too), the oldest turns trimmed to fit max_model_len."""
from __future__ import annotations

import re
import string

WARNING = "⚠️"  # the playground's message when the engine refused a turn or failed
QUEUED = "⏳"  # the playground's placeholder while a reply waits for a paused engine
NOTES = (WARNING, QUEUED)
# appended to a reply the engine cut off: what it got so far is sent to the model again, the note is not
ENGINE_ERROR = "\n\n[engine error: "


MAX_REMOTE_CHARS = 200_000  # a watched server's context is not known here: a generous bound
CHARS_PER_TOKEN = 4  # a message longer than the context at this many characters a token cannot fit: refused unread


def too_long(message: str, config: dict) -> str:
    """Why a message is refused before anything reads it ("" when it is not)."""
    limit = int(config["max_model_len"]) * CHARS_PER_TOKEN
    if len(message) <= limit:
        return ""
    return (f"your message is {len(message):,} characters: this engine's context holds {config['max_model_len']:,} "
            f"tokens, so a message may be at most {limit:,} characters. Shorten it and send it again.")


def text_of(content) -> str:
    """Chat message content as text (gradio may hand back a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


# A visitor's own words on the page are text, never Markdown (gradio's Chatbot renders every message as Markdown):
# CommonMark makes any ASCII punctuation literal after a backslash, and a character reference is no whitespace to it,
# so nothing typed can start any Markdown construct, and gradio's cleandoc (tabs, common indent) changes none of it
_ESCAPED = {**{c: "\\" + c for c in string.punctuation}, "\t": "&#9;"}
_LEADING_SPACES = re.compile(r"^ +", re.MULTILINE)
_UNESCAPED = re.compile(r"\\([" + re.escape(string.punctuation) + r"])|&#(9|32);")


def as_typed(text: str) -> str:
    """Markdown that shows `text` exactly as typed (typed_text is its inverse)."""
    escaped = "".join(_ESCAPED.get(c, c) for c in text)
    return _LEADING_SPACES.sub(lambda m: "&#32;" * len(m.group()), escaped)


def typed_text(shown: str) -> str:
    """The text as_typed showed. A text that as_typed never made is left as it is, but for a backslash before a
    punctuation mark (read as the mark) and the two character references above."""
    return _UNESCAPED.sub(lambda m: m.group(1) or chr(int(m.group(2))), shown)


def for_model(history: list[dict]) -> list[dict]:
    """The messages the model sees: the playground's notes and the user messages they answered (refused or
    never run) are left out."""
    out: list[dict] = []
    for m in history:
        text = text_of(m["content"])
        if m["role"] == "assistant" and text.startswith(NOTES):
            if out and out[-1]["role"] == "user":
                out.pop()
            continue
        if m["role"] == "assistant" and ENGINE_ERROR in text:
            text = text[:text.index(ENGINE_ERROR)]
        out.append({"role": m["role"], "content": text})
    return out


def next_turn(message: str, history: list[dict] | None) -> tuple[list[dict], list[dict]] | None:
    """(the messages the model sees, the page's history with the new message), or None for an empty message."""
    history = list(history or [])
    if not message or not message.strip():
        return None
    return for_model(history) + [{"role": "user", "content": message}], history + [{"role": "user", "content": message}]


def drop_oldest_turn(messages: list[dict]) -> list[dict]:
    """Without the first user message and the replies to it (a leading system message stays)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    end = next((i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), len(messages))
    return messages[:first] + messages[end:]


def prompt_budget(config: dict, max_tokens: int) -> int:
    """The longest prompt to send: max_model_len less room for the reply (max_tokens, but at most a quarter
    of max_model_len, so a long reply does not cost the whole conversation). With paged KV, a request whose
    prompt + max_tokens needs more blocks than the pool is refused, so the pool bounds it too."""
    max_len = config["max_model_len"]
    budget = max_len - max(1, min(max_tokens, max_len // 4))
    if config.get("kv_cache") and config.get("paged_kv"):
        pool = config["num_kv_blocks"] * config["block_size"]
        if pool < max_len:
            budget = min(budget, pool - max_tokens)
    return budget


def fit(messages: list[dict], encode, budget: int) -> tuple[list[int], int]:
    """(prompt token ids, number of oldest turns dropped): turns go, oldest first, until the prompt fits the
    budget; the newest user message always stays (if it alone is too long, the engine says so)."""
    dropped = 0
    prompt = encode(messages)
    while len(prompt) > budget and sum(m["role"] == "user" for m in messages) > 1:
        messages = drop_oldest_turn(messages)
        dropped += 1
        prompt = encode(messages)
    return prompt, dropped
