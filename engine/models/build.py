"""Our decoder from an HF config and its state dict: the weights fused (q|k|v, gate|up), transposed and cast into
its layout, each projection quantized once if asked. loader.py (checkpoints on disk) and random_models.py (seeded
random weights) both build through here."""
from __future__ import annotations

import torch

from ..quant.calibrate import HEAD_KEY
from ..quant.format import UNQUANTIZED, WeightFormat
from ..quant.linear import Projection, make_projection
from .llama import LayerWeights, LlamaFamilyModel, ModelShape, rope_inv_freq


def build_model(hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                max_len: int, weight_format: WeightFormat = UNQUANTIZED,
                hessians: dict[str, torch.Tensor] | None = None) -> LlamaFamilyModel:
    """hessians: X.T @ X by projection name, for GPTQ's rounding (engine/quant/calibrate.py)."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = ModelShape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                       getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim,
                       c.intermediate_size, c.vocab_size, c.rms_norm_eps, c.max_position_embeddings)
    state = {k.removeprefix("model."): v for k, v in state.items()}

    def get(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype)

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in state else None

    def cat_opt(names: list[str]) -> torch.Tensor | None:
        parts = [opt(n) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts)

    hessians = hessians or {}

    def make(weight: torch.Tensor, name: str, is_lm_head: bool = False) -> Projection:
        return make_projection(weight_format, weight, name, is_lm_head, hessians.get(name))
    layers = []
    for i in range(shape.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=make(torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"]), f"{a}qkv_proj"),
            qkv_bias=cat_opt([a + f"{n}_proj.bias" for n in "qkv"]),
            q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"),
            o=make(get(a + "o_proj.weight"), f"{a}o_proj"), o_bias=opt(a + "o_proj.bias"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=make(torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]), f"{m}gate_up_proj"),
            down=make(get(m + "down_proj.weight"), f"{m}down_proj"),
        ))
    embed = get("embed_tokens.weight")
    head = (get(HEAD_KEY) if HEAD_KEY in state else embed if ties_head(c, state) else get("lm_head.weight"))
    lm_head = make(head, "lm_head", is_lm_head=True)
    inv_freq, scaling = rope_inv_freq(c)
    return LlamaFamilyModel(shape, embed, layers, get("norm.weight"), lm_head, inv_freq, scaling, max_len,
                            weight_format)


def ties_head(hf_config, state: dict[str, torch.Tensor]) -> bool:
    """Whether the LM head is the embedding (tied in the config, or no head of its own in the checkpoint)."""
    return getattr(hf_config, "tie_word_embeddings", False) or "lm_head.weight" not in state
