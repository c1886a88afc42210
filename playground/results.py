"""The engine, feature by feature, as files: this machine's measurements kept in the cache, and the last results
measured for the repository shipped in presets/results/, shown until this machine has its own.

The shipped file is `bundle` of the row lists that `python -m engine.bench ... --json` writes:

    python -m playground.results --cumulative cumulative.json --concurrency concurrency.json \\
        --memory memory.json [--quality quality.json] --measured-on "2-core AMD EPYC VM (AVX2), no GPU, torch 2.13" \\
        [--date 2026-12-01]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from engine.measure import NAIVE_LOOP, AblationRow, MemoryRow, QualityRow, to_jsonable
from engine.quant.kernels import cpu_name

# in the tab's order: quality under the cumulative ablation, whose quantization row is what precision costs in speed
EXPERIMENTS = ("cumulative", "quality", "concurrency", "memory")
ROW_TYPES = {"cumulative": AblationRow, "quality": QualityRow, "concurrency": AblationRow, "memory": MemoryRow}
SHIPPED_RESULTS = Path(__file__).resolve().parent.parent / "presets" / "results" / "feature-by-feature.json"
COMMANDS = {"cumulative": "python -m engine.bench ablate --cumulative --json cumulative.json",
            "quality": "python -m engine.bench quality --json quality.json",
            "concurrency": "python -m engine.bench ablate --concurrency 1,8,32 --json concurrency.json",
            "memory": "python -m engine.bench memory --json memory.json"}


@dataclass
class Measured:
    """One experiment's rows, and where and when they were measured."""
    rows: list  # AblationRow (cumulative, concurrency), MemoryRow (memory) or QualityRow (quality)
    measured_on: str  # the machine, in words
    date: str
    command: str  # what produced them (for a run from the page, the equivalent command line)
    shipped: bool = False  # the repository's results, not this machine's
    kv_bytes_per_token: int | None = None  # the model's KV bytes per token, when known (memory)
    note: str = ""  # a caveat of this run (e.g. a quick run with fewer requests than seats)


def parse_rows(kind: str, data: Any) -> list:
    """A row list as `--json` writes it -> rows. A field this version does not know is left out and a missing
    one takes its default, so files from older and newer versions load; anything else raises ValueError."""
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{kind}: expected a list of row objects (what `python -m engine.bench ... --json` writes)")
    cls = ROW_TYPES[kind]
    known = {f.name for f in fields(cls)}
    rows = []
    for i, r in enumerate(data):
        try:
            rows.append(cls(**{k: v for k, v in r.items() if k in known}))
        except TypeError as exc:  # a required field missing: not this experiment's rows
            raise ValueError(f"{kind} row {i}: {exc}") from exc
    _check_kind(kind, rows)
    return rows


def _check_kind(kind: str, rows: list) -> None:
    """Catch one experiment's file given as another's (the three are easy to mix up on a command line)."""
    if kind == "cumulative" and rows and (rows[0].feature != NAIVE_LOOP or rows[0].concurrency is not None):
        raise ValueError(f"cumulative: expected `ablate --cumulative` rows, starting with {NAIVE_LOOP!r}; "
                         f"the first row is {rows[0].feature!r}")
    if kind == "concurrency" and any(r.concurrency is None for r in rows):
        raise ValueError("concurrency: expected `ablate --concurrency ...` rows, each with its concurrency")
    for i, r in enumerate(rows if kind == "quality" else []):
        numbers = (r.top1_agreement, r.perplexity, r.reference_perplexity)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers) \
                or not 0 <= r.top1_agreement <= 1 or min(r.perplexity, r.reference_perplexity) < 1:
            raise ValueError(f"quality row {i} ({r.spec!r}): expected a top-1 agreement in [0, 1] and perplexities "
                             f">= 1, got {r.top1_agreement!r}, {r.perplexity!r}, {r.reference_perplexity!r}")


def _rows_from(source: Path | str | list | None, kind: str) -> list:
    if source is None:
        return []
    data = source if isinstance(source, list) else json.loads(Path(source).read_text())
    return parse_rows(kind, data)


def bundle(cumulative_json: Path | str | list | None, concurrency_json: Path | str | list | None,
           memory_json: Path | str | list | None, measured_on: str, date: str, command: str | None = None,
           kv_bytes_per_token: int | None = None, quality_json: Path | str | list | None = None) -> dict:
    """The shipped file's content from the `--json` row files (paths, or their lists), each checked to be the
    experiment it is given as; None leaves that experiment out."""
    if not measured_on.strip() or not date.strip():
        raise ValueError("say where and when the results were measured (measured_on, date)")
    given = {"cumulative": cumulative_json, "concurrency": concurrency_json, "memory": memory_json,
             "quality": quality_json}
    sources = {kind: given[kind] for kind in EXPERIMENTS}
    if command is None:
        command = "; ".join(COMMANDS[kind] for kind, source in sources.items() if source is not None)
    out: dict[str, Any] = {"measured_on": measured_on, "date": date, "command": command}
    if kv_bytes_per_token is not None:
        out["kv_bytes_per_token"] = kv_bytes_per_token
    for kind, source in sources.items():
        out[kind] = to_jsonable(_rows_from(source, kind))
    return out


def load_shipped(path: Path = SHIPPED_RESULTS) -> dict[str, Measured]:
    """The repository's results, per experiment that has rows; {} when there is no file. A file that is there
    but cannot be read raises ValueError (the page says so rather than silently showing nothing)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        where = {k: str(data[k]) for k in ("measured_on", "date")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path.name}: {exc}") from exc
    kv = data.get("kv_bytes_per_token")
    return {kind: Measured(rows, where["measured_on"], where["date"], str(data.get("command", "")), shipped=True,
                           kv_bytes_per_token=kv if kind == "memory" else None)
            for kind in EXPERIMENTS if (rows := parse_rows(kind, data.get(kind, [])))}


def load_local(path: Path) -> dict[str, Measured]:
    """This machine's results, per experiment; one that cannot be read (an older version wrote it) is left out."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for kind in EXPERIMENTS:
        try:
            section = dict(data[kind])
            out[kind] = Measured(**{**section, "rows": parse_rows(kind, section["rows"]), "shipped": False})
        except (KeyError, TypeError, ValueError):
            continue
    return out


def save_local(path: Path, kind: str, measured: Measured) -> None:
    """Replace one experiment's results in the store, keeping the others' (written whole, then renamed, so a
    crash never leaves half a file)."""
    data = {k: to_jsonable(m) for k, m in load_local(path).items()}
    data[kind] = to_jsonable(measured)
    data[kind].pop("shipped", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def machine_description(llm: Any) -> str:
    """This machine and what ran on it, in words: cores and CPU (or the GPU), torch, the model and its dtype."""
    device = llm.engine.model.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{os.cpu_count()}-core {cpu_name()}, no GPU"
    return f"{where}, torch {torch.__version__.split('+')[0]}, {Path(str(llm.model_path)).name} ({llm.config.dtype})"


def now() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m playground.results", description=__doc__.split("\n")[0])
    for kind in EXPERIMENTS:
        parser.add_argument(f"--{kind}", type=Path, default=None, help=f"the rows of the {kind} run (--json)")
    parser.add_argument("--measured-on", required=True, help="the machine, in words (cores, CPU or GPU, torch)")
    parser.add_argument("--date", default=datetime.now().strftime("%Y-%m-%d"))
    parser.add_argument("--command", default=None, help="the commands that produced the rows (default: the "
                        "experiments' default commands, as in presets/results/README.md)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=None, help="the model's (the page computes it "
                        "from the loaded model when left out)")
    parser.add_argument("--out", type=Path, default=SHIPPED_RESULTS)
    args = parser.parse_args(argv)
    try:
        data = bundle(args.cumulative, args.concurrency, args.memory, args.measured_on, args.date, args.command,
                      args.kv_bytes_per_token, args.quality)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}: " + ", ".join(f"{len(data[k])} {k} rows" for k in EXPERIMENTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
