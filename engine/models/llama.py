"""Our own Llama-family decoder (Llama / SmolLM2, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) over a ragged batch:
a step's tokens are one flat [num_tokens, hidden] tensor. The math follows transformers' step by step so greedy
outputs match it token for token; on CPU the C++ kernels round where those formulas round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import cpu_kernels, huge_pages
from ..attention import AttentionMetadata, LayerKV, PagedMetadata, PrefillSeq, attention
from ..quant import SCALE_DTYPE
from ..quant.format import UNQUANTIZED, WeightFormat
from ..quant.linear import Projection

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Projection  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim (Linear or a quantized sibling)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over head_dim
    k_norm: torch.Tensor | None
    o: Projection  # num_heads * head_dim -> hidden
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Projection  # hidden -> 2 * intermediate
    down: Projection  # intermediate -> hidden


@dataclass
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    if dtype != torch.float32:  # (a cast that does nothing still costs a call, in every layer)
        x = x.float()
    if x.is_cpu:  # what mean() does on CPU (a sum, then a division), in fewer calls and allocations
        variance = x.pow(2).sum(-1, keepdim=True).div_(x.shape[-1])
    else:
        variance = x.pow(2).mean(-1, keepdim=True)
    x = x * variance.add_(eps).rsqrt_()
    return weight * (x if dtype == torch.float32 else x.to(dtype))


def fused_rms_norm():
    """triton_norm.py's RMSNorm, imported when first used: never on a CPU install without triton."""
    from .triton_norm import rms_norm as fused
    return fused


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, rotate_half's minus sign carried by signed_sin (-sin on the
    first half): (-a) * b and a * (-b) are the same float, so bit for bit the same, one negation fewer."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, from `rope_parameters` (transformers 5) or `rope_theta`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":  # scaled variants: transformers' own formulas, on its config object
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        config = hf_config if hasattr(hf_config, "to_dict") else AutoConfig.from_pretrained(hf_config.name_or_path)
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def stack_attends(meta: AttentionMetadata, kv_cache: list[LayerKV] | None, num_tokens: int) -> bool:
    """Whether every row of this step takes attention/sdpa.py's C++ path, the one the DecoderStack runs."""
    return (kv_cache is not None and num_tokens > 0 and meta.write_kv is not None
            and meta.decode_attention is not None and not (meta.kv_int8 and meta.prefills)
            and (meta.decode_lists is not None or meta.num_decode == num_tokens))


def pools_of(kv_cache: list[LayerKV], meta: AttentionMetadata) -> dict:
    """The DecoderStack's per-step arguments besides x."""
    int8 = kv_cache[0].k_scale is not None
    return {"k_pools": [c.k for c in kv_cache], "v_pools": [c.v for c in kv_cache],
            "k_scales": [c.k_scale for c in kv_cache] if int8 else [],
            "v_scales": [c.v_scale for c in kv_cache] if int8 else [],
            "slot_mapping": meta.slot_mapping, "slots": meta.decode_slots, "lens": meta.decode_lens,
            "lists": meta.decode_lists,
            "query_scales": [] if meta.key_scales is None else [ks.query for ks in meta.key_scales],
            "key_inverses": [] if meta.key_scales is None else [ks.key_inverse for ks in meta.key_scales]}


class LlamaFamilyModel:
    DERIVED = ("cos", "signed_sin", "qk_norms")  # attributes computed at load (RoPE tables, joined norms): not weights

    def __init__(self, shape: ModelShape, embed: torch.Tensor, layers: list[LayerWeights], norm: torch.Tensor,
                 lm_head: Projection, inv_freq: torch.Tensor, attention_scaling: float, max_len: int,
                 weight_format: WeightFormat = UNQUANTIZED) -> None:
        self.shape = shape
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # a tied head costs one copy of the embedding, stored for the kernel
        self.weight_format = weight_format
        self.dtype = embed.dtype
        self.device = embed.device
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_scaling).to(self.dtype).to(self.device)
        sin = emb.sin() * attention_scaling
        half = sin.shape[-1] // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.dtype).to(self.device)
        # Qwen3's q and k norms as one [heads + kv_heads, head_dim] weight: q and k normed as one tensor, half the calls
        self.qk_norms = [None if w.q_norm is None else
                         torch.cat((w.q_norm.expand(shape.num_heads, -1), w.k_norm.expand(shape.num_kv_heads, -1)))
                         for w in layers]
        cpu_model = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        self.cpu_ops = cpu_kernels.compiled() if cpu_model else None
        # the projections' weights in 2 MB pages where the system gives them: a step streams them all
        self.huge_page_bytes = huge_pages.gather(self.streamed_tensors())
        # every layer of a step in one C++ call (the loop below, the same kernels in the same order); None: the loop
        self.decoder_stack = self._decoder_stack()

    def _decoder_stack(self):
        """The C++ DecoderStack over this model's layers, or None where a layer has a step it does not run."""
        if self.cpu_ops is None or not hasattr(self.cpu_ops, "DecoderStack") or any(
                n is not None for n in self.qk_norms):
            return None
        projections = [p for w in self.layers for p in (w.qkv, w.o, w.gate_up, w.down)]
        plans = [p.cpp_plan() for p in projections]
        if any(plan is None for plan in plans):
            return None
        s, none = self.shape, torch.empty(0, dtype=self.dtype)
        return self.cpu_ops.DecoderStack(
            norms=[n for w in self.layers for n in (w.input_norm, w.post_norm)],
            kinds=[plan.kind for plan in plans], packed=[plan.packed for plan in plans],
            scales=[plan.scale for plan in plans], groups=[plan.group for plan in plans],
            outs=[p.out_features for p in projections],
            bf16_in=[p.input_dtype == torch.bfloat16 and i % 4 != 1 for i, p in enumerate(projections)],
            qkv_bias=[none if w.qkv_bias is None else w.qkv_bias for w in self.layers],
            o_bias=[none if w.o_bias is None else w.o_bias for w in self.layers],
            heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim, eps=s.rms_norm_eps, dtype=self.dtype)

    def projections(self) -> list[Projection]:
        return [p for w in self.layers for p in (w.qkv, w.o, w.gate_up, w.down)] + [self.lm_head]

    def streamed_tensors(self) -> list[torch.Tensor]:
        """What every step reads whole: the projections' stored weights (and their scales)."""
        return [t for p in self.projections() for t in p.weight_tensors()]

    def kernels(self) -> dict[str, str]:
        """What runs this model's steps here, in words."""
        first = self.layers[0]
        runs: dict[str, list[str]] = {}  # each kernel, and the projections that run it (their K decides)
        whys: dict[str, None] = {}
        for name, p in (("qkv", first.qkv), ("o", first.o), ("gate|up", first.gate_up), ("down", first.down)):
            runs.setdefault(p.choice.short, []).append(name)
            whys[p.choice.why] = None
        kernel = next(iter(runs)) if len(runs) == 1 else ", ".join(f"{k} ({'/'.join(n)})" for k, n in runs.items())
        choice = first.qkv.choice
        return {"weights": f"{choice.scheme or choice.model_dtype} weights · {kernel}", "weights_kernel": kernel,
                "weights_why": "; ".join(whys),
                "lm_head": self.lm_head.choice.describe(),
                "layer_ops": ("torch calls" if self.cpu_ops is None else "C++ (RMSNorm, RoPE, SiLU fused)" +
                              ("; a step's layers in one call" if self.decoder_stack is not None else ""))}

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]

    def kv_dtype(self, kv_cache_dtype: str = "auto") -> torch.dtype:
        return torch.int8 if kv_cache_dtype == "int8" else self.dtype

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token in every layer and KV head; an int8 cache adds a scale per token and KV head."""
        s = self.shape
        per_head = s.head_dim * self.kv_dtype(kv_cache_dtype).itemsize
        if kv_cache_dtype == "int8":
            per_head += SCALE_DTYPE.itemsize
        return 2 * s.num_layers * s.num_kv_heads * per_head

    @torch.inference_mode()
    def forward_prompt(self, input_ids: torch.Tensor, logits_rows: torch.Tensor, key_scales=None) -> torch.Tensor:
        """One prompt, read whole, with no KV cache: what calibration runs (engine/quant/calibrate.py)."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        meta = AttentionMetadata(slot_mapping=None, prefills=[PrefillSeq(0, input_ids.shape[0])],
                                 key_scales=key_scales)
        return self.forward(input_ids, positions, meta, None, logits_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: list[LayerKV] | None, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: each layer's slice of the pool, or None. Returns float32 logits for the
        rows in logits_rows (the last token of each sequence that samples)."""
        s = self.shape
        q_size, kv_size, heads, eps = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_heads, s.rms_norm_eps
        paged = isinstance(meta, PagedMetadata)
        # the triton backend norms in one kernel each; on CPU the C++ layer steps, else transformers' formulas
        ops = None if paged else self.cpu_ops
        norm = fused_rms_norm() if paged else rms_norm

        def add_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, into=None):
            """x + residual (when given) and its RMSNorm; the C++ step adds in place (x is this forward's own)."""
            if ops is not None:
                return x, ops.add_rms_norm(x, residual, weight, eps, bf16_for(into))
            if residual is not None:
                x = x + residual
            return x, norm(x, weight, eps)

        def bf16_for(proj: Projection | None) -> torch.dtype | None:
            return torch.bfloat16 if proj is not None and proj.input_dtype == torch.bfloat16 else None

        if ops is None:
            cos, sin = self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        num_tokens = x.shape[0]
        residual = None  # what the previous MLP adds to x, added as the next norm reads it
        if ops is not None and self.decoder_stack is not None and stack_attends(meta, kv_cache, num_tokens):
            x, residual = self.decoder_stack.run(x, self.cos, self.signed_sin, positions, **pools_of(kv_cache, meta))
            _, h = add_norm(x[logits_rows], residual[logits_rows], self.norm)
            return self.lm_head(h).float()
        # `proj.raw(h)` where the next operation widens it exactly anyway: one cast fewer, same floats
        for i, w in enumerate(self.layers):
            x, h = add_norm(x, residual, w.input_norm, w.qkv)
            qkv = w.qkv.raw(h)
            if w.qkv_bias is not None:
                qkv = qkv + w.qkv_bias
            qk = qkv[:, :q_size + kv_size].view(num_tokens, heads + s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, s.num_kv_heads, s.head_dim).to(self.dtype).contiguous()
            if self.qk_norms[i] is not None:
                qk = norm(qk.to(self.dtype), self.qk_norms[i], eps)
            qk = apply_rope(qk, cos, sin) if ops is None else ops.rope(qk, self.cos, self.signed_sin, positions)
            q, k = qk[:, :heads], qk[:, heads:]
            if not paged and meta.key_scales is not None:
                q, k = meta.key_scales[i](q, k)
            a = w.o.raw(attention(q, k, v, None if kv_cache is None else kv_cache[i], meta))
            if w.o_bias is not None:
                a = a + w.o_bias
            x, h = add_norm(x, a, w.post_norm, w.gate_up)
            gate_up = w.gate_up.raw(h)
            if ops is None:
                g, u = gate_up.chunk(2, dim=-1)
                residual = w.down.raw(F.silu(g.to(self.dtype)) * u)
            else:
                residual = w.down.raw(ops.silu_mul(gate_up, self.dtype, bf16_for(w.down)))
        _, h = add_norm(x[logits_rows], residual[logits_rows], self.norm)
        return self.lm_head(h).float()
