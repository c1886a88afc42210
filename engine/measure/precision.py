"""What each precision costs, in speed and in quality: `decode` (the whole engine's batch-1 time per token, beside
llama.cpp's), `quality` (a quantized or bf16 engine against the fp32 one over a fixed text)."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine import LLMEngine
from ..factory import stored_as
from ..llm import LLM, engine_for
from ..quant.format import WeightFormat
from ..quant.speed import model_speeds
from ..sampling_params import SamplingParams
from .runs import Progress, decode_ms, random_prompts, run_to_end, tell
from .specs import FEATURE_DIR, resolve_spec


def load_each(llm: LLM, specs: Sequence[str], rounds: int, progress: Progress) -> tuple[list, list]:
    """(configs, models): each spec's configuration and weights, all loaded before any timing."""
    configs = [llm.config_for(resolve_spec(spec)) for spec in specs]
    models = []
    for i, (spec, config) in enumerate(zip(specs, configs, strict=True)):
        tell(progress, i, len(specs) + rounds, f"loading {spec}")
        same = (config.dtype, WeightFormat.of(config)) == stored_as(llm.engine.model)  # as LLM.weights_for
        models.append(llm.engine.model if same else llm.load_weights(config))
    return configs, models


# each scheme with every projection quantized, then the int8 and int4 presets whole
DECODE_SPECS = ("dtype=float32", "dtype=bfloat16", "quantization=int8", "int8", "quantization=int4", "int4",
                "quantization=w8a8")


@dataclass
class DecodeRow:
    spec: str
    precision: str
    ms_per_token: list[float]  # one per round
    ratio: float = 1.0  # median time per token over the first spec's

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms_per_token)


LLAMA_CPP_ROW = "llama.cpp"


class LlamaCppDecoder:
    """llama.cpp (the llama-cpp-python package, not a requirement) on a GGUF file, timed as `decode` times the engine:
    greedy, batch 1, the same prompt, as many threads as torch uses (docs/measurements.md, "On a CPU")."""

    def __init__(self, gguf: Path) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise ValueError("--llama-cpp needs the llama-cpp-python package (pip install llama-cpp-python; it "
                             "compiles llama.cpp, about 10 minutes on 2 cores)") from None
        threads = torch.get_num_threads()
        self.gguf = gguf
        self.llm = Llama(str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
        self.precision = f"llama.cpp, {gguf.name}, {threads} threads"

    def ms_per_token(self, prompt: list[int], tokens: int) -> float:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        token = llm.sample(temp=0.0)
        for _ in range(3):  # a few decodes first, as for the engine
            llm.eval([token])
            token = llm.sample(temp=0.0)
        start = time.perf_counter()
        for _ in range(tokens):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        return (time.perf_counter() - start) / tokens * 1e3


def decode_timings(llm: LLM, specs: Sequence[str] = DECODE_SPECS, prompt_len: int = 128, tokens: int = 64,
                   rounds: int = 3, settings: dict[str, Any] | None = None,
                   progress: Progress = None, llama_cpp: Path | None = None) -> list[DecodeRow]:
    """The whole engine's batch-1 time per decode step in each precision (no speculation); the rounds go round every
    precision, so a busy moment hits each alike. llama_cpp: a GGUF file timed in the same rounds, as a last row."""
    other = None if llama_cpp is None else LlamaCppDecoder(llama_cpp)
    configs, models = load_each(llm, specs, rounds, progress)
    prompt = random_prompts(1, prompt_len, seed=5)[0]  # llama.cpp's: decode_ms draws the same
    times: list[list[float]] = [[] for _ in specs]
    other_times: list[float] = []
    for r in range(rounds):
        tell(progress, len(specs) + r, len(specs) + rounds, f"round {r + 1} of {rounds}")
        for i, (config, model) in enumerate(zip(configs, models, strict=True)):
            fields = {**(settings or {}), **config.to_dict(), "speculative_decoding": False}
            engine = engine_for(llm.config_for(fields), model, llm.tokenizer, llm.engine.hf_config)
            decode_ms(engine, 1, prompt_len, 3, seed=5)  # a few decodes first: first-call costs stay out
            times[i].append(decode_ms(engine, 1, prompt_len, tokens, seed=5))
        if other is not None:
            other_times.append(other.ms_per_token(prompt, tokens))
    tell(progress, len(specs) + rounds, len(specs) + rounds, "done")
    rows = [DecodeRow(spec, config.precision, t) for spec, config, t in zip(specs, configs, times, strict=True)]
    if other is not None:
        rows.append(DecodeRow(LLAMA_CPP_ROW, other.precision, other_times))
    for row in rows:
        row.ratio = row.median_ms / rows[0].median_ms
    return rows


QUALITY_TEXT = FEATURE_DIR.parent / "quality" / "text.txt"
REFERENCE_PRECISION = {"dtype": "float32", "quantization": None, "kv_cache_dtype": "auto",
                       "quantization_smoothing": False, "quantization_gptq": False, "kv_cache_smoothing": False}
# each scheme plain, then as calibrated for the presets, the KV cache alone (plain, then keys smoothed), the presets
QUALITY_SPECS = ("quantization=int8", "quantization=int8,quantization_smoothing=true,quantize_lm_head=false",
                 "quantization=int4", "quantization=int4,quantization_gptq=true",
                 "quantization=int4,quantize_lm_head=false", "quantization=w8a8",
                 "quantization=w8a8,quantization_smoothing=true,quantization_gptq=true,quantize_lm_head=false",
                 "kv_cache_dtype=int8", "kv_cache_dtype=int8,kv_cache_smoothing=true", "int8", "int4")


@dataclass
class QualityRow:
    spec: str
    precision: str
    positions: int  # tokens scored (each window's first has nothing before it)
    top1_agreement: float  # positions where both sides' most likely next token is the same
    mean_abs_logprob_diff: float  # |logprob of the text's token, this side - fp32|, mean over positions
    max_abs_logprob_diff: float
    perplexity: float  # exp(-mean logprob of the text's tokens)
    reference_perplexity: float
    seconds: float  # wall time of this side's teacher-forced pass
    kernel: str = ""  # what ran its projections here ("int4 weights · C++ AVX-512 kernel": quant/kernels.py)
    speed_vs_fp32: str = ""  # its scheme's projections against fp32's on this CPU (quant/speed.py), "" unquantized

    @property
    def perplexity_change(self) -> float:
        return self.perplexity / self.reference_perplexity - 1


def text_windows(llm: LLM, text: str, window: int) -> list[list[int]]:
    ids = llm.tokenizer(text).input_ids
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def teacher_forced(engine: LLMEngine, windows: list[list[int]]) -> list[list[dict[int, float] | None]]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    return [o.prompt_logprobs for o in run_to_end(engine, windows, params)]


def compare_logprobs(windows: list[list[int]], ref: list[list], got: list[list]) -> dict[str, float]:
    agree = n = 0
    diffs, ref_lp, got_lp = [], [], []
    for tokens, r_w, g_w in zip(windows, ref, got, strict=True):
        for p in range(1, len(tokens)):
            r, g, t = r_w[p], g_w[p], tokens[p]
            agree += max(r, key=r.get) == max(g, key=g.get)
            n += 1
            diffs.append(abs(r[t] - g[t]))
            ref_lp.append(r[t])
            got_lp.append(g[t])
    return {"positions": n, "top1_agreement": agree / n, "mean_abs_logprob_diff": statistics.fmean(diffs),
            "max_abs_logprob_diff": max(diffs), "perplexity": math.exp(-statistics.fmean(got_lp)),
            "reference_perplexity": math.exp(-statistics.fmean(ref_lp))}


def quality(llm: LLM, specs: Sequence[str] = QUALITY_SPECS, settings: dict[str, Any] | None = None,
            text: str | None = None, window: int = 1024, progress: Progress = None) -> list[QualityRow]:
    """Teacher-forced over the same text: each spec's engine against the fp32 one, position by position."""
    settings = {k: v for k, v in (settings or {}).items() if k not in (*REFERENCE_PRECISION, "model")}
    windows = text_windows(llm, QUALITY_TEXT.read_text() if text is None else text, window)
    total = len(specs) + 1
    tell(progress, 0, total, "fp32 reference")
    ref = teacher_forced(llm.build_engine({**settings, **REFERENCE_PRECISION}), windows)
    rows = []
    for i, spec in enumerate(specs):
        tell(progress, i + 1, total, spec)
        fields = {**settings, **REFERENCE_PRECISION, **resolve_spec(spec)}
        engine = llm.build_engine(fields)
        start = time.perf_counter()
        got = teacher_forced(engine, windows)
        speed = model_speeds(engine.model).get(engine.config.quantization)
        rows.append(QualityRow(spec, engine.config.precision, **compare_logprobs(windows, ref, got),
                               seconds=time.perf_counter() - start, kernel=engine.kernels()["weights"],
                               speed_vs_fp32=speed.describe() if speed is not None else ""))
    tell(progress, total, total, "done")
    return rows
