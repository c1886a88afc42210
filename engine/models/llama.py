"""Our own Llama-family decoder (Llama / SmolLM2, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) over a ragged batch.

All tokens of a step are one flat [num_tokens, hidden] tensor. Projections are fused (qkv, gate|up) and
stored as `Linear`s (or quantized siblings), each one kernel call (see linear.py). The math follows transformers'
reference implementation step by step (fp32 RMSNorm, rotate_half RoPE) so greedy outputs match it token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import AttentionMetadata, LayerKV, attention
from ..quant import SCALE_DTYPE
from .linear import UNQUANTIZED, Projection, WeightFormat

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
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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


class LlamaFamilyModel:
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
        self.sin = (emb.sin() * attention_scaling).to(self.dtype).to(self.device)

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]

    def kv_dtype(self, kv_cache_dtype: str = "auto") -> torch.dtype:
        """The KV pool's element type: the model's own ("auto"), or int8."""
        return torch.int8 if kv_cache_dtype == "int8" else self.dtype

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token in every layer and KV head; an int8 cache adds a scale per token and KV head."""
        s = self.shape
        per_head = s.head_dim * self.kv_dtype(kv_cache_dtype).itemsize
        if kv_cache_dtype == "int8":
            per_head += SCALE_DTYPE.itemsize
        return 2 * s.num_layers * s.num_kv_heads * per_head

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: list[LayerKV] | None, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. kv_cache: each layer's slice of the pool, or None.

        Returns float32 logits for the rows in logits_rows (the last token of each sequence that samples).
        """
        s = self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        num_tokens = x.shape[0]
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, s.rms_norm_eps)
            qkv = w.qkv(h)
            if w.qkv_bias is not None:
                qkv = qkv + w.qkv_bias
            q = qkv[:, :q_size].view(num_tokens, s.num_heads, s.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, s.num_kv_heads, s.head_dim)
            if w.q_norm is not None:
                q = rms_norm(q, w.q_norm, s.rms_norm_eps)
                k = rms_norm(k, w.k_norm, s.rms_norm_eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            a = w.o(attention(q, k, v.contiguous(), None if kv_cache is None else kv_cache[i], meta))
            if w.o_bias is not None:
                a = a + w.o_bias
            x = x + a
            h = rms_norm(x, w.post_norm, s.rms_norm_eps)
            gu = w.gate_up(h)
            g, u = gu.chunk(2, dim=-1)
            x = x + w.down(F.silu(g) * u)
        h = rms_norm(x[logits_rows], self.norm, s.rms_norm_eps)
        return self.lm_head(h).float()
