"""Measuring the engine, as a library: what the playground and `python -m engine.bench` both call.

    specs.py        feature presets and "key=value" flags -> EngineConfig fields
    runs.py         weights loaded once, an engine per configuration, a workload run -> RunResult
    hf.py           transformers' generate over the same weights
    experiments.py  table, compare, hf-static, sched-cost, sampling-cost, prefill-cost, closed-loop
    ablation.py     what each feature is worth: ablate (--cumulative, --concurrency), memory
    precision.py    what each precision costs: kernels, decode (beside llama.cpp), quality
    roofline.py     decode in each precision against this machine's read bandwidth and matmul peak
    report.py       captioned tables rendered as markdown, JSON rows
"""
from .ablation import (
                          ABLATIONS,
                          FEATURES,
                          FULL_ENGINE,
                          FULL_FIELDS,
                          KV_CACHE_DTYPES_SWEPT,
                          NAIVE_LOOP,
                          AblationRow,
                          Feature,
                          MemoryRow,
                          ablate,
                          ablate_concurrency,
                          ablate_cumulative,
                          memory_sweep,
)
from .experiments import (
                          CompareResult,
                          HFStaticResult,
                          SchedCostResult,
                          TableRow,
                          compare,
                          hf_static,
                          run_table,
                          sched_cost,
)
from .precision import (
                          DECODE_SPECS,
                          QUALITY_SPECS,
                          QUALITY_TEXT,
                          DecodeRow,
                          KernelRow,
                          QualityRow,
                          compare_logprobs,
                          decode_timings,
                          kernel_timings,
                          quality,
                          text_windows,
)
from .report import (
                          Report,
                          ablate_report,
                          compare_report,
                          decode_report,
                          hf_static_report,
                          kernels_report,
                          markdown_table,
                          memory_report,
                          quality_report,
                          render_report,
                          sched_cost_report,
                          table_report,
                          to_jsonable,
)
from .runs import (
                          GIB,
                          PHASES,
                          Cancelled,
                          RunResult,
                          StepBreakdown,
                          config_fields,
                          load_llm,
                          run_config,
                          run_workload,
                          weight_bytes,
)
from .specs import list_feature_presets, load_feature_preset, parse_assignments, parse_value, resolve_spec

__all__ = [
    "ABLATIONS", "FEATURES", "FULL_ENGINE", "FULL_FIELDS", "GIB", "KV_CACHE_DTYPES_SWEPT", "NAIVE_LOOP", "PHASES",
    "AblationRow", "Cancelled", "CompareResult", "Feature", "HFStaticResult", "KernelRow", "MemoryRow", "Report",
    "RunResult", "SchedCostResult", "StepBreakdown", "TableRow", "ablate", "ablate_concurrency", "ablate_cumulative",
    "ablate_report", "compare", "compare_report", "config_fields", "hf_static",
    "hf_static_report", "kernel_timings", "kernels_report", "list_feature_presets", "load_feature_preset",
    "load_llm", "markdown_table", "memory_report", "memory_sweep", "quality", "quality_report",
    "QUALITY_SPECS", "QUALITY_TEXT", "QualityRow", "compare_logprobs", "text_windows", "parse_assignments",
    "parse_value", "DECODE_SPECS", "DecodeRow", "decode_timings", "decode_report",
    "render_report", "resolve_spec", "run_config", "run_table", "run_workload", "sched_cost", "sched_cost_report",
    "table_report", "to_jsonable", "weight_bytes",
]
