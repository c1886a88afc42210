"""The one place an automatic setting is decided: the device and dtype ("auto"), the attention backend (None), the
sizes left None and the kernel that runs the weights' precision. `resolve` turns what was asked into a `Resolved`;
`CoreBuilder` turns that into what an engine runs (its KV manager and model runner), its sizes checked. It imports
neither the engine nor reconfigure.py, so both may import it (docs/engine.md).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .blocks import ContiguousKVCache, KVCache, NoKVCache, PagedKVCache
from .config import STRUCTURAL_FIELDS, EngineConfig
from .cuda_graphs import DecodeGraphs, check_cuda_graphs
from .gpu import GpuMemoryPlan, kv_budget_bytes, profile_gpu_memory
from .memory import check_kv_pool_fits
from .quant.calibrate import key_scales_for
from .quant.format import WeightFormat
from .quant.kernels import choose_kernel
from .runner import ModelRunner
from .utils import cdiv

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (config, max_model_len, step tokens) -> the CUDA memory plan, measured by the caller (which keeps it)
PlanGpuMemory = Callable[[EngineConfig, int, int], GpuMemoryPlan | None]


def resolve_device(device: str) -> torch.device:
    """'auto': CUDA when a GPU is there, else the CPU; a CUDA device asked for without one is refused."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(name: str, device: torch.device) -> str:
    """'auto': bfloat16 on CUDA (half the bytes, the tensor cores' type), float16 on a GPU without bf16 (a T4, as
    Colab's free tier lends: bf16 there is emulated), float32 on CPU (exact, and fast there)."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def resolve_attention_backend(config: EngineConfig, device: torch.device) -> str:
    """None: triton on CUDA when there is a KV cache to page through (in the model's dtype), sdpa otherwise. An
    explicit 'triton' is checked here, so a bad choice fails at construction."""
    backend = config.attention_backend
    if backend is None:
        backend = ("triton" if device.type == "cuda" and config.kv_cache and config.kv_cache_dtype != "int8"
                   and _triton_importable() else "sdpa")
    if backend == "triton":
        if config.kv_cache_dtype == "int8":
            raise ValueError("kv_cache_dtype='int8' is dequantized by the sdpa attention backend only: use "
                             "attention_backend='sdpa' with it (the triton kernels read the model's dtype)")
        if not config.kv_cache:
            raise ValueError("attention_backend='triton' reads K/V from the paged cache: it needs kv_cache=True "
                             "(use attention_backend='sdpa' for the naive loop)")
        if not _triton_importable():
            raise ValueError("attention_backend='triton' needs the triton package: pip install triton")
        from .attention.triton_paged import require_triton
        require_triton(device)
    return backend


# Tokens per step with chunked prefill, by device type: a step's budget bounds how long one step (and so every
# stream's gap between tokens) can take. Why 256 on a CPU: docs/measurements.md, "Chunked prefill"; 2,048 on a GPU is
# vLLM's long-standing default (not measured here).
CHUNKED_PREFILL_BUDGET = {"cpu": 256, "cuda": 2048}


def default_max_num_batched_tokens(config: EngineConfig, max_model_len: int, device_type: str = "cpu") -> int:
    """Without chunked prefill the budget must hold a whole prompt."""
    if config.chunked_prefill_active:
        return CHUNKED_PREFILL_BUDGET.get(device_type, CHUNKED_PREFILL_BUDGET["cpu"])
    return max(2048, max_model_len)


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def automatic_sizes(config: EngineConfig, model, plan_gpu_memory: PlanGpuMemory | None = None) -> dict:
    """What each size left empty (None) and the attention backend come to, given config's other fields and the
    loaded model. On CUDA with nothing fixing the pool's size, `plan_gpu_memory` is asked for the memory profile."""
    max_len = config.max_model_len or model.max_len
    device = model.device
    budget_tokens = config.max_num_batched_tokens or default_max_num_batched_tokens(config, max_len, device.type)
    plan = None
    if (plan_gpu_memory is not None and device.type == "cuda" and config.kv_cache_memory_gb is None
            and config.num_kv_blocks is None and config.kv_cache):
        plan = plan_gpu_memory(config, max_len, budget_tokens)
    num_blocks = max(1, kv_budget_bytes(config, device, plan) // kv_bytes_per_block(config, model))
    # never more than every seat filled to max_model_len: beyond that the memory would sit idle
    num_blocks = min(num_blocks, config.max_num_seqs * cdiv(max_len, config.block_size))
    return {"max_model_len": model.max_len,
            "max_num_batched_tokens": default_max_num_batched_tokens(config, max_len, device.type),
            "num_kv_blocks": num_blocks, "attention_backend": resolve_attention_backend(config, device)}


def kv_bytes_per_block(config: EngineConfig, model) -> int:
    return model.kv_bytes_per_token(config.kv_cache_dtype) * config.block_size


def decoder_in_features(model) -> tuple[int, ...]:
    """The K (input features) of the decoder's projections: qkv and gate|up read the hidden state, o the heads'
    outputs, down the MLP's. choose_kernel's answer can depend on K (the VNNI kernels take K in runs of 32)."""
    s = model.shape
    return tuple(sorted({s.hidden_size, s.num_heads * s.head_dim, s.intermediate_size}))


@dataclass(frozen=True)
class Resolved:
    """A configuration as asked (`requested`: "auto" and None kept) and as it runs (`config`: every choice made);
    `in_features`: the model's decoder_in_features."""
    requested: EngineConfig
    config: EngineConfig
    in_features: tuple[int, ...]

    def weights_kernel(self) -> str:
        """The kernel the decoder's projections run the weights' precision with, and why (quant/kernels.py decides
        for each K): "kernel: why", or where Ks differ in kernel, "kernel for K=a, b: why; ..." for each."""
        by_choice: dict[tuple[str, str], list[int]] = {}
        for k in self.in_features:
            choice = choose_kernel(self.config.quantization, self.config.device, TORCH_DTYPES[self.config.dtype],
                                   in_features=k)
            by_choice.setdefault((choice.kernel, choice.why), []).append(k)
        if len(by_choice) == 1:
            return "{}: {}".format(*next(iter(by_choice)))
        return "; ".join(f"{kernel} for K={', '.join(map(str, ks))}: {why}" for (kernel, why), ks in by_choice.items())

    def chosen(self) -> dict:
        """For each field left automatic, what it came to; and the weights' kernel."""
        out = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(EngineConfig)
               if getattr(self.requested, f.name) in (None, "auto")
               and getattr(self.config, f.name) != getattr(self.requested, f.name)}
        return {**out, "weights_kernel": self.weights_kernel()}


def resolve_weights(requested: EngineConfig, device: torch.device) -> EngineConfig:
    """What loading the weights needs decided before there is a model: the dtype (the device is `device`)."""
    return requested.replace(dtype=resolve_dtype(requested.dtype, device))


def resolve(requested: EngineConfig, model, plan_gpu_memory: PlanGpuMemory | None = None) -> Resolved:
    """Every automatic field of `requested` decided for this loaded model (checks that sizes fit are
    CoreBuilder.resolve's)."""
    auto = automatic_sizes(requested, model, plan_gpu_memory)
    device = requested.device if requested.device != "auto" else model.device.type
    config = resolve_weights(requested, model.device).replace(
        device=device, max_model_len=requested.max_model_len or auto["max_model_len"],
        max_num_batched_tokens=requested.max_num_batched_tokens or auto["max_num_batched_tokens"],
        num_kv_blocks=requested.num_kv_blocks or auto["num_kv_blocks"], attention_backend=auto["attention_backend"])
    return Resolved(requested, config, decoder_in_features(model))


def stored_as(model) -> tuple[str, WeightFormat]:
    """How a loaded model's weights are stored: its dtype's name and its weight format."""
    return str(model.dtype).removeprefix("torch."), model.weight_format


def check_resolved(config: EngineConfig, requested: EngineConfig) -> None:
    """The dtype is decided before an engine is built (the weights are loaded in it), never by the engine."""
    if config.dtype == "auto":
        raise ValueError("LLMEngine was given dtype='auto': the dtype is decided by engine/factory.py before an "
                         "engine is built (resolve_weights(config, model.device), or llm.py's engine_for, does it)")
    if differ := [k for k, v in requested.to_dict().items()
                  if getattr(config, k) != v and not (k == "dtype" and v == "auto")]:
        raise ValueError(f"the requested configuration may differ from the one given only in its dtype ('auto'), "
                         f"not in {', '.join(differ)}")


def check_weights(config: EngineConfig, model) -> None:
    """An engine runs the weights it is given: they must be stored as config says (dtype, quantization)."""
    have, want = stored_as(model), (config.dtype, WeightFormat.of(config))
    if have != want:
        raise ValueError(f"the model's weights are {have[0]}, {have[1].describe()}, but the config asks for "
                         f"{want[0]}, {want[1].describe()}: load the model with them (LLM(..., dtype=, quantization=))")


class CoreBuilder:
    """What an engine runs, over one loaded model: a configuration resolved (every automatic field decided) and
    checked, and the KV manager and model runner built for it. `pool_bytes`: the bytes the KV pool in use holds
    (0 before there is one), which a GPU memory profile counts as taken."""

    def __init__(self, model, tokenizer, pool_bytes: Callable[[], int] = lambda: 0,
                 gpu_memory: GpuMemoryPlan | None = None) -> None:
        self.model, self.tokenizer, self.pool_bytes = model, tokenizer, pool_bytes
        self.gpu_memory = gpu_memory  # CUDA: how the pool was sized (gpu.py)

    def automatic_sizes(self, config: EngineConfig) -> dict:
        return automatic_sizes(config, self.model, self._plan_gpu_memory)

    def _plan_gpu_memory(self, config: EngineConfig, max_len: int, budget_tokens: int) -> GpuMemoryPlan:
        """Profile once per (utilization, step size); a settings change that keeps both reuses the plan."""
        plan = self.gpu_memory
        if plan is None or (plan.utilization, plan.profile_tokens) != (config.gpu_memory_utilization, budget_tokens):
            self.gpu_memory = profile_gpu_memory(self.model, config, max_len, budget_tokens, self.pool_bytes())
        return self.gpu_memory

    def resolve(self, config: EngineConfig, current: EngineConfig | None = None) -> EngineConfig:
        """Every automatic field filled (sizes from the model and the memory budget, the attention backend, the
        dtype), then checked: the sizes fit together and in the memory free now. `current`: the configuration that
        runs (None before any does): a new pool must fit beside its pool, while keeping it needs nothing new."""
        resolved = resolve(config, self.model, self._plan_gpu_memory).config
        max_len, num_blocks = resolved.max_model_len, resolved.num_kv_blocks
        if max_len > self.model.max_len:
            raise ValueError(f"max_model_len {max_len} exceeds the loaded model's limit ({self.model.max_len})")
        if resolved.cuda_graphs:
            check_cuda_graphs(self.model.device, resolved.attention_backend, resolved.kv_cache)
        if resolved.kv_cache and not resolved.paged_kv and cdiv(max_len, config.block_size) > num_blocks:
            raise ValueError(
                f"contiguous KV reserves max_model_len={max_len} tokens "
                f"({cdiv(max_len, config.block_size)} blocks) per request, but the pool has only {num_blocks} blocks")
        rebuild = current is None or any(getattr(current, f) != getattr(resolved, f) for f in STRUCTURAL_FIELDS)
        if resolved.kv_cache and rebuild:  # even if free memory has shrunk since, the pool kept is already there
            blocks = f"{num_blocks} blocks"
            what = (f"num_kv_blocks={config.num_kv_blocks}" if config.num_kv_blocks is not None else
                    f"kv_cache_memory_gb={config.kv_cache_memory_gb} ({blocks})"
                    if config.kv_cache_memory_gb is not None else f"the automatic pool ({blocks})")
            check_kv_pool_fits(what, num_blocks, kv_bytes_per_block(resolved, self.model), self.model.device)
        return resolved

    def build(self, c: EngineConfig) -> tuple[KVCache, ModelRunner]:
        """A KV manager and runner for config c. Changes nothing else, so a failure here leaves an engine serving."""
        kv = (NoKVCache(c.block_size) if not c.kv_cache else  # the naive loop's
              ContiguousKVCache(c.num_kv_blocks, c.block_size, c.max_model_len) if not c.paged_kv else
              PagedKVCache(c.num_kv_blocks, c.block_size, c.prefix_caching_active))
        key_scales = key_scales_for(self.model, self.tokenizer) if c.key_smoothing_active else None
        runner = ModelRunner(self.model, c.block_size, c.num_kv_blocks, c.kv_cache, c.kv_cache_dtype,
                             c.attention_backend, scratch_block=c.cuda_graphs, key_scales=key_scales)
        if c.cuda_graphs:
            runner.graphs = DecodeGraphs(self.model, runner.kv_layers, c.block_size, runner.scratch_block,
                                         c.max_num_seqs, c.max_model_len)
        return kv, runner
