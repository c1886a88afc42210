"""Measuring the engine, as a library: what the playground and `python -m engine.bench` both call (docs/engine.md
lists its modules). Each experiment returns dataclasses a UI can use; only the CLI prints."""
from .ablation import (
                          ABLATIONS,
                          FEATURES,
                          FULL_ENGINE,
                          FULL_FIELDS,
                          KV_CACHE_DTYPES_SWEPT,
                          NAIVE_LOOP,
                          AblationRow,
                          MemoryRow,
                          ablate,
                          ablate_concurrency,
                          ablate_cumulative,
                          memory_sweep,
)
from .experiments import (
                          CompareResult,
                          compare,
                          hf_static,
                          run_table,
)
from .precision import (
                          QUALITY_SPECS,
                          QUALITY_TEXT,
                          QualityRow,
                          compare_logprobs,
                          quality,
                          text_windows,
)
from .report import (
                          Report,
                          ablate_report,
                          compare_report,
                          hf_static_report,
                          markdown_table,
                          memory_report,
                          quality_report,
                          render_report,
                          table_report,
                          to_jsonable,
)
from .runs import (
                          GIB,
                          PHASES,
                          Cancelled,
                          config_fields,
                          load_llm,
                          run_config,
                          weight_bytes,
)
from .specs import list_feature_presets, load_feature_preset, parse_assignments, parse_value, resolve_spec

__all__ = [
    "ABLATIONS", "FEATURES", "FULL_ENGINE", "FULL_FIELDS", "GIB", "KV_CACHE_DTYPES_SWEPT", "NAIVE_LOOP", "PHASES",
    "AblationRow", "Cancelled", "CompareResult", "MemoryRow", "Report", "ablate", "ablate_concurrency",
    "ablate_cumulative", "ablate_report", "compare", "compare_report", "config_fields", "hf_static", "hf_static_report",
    "list_feature_presets", "load_feature_preset", "load_llm", "markdown_table", "memory_report", "memory_sweep",
    "quality", "quality_report", "QUALITY_SPECS", "QUALITY_TEXT", "QualityRow", "compare_logprobs", "text_windows",
    "parse_assignments", "parse_value", "render_report", "resolve_spec", "run_config", "run_table",
    "table_report", "to_jsonable", "weight_bytes",
]
