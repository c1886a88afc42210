"""Seeded, reproducible workloads read from presets/workloads/*.toml: groups, each of `count` requests whose prompt
and output lengths are drawn from inclusive ranges, optionally after a prefix the group shares (a system prompt),
from ordinary vocabulary ids so lengths are exact in tokens; or real user messages (`texts`, through the chat
template), for behaviour that needs meaning. A group's `arrival_s` delays it.
"""
from __future__ import annotations

import dataclasses
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .sampling_params import SamplingParams
from .utils import TOKEN_RANGE, chat_token_ids

WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "presets" / "workloads"


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]  # empty for a text request until the workload is tokenized
    params: SamplingParams
    arrival_s: float  # offset from the workload's start
    group: str
    text: str | None = None  # a user message, tokenized with the model's chat template


@dataclass
class Workload:
    name: str
    description: str
    requests: list[WorkloadRequest]
    config: dict  # EngineConfig fields the workload is meant to run with (e.g. a small pool)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.params.max_tokens for r in self.requests)

    def tokenized(self, tokenizer) -> Workload:
        """The same workload with every text request turned into token ids (the model's chat template)."""
        ids = {t: chat_token_ids(tokenizer, [{"role": "user", "content": t}]) for t in {r.text for r in self.requests}
               if t is not None}
        requests = [r if r.text is None else dataclasses.replace(r, prompt_token_ids=ids[r.text])
                    for r in self.requests]
        return dataclasses.replace(self, requests=requests)


def list_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))


def _span(value, what: str) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not 1 <= lo <= hi:
        raise ValueError(f"{what} must be a positive integer or [low, high], got {value!r}")
    return lo, hi


def build_workload(spec: dict) -> Workload:
    rng = random.Random(spec.get("seed", 0))
    requests: list[WorkloadRequest] = []
    arrival = spec.get("arrival", "burst")
    rate = float(spec.get("rate", 0) or 0)
    for group in spec["groups"]:
        texts = list(group.get("texts", []))
        prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(group.get("shared_prefix_tokens", 0))]
        plo, phi = _span(group["prompt_tokens"], "prompt_tokens") if not texts else (0, 0)
        olo, ohi = _span(group["output_tokens"], "output_tokens")
        for i in range(group.get("count", len(texts) or 1)):
            own = [rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(plo, phi))]
            params = SamplingParams(temperature=group.get("temperature", 0.0), max_tokens=rng.randint(olo, ohi),
                                    ignore_eos=group.get("ignore_eos", not texts), seed=rng.randrange(2**31))
            requests.append(WorkloadRequest(prefix + own, params, float(group.get("arrival_s", 0.0)),
                                            group.get("name", "requests"), texts[i % len(texts)] if texts else None))
    if spec.get("shuffle", False):
        rng.shuffle(requests)
    if arrival == "poisson" and rate > 0:
        t = 0.0
        for r in requests:
            t += rng.expovariate(rate)
            r.arrival_s += t
    elif arrival != "burst":
        raise ValueError(f"arrival must be 'burst' or 'poisson' (with rate > 0), got {arrival!r}")
    return Workload(spec.get("name", "workload"), spec.get("description", ""), requests, dict(spec.get("config", {})))


def load_workload(name_or_path: str, quick: bool = False) -> Workload:
    """By preset name (presets/workloads/NAME.toml) or path. quick: a quarter of each group, for a fast look."""
    path = Path(name_or_path)
    if not path.is_file():
        path = WORKLOAD_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(f"unknown workload {name_or_path!r}; presets: {', '.join(list_workloads())}")
    with open(path, "rb") as f:
        spec = tomllib.load(f)
    spec.setdefault("name", path.stem)
    if quick:
        for group in spec["groups"]:
            group["count"] = max(1, group.get("count", 1) // 4)
    return build_workload(spec)
