"""Benchmarks as a library: presets and specs, running workloads, experiments, the HF baseline, reports.

    specs.py        feature presets and "key=value" flags -> EngineConfig fields
    runs.py         weights loaded once, an engine per configuration, a workload run -> RunResult
    hf.py           transformers' generate over the same weights
    experiments.py  table, compare, hf-static, sched-cost, ablate: each returns dataclasses
    report.py       captioned tables rendered as markdown, JSON rows
    cli.py          `python -m engine.bench ...`: the only module that prints

The playground imports the experiments from here; only `python -m engine.bench` uses cli.py.
"""
from .experiments import (
                          ABLATIONS,
                          FULL_ENGINE,
                          AblationRow,
                          CompareResult,
                          HFStaticResult,
                          SchedCostResult,
                          TableRow,
                          ablate,
                          compare,
                          hf_static,
                          run_table,
                          sched_cost,
)
from .report import (
                          Report,
                          ablate_report,
                          compare_report,
                          hf_static_report,
                          markdown_table,
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
                          build_engine,
                          config_fields,
                          engine_config,
                          load_llm,
                          run_config,
                          run_workload,
                          weight_bytes,
)
from .specs import list_feature_presets, load_feature_preset, parse_assignments, parse_value, resolve_spec

__all__ = [
    "ABLATIONS", "FULL_ENGINE", "GIB", "PHASES", "AblationRow", "Cancelled", "CompareResult", "HFStaticResult",
    "Report", "RunResult", "SchedCostResult", "StepBreakdown", "TableRow", "ablate", "ablate_report", "build_engine",
    "compare", "compare_report", "config_fields", "engine_config", "hf_static", "hf_static_report",
    "list_feature_presets", "load_feature_preset", "load_llm", "markdown_table", "parse_assignments",
    "parse_value", "render_report", "resolve_spec", "run_config", "run_table", "run_workload", "sched_cost",
    "sched_cost_report", "table_report", "to_jsonable", "weight_bytes",
]
