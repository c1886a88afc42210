"""What each of the engine's C++ CPU kernels is worth end to end: decode steps with every kernel on, against the
same engine with one kernel on its torch path (`_off`), in alternating rounds in one process.
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass

import torch

from .. import cpu_kernels, huge_pages
from ..llm import warm_up
from ..measure.runs import decode_ms
from ..measure.specs import resolve_spec
from ..quant import kernels as quant_kernels

SPECS = ("dtype=float32", "dtype=bfloat16", "quantization=int8", "quantization=int4", "quantization=w8a8")


@dataclass
class KernelWorthRow:
    spec: str
    kernel: str
    rows: int
    on_ms: list[float]  # ms per decode step with the C++ kernel (the weights in 2 MB pages), per round
    off_ms: list[float]  # with its torch path (in 4 KB pages)

    @property
    def speedup(self) -> float:
        """The torch path's median step over the kernel's: > 1 where the kernel pays."""
        return statistics.median(self.off_ms) / statistics.median(self.on_ms)


def _kernels_for(fields: dict) -> list[str]:
    q = fields.get("quantization")
    dtype = getattr(torch, fields.get("dtype", "float32"))
    own_matmul = q in ("int8", "int4") or (q is None and quant_kernels.choose_kernel(None, "cpu", dtype).own)
    own_matmul = own_matmul and cpu_kernels.compiled().weight_only_available()  # AVX-512 builds only
    return ["attention", "layer ops"] + (["matmul"] if own_matmul else []) + (["w8a8 rows"] if q == "w8a8" else [])


@contextlib.contextmanager
def _off(engine, kernel: str, torch_model):
    runner, model = engine.runner, engine.model
    swaps = {"attention": [(runner.attention, "decode_attention", None), (runner.attention, "write_kv", None)],
             "layer ops": [(model, "cpu_ops", None)],
             # the same engine's pool and schedule, over weights built for torch's kernel
             "matmul": [(engine, "model", torch_model), (runner, "model", torch_model)],
             "w8a8 rows": [(p, name, getattr(cpu_kernels, f"{name[1:]}_python")) for p in model.projections()
                           for name in ("_quantize_rows", "_dequantize_rows")],
             "huge pages": []}
    if kernel not in swaps:
        raise ValueError(f"unknown kernel {kernel!r}")
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps[kernel]]
    for obj, name, value in swaps[kernel]:
        setattr(obj, name, value)
    tensors = model.streamed_tensors() if kernel == "huge pages" else []
    huge_pages.scatter(tensors)
    try:
        yield engine
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        if tensors:
            huge_pages.gather(tensors)


def kernel_worth(llm, specs=SPECS, rows=(1, 16), tokens: int = 24, rounds: int = 3, prompt_len: int = 64,
                 progress=None) -> list[KernelWorthRow]:
    if cpu_kernels.compiled() is None:
        raise ValueError("the engine's C++ CPU kernels are not built here (make kernels): nothing to compare")
    out = []
    for spec in specs:
        fields = resolve_spec(spec) if spec else {}  # key=value flags or a preset name (int4, int8)
        fields = {"num_kv_blocks": 256, "max_num_seqs": max(rows), "prefix_caching": False, **fields}
        engine = llm.build_engine(fields)
        torch_model = None
        if "matmul" in _kernels_for(fields):  # weights packed for torch's (oneDNN's) kernel, as without AVX-512
            real = quant_kernels.cpu_features
            quant_kernels.cpu_features = lambda: frozenset({"avx2"})
            try:
                torch_model = llm.load_weights(llm.config_for(fields))
            finally:
                quant_kernels.cpu_features = real
        warm_up(engine)
        for kernel in _kernels_for(fields) + (["huge pages"] if engine.model.huge_page_bytes else []):
            for n in rows:
                if progress is not None:
                    progress(f"{spec} · {kernel} · {n} rows")
                row = KernelWorthRow(spec, kernel, n, [], [])
                with _off(engine, kernel, torch_model):
                    warm_up(engine)
                for r in range(rounds):  # alternating: a busy moment slows both sides
                    row.on_ms.append(decode_ms(engine, n, prompt_len, tokens, seed=r))
                    with _off(engine, kernel, torch_model):
                        row.off_ms.append(decode_ms(engine, n, prompt_len, tokens, seed=r))
                out.append(row)
    return out
