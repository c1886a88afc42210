"""engine/output.py: each new token's text (incremental detokenization, the same as decoding the whole output) and
the reason a request ends there (stop tokens, EOS unless ignored, stop strings cut from the text, the length limit),
driven directly with token ids whose text is known, and through an engine, which must let go of every request's
state once it finishes or is aborted."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.measure.runs import random_prompts
from engine.output import OutputProcessor
from engine.request import Request

UNICODE = "Grüße, 日本語 🙂 naïve café"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], num_kv_blocks=32, max_model_len=128)


@pytest.fixture()
def tok(llm):
    return llm.tokenizer


def feed(proc: OutputProcessor, ids: list[int], params: SamplingParams, max_model_len: int = 1000,
         prompt: list[int] = PROMPT) -> tuple[list[str], list[str | None], Request]:
    """ids appended one by one, as the engine does: the text after each and each one's finish reason, up to and
    including the first that ends the request."""
    req = Request("r", prompt, params)
    proc.add(req.request_id)
    texts, reasons = [], []
    for token in ids:
        req.token_ids.append(token)
        reasons.append(proc.process(req, token, max_model_len))
        texts.append(proc.text(req.request_id))
        if reasons[-1]:
            break
    return texts, reasons, req


def test_incremental_text_is_the_whole_decode_and_never_half_a_character(tok):
    ids = tok(UNICODE).input_ids
    # the case is a real one: some prefixes of these ids end inside a character's bytes
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    proc = OutputProcessor(tok, {tok.eos_token_id})
    texts, reasons, _ = feed(proc, ids, SamplingParams(max_tokens=100))
    assert reasons == [None] * len(ids)
    assert texts[-1] == tok.decode(ids, skip_special_tokens=True) == UNICODE
    for i, text in enumerate(texts):  # each text a prefix of the whole, held back only while a character is cut
        assert "\ufffd" not in text and UNICODE.startswith(text)
        if not tok.decode(ids[:i + 1]).endswith("\ufffd"):
            assert text == tok.decode(ids[:i + 1], skip_special_tokens=True)


def test_special_tokens_are_left_out_of_the_text(tok):
    ids = tok(UNICODE).input_ids
    ids = ids[:4] + [tok.eos_token_id] + ids[4:]
    texts, reasons, _ = feed(OutputProcessor(tok, {tok.eos_token_id}), ids,
                             SamplingParams(max_tokens=100, ignore_eos=True))
    assert reasons == [None] * len(ids) and texts[-1] == tok.decode(ids, skip_special_tokens=True) == UNICODE


def test_a_stop_string_cuts_the_text_at_the_earliest_hit(tok):
    text = "One two three. Then END comes, and after it STOP, then more words follow here."
    ids = tok(text).input_ids
    proc = OutputProcessor(tok, {tok.eos_token_id})
    texts, reasons, req = feed(proc, ids, SamplingParams(max_tokens=100, stop=["STOP", "END"]))
    # it ends at the token that completes "END" (listed second but first in the text), with the text cut before it
    end = next(i for i in range(len(ids)) if "END" in tok.decode(ids[:i + 1]))
    assert len(reasons) == end + 1 and reasons[-1] == "stop" and reasons[:-1] == [None] * end
    assert texts[-1] == text[:text.index("END")] == "One two three. Then "
    assert req.output_token_ids == ids[:end + 1]
    # a stop string made of several tokens' text, found though it started before the last token
    spanning = "three. Then"
    assert not any(spanning in tok.decode([t]) for t in ids)
    texts, reasons, _ = feed(OutputProcessor(tok, set()), ids,
                             SamplingParams(max_tokens=100, stop=[spanning]))
    assert reasons[-1] == "stop" and texts[-1] == "One two "


def test_stop_token_ids_and_eos(tok):
    ids = tok(UNICODE).input_ids
    eos = ids[6]
    proc = OutputProcessor(tok, {eos})
    _, reasons, req = feed(proc, ids, SamplingParams(max_tokens=100, stop_token_ids=[ids[3]]))
    assert reasons == [None] * 3 + ["stop"] and req.output_token_ids == ids[:4]
    _, reasons, _ = feed(proc, ids, SamplingParams(max_tokens=100))  # EOS ends it
    assert reasons == [None] * 6 + ["stop"]
    texts, reasons, _ = feed(proc, ids, SamplingParams(max_tokens=100, ignore_eos=True))  # not when ignored
    assert reasons == [None] * len(ids) and texts[-1] == UNICODE
    _, reasons, _ = feed(proc, ids, SamplingParams(max_tokens=100, ignore_eos=True, stop_token_ids=[eos]))
    assert reasons == [None] * 6 + ["stop"]  # a stop token id stops whatever ignore_eos says


def test_the_length_limit(tok):
    ids = tok(UNICODE).input_ids
    proc = OutputProcessor(tok, set())
    texts, reasons, _ = feed(proc, ids, SamplingParams(max_tokens=5))
    assert reasons == [None] * 4 + ["length"] and texts[-1] == "Grüße,"
    # max_model_len counts the prompt too: 3 prompt tokens + 4 generated reach 7
    _, reasons, _ = feed(proc, ids, SamplingParams(max_tokens=100), max_model_len=7)
    assert reasons == [None] * 3 + ["length"]
    # a stop token on the last allowed token is a stop, not a length
    _, reasons, _ = feed(proc, ids, SamplingParams(max_tokens=5, stop_token_ids=[ids[4]]))
    assert reasons[-1] == "stop"


def run_all(engine) -> dict:
    out = {}
    while engine.has_unfinished():
        out.update((o.request_id, o) for o in engine.step() if o.finished)
    return out


def test_engine_texts_and_stop_strings(llm):
    engine = llm.build_engine({})
    tok = llm.tokenizer
    prompts = random_prompts(3, 12, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in prompts]
    free = run_all(engine)
    for rid in ids:
        o = free[rid]
        whole = tok.decode(o.token_ids, skip_special_tokens=True)
        assert o.finish_reason == "length" and len(o.token_ids) == 20
        assert o.text == whole if not whole.endswith("\ufffd") else whole.startswith(o.text)
    # each again with a stop string taken from the middle of its text: the same tokens up to it, the text cut there
    for p, rid in zip(prompts, ids, strict=True):
        text = free[rid].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        (o,) = run_all_one(engine, p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
        assert o.finish_reason == "stop" and o.text == text[:text.index(stop)]
        assert free[rid].token_ids[:len(o.token_ids)] == o.token_ids
    assert len(engine.output) == 0


def run_all_one(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    return [run_all(engine)[rid]]


def test_no_state_is_left_after_many_requests_and_aborts(llm):
    engine = llm.build_engine({})
    prompts = random_prompts(24, 10, seed=3)
    rids = []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=4 + i % 5, ignore_eos=i % 2 == 0,
                                stop=["e"] if i % 3 == 0 else [])
        rids.append(engine.add_request(p, params))
    assert len(engine.output) == len(prompts)
    for rid in rids[::4]:  # before any step
        assert engine.abort(rid)
    done = {o.request_id: o for _ in range(2) for o in engine.step() if o.finished}
    for rid in rids[1::4]:  # mid-way (or already finished)
        engine.abort(rid)
    done.update(run_all(engine))
    assert len(engine.output) == 0 and not engine.requests
    assert {done[r].finish_reason for r in rids[::4]} == {"abort"}
    assert {o.finish_reason for o in done.values()} >= {"abort", "length"}
    # a second round on the same engine: still nothing left over
    for p in prompts[:6]:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=3))
    engine.abort(engine.add_request(prompts[0], SamplingParams(max_tokens=3)))
    run_all(engine)
    assert len(engine.output) == 0 and not engine.requests
