"""bf16's dense matmul at the few rows of a decode step (engine/csrc/cpu_kernels.cpp's dense_matmul: AMX's tiles where
this CPU and build have them, else AVX-512 BF16's dot products) against torch's bf16 matmul, a row's result in any
batch, and the bf16 model's projections running on it.

bf16 is a lower precision than the reference: its products are compared within a stated bound, not for equality.
The bound: |ours - exact| <= |exact| / 128 + 1e-5 * (|x| @ |w|.T), that is the output's rounding to bf16 (at most
1/256 of it) with room, plus float32 sums' rounding over the terms' magnitude. A kernel that dropped or repeated
one tile of 32 input features, or read another output's weights, is off by several percent of the magnitude and
fails it (the last test checks the bound says so).
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.quant.kernels import choose_kernel, cpu_features
from engine.quant.linear import Linear


def _built() -> bool:
    ext = cpu_kernels.compiled()
    return ext is not None and "bfloat16" in ext.dense_dtypes()


pytestmark = pytest.mark.skipif(not _built(), reason="dense_matmul has no bf16 in this build (AVX-512 BF16)")

# (n, k): odd N and N off the 16-output blocks and the 4-block groups, K a multiple of 32 (AMX's step) and not
SHAPES = [(33, 64), (961, 576), (5, 1536), (200, 96), (17, 130)]
ROWS = [1, 2, 3, 4, 17, 40]  # a decode step's few rows; past 16: AMX's tiles of 16 and a zero-padded last one


def within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output: whether y is within the module's bound of the exact product."""
    exact, magnitude = x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t()
    return (y.double() - exact).abs() <= exact.abs() / 128 + 1e-5 * magnitude


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.usefixtures("two_threads")
def test_the_bf16_kernel_agrees_with_torchs_bf16_matmul(n, k):
    ext = cpu_kernels.compiled()
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1)).to(torch.bfloat16)
    packed = ext.pack_dense(w)
    for m in ROWS:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        ours, torchs = ext.dense_matmul(x, packed, n), x @ w.t()
        assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
        assert within_bound(ours, x, w).all(), f"{m} x {k} -> {n}: outside the bound"
        assert within_bound(torchs, x, w).all()  # the bound is one torch's own bf16 matmul meets
        magnitude = x.double().abs() @ w.double().abs().t()
        assert ((ours.double() - torchs.double()).abs() <= torchs.double().abs() / 64 + 2e-5 * magnitude).all()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.usefixtures("two_threads")
def test_a_bf16_row_is_the_same_alone_and_in_any_batch(n, k):
    ext = cpu_kernels.compiled()
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g).to(torch.bfloat16), torch.randn(40, k, generator=g).to(torch.bfloat16)
    packed = ext.pack_dense(w)
    full = ext.dense_matmul(x, packed, n)
    for m in (1, 2, 3, 4, 5, 16, 17, 33):
        assert torch.equal(ext.dense_matmul(x[:m], packed, n), full[:m]), m
    strided = torch.randn(3, k + 32, generator=g).to(torch.bfloat16)[:, :k]  # rows read as they lie
    assert torch.equal(ext.dense_matmul(strided, packed, n), ext.dense_matmul(strided.contiguous(), packed, n))


def test_amx_is_used_where_the_cpu_has_it():
    """On a CPU with AMX the build's bf16 runs on its tiles (Linux lets the process use them), and the projections
    choose the engine's kernel there rather than oneDNN's."""
    if "amx_bf16" not in cpu_features():
        pytest.skip("no AMX on this CPU")
    assert cpu_kernels.compiled().dense_amx()
    assert choose_kernel(None, "cpu", torch.bfloat16).kernel == "dense_matmul (C++)"
    assert "AMX" in choose_kernel(None, "cpu", torch.bfloat16).why


def test_the_bf16_model_runs_its_projections_on_the_kernel(tiny_models, monkeypatch):
    """Every projection of a bf16 model (the LM head too) is a Linear on dense_matmul, and a decode step calls it."""
    ext = cpu_kernels.compiled()
    llm = LLM(tiny_models["llama"][0], dtype="bfloat16", num_kv_blocks=64)
    projections = llm.engine.model.projections()
    assert all(isinstance(p, Linear) and p.kernel == "dense_matmul (C++)" and p._own is ext.dense_matmul
               for p in projections)
    rows = []

    def counting(x, packed, n):
        rows.append(x.shape[0])
        return ext.dense_matmul(x, packed, n)

    for p in projections:
        monkeypatch.setattr(p, "_own", counting)
    # the layers' projections called from Python, one by one (the C++ DecoderStack calls the same kernel itself:
    # tests/test_step_fast_paths.py)
    monkeypatch.setattr(llm.engine.model, "decoder_stack", None)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3
    assert rows.count(1) >= 2 * len(projections)  # the two decode steps' single rows, every projection


def test_the_bound_catches_a_wrong_kernel():
    """The bound is tight enough to fail a kernel that skipped one tile of 32 input features."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 576, generator=g).to(torch.bfloat16), torch.randn(2, 576, generator=g).to(torch.bfloat16)
    skipped = x.clone()
    skipped[:, 64:96] = 0
    assert not within_bound((skipped @ w.t()), x, w).all()
