"""Which kernel runs a quantized projection (engine/quant/kernels.py) and whether it pays here (engine/quant/speed.py):
one function decides, every projection and every view asks it, and a scheme slower than fp32 on this CPU says so."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from engine import LLM, cpu_kernels
from engine.quant import kernels, speed
from engine.quant.format import QUANTIZATION_SCHEMES, WeightFormat, check_scheme
from engine.quant.kernels import choose_kernel
from engine.quant.linear import make_projection
from engine.quant.speed import SchemeSpeed, scheme_speeds

AVX512 = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


class BuiltWithAvx512:
    """Stands in for the compiled C++ module of an AVX-512 build."""
    @staticmethod
    def weight_only_available() -> bool:
        return True

    @staticmethod
    def dense_dtypes() -> list[str]:
        return ["float32", "bfloat16"]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_weight_only_choice_follows_the_cpu_and_the_build(scheme):
    own = choose_kernel(scheme, "cpu", features=AVX512, extension=BuiltWithAvx512)
    assert own.own and own.kernel == f"{scheme}_matmul (C++)" and own.activations is None
    assert own.describe() == f"{scheme} weights · C++ AVX-512 kernel"
    on_avx2 = choose_kernel(scheme, "cpu", features=AVX2, extension=BuiltWithAvx512)
    assert not on_avx2.own and on_avx2.kernel.startswith("torch._weight_") and on_avx2.activations == torch.bfloat16
    assert "AVX2 on this CPU" in on_avx2.why and on_avx2.describe() == f"{scheme} weights · torch kernel"
    unbuilt = choose_kernel(scheme, "cpu", features=AVX512, extension=None)
    assert not unbuilt.own and "not built" in unbuilt.why


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_weight_only_takes_the_vnni_kernel_where_the_cpu_and_the_build_have_it(scheme):
    with_vnni = type("WithVnni", (BuiltWithAvx512,), {"vnni_available": staticmethod(lambda: True)})
    vnni = choose_kernel(scheme, "cpu", features=AVX512, extension=with_vnni)
    assert vnni.own and vnni.kernel == f"{scheme}_matmul_vnni (C++)" and vnni.activations is None
    assert vnni.describe() == f"{scheme} weights · C++ AVX-512 VNNI kernel" and "two 8-bit parts" in vnni.why
    exact = choose_kernel(scheme, "cpu", features=AVX512 - {"avx512_vnni"}, extension=with_vnni)
    assert exact.kernel == f"{scheme}_matmul (C++)"  # an AVX-512 CPU without VNNI: the exact float kernel
    # the VNNI kernels take K in runs of 32: a projection's own choice knows its K
    assert choose_kernel(scheme, "cpu", features=AVX512, extension=with_vnni, in_features=64) == vnni
    off_runs = choose_kernel(scheme, "cpu", features=AVX512, extension=with_vnni, in_features=48)
    assert off_runs.own and off_runs.kernel == f"{scheme}_matmul (C++)"
    assert off_runs.why.startswith("48 input features, not a multiple of 32")


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        choose_kernel("int3", "cpu")
    for scheme in ("int8", "w8a8"):
        with pytest.raises(ValueError, match=f"quantization='{scheme}' has no kernel on cuda .*slower than bf16"):
            choose_kernel(scheme, "cuda")
    assert choose_kernel("int4", "cuda").kernel == "torch._weight_int4pack_mm"
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        check_scheme("int4", 48, False, False)
    with pytest.raises(ValueError, match="need a quantization scheme"):
        check_scheme(None, 32, True, False)


def test_w8a8_weights_get_the_bits_this_machines_fbgemm_sums_allow():
    choice = choose_kernel("w8a8", "cpu")
    assert choice.weight_max == (127 if kernels.fbgemm_sums() == "int32" else 63)
    assert ("8-bit" if choice.weight_max == 127 else "7-bit") in choice.why


def test_unquantized_choice_by_dtype_cpu_and_build():
    for dtype in (torch.float32, torch.bfloat16):
        own = choose_kernel(None, "cpu", dtype, features=AVX512, extension=BuiltWithAvx512)
        assert own.own and own.kernel == "dense_matmul (C++)"
        assert own.describe() == f"{str(dtype)[6:]} weights · C++ AVX-512 kernel"
        unbuilt = choose_kernel(None, "cpu", dtype, features=AVX512, extension=None)
        assert not unbuilt.own and unbuilt.kernel in ("oneDNN", "x @ W")
    amx = AVX512 | {"amx_tile", "amx_bf16"}  # oneDNN's bf16 linear uses AMX: it keeps bf16 there, not float32,
    assert not choose_kernel(None, "cpu", torch.bfloat16, features=amx, extension=BuiltWithAvx512).own
    assert choose_kernel(None, "cpu", torch.float32, features=amx, extension=BuiltWithAvx512).own
    with_amx = type("WithAmx", (BuiltWithAvx512,), {"dense_amx": staticmethod(lambda: True)})  # unless ours uses it
    on_tiles = choose_kernel(None, "cpu", torch.bfloat16, features=amx, extension=with_amx)
    assert on_tiles.own and "AMX" in on_tiles.why
    assert not choose_kernel(None, "cpu", torch.bfloat16, features=amx,
                             extension=type("NoAmx", (with_amx,), {"dense_amx": staticmethod(lambda: False)})).own
    fp32_only = type("Avx512NoBf16", (BuiltWithAvx512,), {"dense_dtypes": staticmethod(lambda: ["float32"])})
    assert not choose_kernel(None, "cpu", torch.bfloat16, features=AVX512, extension=fp32_only).own
    no_bf16 = AVX512 - {"avx512_bf16"}  # the CPU decides too (kernel-worth builds torch's weights by saying AVX2)
    assert not choose_kernel(None, "cpu", torch.bfloat16, features=no_bf16, extension=BuiltWithAvx512).own
    assert not choose_kernel(None, "cpu", torch.float32, features=AVX2, extension=BuiltWithAvx512).own
    unbuilt = choose_kernel(None, "cpu", torch.float32, features=AVX512, extension=None)
    assert unbuilt.describe() == "float32 weights · oneDNN kernel"
    assert choose_kernel(None, "cuda", torch.bfloat16).kernel == "x @ W"
    ext, amx = cpu_kernels.compiled(), "amx_bf16" in kernels.cpu_features()  # this machine, its build
    for dtype in (torch.float32, torch.bfloat16):
        built = ext is not None and str(dtype)[6:] in ext.dense_dtypes()  # -march=native: the CPU's own flags
        tiles = ext is not None and getattr(ext, "dense_amx", lambda: False)()
        assert choose_kernel(None, "cpu", dtype).own == (built and not (amx and dtype == torch.bfloat16 and not tiles))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_projection_runs_what_the_choice_says(scheme, monkeypatch):
    """The projection asks choose_kernel: simulate an AVX2 machine and it is built on torch's kernel."""
    w = torch.randn(64, 128) * 0.02
    monkeypatch.setattr(kernels, "cpu_features", lambda: AVX2)
    lin = make_projection(WeightFormat(scheme), w, "test")
    assert not lin.choice.own and lin._own is None and lin.kernel == lin.choice.kernel.rsplit(".", 1)[-1]
    monkeypatch.setattr(kernels, "cpu_features", lambda: AVX512)
    lin = make_projection(WeightFormat(scheme), w, "test")
    built = cpu_kernels.compiled() is not None and cpu_kernels.compiled().weight_only_available()
    assert lin.choice.own == built and (lin._own is not None) == built


def test_the_snapshot_and_status_line_say_what_runs(tiny_models):
    llm = LLM(tiny_models["llama"][0], quantization="int4", num_kv_blocks=16)
    snap = llm.engine.snapshot()
    choice = llm.engine.model.layers[0].qkv.choice
    assert snap.kernels["weights"] == choice.describe() and snap.kernels["weights"].startswith("int4 weights · ")
    assert snap.kernels["weights_why"] == choice.why and snap.kernels["lm_head"].startswith("int4 weights")
    from playground.handlers import Playground
    line = Playground(llm).status()
    assert f"{snap.precision} · {choice.short}" in line


def test_a_slower_scheme_says_so():
    slow = SchemeSpeed("w8a8", "fbgemm kernel", (1, 16), (0.7, 0.61), "cpu")
    assert slow.slower and slow.describe() == "0.70x fp32 at 1 row, 0.61x at 16 (slower than fp32 here)"
    mixed = SchemeSpeed("int8", "torch kernel", (1, 16), (2.5, 0.8), "cpu")
    assert not mixed.slower and "slower" not in mixed.describe()


SHAPES = [(96, 64), (64, 64), (256, 64), (64, 128)]


@pytest.mark.slow
def test_speed_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("WATCHLLM_CACHE", str(tmp_path))
    calls = []
    real = speed.measure

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(speed, "measure", counted)
    first = scheme_speeds(SHAPES)
    assert set(first) == set(QUANTIZATION_SCHEMES) and len(calls) == 1
    for s in first.values():  # measured, not made up: a positive ratio per row count, on the chosen kernel
        assert s.rows == speed.ROWS and all(x > 0 for x in s.speedup)
        assert s.kernel == choose_kernel(s.scheme, "cpu").short
    assert scheme_speeds(SHAPES) == first and len(calls) == 1  # from the cache
    scheme_speeds(SHAPES[:2])  # other shapes: another key
    assert len(calls) == 2
    scheme_speeds(SHAPES, refresh=True)
    assert len(calls) == 3
    (tmp_path / speed.CACHE_FILE).write_text("{not json")  # a broken cache costs only the measurement
    assert set(scheme_speeds(SHAPES)) == set(QUANTIZATION_SCHEMES) and len(calls) == 4
    assert json.loads((tmp_path / speed.CACHE_FILE).read_text())
    # each scheme is timed against fp32's projections: another kernel for those (oneDNN where the engine's C++
    # dense matmul is not built) is another measurement, not the cached one
    real_choice = speed.choose_kernel
    monkeypatch.setattr(speed, "choose_kernel", lambda scheme, *a, **k: real_choice(scheme, *a, **k)
                        if scheme is not None else replace(real_choice(None, *a, **k), kernel="another"))
    scheme_speeds(SHAPES)
    assert len(calls) == 5


def test_the_page_and_tables_show_a_slower_scheme(tiny_models, monkeypatch):
    slow = {"w8a8": SchemeSpeed("w8a8", "fbgemm kernel", (1, 16), (0.9, 0.61), "Test CPU (AVX2)"),
            "int4": SchemeSpeed("int4", "torch kernel", (1, 16), (3.0, 1.2), "Test CPU (AVX2)")}
    monkeypatch.setattr("playground.settings.model_speeds", lambda model: slow)
    from playground.handlers import Playground
    note = Playground(LLM(tiny_models["llama"][0], num_kv_blocks=16)).weights_note()
    assert "Test CPU (AVX2)" in note and "**w8a8** (fbgemm kernel) 0.90x fp32 at 1 row, 0.61x at 16 (slower" in note
    assert "**int4** (torch kernel) 3.00x fp32" in note
    from engine.measure.ablation import AblationRow
    from playground.tables import ablation_table
    rows = [AblationRow("full engine", None, precision="float32", kernel="float32 weights · oneDNN kernel"),
            AblationRow("no quantization", "quantization", precision="float32, w8a8 weights",
                        kernel="w8a8 weights · fbgemm kernel", speed_vs_fp32=slow["w8a8"].describe())]
    notes = [r[-1] for r in ablation_table(rows)["data"]]
    assert notes == ["", "w8a8 weights · fbgemm kernel: projections 0.90x fp32 at 1 row, 0.61x at 16 (slower than "
                         "fp32 here)"]
