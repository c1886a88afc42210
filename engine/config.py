"""EngineConfig: every size and feature switch of the engine, validated in one place (`from_kwargs`, which LLM and the
playground both use), so a misspelt field or an impossible value is a ValueError before any weights are loaded."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .quant.format import WeightFormat, check_scheme

FEATURE_SWITCHES = ("kv_cache", "paged_kv", "continuous_batching", "prefix_caching", "chunked_prefill",
                    "speculative_decoding")
# Changing one of these rebuilds the KV pool: running requests are preempted and re-prefilled.
STRUCTURAL_FIELDS = ("block_size", "num_kv_blocks", "kv_cache_memory_gb", "kv_cache", "paged_kv", "kv_cache_dtype",
                     "kv_cache_smoothing",
                     "attention_backend", "cuda_graphs", "gpu_memory_utilization")
# How the weights are stored: a model is loaded (and quantized) with them.
WEIGHT_FIELDS = ("dtype", "quantization", "quantization_group_size", "quantize_lm_head", "quantization_smoothing",
                 "quantization_gptq")
# These need a new model load and cannot change while serving.
LOAD_TIME_FIELDS = ("model", "device", *WEIGHT_FIELDS)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on CUDA, float32 on CPU
SCHEDULING_POLICIES = ("priority", "fcfs")  # engine/policies.py
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
ATTENTION_BACKENDS = ("sdpa", "triton")  # None: triton on CUDA (with a KV cache), sdpa elsewhere
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    # None: 0.5 GB on CPU; on CUDA what gpu_memory_utilization leaves after weights and a profiled forward
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: share of the card this engine may fill (weights + peak + KV)
    attention_backend: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: by device and chunked prefill (factory.py's default_...)
    max_model_len: int | None = None  # None: min(model context, 2048)
    seed: int = 0
    scheduling_policy: str = "priority"  # or "fcfs" (engine/policies.py)
    # feature switches
    kv_cache: bool = True
    paged_kv: bool = True
    continuous_batching: bool = True
    prefix_caching: bool = True
    chunked_prefill: bool = True
    speculative_decoding: bool = False
    num_speculative_tokens: int = 4  # k: draft tokens per request and step, at most
    prompt_lookup_min: int = 2  # shortest n-gram matched to propose drafts
    prompt_lookup_max: int = 4  # longest n-gram tried first
    # rows (decodes + drafts) a step verifies before drafts shrink (spec.adaptive_k; why: docs/measurements.md,
    # "Speculative decoding")
    speculative_token_budget: int = 16
    cuda_graphs: bool = False  # CUDA only: decode steps replayed from graphs captured per batch-size bucket
    # precision (docs/engine.md's table; why int4's groups are 32: docs/measurements.md, under the quality table)
    quantization: str | None = None  # None, "int8", "int4" or "w8a8"
    quantization_group_size: int = 32  # int4: input features per scale and zero
    quantize_lm_head: bool | str = True  # True: as the projections; False: the model's dtype; or a scheme
    quantization_smoothing: bool = False  # SmoothQuant / AWQ, calibrated at load (quant/calibrate.py)
    quantization_gptq: bool = False  # the weights rounded by GPTQ instead of to the nearest level
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "int8" (a scale per token and KV head)
    kv_cache_smoothing: bool = False  # int8 KV only: each key channel divided by a calibrated scale

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        return cls().replace(**kwargs)

    def replace(self, **changes) -> EngineConfig:
        if unknown := sorted(set(changes) - set(self.field_names())):
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}; "
                             f"known fields: {', '.join(self.field_names())}")
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.field_names()}

    def validate(self) -> None:
        for name in (*FEATURE_SWITCHES, "cuda_graphs", "quantization_smoothing", "quantization_gptq",
                     "kv_cache_smoothing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        check_scheme(self.quantization, self.quantization_group_size, self.quantization_smoothing,
                     self.quantization_gptq, self.quantize_lm_head)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not (self.device in ("cpu", "cuda", "auto") or str(self.device).startswith("cuda:")):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 or bs > 1024 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two between 1 and 1024, got {bs!r}")
        for name in ("max_num_seqs", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "speculative_token_budget"):
            _positive_int(name, getattr(self, name))
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        _positive_int("seed", self.seed, allow_zero=True)
        for name in ("num_kv_blocks", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} (or None: triton on CUDA, sdpa "
                             f"on CPU), got {self.attention_backend!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        gb = self.kv_cache_memory_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or gb <= 0):
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {gb!r}")
        if (self.max_num_batched_tokens is not None and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len and not self.chunked_prefill_active):
            why = "chunked prefill is off" if self.kv_cache else "without a KV cache prompts cannot be chunked"
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) and {why}: a full-length prompt could never be scheduled")

    @property
    def precision(self) -> str:
        """What the engine computes with, in words. Greedy output is the same token for token only within one
        precision: every feature switch keeps it, a change of precision does not."""
        parts = [self.dtype]
        if self.quantization is not None:
            parts.append(WeightFormat.of(self).describe())
        if self.kv_cache_dtype != "auto":
            parts.append(f"{self.kv_cache_dtype} KV" + (", keys smoothed" if self.key_smoothing_active else ""))
        return ", ".join(parts)

    @property
    def key_smoothing_active(self) -> bool:
        return self.kv_cache_smoothing and self.kv_cache_dtype == "int8"

    # What actually runs: prefix caching shares blocks, so it needs a paged KV cache.
    @property
    def prefix_caching_active(self) -> bool:
        return self.prefix_caching and self.paged_kv and self.kv_cache

    # A chunk's K/V must wait in a cache for the next chunk.
    @property
    def chunked_prefill_active(self) -> bool:
        return self.chunked_prefill and self.kv_cache

    # Drafts are verified against a cached context.
    @property
    def speculative_decoding_active(self) -> bool:
        return self.speculative_decoding and self.kv_cache


def _positive_int(name: str, value, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
