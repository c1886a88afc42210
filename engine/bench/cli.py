"""The command line: a thin front over the experiments; it alone prints. Each command can also write --json.

    python -m engine.bench                       # `table`: Batch | Time | TTFT | TPOT | Memory | TPS, and HF
    python -m engine.bench compare --workload mixed-lengths --a naive --b full
    python -m engine.bench hf-static --workload mixed-lengths   # or --fixed: 16 x (48 prompt, 64 new)
    python -m engine.bench sched-cost --running 64
    python -m engine.bench ablate --workload mixed-lengths --quick --json ablation.json
    python -m engine.bench ablate --cumulative                  # the engine, feature by feature
    python -m engine.bench ablate --concurrency 1,8,32          # each feature's worth under load
    python -m engine.bench memory --blocks 32,64,128            # where requests stop fitting
    python -m engine.bench gpu-check --out DIR                  # the GPU engine, checked on one GPU

A configuration SPEC is a preset name (presets/features/NAME.toml) or flags such as "prefix_caching=false".
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..workloads import load_workload
from . import experiments as ex
from . import report as rp
from .runs import load_llm
from .specs import parse_assignments

COMMANDS = ("table", "compare", "hf-static", "sched-cost", "ablate", "memory")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="model folder, GGUF file or hub id (default: embedded)")
    common.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="any EngineConfig field, e.g. --set block_size=32 (repeatable, or comma-separated)")
    common.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_common_parser()]
    table = sub.add_parser("table", parents=common, help="the reference table (default)")
    table.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 16])
    table.add_argument("--input-len", type=int, default=128)
    table.add_argument("--output-len", type=int, default=128)
    table.add_argument("--seed", type=int, default=0)
    table.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    cmp = sub.add_parser("compare", parents=common, help="one workload through two configurations")
    cmp.add_argument("--workload", required=True, help="preset name or TOML path")
    cmp.add_argument("--a", default="naive", help="preset name or flags (default: naive)")
    cmp.add_argument("--b", default="full", help="preset name or flags (default: full)")
    cmp.add_argument("--quick", action="store_true", help="a quarter of each workload group")
    cmp.add_argument("--repeat", type=int, default=1, help="run the pair N times side by side (report the spread)")
    hf = sub.add_parser("hf-static", parents=common, help="HF generate in static batches vs the engine")
    hf.add_argument("--workload", default="mixed-lengths")
    hf.add_argument("--batch-size", type=int, default=8)
    hf.add_argument("--fixed", action="store_true", help="the fixed-16 workload (16 x 48 prompt, 64 new), one batch")
    hf.add_argument("--quick", action="store_true")
    ab = sub.add_parser("ablate", parents=common, help="the full engine, then each feature switch off in turn")
    ab.add_argument("--workload", default="ablation", help="preset name or TOML path")
    ab.add_argument("--quick", action="store_true", help="a quarter of each workload group")
    ab.add_argument("--cumulative", action="store_true",
                    help="everything off (the naive loop), then each feature added back in the course's order")
    ab.add_argument("--concurrency", type=_int_list, default=None, metavar="1,8,32",
                    help="each feature's multiplier at each number of requests at a time (max_num_seqs)")
    mem = sub.add_parser("memory", parents=common, help="KV pool sizes, paged vs contiguous: what fits")
    mem.add_argument("--workload", default="memory-pressure", help="preset name or TOML path")
    mem.add_argument("--blocks", type=_int_list, default=[32, 64, 128, 256], help="pool sizes, in blocks")
    mem.add_argument("--quick", action="store_true", help="a quarter of each workload group")
    sc = sub.add_parser("sched-cost", parents=common, help="the scheduler's own cost per step")
    sc.add_argument("--running", type=int, default=64)
    sc.add_argument("--prompt-len", type=int, default=16)
    sc.add_argument("--decode-steps", type=int, default=32)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["table", *argv]  # `table` is the default subcommand
    return build_parser().parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    settings = parse_assignments(args.settings) if args.settings else {}
    if args.model is not None:
        settings["model"] = args.model
    return settings


def _bar(done: int, total: int, what: str) -> None:
    """Progress on stderr, so stdout stays the report."""
    print(f"[{done}/{total}] {what}", file=sys.stderr, flush=True)


def run_command(args: argparse.Namespace) -> rp.Report:
    settings = settings_from_args(args)
    llm = load_llm(settings)
    if args.command == "table":
        rows = ex.run_table(llm, args.batch_sizes, args.input_len, args.output_len, settings, not args.no_hf, args.seed)
        return rp.table_report(rows, args.input_len, args.output_len)
    if args.command == "compare":
        workload = load_workload(args.workload, args.quick)
        return rp.compare_report(ex.compare(llm, workload, args.a, args.b, settings, args.repeat))
    if args.command == "hf-static":
        workload = load_workload("fixed-16" if args.fixed else args.workload, args.quick)
        batch = len(workload.requests) if args.fixed else args.batch_size
        return rp.hf_static_report(ex.hf_static(llm, workload, batch, settings))
    if args.command == "ablate":
        workload = load_workload(args.workload, args.quick).tokenized(llm.tokenizer)
        if args.concurrency:
            return rp.ablate_report(workload, ex.ablate_concurrency(llm, workload, args.concurrency, settings, _bar))
        if args.cumulative:
            return rp.ablate_report(workload, ex.ablate_cumulative(llm, workload, settings, _bar), cumulative=True)
        return rp.ablate_report(workload, ex.ablate(llm, workload, settings, _bar))
    if args.command == "memory":
        workload = load_workload(args.workload, args.quick).tokenized(llm.tokenizer)
        rows = ex.memory_sweep(llm, workload, args.blocks, settings, _bar)
        return rp.memory_report(workload, rows, llm.engine.model.kv_bytes_per_token())
    return rp.sched_cost_report(ex.sched_cost(llm, args.running, args.prompt_len, args.decode_steps, settings))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu-check"]:  # its own options and report (gpu_check.py)
        from .gpu_check import main as gpu_check_main
        return gpu_check_main(argv[1:])
    args = parse_args(argv)
    try:
        report = run_command(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(rp.render_report(report))
    if args.json is not None:
        data = report.rows if report.rows is not None else report
        args.json.write_text(json.dumps(rp.to_jsonable(data), indent=2) + "\n")
        print(f"\nrows written to {args.json}")
    return 0


