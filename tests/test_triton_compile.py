"""The Triton kernels compile for real GPUs, on a machine without one: Triton lowers them to PTX and runs ptxas
(shipped in its wheel) for a named target, which needs no driver. The interpreter the CPU suite runs them in is more
lenient than the compiler (it let a plain global float in a kernel through; the first GPU run refused it), so every
kernel (the attention kernels and the fused RMSNorm) is compiled here for each GPU generation the README names, in
each dtype the engine stores K/V in there.

Compiling runs in a subprocess: this test session turns Triton's interpreter on before triton is imported, so this
module must not import triton itself.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# (compute capability, dtype): sm_75 (T4: no bf16, so fp16), sm_80 (A100), sm_89 (L4), sm_90 (H100, H200)
TARGETS = [(75, "fp16"), (80, "bf16"), (89, "bf16"), (90, "bf16"), (90, "fp32")]


def compile_all(targets) -> dict:
    """Compile each kernel for each (capability, dtype) to a cubin; returns {name: "ok" | error}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.attention import triton_paged as tp
    from engine.models import triton_norm
    results = {}
    for cc, dtype in targets:
        ptr, precision = f"*{dtype}", "ieee" if dtype == "fp32" else "tf32"
        kernels = {
            "store_kv": (tp._store_kv, dict(N=256, BLOCK=256), dict(slot_ptr="*i64")),
            "decode": (tp._decode, dict(GROUP=3, G_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16,
                                        BLOCK_N=tp.BLOCK_N, PRECISION=precision), dict(scale="fp32")),
            "prefill": (tp._prefill, dict(GROUP=3, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=tp.BLOCK_M,
                                          BLOCK_N=tp.BLOCK_N, PRECISION=precision), dict(scale="fp32")),
            "rms_norm": (triton_norm._rms_norm, dict(N=1024, BLOCK=1024, ROWS=triton_norm.ROWS), dict(eps="fp32")),
        }
        for name, (fn, consts, types) in kernels.items():
            signature = {}
            for arg in fn.arg_names:
                if arg in consts:
                    signature[arg] = "constexpr"
                elif arg in types:
                    signature[arg] = types[arg]
                elif arg.endswith("_ptr"):
                    signature[arg] = "*i32" if arg in ("table_ptr", "ctx_ptr", "q_start_ptr", "q_len_ptr") else ptr
                else:
                    signature[arg] = "i32"
            constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
            key = f"{name} sm_{cc} {dtype}"
            try:
                compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32))
                results[key] = "ok" if compiled.asm.get("cubin") else "no cubin"
            except Exception as exc:  # reported per kernel, so one failure names itself
                results[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
    return results


@pytest.mark.slow
def test_every_kernel_compiles_for_each_gpu_generation():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4 * len(TARGETS)
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, failed


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print(json.dumps(compile_all(TARGETS)))
