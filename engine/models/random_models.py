"""`model="random:NAME"`: a known model's architecture with seeded random weights, built on the device, no download:
to benchmark any machine without the hub (the shapes, and so every step's cost, are the real model's; the tokens
are noise). Prompts are token ids (there is no tokenizer); generated text is shown as `<id>` markers.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from .build import build_model

RANDOM_PREFIX = "random:"

# Each model's config.json, the fields our decoder reads.
ARCHITECTURES: dict[str, dict] = {
    "qwen3-0.6b": dict(  # Qwen/Qwen3-0.6B
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
        attention_bias=False),
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
        attention_bias=False),
    "llama-1b": dict(  # meta-llama/Llama-3.2-1B
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
        rope_theta=500000.0, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}),
}
INIT_STD = 0.02  # transformers' initializer_range for these models


def random_name(model: str | None) -> str | None:
    """'qwen3-0.6b' for 'random:qwen3-0.6b'; None for any other model string; ValueError for an unknown name."""
    if not model or not model.startswith(RANDOM_PREFIX):
        return None
    name = model[len(RANDOM_PREFIX):]
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown random architecture {name!r}; known: "
                         f"{', '.join(RANDOM_PREFIX + n for n in ARCHITECTURES)}")
    return name


def hf_config(name: str, **overrides):
    """The architecture's transformers config object (also what HF parity checks build their model from)."""
    from transformers import LlamaConfig, Qwen3Config
    fields = {**ARCHITECTURES[name], **overrides}
    fields.pop("architectures"), fields.pop("model_type")
    if "rope_parameters" not in fields:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
    cls = Qwen3Config if ARCHITECTURES[name]["model_type"] == "qwen3" else LlamaConfig
    config = cls(**fields)
    config.architectures = ARCHITECTURES[name]["architectures"]
    return config


def random_state_dict(config, seed: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """HF-named weights: normal(0, 0.02) matrices, norms at 1 (as a freshly initialised transformers model)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    state = {"model.embed_tokens.weight": normal(config.vocab_size, h), "model.norm.weight": ones(h)}
    qwen3 = type(config).__name__.startswith("Qwen3")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter)})
        if qwen3:
            state[p + "self_attn.q_norm.weight"] = ones(head_dim)
            state[p + "self_attn.k_norm.weight"] = ones(head_dim)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, h)
    return state


class TokenIdTokenizer:
    """Stands in for a tokenizer where there is none: prompts must be token ids, tokens print as `<id>`."""

    eos_token_id = None
    token_ids_only = True  # no text to calibrate over (quant/calibrate.py)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, text, **_):
        raise ValueError(f"random:{self.name} has no tokenizer: pass the prompt as a list of token ids")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError(f"random:{self.name} has no tokenizer or chat template: pass token ids")


def load_random_model(model: str, dtype: torch.dtype, device: torch.device, max_len: int | None, seed: int = 0,
                      weight_format=None, **overrides):
    """(our model, tokenizer stand-in, config, a pseudo-path naming it), as load_model returns for a folder.
    overrides: config fields to change (tests shrink the architecture with them)."""
    name = random_name(model)
    if weight_format is not None and weight_format.calibrated:
        raise ValueError(f"quantization_smoothing and quantization_gptq calibrate over a text, and {model} has no "
                         f"tokenizer: quantize it without them")
    config = hf_config(name, **overrides)
    max_len = max_len or min(config.max_position_embeddings, 2048)
    if max_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's context ({config.max_position_embeddings})")
    state = random_state_dict(config, seed, dtype, device)
    net = build_model(config, state, dtype, device, max_len, *(() if weight_format is None else (weight_format,)))
    return net, TokenIdTokenizer(name), SimpleNamespace(eos_token_id=None), Path(model)
