"""The Engine settings tab's side of the playground: the form's values, a change applied (at once, at a step
boundary, or as a rebuild of the weights), Reset and Restart. A mixin of Playground (playground/handlers.py)."""
from __future__ import annotations

import time
from collections.abc import Callable

from engine import EngineConfig
from engine.config import FEATURE_SWITCHES, WEIGHT_FIELDS
from engine.factory import resolve_dtype, resolve_weights
from engine.llm import warm_up
from engine.quant.format import WeightFormat
from engine.quant.speed import model_speeds

from .room import describe_changes, plain
from .stepmode import plural

SIZE_FIELDS = ["block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"]
# the KV pool's element type, and whether an int8 pool's keys are smoothed: a pool rebuild, like its size
KV_DTYPE_FIELDS = ("kv_cache_dtype", "kv_cache_smoothing")
AUTOMATIC_FIELDS = {"num_kv_blocks": "blocks", "max_num_batched_tokens": "tokens", "max_model_len": "tokens"}
ProgressFn = Callable[[float, str], None]
NO_QUANTIZATION = "none"  # the form's word for quantization=None (a dropdown cannot hold None)
# the form's words for quantize_lm_head's True and False (beside which it may name a scheme of the head's own)
LM_HEAD_WORDS = {True: "as the weights", False: "no (the dtype)"}
# A new engine, in the order they happen: the first only for a change of the weights, while the old one serves.
REBUILD_STAGES = ("loading and quantizing the weights (the engine keeps serving meanwhile)",
                  "building the engine with its KV pool (the old one has stopped)", "warming up")
ENDED_BY_REBUILD = "the engine was rebuilt ({what}): this request was ended; send it again"


class SettingsHandlers:
    """settings, apply_settings, reset_settings, restart and the notes beside the form."""

    def settings(self) -> dict:
        """What the form shows: the configuration the engine runs once pending changes apply (so sending the form
        back never undoes one), with None for a size left automatic and for no quantization."""
        cfg = self.service.config_view().requested  # dtype as this device resolves it: the form offers no "auto"
        return {k: self._config_value(k, cfg[k]) if k == "dtype" else cfg[k]
                for k in (*FEATURE_SWITCHES, *SIZE_FIELDS, *KV_DTYPE_FIELDS, *WEIGHT_FIELDS)}

    def weights_note(self) -> str:
        """What the weights are now, what runs them here, and what changing them does."""
        snap = self.service.snapshot()
        kernel = snap.kernels.get("weights")
        runs = f" Its projections run on the {snap.kernels['weights_kernel']}: {snap.kernels['weights_why']}." \
            if kernel else ""
        return (f"**Weights: {snap.precision}.**{runs}{self.speed_note()}\n\n"
                "Changing the dtype or the quantization rebuilds the model: the new weights are loaded from the same "
                "checkpoint (and quantized) while this engine keeps serving, then the engine is rebuilt with its KV "
                "pool and warmed up. Requests running or waiting at that moment are ended with a message (send them "
                "again); a chat sent during the rebuild waits for the new engine. A change that is refused (a group "
                "size that does not divide a layer, a scheme without a kernel here) leaves the engine and its "
                "requests as they were. The KV cache's dtype changes without a rebuild: int8 holds ~4x the blocks of "
                "fp32 in the same memory; kv_cache_smoothing (int8 only) rescales its keys per channel, calibrated "
                "once (about 2 s), which halves what the int8 cache costs in quality.")

    def speed_note(self) -> str:
        """Each scheme against fp32 on this CPU (quant/speed.py): one slower here is not offered as the faster."""
        speeds = model_speeds(self.llm.engine.model)
        if not speeds:
            return ""
        cpu = next(iter(speeds.values())).cpu
        lines = "; ".join(f"**{v.scheme}** ({v.kernel}) {v.describe()}" for v in speeds.values())
        return (f"\n\nOn this CPU ({cpu}; one layer's projections timed once and kept in the cache), the "
                f"quantized weights against fp32: {lines}.")

    def settings_hints(self) -> dict[str, str]:
        """For each size that may be left empty: what empty means, with the number the engine would use."""
        view = self.service.config_view()
        return {k: f"empty = automatic: {view.automatic[k]} {unit}"
                + ("" if view.requested[k] is None else f" (now set to {view.requested[k]})")
                for k, unit in AUTOMATIC_FIELDS.items()}

    def settings_note(self) -> str:
        """Changes waiting for a step boundary, one that could not be applied, and an attached server's caveat."""
        view, notes = self.service.config_view(), []
        if (remote := self.remote) is not None:
            notes.append(f"⚠️ The page is attached to {plain(remote.url)}: this form shows the engine in this "
                         f"process, not that server's settings (which cannot be read or changed from here).")
        if view.pending:
            notes.append(f"⏳ waiting for the next step boundary: {_fields(view.pending)}")
        last = self.service.snapshot().last_reconfig
        if last and last.get("error"):
            notes.append(f"⚠️ step {last['step']}: {_fields(last['changes'])} could not be applied, the previous "
                         f"configuration kept serving: {last['error']}")
        return "\n\n".join(notes)

    def apply_settings(self, loaded: dict | None = None, progress: ProgressFn | None = None, **values) -> str:
        """Send only the fields that differ from what the form was loaded with (`loaded`), so a stale field never
        undoes another change; without `loaded` (an API call), every field that differs from what the engine runs."""
        current = self.settings()
        base = {**current, **{k: self._config_value(k, v) for k, v in (loaded or {}).items() if k in current}}
        wanted = {k: self._config_value(k, v) for k, v in values.items() if k in current}
        changes = {k: v for k, v in wanted.items() if v != base[k] and v != current[k]}
        if not changes:
            return "Nothing changed."
        return self.local_only("Engine settings") or self._update(changes, progress)

    def reset_settings(self, progress: ProgressFn | None = None) -> str:
        """Every switch and size back to EngineConfig's defaults (sizes automatic), and so the weights."""
        defaults, current = EngineConfig(), self.settings()
        changes = {k: d for k, v in current.items() if (d := self._config_value(k, getattr(defaults, k))) != v}
        if note := self.local_only("Engine settings"):
            return note
        return self._update(changes, progress) if changes else "Already at the defaults."

    def _config_value(self, name: str, value):
        """_coerce, and dtype 'auto' as this device resolves it (so 'auto' for what runs now changes nothing)."""
        value = _coerce(name, value)
        return resolve_dtype(value, self.llm.engine.model.device) if name == "dtype" and value == "auto" else value

    def _update(self, changes: dict, progress: ProgressFn | None = None) -> str:
        if any(k in WEIGHT_FIELDS for k in changes):
            return self._change_weights(changes, progress)
        if not self.service.alive:  # the thread died: the change comes with a fresh engine
            return self.restart(changes)
        try:
            record = self.service.update_config(**changes)
        except ValueError as exc:
            return f"⚠️ Not applied, the engine keeps its previous configuration: {exc}"
        except RuntimeError:  # the thread died meanwhile
            return self.restart(changes)
        if record is None:
            self.room.note(describe_changes(changes) + " (at the next step)")
            return f"Applied at the next step boundary (requests are in flight): {_fields(changes)}."
        if record.get("error"):
            return f"⚠️ Not applied, the engine keeps its previous configuration: {record['error']}"
        self.room.note(describe_changes(changes))
        moved = record["requests_re_prefilled"]
        return f"Applied: {_fields(changes)}." + (f" Re-prefilled: {', '.join(moved)}." if moved else "")

    def _change_weights(self, changes: dict, progress: ProgressFn | None) -> str:
        """The new weights are loaded while the old engine serves, then _restart replaces the engine. Anything
        refused before the old engine stops (a bad value, a group size, no kernel) leaves it untouched."""
        view, before = self.service.config_view(), self.service.snapshot().precision
        changes = {**view.pending, **changes}  # a change still waiting for a step is not lost with the engine
        weights = {k: v for k, v in changes.items() if k in WEIGHT_FIELDS}
        kept = f"⚠️ Not applied: the engine keeps its weights ({before}) and its requests"
        try:
            # as the weights would be loaded: a requested dtype "auto" is what this device resolves it to
            now, new = (resolve_weights(self.llm.config_for(fields), self.llm.engine.model.device)
                        for fields in (view.requested, {**view.requested, **changes}))
        except ValueError as exc:
            return f"{kept}: {exc}"
        if (now.dtype, WeightFormat.of(now)) == (new.dtype, WeightFormat.of(new)):
            rest = {k: v for k, v in changes.items() if k not in WEIGHT_FIELDS}
            why = (f"Not applied: {_fields(weights)} leaves the weights as they are ({before}; the group size "
                   f"applies to int4 only, quantize_lm_head to quantized weights only), so nothing is rebuilt.")
            return why + (f" {self._update(rest)}" if rest else "")
        if not self._exclusive.acquire(blocking=False):
            return f"{kept}: {self._busy()}; wait for it (or cancel it), then apply again."
        what = f"rebuilding the engine for {new.precision}"
        self._engine_up.clear()  # a chat sent from now on waits for the new engine rather than being ended
        try:
            self._stage(progress, 0, what)
            start = time.perf_counter()
            try:
                self.llm.weights_for(new)  # kept by the LLM: restart's build_engine takes these
            except (ValueError, MemoryError, RuntimeError) as exc:  # torch's out-of-memory is a RuntimeError
                return f"{kept}: {exc}"
            loaded = time.perf_counter() - start
            message, built, ended = self._restart(changes, progress, ENDED_BY_REBUILD.format(what=new.precision),
                                                  what)
        finally:
            self.rebuilding = None
            self._engine_up.set()
            self._exclusive.release()
        now_running = self.service.snapshot().precision
        self.room.note(f"rebuilt the engine for {now_running}")
        if not built:
            return f"⚠️ {new.precision} could not run here; the engine runs {now_running}. {message}"
        return (f"Rebuilt the engine for {now_running}: weights loaded in {loaded:.1f} s, engine built and warmed "
                f"up in {time.perf_counter() - start - loaded:.1f} s. " + (ended or "No request was open."))

    def restart(self, changes: dict | None = None, progress: ProgressFn | None = None) -> str:
        """A new engine thread over the same weights, with the last configuration that ran (plus `changes`), else
        the defaults. Never raises: the page must always get an engine back."""
        if note := self.local_only("Restarting the engine"):
            return note
        if self.rebuilding:
            return f"⚠️ Not restarted: {self._busy()}; it brings a new engine anyway."
        message = self._restart(changes, progress)[0]
        self.room.note("restarted the engine" + (f" with {describe_changes(changes)}" if changes else ""))
        return message

    def _restart(self, changes: dict | None = None, progress: ProgressFn | None = None,
                 reason: str = "the engine was restarted: this request was ended; send it again",
                 what: str = "restarting the engine") -> tuple[str, bool, str]:
        """restart(); requests still open end with `reason`. Returns the message, whether the engine came back with
        `changes`, and how many requests were ended, in words ("" for none)."""
        old = self.service
        self.rebuilding = what
        self._engine_up.clear()
        try:
            snap = old.snapshot()
            ended = snap.num_running + snap.num_waiting if old.alive else 0
            old.shutdown(reason)
            last = old.reconfig.requested.to_dict()
            attempts = [(f"with {_fields(changes)}", {**last, **changes})] if changes else []
            attempts += [("with the last configuration that ran", last), ("with the defaults", {})]
            failures = []
            for label, fields in attempts:
                try:
                    self._stage(progress, 1, what)
                    engine = self.llm.build_engine(fields)
                    self._stage(progress, 2, what)
                    warm_up(engine)  # a configuration that builds but cannot run a step is not back
                except Exception as exc:  # whatever went wrong, the next attempt may still work
                    failures.append(f"{label}: {exc}")
                    continue
                self.llm.engine = engine
                self.service = self._new_service(engine, follows=old)
                lost = (f"{plural(ended, 'request')} running or waiting {'was' if ended == 1 else 'were'} ended "
                        f"(their chats say so: send them again)." if ended else "")
                return (f"Engine restarted {label}." + (f" ⚠️ Not possible {'; '.join(failures)}." if failures else "")
                        + (f" {lost}" if lost else ""), not failures and bool(changes), lost)
            return f"⛔ The engine could not be restarted: {'; '.join(failures)}", False, ""
        finally:
            self.rebuilding = None
            self._engine_up.set()

    def _stage(self, progress: ProgressFn | None, index: int, what: str) -> None:
        """A rebuild's stage, on the caller's progress bar and every tab's status line."""
        stage = f"{what}: {index + 1}/{len(REBUILD_STAGES)} {REBUILD_STAGES[index]}"
        self.rebuilding = stage
        if progress:
            progress(index / len(REBUILD_STAGES), stage)


def _coerce(name: str, value):
    """A form value as the config field wants it: gradio hands numbers back as floats (or strings from a
    dropdown), and an emptied number field as None, which means automatic for the sizes that allow it."""
    if name == "quantize_lm_head":  # a bool or a scheme: the form's words (or an API caller's true/false) back
        words = {w: v for v, w in LM_HEAD_WORDS.items()} | {"true": True, "false": False}
        return words.get(value.lower(), value) if isinstance(value, str) else value  # else EngineConfig refuses
    if name in FEATURE_SWITCHES or isinstance(getattr(EngineConfig, name, None), bool):  # a switch: a checkbox's
        return bool(value)
    if name == "quantization" and value in (NO_QUANTIZATION, ""):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # None, or something EngineConfig will refuse with a message


def form_value(name: str, value):
    """A setting as the form shows it; _coerce turns it back."""
    if name == "quantize_lm_head" and isinstance(value, bool):
        return LM_HEAD_WORDS[value]
    return NO_QUANTIZATION if name == "quantization" and value is None else value


def _fields(changes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items())
