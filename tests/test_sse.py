"""Server-sent events written and read in one place (engine/sse.py): line ends are CR, LF and CRLF only, so a chunk
holding U+2028, U+2029 or U+0085 stays whole; the writer escapes them for readers that split as str.splitlines."""
from __future__ import annotations

import asyncio
import json

import httpx

from engine import sse
from engine.bench.serve import stream_request

ODD = "a\u2028b\u2029c\x85d"  # what a sampled reply can hold; str.splitlines cuts at each


def test_an_event_escapes_the_characters_splitlines_takes_for_line_ends():
    chunk = {"choices": [{"text": ODD + " é 日本"}]}
    text = sse.event(chunk)
    assert text.startswith("data: ") and text.endswith("\n\n")
    assert text.splitlines() == [text[:-2], ""]  # one line and the blank, even split as splitlines does
    assert json.loads(text[6:]) == chunk  # the same JSON
    assert "é 日本" in text  # other non-ASCII stays as it is
    assert sse.event("[DONE]") == "data: [DONE]\n\n"


def test_lines_split_at_cr_lf_and_crlf_alone_wherever_the_pieces_break():
    stream = f"data: {{\"t\": \"{ODD}\"}}\r\n\r\ndata: x\n\ndata: y\r\rdata: z\n: ping\r\n\r\n"
    want = [f"data: {{\"t\": \"{ODD}\"}}", "", "data: x", "", "data: y", "", "data: z", ": ping", ""]
    assert list(sse.lines([stream])) == want
    for cut in range(1, len(stream)):  # a CRLF split between pieces is still one line end
        assert list(sse.lines([stream[:cut], stream[cut:]])) == want, cut
    assert list(sse.lines(list(stream))) == want  # one character a piece

    async def collect():
        async def pieces():
            for ch in stream:
                yield ch
        return [line async for line in sse.alines(pieces())]
    assert asyncio.run(collect()) == want
    assert list(sse.lines(["last line, no end"])) == ["last line, no end"]


def test_bench_serve_reads_a_chunk_holding_raw_line_separators():
    """vLLM streams U+2028 raw; httpx's aiter_lines cut such a chunk and `bench serve` called it 'not JSON', which
    stopped a whole `bench versus` cell."""
    raw = "".join("data: " + json.dumps(b, ensure_ascii=False) + "\n\n" for b in (
        {"choices": [{"text": ODD}]}, {"choices": [{"text": "!", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=raw.encode()))

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await stream_request(client, "/v1/completions", {}, chat=False, run_start=0.0)
    rec = asyncio.run(go())
    assert rec.ok and rec.error is None and rec.text == ODD + "!" and rec.output_tokens == 2
