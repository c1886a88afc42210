"""`python -m engine.bench gpu-check --out DIR`: everything the GPU engine claims, checked in one run on one GPU
(docs/gpu.md says what each section checks). The report is written after every section, so a run cut short still
leaves what it measured; `--cpu-dry-run` runs the same steps at toy sizes on CPU, so the command itself is tested.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter as _now
from typing import Any

SECTIONS = ("tests", "parity", "sweep", "hf", "goals")
GOALS = {"tpot_batch1_graphs_ms": 3.0, "tps_batch256": 25_000.0, "hf_ratio_batch64": 5.0}


@dataclass
class Plan:
    """Sizes of one run: the real check on a GPU, or the CPU dry run's toy version."""
    device: str
    model: str
    dtype: str
    input_len: int
    output_len: int
    batches: list[int]
    graph_batches: list[int]
    hf_batch: int
    parity_tokens: int
    overrides: dict[str, Any] = field(default_factory=dict)  # shrink the random architecture (dry run)
    run_tests: bool = True


GPU_PLAN = Plan("cuda", "random:qwen3-0.6b", "bfloat16", 128, 256, [1, 16, 64, 256], [1, 16, 64, 256], 64, 32)
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=32768)  # the vocabulary holds the sweep's token ids
DRY_PLAN = Plan("cpu", "random:qwen3-0.6b", "float32", 8, 4, [1, 2], [], 2, 6, overrides=TINY, run_tests=False)


def _free(device) -> None:
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def random_engine(model: str, dtype: str, device: str, overrides: dict, fields: dict):
    """An engine over a random architecture, seed 0: the same weights every time it is built."""
    import torch

    from ..config import EngineConfig
    from ..engine import LLMEngine
    from ..factory import TORCH_DTYPES as DTYPES
    from ..models.random_models import load_random_model
    from ..quant.format import WeightFormat
    config = EngineConfig.from_kwargs(model=model, dtype=dtype, device=device, **fields)
    net, tok, cfg, _ = load_random_model(model, DTYPES[dtype], torch.device(device), fields.get("max_model_len"),
                                         weight_format=WeightFormat.of(config), **overrides)
    return LLMEngine(config, net, tok, cfg)


def _greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from ..measure.runs import run_to_end
    from ..sampling_params import SamplingParams
    return [o.token_ids for o in run_to_end(engine, prompts, SamplingParams(temperature=0, max_tokens=n,
                                                                             ignore_eos=True))]


def _hf_model(model: str, dtype: str, device: str, overrides: dict):
    """transformers' model with the engine's random weights (the same seeded state dict)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..factory import TORCH_DTYPES as DTYPES
    from ..models.random_models import hf_config, random_name, random_state_dict
    config = hf_config(random_name(model), **overrides)
    hf = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation="sdpa")
    result = hf.load_state_dict(random_state_dict(config, 0, DTYPES[dtype], torch.device(device)), strict=False)
    if set(result.missing_keys) - {"lm_head.weight"} or result.unexpected_keys:  # only the tied head is implied
        raise RuntimeError(f"HF model and random weights disagree: {result}")
    hf.tie_weights()
    return hf.to(device).eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    import torch
    ids = torch.tensor([prompt], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, temperature=None, top_p=None, top_k=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def parity(plan: Plan) -> dict:
    """fp32 tiny: identical greedy tokens; plan's model in plan's dtype: top-5 containment at first divergence."""
    import torch
    prompts = [[3, 17, 100, 42, 7, 250, 11], [5, 6, 300, 301, 9, 10, 12, 13, 14]]
    result: dict[str, Any] = {}
    fields = dict(max_model_len=64, block_size=16, num_kv_blocks=32, max_num_seqs=4)
    graphs = {"cuda_graphs": plan.device == "cuda", "attention_backend": "triton"}
    engine = random_engine("random:qwen3-0.6b", "float32", plan.device, TINY, {**fields, **graphs})
    ours = _greedy(engine, prompts, plan.parity_tokens)
    del engine
    hf = _hf_model("random:qwen3-0.6b", "float32", plan.device, TINY)
    theirs = [_hf_greedy(hf, p, plan.parity_tokens) for p in prompts]
    del hf
    result["fp32_tiny"] = {"identical": ours == theirs, "engine": ours, "hf": theirs, **graphs}
    _free(torch.device(plan.device))

    engine = random_engine(plan.model, plan.dtype, plan.device, plan.overrides, {**fields, "max_model_len": 128})
    ours = _greedy(engine, prompts, plan.parity_tokens)
    del engine
    hf = _hf_model(plan.model, plan.dtype, plan.device, plan.overrides)
    rows = []
    for prompt, mine in zip(prompts, ours):
        ref = _hf_greedy(hf, prompt, plan.parity_tokens)
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        row = {"first_divergence": first, "engine": mine, "hf": ref, "in_top5": True}
        if first is not None:
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + mine[:first]], device=hf.device)).logits[0, -1].float()
            row["in_top5"] = mine[first] in logits.topk(5).indices.tolist()
        rows.append(row)
    del hf
    _free(torch.device(plan.device))
    result[f"{plan.dtype}_{plan.model}"] = {"rows": rows, "top5_containment": all(r["in_top5"] for r in rows)}
    return result


def sweep(plan: Plan, rows: list[dict] | None = None, on_row=lambda: None) -> list[dict]:
    """The reference table for each backend, and CUDA graphs on at the graph batches; rows appended to `rows` as they
    finish (on_row() after each, so the report can be written), a failed one holding its error."""
    import torch

    from ..measure.experiments import run_table_row
    from ..measure.runs import load_llm
    from ..utils import cdiv
    if plan.overrides:  # the dry run's tiny model: run_table_row needs an LLM, so wrap an engine's weights
        llm = _tiny_llm(plan)
    else:
        llm = load_llm({"model": plan.model, "dtype": plan.dtype, "device": plan.device,
                        "max_model_len": plan.input_len + plan.output_len})
    runs = [(b, backend, False) for b in plan.batches for backend in ("sdpa", "triton")]
    runs += [(b, "triton", True) for b in plan.graph_batches]
    rows = [] if rows is None else rows
    for batch, backend, graphs in runs:
        blocks = batch * cdiv(plan.input_len + plan.output_len, 16) + 8
        settings = {"attention_backend": backend, "cuda_graphs": graphs, "max_num_seqs": batch,
                    "num_kv_blocks": blocks, "block_size": 16, "prefix_caching": False}
        start = _now()
        try:
            row = run_table_row(llm, batch, plan.input_len, plan.output_len, settings)
        except Exception as exc:  # one configuration failing must not cost the others
            rows.append({"batch": batch, "attention_backend": backend, "cuda_graphs": graphs,
                         "error": _error(exc), "traceback": traceback.format_exc()})
        else:
            rows.append({"batch": batch, "attention_backend": backend, "cuda_graphs": graphs,
                         "ttft_ms": _ms(row.ttft_s), "tpot_ms": _ms(row.tpot_s), "tps": row.tps,
                         "vram_gb": row.memory_gb, "time_s": row.time_s, "wall_with_setup_s": _now() - start})
        _free(torch.device(plan.device))
        on_row()
    return rows


def _tiny_llm(plan: Plan):
    """An LLM object around the dry run's tiny random model (LLM() itself builds only the full architectures)."""
    from ..llm import LLM
    llm = LLM.__new__(LLM)
    engine = random_engine(plan.model, plan.dtype, plan.device, plan.overrides,
                     {"kv_cache": False, "max_model_len": plan.input_len + plan.output_len})
    llm.config, llm.engine, llm.tokenizer, llm.model_path = engine.config, engine, engine.tokenizer, Path(plan.model)
    return llm


def hf_ratio(plan: Plan, rows: list[dict]) -> dict:
    """transformers' generate at hf_batch on the same weights vs the engine's best row at that batch."""
    import torch

    from ..measure.experiments import table_prompts
    from ..measure.hf import hf_generate, hf_warm_up
    hf = _hf_model(plan.model, plan.dtype, plan.device, plan.overrides)
    hf_warm_up(hf, 0)
    seconds = hf_generate(hf, table_prompts(plan.hf_batch, plan.input_len, 0), plan.output_len, 0)
    del hf
    _free(torch.device(plan.device))
    hf_tps = plan.hf_batch * plan.output_len / seconds
    ours = max((r for r in rows if r["batch"] == plan.hf_batch), key=lambda r: r["tps"], default=None)
    return {"batch": plan.hf_batch, "hf_time_s": seconds, "hf_tps": hf_tps,
            "engine_tps": ours and ours["tps"], "engine_config": ours and
            {k: ours[k] for k in ("attention_backend", "cuda_graphs")},
            "ratio": ours and ours["tps"] / hf_tps}


def gpu_tests(out: Path, timeout: float = 180) -> dict:
    """The GPU-marked tests in their own process: no Triton interpreter there, real compiled kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider"]
    start = _now()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"returncode": proc.returncode, "passed": proc.returncode == 0, "summary": summary,
            "seconds": _now() - start}


def goals(rows: list[dict], ratio: dict) -> dict:
    def pick(batch, graphs):
        return next((r for r in rows if r["batch"] == batch and r["cuda_graphs"] == graphs
                     and r["attention_backend"] == "triton"), None)
    g1, big = pick(1, True), max((r for r in rows if r["batch"] == 256), key=lambda r: r["tps"], default=None)
    out = {}
    if g1 and g1["tpot_ms"] is not None:
        out["tpot_batch1_graphs_ms"] = {"value": g1["tpot_ms"], "goal": f"<= {GOALS['tpot_batch1_graphs_ms']}",
                                        "met": g1["tpot_ms"] <= GOALS["tpot_batch1_graphs_ms"]}
    if big:
        out["tps_batch256"] = {"value": big["tps"], "goal": f">= {GOALS['tps_batch256']:.0f}",
                               "met": big["tps"] >= GOALS["tps_batch256"]}
    if ratio.get("ratio"):
        out["hf_ratio_batch64"] = {"value": ratio["ratio"], "goal": f">= {GOALS['hf_ratio_batch64']}",
                                   "met": ratio["ratio"] >= GOALS["hf_ratio_batch64"]}
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _environment(plan: Plan) -> dict:
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": plan.device}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if plan.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return env


def run(out: Path, dry_run: bool = False, only: Sequence[str] = SECTIONS) -> dict:
    import torch
    if not dry_run and not torch.cuda.is_available():
        raise ValueError("gpu-check needs a CUDA GPU and torch.cuda.is_available() is False here; "
                         "--cpu-dry-run runs the same steps at toy sizes on CPU (Triton's interpreter)")
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown gpu-check section(s) {sorted(unknown)}; the sections are {', '.join(SECTIONS)}")
    plan = DRY_PLAN if dry_run else GPU_PLAN
    out.mkdir(parents=True, exist_ok=True)
    start = _now()
    report: dict[str, Any] = {"plan": asdict(plan), "environment": _environment(plan), "dry_run": dry_run,
                              "sections": list(only)}
    steps = {"tests": lambda: gpu_tests(out) if plan.run_tests else {"skipped": "dry run"},
             "parity": lambda: parity(plan),
             "sweep": lambda: sweep(plan, report.setdefault("sweep", []), lambda: _write(out, report)),
             "hf": lambda: hf_ratio(plan, _measured(report.get("sweep"))),
             "goals": lambda: goals(_measured(report.get("sweep")), _dict(report.get("hf"))) if not dry_run
             else {"skipped": "dry run: toy sizes"}}
    for name in SECTIONS:
        if name not in only:
            continue
        began = _now()
        try:
            report[name] = steps[name]()
        except Exception as exc:  # one broken section must not cost the others' numbers
            report[name] = {"error": _error(exc), "traceback": traceback.format_exc()}
            _free_quietly(plan)
        report.setdefault("section_seconds", {})[name] = _now() - began
        report["seconds"] = _now() - start
        _write(out, report)
    return report


def _error(exc: BaseException) -> str:
    """One line naming the error: a compiler's message spans lines of source, its cause is the last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _measured(value) -> list[dict]:
    """The sweep's rows that ran (a failed row holds only its error)."""
    return [r for r in value if "error" not in r] if isinstance(value, list) else []


def _dict(value) -> dict:
    return value if isinstance(value, dict) and "error" not in value else {}


def _free_quietly(plan: Plan) -> None:
    try:
        import torch
        _free(torch.device(plan.device))
    except Exception:  # noqa: S110 - the device may be what broke; the next section reports it
        pass


def _write(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


def failures(report: dict) -> list[str]:
    """Sections that raised, or whose check says no."""
    bad = [name for name in SECTIONS if isinstance(report.get(name), dict) and "error" in report[name]]
    if report.get("tests", {}).get("passed") is False:
        bad.append("tests")
    tiny = report.get("parity", {}).get("fp32_tiny") if isinstance(report.get("parity"), dict) else None
    if tiny is not None and not tiny["identical"]:
        bad.append("parity")
    return sorted(set(bad), key=SECTIONS.index)


def markdown(report: dict) -> str:
    env, plan = report["environment"], report["plan"]
    where = env.get("gpu") or f"CPU dry run ({env['device']}, toy sizes: not a measurement of a GPU)"
    lines = [f"# gpu-check: {where}", "",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; model "
             f"`{plan['model']}` ({plan['dtype']}), prompt {plan['input_len']}, {plan['output_len']} new tokens; "
             f"{report.get('seconds', 0):.0f} s in all.", ""]
    rows = report.get("sweep")
    if isinstance(rows, list):
        from ..measure.report import markdown_table
        lines += [markdown_table([{"Batch": r["batch"], "Attention": r["attention_backend"],
                                   "CUDA graphs": "on" if r["cuda_graphs"] else "off",
                                   "TTFT ms": f"failed: {r['error'][:120]}" if "error" in r else r["ttft_ms"],
                                   **{k: r.get(key) for k, key in (("TPOT ms", "tpot_ms"), ("TPS (tok/s)", "tps"),
                                                                   ("VRAM GB", "vram_gb"))}} for r in rows]), ""]
    hf = report.get("hf")
    if isinstance(hf, dict) and "hf_tps" in hf:
        lines += [f"HF `generate` at batch {hf['batch']}: {hf['hf_tps']:,.0f} tok/s; the engine "
                  f"{_fmt(hf['engine_tps'])} tok/s: **{_fmt(hf['ratio'], 2)}x**.", ""]
    p = report.get("parity")
    if isinstance(p, dict) and "fp32_tiny" in p:
        tiny = p["fp32_tiny"]
        lines.append(f"- Parity, fp32 tiny model (triton, CUDA graphs {'on' if tiny['cuda_graphs'] else 'off'}): "
                     f"greedy tokens {'identical' if tiny['identical'] else 'DIFFER'} to HF.")
        for key, value in p.items():
            if key != "fp32_tiny":
                firsts = [r["first_divergence"] for r in value["rows"]]
                lines.append(f"- Parity, {key}: first divergence at {firsts} (None: none); engine token in HF's "
                             f"top 5 there: {'yes' if value['top5_containment'] else 'NO'}.")
    t = report.get("tests")
    if isinstance(t, dict) and "error" not in t:
        lines.append(f"- GPU-marked tests: {t.get('summary') or t.get('skipped')}.")
    g = report.get("goals")
    if isinstance(g, dict) and "skipped" not in g and "error" not in g:
        for name, goal in g.items():
            verdict = "met" if goal["met"] else "NOT met"
            lines.append(f"- Goal {name}: {_fmt(goal['value'], 2)} (goal {goal['goal']}): {verdict}.")
    for name in SECTIONS:
        section = report.get(name)
        if isinstance(section, dict) and "error" in section:
            lines.append(f"- Section {name} FAILED: {section['error']}")
        elif name not in report and name in report.get("sections", SECTIONS):
            lines.append(f"- Section {name}: not run (yet).")
    return "\n".join(lines) + "\n"


def _fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="toy sizes on CPU, kernels in Triton's interpreter: tests the command, measures nothing")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, in this order: {','.join(SECTIONS)} (default all)")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    try:
        report = run(args.out, args.cpu_dry_run, [s.strip() for s in args.only.split(",") if s.strip()])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"written to {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    bad = failures(report)
    if bad:
        print(f"failed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0
