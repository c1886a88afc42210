"""The Hugging Face transformers baseline: `generate` over the same weights, timed the same way."""
from __future__ import annotations

import time
from typing import Any

import torch

from ..factory import TORCH_DTYPES
from ..llm import LLM
from ..workloads import Workload
from .runs import random_prompts


def load_hf_model(llm: LLM) -> tuple[Any, int]:
    """transformers' model over the same weights, dtype and device, warmed up; and its pad id."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=TORCH_DTYPES[llm.config.dtype])
    hf = hf.to(llm.engine.model.device).eval()
    pad = hf_pad_id(hf, llm.tokenizer)
    hf_warm_up(hf, pad)
    return hf, pad


def hf_pad_id(hf_model: Any, tokenizer: Any) -> int:
    for candidate in (hf_model.config.pad_token_id, tokenizer.pad_token_id, hf_model.config.eos_token_id):
        if isinstance(candidate, (list, tuple)) and candidate:
            candidate = candidate[0]
        if isinstance(candidate, int):
            return candidate
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(hf_model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> float:
    """Seconds for one left-padded greedy batch in which every row generates exactly max_new_tokens."""
    width = max(len(p) for p in prompts)
    device = hf_model.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, pad_token_id=pad_id,
                                temperature=None, top_p=None, top_k=None)
    _sync(device)
    elapsed = time.perf_counter() - start
    if out.shape[1] - width != max_new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens per row, expected {max_new_tokens}")
    return elapsed


def hf_warm_up(hf_model: Any, pad_id: int) -> None:
    hf_generate(hf_model, random_prompts(1, 8, seed=-1), 2, pad_id)


def hf_static_batches(hf_model: Any, workload: Workload, batch_size: int, pad_id: int) -> tuple[float, int, int]:
    """(seconds, generated tokens, useful tokens) for the workload in static batches, in workload order."""
    seconds, generated, useful = 0.0, 0, 0
    for i in range(0, len(workload.requests), batch_size):
        batch = workload.requests[i:i + batch_size]
        longest = max(r.params.max_tokens for r in batch)
        seconds += hf_generate(hf_model, [list(r.prompt_token_ids) for r in batch], longest, pad_id)
        generated += longest * len(batch)
        useful += sum(r.params.max_tokens for r in batch)
    return seconds, generated, useful

