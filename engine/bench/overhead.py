"""`python -m engine.bench serve-overhead`: what the HTTP streaming path costs, measured side by side.

Each round runs the same requests twice, each side in a fresh process: `python app.py` loaded by `bench serve`, then
`LLM.generate` over the same prompt token ids, max_tokens with ignore_eos and engine configuration. Rounds
alternate, so a machine that gets busier hurts both sides alike.

    python -m engine.bench.overhead PROMPTS.json OUT.json   # one offline side (what a round starts)
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..measure.specs import parse_assignments
from ..workloads import Workload
from . import serve as sv

ROOT = Path(__file__).resolve().parent.parent.parent
STARTUP_TIMEOUT_S = 300.0  # a loaded 2-core machine can take a minute to serve the page
WARMUP_TOKENS = 4


@dataclass
class OverheadRound:
    round: int
    http_tokens: int
    http_s: float
    http_failed: int
    offline_tokens: int
    offline_s: float

    @property
    def http_tok_s(self) -> float:
        return self.http_tokens / self.http_s

    @property
    def offline_tok_s(self) -> float:
        return self.offline_tokens / self.offline_s

    @property
    def ratio(self) -> float:
        """HTTP throughput as a share of LLM.generate's: 0.95 means the HTTP path costs 5%."""
        return self.http_tok_s / self.offline_tok_s


@dataclass
class OverheadResult:
    workload: str
    api: str
    num_requests: int
    concurrency: int
    max_tokens: int | None
    settings: dict[str, Any]
    rounds: list[OverheadRound] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [r.ratio for r in self.rounds]

    def to_json(self) -> dict[str, Any]:
        rounds = [{**asdict(r), "http_tok_s": r.http_tok_s, "offline_tok_s": r.offline_tok_s, "ratio": r.ratio}
                  for r in self.rounds]
        return {**asdict(self), "rounds": rounds, "median_ratio": statistics.median(self.ratios)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assignments(settings: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items())


def launch_app(port: int, model: str | None, settings: dict[str, Any], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "app.py"), "--set", _assignments(settings)]
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1",
           "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_until_serving(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ValueError(f"app.py exited with {proc.returncode} before serving: {_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ValueError(f"app.py did not serve {url} within {timeout_s:.0f} s: {_tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, chars: int = 1500) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def http_side(requests: list[sv.ServeRequest], args, settings: dict[str, Any], workdir: Path,
              round_no: int) -> sv.ServeResult:
    port, log = free_port(), workdir / f"app-round{round_no}.log"
    url = f"http://127.0.0.1:{port}"
    proc = launch_app(port, args.model, settings, log)
    try:
        wait_until_serving(proc, url, log)
        warm = [sv.ServeRequest(requests[0].text, WARMUP_TOKENS, True)]
        sv.run_serve(url, warm, 1, api=args.api)
        return sv.run_serve(url, requests, args.concurrency, api=args.api, workload=args.workload)
    finally:
        stop(proc)


def offline_side(prompts_file: Path, workdir: Path, round_no: int) -> dict[str, Any]:
    out, log = workdir / f"offline-round{round_no}.json", workdir / f"offline-round{round_no}.log"
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, "-m", "engine.bench.overhead", str(prompts_file), str(out)], cwd=ROOT,
                            stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise ValueError(f"the LLM.generate side failed ({rc}): {_tail(log)}")
    return json.loads(out.read_text())


def serve_overhead(workload: Workload, args, progress: Callable[[int, int, str], None] | None = None
                   ) -> OverheadResult:
    settings = parse_assignments(args.settings) if args.settings else {}
    settings.setdefault("max_num_seqs", args.concurrency)
    from ..models.loader import load_tokenizer, resolve_model
    tokenizer = load_tokenizer(resolve_model(args.tokenizer or args.model))
    requests = sv.workload_requests(workload, tokenizer, args.requests, args.max_tokens, ignore_eos=True)
    result = OverheadResult(workload.name, args.api, len(requests), args.concurrency, args.max_tokens, settings)
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp:
        workdir = Path(tmp)
        prompts_file = workdir / "prompts.json"
        prompts_file.write_text(json.dumps({"model": args.model, "api": args.api, "settings": settings,
                                            "requests": [[r.text, r.max_tokens] for r in requests]}))
        for i in range(1, args.rounds + 1):
            if progress:
                progress(2 * i - 2, 2 * args.rounds, f"round {i}: python app.py + bench serve")
            http = http_side(requests, args, settings, workdir, i)
            if progress:
                progress(2 * i - 1, 2 * args.rounds, f"round {i}: LLM.generate in a fresh process")
            offline = offline_side(prompts_file, workdir, i)
            result.rounds.append(OverheadRound(i, http.total_output_tokens, http.duration_s,
                                               http.num_requests - len(http.completed), offline["tokens"],
                                               offline["seconds"]))
        if progress:
            progress(2 * args.rounds, 2 * args.rounds, "done")
    return result


def render(result: OverheadResult) -> str:
    rows = [{"round": r.round, "HTTP tok/s": r.http_tok_s, "LLM.generate tok/s": r.offline_tok_s,
             "HTTP / generate": r.ratio, "HTTP failed": r.http_failed, "tokens (HTTP, generate)":
             f"{r.http_tokens}, {r.offline_tokens}", "seconds (HTTP, generate)": f"{r.http_s:.1f}, {r.offline_s:.1f}"}
            for r in result.rounds]
    from ..measure.report import markdown_table
    ratios = result.ratios
    median = statistics.median(ratios)
    lines = [f"## HTTP streaming path vs LLM.generate: workload {result.workload!r}, {result.num_requests} requests, "
             f"{result.concurrency} in flight, max_tokens {result.max_tokens or 'as the workload'} with ignore_eos, "
             f"/v1/{'chat/completions' if result.api == 'chat' else 'completions'}, config "
             f"{_assignments(result.settings)}", "", markdown_table(rows), "",
             f"HTTP / generate: median {median:.3f} (overhead {100 * (1 - median):.1f}%), "
             f"spread {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds; "
             f"failed HTTP requests: {sum(r.http_failed for r in result.rounds)}"]
    return "\n".join(lines)


def offline_main(prompts_file: str, out_file: str) -> None:
    """One LLM.generate run in this (fresh) process, over the prompts exactly as the server tokenizes them."""
    from ..llm import LLM, chat_token_ids
    from ..sampling_params import SamplingParams
    spec = json.loads(Path(prompts_file).read_text())
    llm = LLM(spec["model"], **spec["settings"])
    tok = llm.tokenizer
    ids = [chat_token_ids(tok, [{"role": "user", "content": text}]) if spec["api"] == "chat"
           else tok(text).input_ids for text, _ in spec["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in spec["requests"]]
    llm.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(ids, params)
    seconds = time.perf_counter() - start
    Path(out_file).write_text(json.dumps({"tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds}))


if __name__ == "__main__":
    offline_main(sys.argv[1], sys.argv[2])
