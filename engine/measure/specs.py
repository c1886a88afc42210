"""Configuration specs: a feature preset name (presets/features/NAME.toml) or flags such as "prefix_caching=false"."""
from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import EngineConfig

FEATURE_DIR = Path(__file__).resolve().parent.parent.parent / "presets" / "features"


def parse_value(text: str) -> bool | int | float | str | None:
    """'true'/'false' -> bool, 'none'/'null' -> None, then int, then float, else the string itself."""
    value = text.strip()
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def check_fields(fields: dict[str, Any], source: str) -> None:
    unknown = sorted(set(fields) - set(EngineConfig.field_names()))
    if unknown:
        raise ValueError(f"{source}: unknown config field(s) {', '.join(unknown)}; "
                         f"known fields: {', '.join(EngineConfig.field_names())}")


def parse_assignments(text: str | Sequence[str]) -> dict[str, Any]:
    """'a=1,b=false' (or a list of such strings) -> {'a': 1, 'b': False}; keys must be EngineConfig fields."""
    parts = [text] if isinstance(text, str) else list(text)
    fields: dict[str, Any] = {}
    for item in (p.strip() for part in parts for p in part.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        fields[key.strip()] = parse_value(value)
    check_fields(fields, f"flags {', '.join(parts)!r}")
    return fields


def list_feature_presets() -> list[str]:
    return sorted(p.stem for p in FEATURE_DIR.glob("*.toml"))


def load_feature_preset(name: str) -> dict[str, Any]:
    path = FEATURE_DIR / f"{name}.toml"
    if not name or not path.is_file():
        raise ValueError(f"unknown feature preset {name!r}; presets: {', '.join(list_feature_presets())} "
                         f"(or give flags such as 'prefix_caching=false,max_num_seqs=8')")
    with open(path, "rb") as f:
        fields = tomllib.load(f)
    check_fields(fields, f"feature preset {name!r} ({path})")
    return fields


def resolve_spec(spec: str) -> dict[str, Any]:
    """A preset name or comma-separated key=value flags -> EngineConfig fields."""
    spec = spec.strip()
    return parse_assignments(spec) if "=" in spec else load_feature_preset(spec)
