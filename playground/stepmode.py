"""Step mode in words: what the scheduler decided in one step, with the tokens shown as text.

Numbering: the snapshot's `step` counts the steps done, a StepRecord's `step` is the step's index from 0; people
read "Step 1" for the first step, so the heading shows index + 1 and the status line says "steps done: N".
"""
from __future__ import annotations

from collections.abc import Sequence

MAX_DECODES_SHOWN = 16  # a batch of 64 decodes would bury the rest of the description


def plural(count: int, word: str) -> str:
    return f"{count} {word if count == 1 else word + 's'}"


def token_text(tokenizer, token_ids: Sequence[int]) -> str:
    """Tokens as a quoted string for markdown: spaces and newlines visible, never breaking the code span."""
    if tokenizer is None or not token_ids:
        return ""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=False)
    return "`" + repr(text).replace("`", "'") + "`"


def describe_step(snap, tokenizer=None) -> str:
    """What the scheduler decided in the snapshot's last step, in words. With a tokenizer, the tokens a prefill
    ended on and the tokens sampled are shown as text (for requests still live after the step)."""
    if not snap.steps:
        return "No step yet."
    rec = snap.steps[-1]
    lines = [f"### Step {rec.step + 1}: {plural(rec.num_batched_tokens, 'token')} in the batch, "
             f"{plural(rec.num_seqs, 'request')}"]
    reconfig = snap.last_reconfig
    if reconfig and reconfig["step"] == rec.step:
        changes = ", ".join(f"{k}={v}" for k, v in reconfig["changes"].items())
        moved = reconfig.get("requests_re_prefilled") or []
        lines.append(f"- before this step, the configuration change applied: {changes} ({reconfig['action']}"
                     + (f": requests {', '.join(moved)} gave their blocks back and are prefilled again" if moved
                        else "") + ")")
    if rec.prefills and not snap.config.get("kv_cache", True):
        lines.append("- no KV cache: every request recomputes its whole sequence, every step")
    for e in rec.prefills:
        cached = f" ({plural(e.prefix_hit_tokens, 'prompt token')} reused from the prefix cache)" \
            if e.prefix_hit_tokens else ""
        tail, new = _recent(snap, e, tokenizer)
        ending = f", ending {tail}" if tail else ""
        sampled = f"; its first generated token: {new}" if new else ""
        chunk = (f" — a chunk: {e.num_computed_after}/{e.num_prompt_tokens} prompt tokens done, the rest in the next "
                 "steps beside the decodes" if not e.num_new_tokens and e.num_computed_after < e.num_prompt_tokens
                 else "")
        lines.append(f"- request **{e.request_id}** prefilled **{plural(e.num_tokens, 'token')}**{cached}"
                     f"{ending}{sampled}{chunk}")
    for e in rec.verifies:
        new = _recent(snap, e, tokenizer)[1]
        lines.append(f"- request **{e.request_id}** drafted {e.num_drafts}, accepted {e.num_accepted} "
                     f"(speculative decoding: {plural(e.num_new_tokens, 'token')} this step"
                     + (f" → {new}" if new else "") + ")")
    if rec.decodes:
        shown = [f"**{e.request_id}**" + (f" → {new}" if (new := _recent(snap, e, tokenizer)[1]) else "")
                 for e in rec.decodes[:MAX_DECODES_SHOWN]]
        more = len(rec.decodes) - len(shown)
        lines.append(f"- decoded one token each for {plural(len(rec.decodes), 'request')}: " + ", ".join(shown)
                     + (f" and {more} more" if more else ""))
    for rid in rec.preempted:
        lines.append(f"- request **{rid}** was **preempted**: the pool ran out of blocks, so the newest running "
                     "request gave its blocks back and went to the front of the queue (it will be recomputed)")
    for rid, reason in rec.finished:
        lines.append(f"- request **{rid}** finished ({reason}); its blocks are free for the next step")
    if not (rec.prefills or rec.decodes or rec.verifies or rec.preempted):
        lines.append("- nothing to run" + (f"; {rec.num_waiting} waiting" if rec.num_waiting else ""))
    lines.append(f"\nAfter the step: {snap.num_running} running, {snap.num_waiting} waiting, "
                 f"{snap.kv_blocks_used}/{plural(snap.kv_blocks_total, 'block')} used.")
    return "\n".join(lines)


def _recent(snap, entry, tokenizer) -> tuple[str, str]:
    """(the last few computed tokens, the tokens generated this step) as text; empty when the request has left
    the snapshot (finished in this step) or there is no tokenizer."""
    req = snap.requests.get(entry.request_id)
    if req is None or tokenizer is None:
        return "", ""
    recent = list(req.recent_token_ids)
    new = recent[len(recent) - entry.num_new_tokens:] if entry.num_new_tokens else []
    computed = recent[:len(recent) - len(new)] if entry.phase == "prefill" else []
    return token_text(tokenizer, computed[-4:]), token_text(tokenizer, new)
