"""Activation-aware smoothing before quantization (the idea of SmoothQuant and AWQ), done once at load.

y = x @ W.T = (x / s) @ (W * s).T for any positive s per input channel, but W * s and x / s round differently:
channels with large activations (SmolLM2 has a few, 10-100x the rest) matter most, so scaling their weights up
before rounding cuts the error. The 1 / s is folded into what feeds each projection, adding nothing to a step
(qkv and gate|up: the RMSNorm before them; o: v's output rows; down: up's rows; the LM head: the final norm).
s = act^alpha / w^(1 - alpha) per channel, alpha per projection the one of a grid with the least output error over
the unquantized model's activations on presets/quality/calibration.txt; s = 1 is always a candidate, so a projection
is never made worse on the calibration text.

An int8 KV cache's keys are smoothed the same way (key_scales): each key channel divided by s, each query channel
multiplied by it, q . k unchanged. Applied at run time (attention.KeyScale), not folded into the weights, so the
same weights serve an engine with an int8 cache and one without.
"""
from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .numerics import dequantize_int4, dequantize_int8, dequantize_uint8, quantize_int4, quantize_int8, quantize_uint8

CALIBRATION_TEXT = Path(__file__).resolve().parents[2] / "presets" / "quality" / "calibration.txt"
ALPHAS = tuple(a / 10 for a in range(1, 10))  # the grid searched, besides no smoothing
SEARCH_ROWS = 256  # calibration tokens the error is measured over (statistics use them all)
SEARCH_OUTPUTS = 4096  # output channels it is measured over (the LM head has 49,152)
MAX_TOKENS = 2048  # calibration tokens read (one forward pass; the text has fewer)
# bump when the search changes: cached scales (engine/models/loader.py) from an older search are not reused
SEARCH_VERSION = 2  # 2: w8a8's activations asymmetric
HEAD_KEY = "lm_head.smoothed.weight"  # the LM head's own smoothed weight when the checkpoint ties it to the embedding


@dataclass(frozen=True)
class Fake:
    """A scheme's rounding, in fp32: what its kernel will compute, for comparing candidate scales."""
    scheme: str
    group_size: int = 32
    weight_max: int = 127  # w8a8's may have fewer levels (kernels.py's W8A8_WEIGHT_MAX_BY_SUMS)

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.scheme == "int4":
            return dequantize_int4(*quantize_int4(w, self.group_size), torch.float32)
        return dequantize_int8(*quantize_int8(w, self.weight_max), torch.float32)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "w8a8":
            return dequantize_uint8(*quantize_uint8(x), torch.float32)
        return x.to(torch.bfloat16).float()  # the weight-only kernels take bf16 activations

    @property
    def uses_max(self) -> bool:
        return self.scheme == "w8a8"


def best_scale(x: Inputs, w: torch.Tensor, fake: Fake, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """The s [K] for the inputs x entering w [N, K] with the least output error once quantized. heads =
    (num_kv_heads, group): s is tied across the query heads of a group (o's input), which read the same v."""
    act = (x.max_abs if fake.uses_max else x.mean_abs).clamp(min=1e-5)
    wmax = w.abs().amax(0).clamp(min=1e-5)
    if heads is not None:
        kv, group = heads
        act, wmax = (t.view(kv, group, -1).amax(1) for t in (act, wmax))
    rows = x.rows
    if w.shape[0] > SEARCH_OUTPUTS:  # each output channel rounds on its own: a sample of them measures the error
        w = w[torch.linspace(0, w.shape[0] - 1, SEARCH_OUTPUTS).long()]
    ref = rows @ w.T

    def full(s: torch.Tensor) -> torch.Tensor:
        return s if heads is None else s.unsqueeze(1).expand(-1, heads[1], -1).reshape(-1)

    def error(s: torch.Tensor) -> float:
        return (fake.activation(rows / s) @ fake.weight(w * s).T - ref).pow(2).mean().item()

    def candidate(alpha: float) -> torch.Tensor:
        s = act.pow(alpha) / wmax.pow(1 - alpha)
        return full(s / (s.max() * s.min()).sqrt())  # centred on 1 in log scale: the weights neither grow nor shrink

    return least_error(error, torch.ones_like(w[0]), map(candidate, ALPHAS))


def least_error(error: Callable[[torch.Tensor], float], none: torch.Tensor,
                candidates: Iterable[torch.Tensor]) -> torch.Tensor:
    """The candidate scale with the least error; `none` (no smoothing) unless one beats it."""
    best, best_err = none, error(none)
    for s in candidates:
        err = error(s)
        if err < best_err:
            best, best_err = s, err
    return best


class _Recorder:
    """Stands in for a projection during calibration: keeps what the search and GPTQ need of its inputs."""

    def __init__(self, proj, gram: bool) -> None:
        self.proj, self.want_gram, self.gram = proj, gram, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._record(x)
        return self.proj(x)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        self._record(x)
        return self.proj.raw(x)

    @property
    def input_dtype(self) -> torch.dtype:
        return self.proj.input_dtype

    def _record(self, x: torch.Tensor) -> None:
        xf = x.float()
        self.rows = xf[torch.linspace(0, xf.shape[0] - 1, min(SEARCH_ROWS, xf.shape[0])).long()]
        self.mean_abs, self.max_abs = xf.abs().mean(0), xf.abs().amax(0)
        if self.want_gram:
            self.gram = xf.T @ xf


@dataclass
class Inputs:
    """One projection's calibration inputs, as _Recorder kept them."""
    rows: torch.Tensor  # [SEARCH_ROWS, K]
    mean_abs: torch.Tensor  # [K]
    max_abs: torch.Tensor
    gram: torch.Tensor | None  # [K, K]: X.T @ X over every calibration token (for GPTQ only)


def calibration_inputs(model, token_ids: list[int], gram: bool = True) -> dict[tuple[int, str], Inputs]:
    """Every projection's inputs over the calibration tokens: {(layer, name): Inputs}, layer -1 the LM head's."""
    owners = {(i, name): w for i, w in enumerate(model.layers) for name in ("qkv", "o", "gate_up", "down")}
    owners[-1, "lm_head"] = model
    recorders = {}
    for (i, name), owner in owners.items():
        recorders[i, name] = rec = _Recorder(getattr(owner, name), gram)
        setattr(owner, name, rec)
    try:
        ids = torch.tensor(token_ids[:MAX_TOKENS], device=model.device)
        model.forward_prompt(ids, torch.arange(ids.shape[0], device=model.device))
    finally:
        for key, owner in owners.items():
            setattr(owner, key[1], recorders[key].proj)
    return {key: Inputs(r.rows, r.mean_abs, r.max_abs, r.gram) for key, r in recorders.items()}


def projection_name(layer: int, name: str) -> str:
    """The name build_model gives a projection (its refusals and its hessian are keyed by it)."""
    if layer < 0:
        return "lm_head"
    return f"layers.{layer}." + ("self_attn." if name in ("qkv", "o") else "mlp.") + f"{name}_proj"


def calibrate(state: dict[str, torch.Tensor], model, token_ids: list[int], fake: Fake, num_kv_heads: int,
              head_dim: int, tied: bool, head: Fake | None, smooth: bool, gptq: bool,
              known: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """(state, hessians, scales): the state with every projection's input smoothed for fake's scheme (the LM head's
    for `head`'s; None: unsmoothed) when `smooth`, each projection's X.T @ X over its smoothed inputs when `gptq`,
    and the scales. `known`: scales cached for this checkpoint, format and text, so without GPTQ no forward runs."""
    inputs = calibration_inputs(model, token_ids, gram=gptq) if gptq or (smooth and not known) else {}
    out = {k: v.float().clone() if v.is_floating_point() else v for k, v in state.items()}
    scales: dict[tuple[int, str], torch.Tensor] = {}

    def find(key: tuple[int, str], w: torch.Tensor, heads: tuple[int, int] | None = None,
             rounding: Fake = fake) -> torch.Tensor:
        if not smooth:
            s = torch.ones(w.shape[1])
        elif known:
            s = known[projection_name(*key)].float()
        else:
            s = best_scale(inputs[key], w, rounding, heads)
        scales[key] = s
        return s

    for i in range(len(model.layers)):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        s = find((i, "qkv"), torch.cat([out[a + f"{n}_proj.weight"] for n in "qkv"]))
        out[p + "input_layernorm.weight"] = out[p + "input_layernorm.weight"] / s
        for n in "qkv":
            out[a + f"{n}_proj.weight"] = out[a + f"{n}_proj.weight"] * s

        num_heads = out[a + "o_proj.weight"].shape[1] // head_dim
        group = num_heads // num_kv_heads
        s = find((i, "o"), out[a + "o_proj.weight"], heads=(num_kv_heads, group))
        per_kv = s.view(num_kv_heads, group, head_dim)[:, 0].reshape(-1)  # v's output channels
        out[a + "v_proj.weight"] = out[a + "v_proj.weight"] / per_kv.unsqueeze(1)
        if a + "v_proj.bias" in out:
            out[a + "v_proj.bias"] = out[a + "v_proj.bias"] / per_kv
        out[a + "o_proj.weight"] = out[a + "o_proj.weight"] * s

        s = find((i, "gate_up"), torch.cat([out[m + "gate_proj.weight"], out[m + "up_proj.weight"]]))
        out[p + "post_attention_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] / s
        for n in ("gate", "up"):
            out[m + f"{n}_proj.weight"] = out[m + f"{n}_proj.weight"] * s

        s = find((i, "down"), out[m + "down_proj.weight"])
        out[m + "up_proj.weight"] = out[m + "up_proj.weight"] / s.unsqueeze(1)
        out[m + "down_proj.weight"] = out[m + "down_proj.weight"] * s

    if head is not None:
        weight = out["embed_tokens.weight"] if tied else out["lm_head.weight"]
        s = find((-1, "lm_head"), weight, rounding=head)
        out["norm.weight"] = out["norm.weight"] / s
        out[HEAD_KEY if tied else "lm_head.weight"] = weight * s
    hessians = {}
    if gptq:  # the inputs the smoothed weights see: x / s
        hessians = {projection_name(*key): inputs[key].gram / torch.outer(s, s) for key, s in scales.items()}
    return out, hessians, {projection_name(*key): s for key, s in scales.items()}


KEY_ALPHAS = (0.25, 0.5, 0.75, 1.0)  # the grid searched for an int8 cache's key smoothing, besides none
_key_scales: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its key scales (key_scales_for)


class _KeyRecorder:
    """Stands in for a layer's KeyScale during calibration: samples the queries and keys, changing nothing."""

    def __init__(self) -> None:
        self.queries: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.key_max: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kf = k.float()
        rows = torch.linspace(0, k.shape[0] - 1, min(SEARCH_ROWS, k.shape[0]), device=k.device).long()
        self.queries.append(q[rows].float().cpu())
        self.keys.append(kf[rows].cpu())
        top = kf.abs().amax(0).cpu()
        self.key_max = top if self.key_max is None else torch.maximum(self.key_max, top)
        return q, k

    def best_scale(self) -> torch.Tensor:
        """s [num_kv_heads, head_dim] whose int8 keys err least in q . k over the sample (ones if none helps)."""
        q, k = torch.cat(self.queries), torch.cat(self.keys)
        rows, kv_heads, dim = k.shape
        q = q.view(rows, kv_heads, -1, dim)  # each KV head's group of query heads

        def error(s: torch.Tensor) -> float:
            k_hat = dequantize_int8(*quantize_int8(k / s), torch.float32) * s  # what the cache gives back
            return torch.einsum("rhgd,shd->hgrs", q, k_hat - k).pow(2).mean().item()

        def candidate(alpha: float) -> torch.Tensor:
            s = self.key_max.clamp(min=1e-5).pow(alpha)
            return s / s.log().mean(-1, keepdim=True).exp()  # centred on 1 in log scale, per head

        return least_error(error, torch.ones(kv_heads, dim), map(candidate, KEY_ALPHAS))


def calibration_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """The calibration text's tokens (at most MAX_TOKENS); a model without a tokenizer (random:...) has no text,
    so seeded random tokens stand in."""
    if getattr(tokenizer, "token_ids_only", False):  # models/random_models.TokenIdTokenizer
        rng = random.Random(0)
        return [rng.randrange(vocab_size) for _ in range(MAX_TOKENS)]
    return tokenizer(CALIBRATION_TEXT.read_text()).input_ids[:MAX_TOKENS]


def key_scales(model, token_ids: list[int]) -> torch.Tensor:
    """Each layer's key smoothing scales, [num_layers, num_kv_heads, head_dim], in windows its RoPE table covers."""
    recorders = [_KeyRecorder() for _ in model.layers]
    for start in range(0, len(token_ids), model.max_len):
        ids = torch.tensor(token_ids[start:start + model.max_len], device=model.device)
        model.forward_prompt(ids, torch.tensor([ids.shape[0] - 1], device=model.device), key_scales=recorders)
    return torch.stack([r.best_scale() for r in recorders])


def key_scales_for(model, tokenizer) -> torch.Tensor:
    """key_scales over the calibration text, once per model."""
    if model not in _key_scales:
        _key_scales[model] = key_scales(model, calibration_token_ids(tokenizer, model.embed.shape[0]))
    return _key_scales[model]
