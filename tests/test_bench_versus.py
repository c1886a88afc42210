"""`bench versus`: two servers driven alternately with the same fresh prompts, checked from the servers' own
counters (what each was sent), not from the bench's report of itself."""
from __future__ import annotations

import json

import pytest

from engine import LLM
from tests.conftest import serve_app

pytestmark = pytest.mark.served  # the app on a local port: `make test` runs it beside the rest

httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("gradio")


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(httpx.get(url.rstrip("/") + "/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def two_servers(tiny_models, tmp_path_factory):
    folder = tiny_models["llama"][0]
    with serve_app(LLM(folder, max_model_len=256, max_num_seqs=4), tmp_path_factory.mktemp("a") / "s.json",
                   "tiny-a") as (a, _), \
         serve_app(LLM(folder, max_model_len=256, max_num_seqs=4), tmp_path_factory.mktemp("b") / "s.json",
                   "tiny-b") as (b, _):
        yield a.rstrip("/"), b.rstrip("/"), folder


@pytest.mark.slow
def test_versus_sends_both_servers_the_same_fresh_prompts_and_tabulates_ratios(two_servers, capsys, tmp_path,
                                                                               monkeypatch):
    from engine.bench import versus
    from engine.bench.cli import main
    a, b, folder = two_servers
    before = {url: counters(url) for url in (a, b)}
    out_json = tmp_path / "versus.json"
    pauses = []
    monkeypatch.setattr(versus.time, "sleep", pauses.append)
    rc = main(["versus", "--server", f"one={a}", "--server", f"two={b}", "--concurrency", "1,2",
               "--temperature", "0,1", "--rounds", "2", "--requests", "3", "--prompt-len", "12",
               "--output-len", "5", "--tokenizer", folder, "--tag", "fp32", "--json", str(out_json),
               "--settle", "0.5"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert pauses == [0.5] * 16  # quiet before each of the 2 x 2 x 2 rounds' two runs
    after = {url: counters(url) for url in (a, b)}
    sent = {url: {k: after[url][k] - before[url].get(k, 0.0)
                  for k in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")} for url in (a, b)}
    # 2 concurrencies x 2 temperatures x 2 rounds x 3 requests x 5 tokens, plus one 4-token warm-up each
    assert sent[a]["vllm:generation_tokens_total"] == sent[b]["vllm:generation_tokens_total"] == 24 * 5 + 4
    assert sent[a]["vllm:prompt_tokens_total"] == sent[b]["vllm:prompt_tokens_total"] > 24 * 10  # the same prompts
    data = json.loads(out_json.read_text())
    assert [(c["concurrency"], c["temperature"]) for c in data["cells"]] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
    prompts = [r["one"]["total_input_tokens"] for c in data["cells"] for r in c["rounds"]]
    assert prompts == [r["two"]["total_input_tokens"] for c in data["cells"] for r in c["rounds"]]
    assert len(set(prompts)) > 1  # fresh per round: not one prompt set replayed (a prefix-cache hit otherwise)
    assert f"--seed {data['seed']}" in captured.out  # a seed of its own each run, said so it can be replayed
    table = captured.out
    assert "one / two (fp32)" in table and "| 2 | temperature 1 |" in table
    rows = [line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 4 and all(line.count("x") >= 5 for line in rows)
    for c in data["cells"]:
        for r in c["rounds"]:
            assert r["one"]["completed"] == r["two"]["completed"] == 3


def test_versus_refuses_what_it_cannot_compare(two_servers, capsys):
    from engine.bench.cli import main
    a, b, folder = two_servers
    assert main(["versus", "--server", f"one={a}", "--tokenizer", folder]) == 2
    assert "two servers" in capsys.readouterr().err
    assert main(["versus", "--server", f"one={a}", "--server", f"one={b}", "--tokenizer", folder]) == 2
    assert "different labels" in capsys.readouterr().err
    assert main(["versus", "--server", a, "--server", f"two={b}", "--tokenizer", folder]) == 2
    assert "LABEL=URL" in capsys.readouterr().err
    assert main(["versus", "--server", f"one={a}", "--server", f"two={b}", "--tokenizer", folder,
                 "--settle", "61"]) == 2
    assert "--settle must be 0-60 seconds" in capsys.readouterr().err
