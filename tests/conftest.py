"""Shared fixtures: the embedded default model (loaded once) and tiny random models built from configs."""
from __future__ import annotations

import contextlib
import os
import time
import weakref

import pytest
import torch

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download from a model hub
# tools/run_tests.py gives each of its two lanes one thread, so that neither stalls on a core the other holds
torch.set_num_threads(int(os.environ.get("WATCHLLM_TEST_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))

TINY_ARCHS = ("llama", "qwen3", "qwen2")


def kernels_line() -> str:
    """Which of the engine's C++ CPU kernels the run uses (`python -m engine.cpu_kernels status`)."""
    try:
        from engine import cpu_kernels
        return cpu_kernels.status()
    except Exception as exc:  # the line never stops a run; the tests that need the kernels say what is wrong
        return f"C++ CPU kernels: unknown ({type(exc).__name__}: {exc})"


# `make test` (tools/run_tests.py) runs two pytest lanes side by side: the second takes the tests marked `served`
# (they mostly wait on a page or a stream) and these files' quick tests, whose arithmetic evens out the two lanes'
# times (one thread each, on a 2-core Xeon: `make test-fast`'s lanes took 108 s and 48 s with `served` alone, 82 s
# and 72 s with these; the files' slow tests, the real model's quality among them, stay in the first lane, which the
# browsers' ~280 s leave shorter in a full run)
SECOND_LANE_FILES = {"test_quant.py", "test_bench.py", "test_sampler.py"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks
def pytest_collection_modifyitems(items):
    for item in items:
        quick = item.path.name in SECOND_LANE_FILES and not item.get_closest_marker("slow")
        if item.get_closest_marker("served") or quick:
            item.add_marker(pytest.mark.lane2)


def pytest_report_header(config):
    return kernels_line()


def pytest_terminal_summary(terminalreporter):
    """The same line at the end, where `pytest -q` (make test) shows it: the header is hidden under -q."""
    if terminalreporter.config.get_verbosity() < 0:
        terminalreporter.write_line(kernels_line())


def build_tiny_model(arch: str, folder, seed: int = 0, vocab_size: int = 49152):
    """A seeded random model of the given family, saved as an HF folder with the default tokenizer."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from engine.models.loader import resolve_model

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        config, cls = LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope), LlamaForCausalLM
    elif arch == "qwen3":
        config, cls = Qwen3Config(**common, head_dim=16, tie_word_embeddings=False), Qwen3ForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(resolve_model(None))).save_pretrained(folder)
    return model


@pytest.fixture()
def two_threads():
    """torch and the C++ kernels (their own threads: engine/csrc/cpu_kernels.cpp) on two threads for one test,
    whatever the run gives the rest: `make test` runs its lanes on one thread each, and a kernel's split of its rows
    between threads must still be checked against its reference."""
    from engine import cpu_kernels
    ext = cpu_kernels.compiled()
    before = torch.get_num_threads()
    kernels_before = ext.pool_stats()["threads_set"] if ext is not None else None
    torch.set_num_threads(2)
    if ext is not None:
        ext.kernel_threads(2)
    yield
    torch.set_num_threads(before)
    if ext is not None:
        ext.kernel_threads(kernels_before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (folder, HF model) for each tiny architecture."""
    out = {}
    for arch in TINY_ARCHS:
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        out[arch] = (str(folder), build_tiny_model(arch, folder))
    return out


@pytest.fixture(scope="session")
def default_llm():
    from engine import LLM
    return LLM()


@pytest.fixture(scope="session")
def hf_default(default_llm):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(default_llm.model_path), dtype=torch.float32).eval()


@contextlib.contextmanager
def serve_app(llm, store=None, model_name: str = "test-model", access=None, api_key: str | None = None,
              with_demo: bool = False):
    """The playground app (page, OpenAI API and metrics on one port) launched on a free local port as main()
    launches it; yields (url, Playground). `store`: where its ablation results go (a test passes a temporary file
    so the user's own results stay untouched). `model_name`: the name the API answers to. `access`: who may
    change the engine (default: everyone, as on 127.0.0.1). `api_key`: required on /v1/* when given.
    `with_demo`: yield (url, Playground, the gradio Blocks) instead."""
    pytest.importorskip("gradio")
    import app
    from playground import Playground
    from playground.page_client import free_port
    pg = Playground(llm, store=store)
    port = free_port()
    demo = app.launch(pg, model_name, access=access, api_key=api_key, server_name="127.0.0.1", server_port=port,
                      prevent_thread_lock=True, quiet=True)
    try:
        yield (f"http://127.0.0.1:{port}/", pg, demo) if with_demo else (f"http://127.0.0.1:{port}/", pg)
    finally:
        demo.close()
        pg.service.shutdown()


_HF_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(prompt, max_new): tokens}


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, batch 1, greedy: the reference our engine must match token for token. Each
    (model, prompt, length) is generated once per session: tests that check the same prompts against one HF model
    (the default model with its usual pool and with a tiny one) share its answer, which is deterministic."""
    known = _HF_GREEDY.setdefault(hf_model, {})
    key = (tuple(prompt_ids), max_new_tokens)
    if key not in known:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=hf_model.config.pad_token_id)
        known[key] = out[0, len(prompt_ids):].tolist()
    return list(known[key])


def wait_until(condition, timeout_s: float = 10.0, poll_s: float = 0.05) -> bool:
    """Whether condition() came true within timeout_s (asked every poll_s): for what another thread does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


def assert_all_blocks_free(engine) -> None:
    assert not engine.has_unfinished()
    ref_counts, _ = engine.kv.block_states()
    assert all(rc == 0 for rc in ref_counts)
    assert engine.kv.stats().kv_blocks_used == 0
    assert not getattr(engine.kv, "tables", None), "the KV manager still holds a finished request's blocks"


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium per test module (Debian's, never `playwright install`), for pages in contexts of
    their own: tests/test_e2e_browser.py's open_page."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from tests.test_e2e_browser import CHROMIUM, FLAGS
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()
