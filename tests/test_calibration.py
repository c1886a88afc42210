"""Calibrated quantization (quant/calibrate.py, GPTQ in quant/numerics.py): smoothing must leave the unquantized
model's function unchanged (only where the rounding happens moves), GPTQ must keep every weight on the scheme's
grid with the same scales while erring less over the calibration inputs, and a calibrated model must load and
serve through the engine."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.attention import AttentionMetadata, PrefillSeq
from engine.models.build import build_model, ties_head
from engine.models.loader import load_hf_config, load_state_dict, resolve_model
from engine.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from engine.quant.calibrate import HEAD_KEY, Fake, Inputs, best_scale, calibrate
from engine.quant.kernels import w8a8_weight_max
from engine.quant.linear import W8A8Linear


def correlated(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [n, k] and inputs [512, k] whose channels are correlated (near a low-rank space, as a layer's
    inputs are)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, k, generator=g) + 0.1 * torch.randn(512, k, generator=g)
    return w, x


def output_error(w_hat: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    return float(((w_hat - w) @ x.T).pow(2).mean())


@pytest.mark.parametrize("scheme", ["int8", "w8a8", "int4"])
def test_gptq_keeps_the_grid_and_errs_less_over_the_calibration_inputs(scheme):
    w, x = correlated(64, 320)  # more columns than GPTQ_BLOCK: later blocks take the earlier ones' errors
    h = x.T @ x
    before = w.clone()
    if scheme == "int4":
        plain, gptq = quantize_int4(w, 32), quantize_int4(w, 32, hessian=h)
        assert torch.equal(plain[1], gptq[1]) and torch.equal(plain[2], gptq[2])  # the same scales and mids
        assert int(gptq[0].max()) <= 15
        rtn, rounded = dequantize_int4(*plain, torch.float32), dequantize_int4(*gptq, torch.float32)
    else:
        qmax = w8a8_weight_max() if scheme == "w8a8" else 127
        plain, gptq = quantize_int8(w, qmax), quantize_int8(w, qmax, hessian=h)
        assert torch.equal(plain[1], gptq[1]) and int(gptq[0].abs().max()) <= qmax
        rtn, rounded = dequantize_int8(*plain, torch.float32), dequantize_int8(*gptq, torch.float32)
    assert torch.equal(w, before)  # the caller's weight (a tied embedding, say) is read, never written
    assert not torch.equal(rtn, rounded)
    assert output_error(rounded, w, x) < 0.3 * output_error(rtn, w, x)  # measured ~0.09


def test_smoothing_moves_an_outlier_channels_range_into_the_weights():
    """w8a8 rounds activations per token: one channel 50x the others costs every other channel its precision.
    The scale found for it is > 1 (its activations divided, its weights multiplied), and the error falls."""
    w, x = correlated(96, 64, seed=1)
    x[:, 5] *= 50
    fake = Fake("w8a8", weight_max=w8a8_weight_max())
    inputs = Inputs(x[:256], x.abs().mean(0), x.abs().amax(0), x.T @ x)
    s = best_scale(inputs, w, fake)
    assert s[5] > 2 * s.median()

    def error(s):
        return output_error(fake.activation(x / s) @ fake.weight(w * s).T, x @ w.T, torch.eye(96))
    assert error(s) < 0.5 * error(torch.ones(64))


def forward_logits(model, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    rows = torch.arange(n)
    return model.forward(torch.tensor(tokens), rows, AttentionMetadata(None, prefills=[PrefillSeq(0, n)]), None, rows)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_smoothing_leaves_the_unquantized_model_unchanged(tiny_models, arch, monkeypatch):
    """Random scales (not the searched ones, which may be 1) folded into the norms, v, up and the LM head:
    the fp32 model must compute the same logits. Covers GQA (a scale shared by a group's query heads), a tied
    head (llama: its own smoothed copy, the embedding kept), q/k norms (qwen3) and biases (qwen2)."""
    import engine.quant.calibrate as calibrate_module
    folder = resolve_model(tiny_models[arch][0])
    config, state = load_hf_config(folder), load_state_dict(folder)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    model = build_model(config, state, torch.float32, torch.device("cpu"), 64)
    gen = torch.Generator().manual_seed(0)

    def random_scale(x, w, fake, heads=None):
        s = torch.rand(w.shape[1] if heads is None else heads[0] * w.shape[1] // (heads[0] * heads[1]),
                       generator=gen) * 3 + 0.2
        return s if heads is None else s.view(heads[0], 1, -1).expand(-1, heads[1], -1).reshape(-1)
    monkeypatch.setattr(calibrate_module, "best_scale", random_scale)
    tied = ties_head(config, state)
    smoothed, hessians, _ = calibrate(state, model, list(range(3, 40)), Fake("w8a8"), model.shape.num_kv_heads,
                                   model.shape.head_dim, tied=tied, head=Fake("w8a8"), smooth=True, gptq=True)
    assert (HEAD_KEY in smoothed) == tied and "lm_head" in hessians and len(hessians) == 4 * 2 + 1
    assert not torch.equal(smoothed["norm.weight"], state["norm.weight"].float())
    again = build_model(config, smoothed, torch.float32, torch.device("cpu"), 64)
    if tied:
        assert torch.equal(again.embed, model.embed)
    tokens = list(range(5, 45))
    ref, got = forward_logits(model, tokens), forward_logits(again, tokens)
    assert torch.allclose(got, ref, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.slow
def test_a_calibrated_model_loads_quantized_and_differs_from_the_plain_one(tiny_models):
    folder = tiny_models["qwen2"][0]
    plain = LLM(folder, quantization="w8a8", max_model_len=128)
    calibrated = LLM(folder, quantization="w8a8", quantization_smoothing=True, quantization_gptq=True,
                     max_model_len=128)
    assert isinstance(calibrated.engine.model.layers[0].qkv, W8A8Linear)
    assert "smoothed" in calibrated.config.precision and "GPTQ" in calibrated.config.precision
    q_plain, _ = plain.engine.model.layers[0].gate_up.int8_weight()
    q_cal, _ = calibrated.engine.model.layers[0].gate_up.int8_weight()
    assert not torch.equal(q_plain, q_cal)
    tokens = list(range(5, 45))
    assert forward_logits(calibrated.engine.model, tokens).isfinite().all()


def test_the_lm_head_is_smoothed_for_its_own_scheme(tiny_models, tmp_path, monkeypatch):
    """int4 projections with an int8 head: each projection's scale is searched with int4's rounding, the head's with
    int8's (a head smoothed for a grid it is not stored on would be tuned for the wrong error); a head kept in the
    dtype is not smoothed at all."""
    import engine.quant.calibrate as calibrate_module
    monkeypatch.setenv("WATCHLLM_CACHE", str(tmp_path))
    searched = []  # the rounding each search used, in calibrate's order: each layer's four projections, the head
    real = calibrate_module.best_scale

    def recording(x, w, fake, heads=None):
        searched.append(fake.scheme)
        return real(x, w, fake, heads)
    monkeypatch.setattr(calibrate_module, "best_scale", recording)
    folder = tiny_models["llama"][0]
    llm = LLM(folder, quantization="int4", quantization_smoothing=True, quantize_lm_head="int8", max_model_len=64)
    projections = 4 * len(llm.engine.model.layers)
    assert searched == ["int4"] * projections + ["int8"]
    searched.clear()
    LLM(folder, quantization="int4", quantization_smoothing=True, quantize_lm_head=False, max_model_len=64)
    assert searched == ["int4"] * projections


def test_a_random_model_refuses_calibration_rather_than_ignoring_it():
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM("random:smollm2-135m", quantization="int8", quantization_gptq=True, max_model_len=64)


@pytest.mark.parametrize("field", ["quantization_smoothing", "quantization_gptq"])
def test_calibration_without_a_scheme_is_refused(field):
    from engine import EngineConfig
    with pytest.raises(ValueError, match="need a quantization scheme"):
        EngineConfig(**{field: True}).validate()
    with pytest.raises(ValueError, match=f"{field} must be True or False"):
        EngineConfig(quantization="int8", **{field: "yes"}).validate()


@pytest.mark.slow
def test_smoothing_scales_are_cached_and_give_the_same_weights(tiny_models, tmp_path, monkeypatch):
    """A second load with smoothing finds its scales in the cache: no calibration pass, the same quantized weights.
    Another format (group size, LM head) or a changed calibration text would be another file."""
    import engine.quant.calibrate as calibrate_module
    monkeypatch.setenv("WATCHLLM_CACHE", str(tmp_path))
    folder = tiny_models["llama"][0]
    first = LLM(folder, quantization="int8", quantization_smoothing=True, max_model_len=64)
    assert len(list((tmp_path / "calibration").glob("*.pt"))) == 1

    def no_pass(*args, **kwargs):
        raise AssertionError("calibrated again instead of reading the cache")
    monkeypatch.setattr(calibrate_module, "calibration_inputs", no_pass)
    second = LLM(folder, quantization="int8", quantization_smoothing=True, max_model_len=64)
    for a, b in zip(first.engine.model.layers, second.engine.model.layers, strict=True):
        assert torch.equal(a.qkv.qweight, b.qkv.qweight) and torch.equal(a.input_norm, b.input_norm)
    with pytest.raises(AssertionError, match="calibrated again"):  # another format is not served from that file
        LLM(folder, quantization="int8", quantization_smoothing=True, quantize_lm_head=False, max_model_len=64)
