"""What the playground's buttons, chats and timers do. No gradio layout here; functions return plain values.

The live engine runs in an EngineService thread; ablation and comparison runs build their own engines over
the same loaded weights, with the live engine paused meanwhile so their measurements are clean.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from engine import LLM, SamplingParams, bench
from engine.config import FEATURE_SWITCHES, NOT_YET_BUILT
from engine.models.loader import cache_dir
from engine.service import EngineService
from engine.workloads import list_workloads, load_workload
from viz.dashboard import DashboardFigures, FigureCache

from . import conversation
from .conversation import QUEUED, WARNING
from .stepmode import describe_step, plural

BUILT_SWITCHES = [s for s in FEATURE_SWITCHES if s not in NOT_YET_BUILT]
SIZE_FIELDS = ["block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"]
ProgressFn = Callable[[float, str], None]
QUEUED_NOTE = f"{QUEUED} queued: the engine is paused (step mode). Press Step or Resume on the Step mode tab to run it."


def ablation_store() -> Path:
    return cache_dir() / "last-ablation.json"


class Playground:
    def __init__(self, llm: LLM, store: Path | None = None) -> None:
        self.llm = llm
        self.service = EngineService(llm.engine)
        self.figures = FigureCache()
        self.store = store or ablation_store()
        self._exclusive = threading.Lock()  # one ablation / comparison at a time
        self.replies: deque[str] = deque(maxlen=32)  # final texts of recent chat replies

    # ---- chat --------------------------------------------------------------------------------------------
    def chat(self, message: str, history: list[dict], temperature: float = 0.7,
             max_tokens: int = 256) -> Iterator[tuple[list[dict], str]]:
        """Stream the assistant's reply into the history; the second value is the reply's stats line.
        The model sees the conversation without the playground's notes (warnings, "queued"), and without its
        oldest turns when it no longer fits max_model_len (the stats line says so)."""
        history = list(history or [])
        if not message or not message.strip():
            yield history, ""
            return
        messages = conversation.for_model(history) + [{"role": "user", "content": message}]
        history = history + [{"role": "user", "content": message}]
        try:
            config = self.service.snapshot().config
            prompt, dropped = conversation.fit(messages, self.llm.apply_chat_template,
                                               conversation.prompt_budget(config, int(max_tokens)))
            oldest = "the oldest turn" if dropped == 1 else f"the {dropped} oldest turns"
            trimmed = f"too long for max_model_len {config['max_model_len']}: left out {oldest} · " if dropped else ""
            stream = self.service.stream(prompt, SamplingParams(temperature=float(temperature),
                                                                max_tokens=int(max_tokens), seed=None))
            if self.service.paused:  # say so now rather than show an empty reply until someone steps
                yield history + [{"role": "assistant", "content": QUEUED_NOTE}], trimmed + "queued"
            history = history + [{"role": "assistant", "content": ""}]
            try:
                for out in stream:
                    if out.error:
                        history[-1]["content"] += f"\n\n[engine error: {out.error}]"
                        yield history, "the engine stopped; restart it from the Engine settings tab"
                        return
                    history[-1]["content"] = out.text
                    if out.finished:
                        self.replies.append(out.text)
                    yield history, trimmed + reply_stats(out)
            finally:  # Stop pressed or tab closed: abort the request now, freeing its blocks
                stream.close()
        except (ValueError, RuntimeError) as exc:  # too long, bad settings, engine down: say so in the chat
            history = [m for m in history if m.get("content") != ""]
            history.append({"role": "assistant", "content": f"{WARNING} {exc}"})
            yield history, ""

    # ---- dashboard -------------------------------------------------------------------------------------
    def dashboard(self) -> DashboardFigures:
        return self.figures.get(self.service.snapshot(), self.service.history)

    def status(self) -> str:
        snap = self.service.snapshot()
        state = "⛔ engine thread stopped: " + self.service.error if self.service.error else (
            "⏸ paused (step mode)" if self.service.paused else "▶ running")
        return (f"**{state}** · steps done: {snap.step} · running {snap.num_running} · waiting {snap.num_waiting} · "
                f"preemptions {snap.num_preemptions} · KV {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks · "
                f"prefix hits {snap.prefix_cache_hits}/{snap.prefix_cache_queries} tokens · "
                f"generated {plural(snap.generation_tokens_total, 'token')}")

    # ---- settings ----------------------------------------------------------------------------------------
    def settings(self) -> dict:
        """The engine's actual configuration (what the controls show on page load)."""
        cfg = self.service.snapshot().config
        return {k: cfg[k] for k in BUILT_SWITCHES + SIZE_FIELDS}

    def apply_settings(self, **values) -> str:
        current = self.settings()
        wanted = {k: _coerce(v, current[k]) for k, v in values.items() if k in current}
        changes = {k: v for k, v in wanted.items() if v != current[k]}
        if not changes:
            return "Nothing changed."
        try:
            self.service.update_config(**changes)
        except ValueError as exc:
            return f"⚠️ Not applied, the engine keeps its previous configuration: {exc}"
        shown = ", ".join(f"{k}={v}" for k, v in changes.items())
        return f"Applied at the next step boundary: {shown}."

    def restart(self) -> str:
        """A new engine thread over the same weights (after a crash, or to start clean)."""
        old = self.service
        old.shutdown()
        engine = bench.build_engine(self.llm, self.llm.engine.requested_config.to_dict())
        self.llm.engine = engine
        self.service = EngineService(engine)
        return "Engine restarted."

    # ---- traffic generator -----------------------------------------------------------------------------
    def traffic(self, workload_name: str, num_users: int, progress: ProgressFn | None = None) -> str:
        """Send N synthetic users' requests from a workload to the live engine; returns when all are done."""
        workload = load_workload(workload_name)
        requests = (workload.requests * (1 + int(num_users) // max(1, len(workload.requests))))[: int(num_users)]
        streams, refused = [], []
        for r in requests:
            try:
                streams.append(self.service.submit(list(r.prompt_token_ids), r.params)[1])
            except ValueError as exc:  # e.g. a prompt longer than max_model_len: the others still run
                refused.append(str(exc))
        start, tokens = time.perf_counter(), 0
        for i, q in enumerate(streams):
            while True:
                out = q.get(timeout=600)
                if out.finished:
                    tokens += len(out.token_ids)
                    break
            if progress:
                progress((i + 1) / len(streams), f"{i + 1}/{len(streams)} users done")
        wall = max(time.perf_counter() - start, 1e-9)
        msg = (f"{len(streams)} users from '{workload_name}': {tokens} tokens in {wall:.1f} s "
               f"({tokens / wall:.1f} tok/s).")
        if refused:
            msg += f" ⚠️ {len(refused)} request(s) refused by the engine: {refused[0]}"
        return msg

    # ---- ablation and comparison ---------------------------------------------------------------------------
    def ablate(self, workload_name: str, quick: bool = True,
               progress: ProgressFn | None = None) -> list[bench.AblationRow]:
        workload = load_workload(workload_name, quick)
        report = (lambda i, n, name: progress(i / n, f"running: {name}")) if progress else None
        with self._exclusive, self._paused():
            rows = bench.ablate(self.llm, workload, progress=report)
        self.store.parent.mkdir(parents=True, exist_ok=True)
        self.store.write_text(json.dumps(bench.to_jsonable({"workload": workload.name, "quick": quick, "rows": rows})))
        return rows

    def last_ablation(self) -> list[bench.AblationRow]:
        try:
            return [bench.AblationRow(**r) for r in json.loads(self.store.read_text())["rows"]]
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or written by an older version
            return []

    def compare(self, workload_name: str, spec_a: str, spec_b: str, quick: bool = True) -> bench.CompareResult:
        workload = load_workload(workload_name, quick)
        with self._exclusive, self._paused():
            return bench.compare(self.llm, workload, spec_a, spec_b)

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """Hold the live engine still while a measurement runs, then restore its state."""
        service, was_paused = self.service, self.service.paused
        service.pause()
        try:
            yield
        finally:
            if not was_paused:
                service.resume()

    # ---- step mode ---------------------------------------------------------------------------------------
    def pause(self) -> str:
        self.service.pause()
        return "Paused: the engine waits. Press Step to run exactly one step."

    def resume(self) -> str:
        self.service.resume()
        return "Running."

    def step(self) -> str:
        if not self.service.paused:
            self.service.pause()
        snap = self.service.step_once()
        return describe_step(snap, self.llm.tokenizer)


def reply_stats(out) -> str:
    m = out.metrics
    parts = []
    if m.ttft is not None:
        parts.append(f"TTFT {m.ttft * 1e3:.0f} ms")
    if m.first_token_time is not None and m.num_generation_tokens > 1:
        elapsed = (m.finished_time or time.perf_counter()) - m.first_token_time
        if elapsed > 0:
            parts.append(f"{(m.num_generation_tokens - 1) / elapsed:.1f} tokens/s")
    parts.append(f"prefix cache: {m.num_cached_tokens} of {m.num_prompt_tokens} prompt tokens reused")
    if m.num_preemptions:
        parts.append(f"preempted {m.num_preemptions}x")
    if out.finished:
        parts.append(f"finished: {out.finish_reason}")
    return " · ".join(parts)


def feature_presets() -> list[str]:
    return bench.list_feature_presets()


def workloads() -> list[str]:
    return list_workloads()


def _coerce(value, like):
    if isinstance(like, bool):
        return bool(value)
    if isinstance(like, int) and value is not None:
        return int(value)
    return value
