"""The weights' precision changed from the Engine settings form: the model is rebuilt through Playground.restart,
what runs afterwards is what LLM(...) with that precision runs, and a refused change leaves everything as it was."""
from __future__ import annotations

import queue
import threading

import pytest

from engine import LLM, SamplingParams
from engine.config import FEATURE_SWITCHES
from engine.quant.linear import Int4Linear, Int8Linear, Linear
from playground import Playground
from playground.settings import LM_HEAD_WORDS, NO_QUANTIZATION, REBUILD_STAGES, form_value

PROMPTS = [[1000 + 7 * i + j for j in range(12 + 3 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_models) -> str:
    return tiny_models["llama"][0]


@pytest.fixture(scope="module")
def pg(folder, tmp_path_factory):
    playground = Playground(LLM(folder, max_model_len=512), store=tmp_path_factory.mktemp("store") / "ablation.json")
    yield playground
    playground.service.shutdown()


def served(pg: Playground) -> list[list[int]]:
    """Greedy token ids of PROMPTS through the page's live engine."""
    outs = []
    for prompt in PROMPTS:
        *_, last = pg.service.stream(prompt, GREEDY)
        assert last.error is None, last.error
        outs.append(list(last.token_ids))
    return outs


def direct(folder: str, **fields) -> list[list[int]]:
    """The same prompts through an LLM built directly with these fields, on the same checkpoint."""
    return [list(o.token_ids) for o in LLM(folder, max_model_len=512, **fields).generate(PROMPTS, GREEDY)]


def projection(pg: Playground):
    return pg.llm.engine.model.layers[0].qkv


def rebuilt(pg, **change) -> str:
    """Apply a weights change through the page's handler; the precision the new engine runs (a rebuild replaces
    the service: asserted)."""
    before = pg.service
    pg.apply_settings(None, **change)
    assert pg.service is not before, "no rebuild"
    return pg.service.snapshot().precision


def test_int8_from_the_form_rebuilds_the_model_and_back(pg, folder):
    fp32 = served(pg)
    assert fp32 == direct(folder)
    assert isinstance(projection(pg), Linear) and pg.settings()["quantization"] is None
    form = pg.settings()
    stages = []
    service = pg.service
    pg.apply_settings(form, lambda f, d: stages.append((f, d)), **{**form, "quantization": NO_QUANTIZATION,
                                                                   "max_num_seqs": 8})
    # "none" is what runs: no weight change, no rebuild, the rest applied live
    assert pg.service is service and pg.service.config_changes[-1].changes == {"max_num_seqs": 8}
    pg.apply_settings(form, lambda f, d: stages.append((f, d)), **{**pg.settings(), "quantization": "int8"})
    assert pg.service is not service  # rebuilt: a new engine over the int8 weights (checked below)
    # the bar went through each stage, and the status line said what was happening
    assert [f for f, _ in stages] == [i / len(REBUILD_STAGES) for i in range(len(REBUILD_STAGES))]
    assert all(d.startswith("rebuilding the engine for float32, int8 weights: ") for _, d in stages)
    assert "loading and quantizing the weights" in stages[0][1] and "warming up" in stages[-1][1]
    assert isinstance(projection(pg), Int8Linear) and pg.llm.engine.model.weight_format.quantization == "int8"
    assert pg.settings()["quantization"] == "int8" and pg.settings()["max_num_seqs"] == 8  # the other change kept
    # what the page shows: the snapshot's precision, on every tab's status line and in the form's note
    assert pg.service.snapshot().precision == "float32, int8 weights"
    assert "float32, int8 weights" in pg.status() and "**Weights: float32, int8 weights.**" in pg.weights_note()
    int8 = served(pg)
    assert int8 == direct(folder, quantization="int8")
    history, stats = list(pg.chat("Hello there", [], 0.0, 6))[-1]
    assert history[-1]["role"] == "assistant" and "finished" in stats

    assert rebuilt(pg, quantization=NO_QUANTIZATION) == "float32"  # back: fp32, token for token the original's
    assert isinstance(projection(pg), Linear) and served(pg) == fp32

    # bf16 and back to fp32: the LLM hands out the fp32 weights again, not the bf16 model the engine ran
    assert rebuilt(pg, dtype="bfloat16") == "bfloat16" and str(projection(pg).dtype) == "torch.bfloat16"
    assert rebuilt(pg, dtype="float32") == "float32"
    assert served(pg) == fp32
    assert "Applied" in pg.apply_settings(None, max_num_seqs=64)


def test_the_lm_head_takes_its_own_scheme_from_the_form(pg, folder):
    """The form's LM head field: a scheme of the head's own (int8 beside int4 projections, as the int4 preset has it)
    rebuilds the model with it; the form's words for True and False, and an API caller's "false", mean the bools."""
    precision = rebuilt(pg, quantization="int4", quantize_lm_head="int8")
    assert precision == "float32, int4 weights (groups of 32), the LM head int8"
    model = pg.llm.engine.model
    assert isinstance(model.lm_head, Int8Linear) and isinstance(projection(pg), Int4Linear)
    assert served(pg) == direct(folder, quantization="int4", quantize_lm_head="int8")
    assert form_value("quantize_lm_head", pg.settings()["quantize_lm_head"]) == "int8"
    assert rebuilt(pg, quantize_lm_head=LM_HEAD_WORDS[True]) == "float32, int4 weights (groups of 32)"
    assert isinstance(pg.llm.engine.model.lm_head, Int4Linear)
    assert form_value("quantize_lm_head", pg.settings()["quantize_lm_head"]) == LM_HEAD_WORDS[True]
    assert rebuilt(pg, quantize_lm_head="false") == "float32, int4 weights (groups of 32) but the LM head"
    assert isinstance(pg.llm.engine.model.lm_head, Linear)
    pg.reset_settings()
    assert pg.service.snapshot().precision == "float32"


def test_a_refused_weight_change_keeps_the_engine_its_weights_and_its_requests(pg):
    assert pg.apply_settings(None, quantization="int8").startswith("Rebuilt")
    service, model = pg.service, pg.llm.engine.model
    pg.pause()
    try:
        rid, q = service.submit(PROMPTS[0], GREEDY)  # in flight through every refusal below
        pg.step()
        for fields, why in [
            ({"quantization_group_size": 7}, "quantization_group_size must be one of (32, 64, 128, 256)"),
            ({"quantization": "int3"}, "quantization must be None or one of"),
            ({"quantize_lm_head": "int3"}, "quantize_lm_head must be True (as the projections), False"),
            ({"quantize_lm_head": ["int8"]}, "quantize_lm_head must be True"),
            ({"quantization": "int4", "quantization_group_size": 128},  # the tiny model's layers are 64 wide
             "quantization_group_size=128 does not divide its 64 input features"),
        ]:
            msg = pg.apply_settings(None, **fields)
            assert msg.startswith("⚠️ Not applied: the engine keeps its weights (float32, int8 weights) and its "
                                  "requests: ") and why in msg, msg
            assert pg.service is service and service.alive and pg.llm.engine.model is model
            assert service.is_streaming(rid) and pg.settings()["quantization"] == "int8"
        # a field that changes no weights is said, not rebuilt
        msg = pg.apply_settings(None, quantization_group_size=64)
        assert msg.startswith("Not applied: quantization_group_size=64 leaves the weights as they are"), msg
        assert pg.service is service and pg.settings()["quantization_group_size"] == 32
    finally:
        pg.resume()
    while not (out := q.get(timeout=60)).finished:
        pass
    assert out.error is None and len(out.token_ids) == GREEDY.max_tokens


def test_requests_open_at_a_rebuild_are_ended_with_a_message_and_chats_sent_meanwhile_wait(pg, monkeypatch):
    pg.pause()
    rid, q = pg.service.submit(PROMPTS[1], GREEDY)
    pg.step()
    loading, release = threading.Event(), threading.Event()
    load = pg.llm.weights_for

    def slow_weights_for(config):
        loading.set()
        assert release.wait(60)
        return load(config)
    monkeypatch.setattr(pg.llm, "weights_for", slow_weights_for)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("msg", pg.apply_settings(
        None, quantization="int4")))
    worker.start()
    assert loading.wait(60)
    assert "⟳ rebuilding the engine for float32, int4 weights (groups of 32): 1/3 loading" in pg.status()
    chat = pg.chat("Hello", [], 0.0, 4)
    history, stats = next(chat)  # said at once, and the chat waits for the new engine
    assert history[-1]["content"].startswith("⏳ queued: rebuilding the engine for") and stats == "queued"
    release.set()
    history, stats = list(chat)[-1]
    assert "finished" in stats and not history[-1]["content"].startswith("⚠️")
    worker.join(60)
    assert pg.service.snapshot().precision == "float32, int4 weights (groups of 32)"
    assert "their chats say so: send them again" in result["msg"]  # the presenter is told what the rebuild ended
    assert isinstance(projection(pg), Int4Linear) and not pg.service.paused  # a new engine, not paused
    while not (out := q.get(timeout=10)).finished:  # the step's output, then the end
        pass
    assert out.error and "the engine was rebuilt (float32, int4 weights (groups of 32))" in out.error
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert not pg.service.is_streaming(rid)
    pg.reset_settings()
    assert pg.service.snapshot().precision == "float32" and isinstance(projection(pg), Linear)


@pytest.mark.slow
def test_the_settings_api_shows_and_changes_the_weights(folder):
    from gradio_client import Client

    from tests.conftest import serve_app
    with serve_app(LLM(folder, max_model_len=512)) as (url, playground):
        client = Client(url, verbose=False)
        *form, note, weights_note = client.predict(api_name="/settings")
        form = [f["value"] if isinstance(f, dict) else f for f in form]  # each field with whether it may be edited
        # the form's fields in order: the switches, the six sizes and the keys' smoothing, then the weights
        # (quantization, group size, LM head, dtype, and any weight switch EngineConfig has beyond them)
        w = len(FEATURE_SWITCHES) + 7

        def fields(*weights):
            return [*form[:w], *weights, *form[w + len(weights):]]
        head = LM_HEAD_WORDS[True]
        assert form[w:w + 4] == [NO_QUANTIZATION, 32, head, "float32"]
        assert "**Weights: float32.**" in weights_note and "rebuilds the model" in weights_note
        msg = client.predict(*fields("int8", 32, head, "float32"), api_name="/apply_settings")
        assert msg.startswith("Rebuilt the engine for float32, int8 weights"), msg
        assert isinstance(projection(playground), Int8Linear)
        assert [f["value"] for f in client.predict(api_name="/settings")[w:w + 4]] == ["int8", 32, head, "float32"]
        with pytest.raises(Exception, match="yes"):  # the LM head's field takes its words or a scheme, nothing else
            client.predict(*fields("int8", 32, "yes", "float32"), api_name="/apply_settings")
        status, *_ = client.predict(api_name="/dashboard")
        assert "float32, int8 weights" in status
        with pytest.raises(Exception, match="int3"):  # not one of the dropdown's choices: refused before the engine
            client.predict(*fields("int3", 32, head, "float32"), api_name="/apply_settings")
        assert isinstance(projection(playground), Int8Linear) and playground.service.alive
