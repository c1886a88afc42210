"""The CPU engine's own kernels (csrc/cpu_kernels.cpp), each where torch's calls spent most of a decode step's time
outside the arithmetic; why each, and how closely it agrees with torch, is said at its section of the C++ source,
what each gained in docs/measurements.md. Built ahead by `make kernels` (`python -m engine.cpu_kernels build`) into
the cache, one folder per source, CPU, Python and torch install.

At run time (compiled()) nothing is compiled: a build present is imported, and without one a line on stderr says how
to build it and torch's calls run (the same results, more slowly). WATCHLLM_BUILD_KERNELS=1 builds it at first use
instead; WATCHLLM_CPU_EXTENSIONS=0 keeps to the torch calls. A build cut short is cleared by build_folder.py.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import platform
import sys
import threading
import time
import warnings
from functools import cache
from pathlib import Path

import torch

from .build_folder import LOCK_FILE, PID_FILE, claimed, remove
from .cache import cache_dir
from .quant import quantize_uint8

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
W8A8_ZERO_POINT = 128  # the zero point fbgemm is given; each row's own is corrected after (models/linear.py)
# -fopenmp: the `omp simd` reductions (the kernels' threads are their own, not OpenMP's); -ffp-contract=off: no fused
# multiply-adds, so that the w8a8 helpers round as the torch calls do
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
LIB_EXT = ".pyd" if sys.platform == "win32" else ".so"  # torch.utils.cpp_extension.LIB_EXT, without importing it
BUILD_TIME = "about a minute, a few on a slow machine"
WAIT_S = 600.0  # how long a build or a start waits for another process's build before giving up on it
HOW_TO_BUILD = "`make kernels` or `python -m engine.cpu_kernels build`"
TORCH_INSTEAD = "torch's calls run instead (the same results, more slowly)"
_build_lock = threading.RLock()  # one build at a time in this process (other processes: builder.pid, flock)
_said: set[str] = set()  # the lines said once per process
_loaded: dict[str, object] = {}  # library path -> its module, imported once per process

# `python -m engine.cpu_kernels` imports the package `engine` first, which imports this module, so runpy would warn
# that it runs a second copy; the command only calls into the first one (main() below), so the warning is noise
warnings.filterwarnings("ignore", message=r"'engine\.cpu_kernels' found in sys\.modules", category=RuntimeWarning)


def quantize_rows_python(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quant.quantize_uint8's rows centred on fbgemm's zero point: (q - 128 as fp32, scale, zero - 128)."""
    q, scale, zero = quantize_uint8(x)
    return q.float().sub_(W8A8_ZERO_POINT), scale, zero.sub_(W8A8_ZERO_POINT)


def dequantize_rows_python(y: torch.Tensor, scale: torch.Tensor, shifted: torch.Tensor,
                           unit: torch.Tensor) -> torch.Tensor:
    """y [T, N] in place: (y - shifted[t] * unit[n]) * scale[t]."""
    return y.sub_(torch.outer(shifted, unit)).mul_(scale.unsqueeze(-1))


def _torch_path() -> str:
    return str(Path(torch.__file__).resolve().parent)


def _build_key() -> str:
    """What the machine code depends on (torch's install path too: two environments with the same torch each build
    their own), so two checkouts or environments never rebuild over each other."""
    flags = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), flags)
    except OSError:
        pass
    key = (f"{SOURCE.read_bytes()!r}|{CFLAGS}|{LDFLAGS}|{flags}|{sys.version_info[:2]}|{torch.__version__}|"
           f"{_torch_path()}")
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def module_name() -> str:
    return f"watchllm_cpu_kernels_{_build_key()}"


def build_folder() -> Path:
    return cache_dir() / "extensions" / module_name()


def library_path() -> Path:
    return build_folder() / f"{module_name()}{LIB_EXT}"


def _say(line: str) -> None:
    """A line for whoever started the engine (stderr: the app's and the tests' output stays theirs)."""
    print(f"watch-llm: {line}", file=sys.stderr, flush=True)


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        _say(line)


def _last_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines()[-1:] or [type(exc).__name__])[0]


def _import_built(name: str, library: Path):
    """The built module straight from its file, without running ninja or the compiler; once per process."""
    key = str(library)
    if key not in _loaded:
        spec = importlib.util.spec_from_file_location(name, library)
        if spec is None or spec.loader is None:
            raise ImportError(f"{library} is not a Python extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[key] = module
    return _loaded[key]


def _compile(folder: Path, name: str, verbose: bool):
    from torch.utils.cpp_extension import load
    return load(name, [str(SOURCE)], build_directory=str(folder), extra_ldflags=LDFLAGS, extra_cflags=CFLAGS,
                verbose=verbose)


def build(say=_say, verbose: bool = False, force: bool = False):
    """Build the module (or load the one there, unless force) and return it; None if it could not be (said why)."""
    name, folder = module_name(), build_folder()
    library = folder / f"{name}{LIB_EXT}"
    with _build_lock:
        try:
            with claimed(folder, say, WAIT_S, instead=TORCH_INSTEAD) as free:
                if not free:
                    return None
                if force:
                    for path in folder.iterdir():
                        if path.is_file() and path.name != PID_FILE:
                            remove(path)
                elif library.is_file():
                    try:
                        ext = _import_built(name, library)
                        say(f"already built in {folder}: nothing to compile (--force builds it again)")
                        return ext
                    except Exception as exc:  # a link cut short, say: build it again
                        say(f"the build in {folder} does not load ({_last_line(exc)}); building it again")
                        remove(library)
                started = time.monotonic()
                ext = _compile(folder, name, verbose)
                _loaded[str(library)] = ext
                say(f"built the C++ CPU kernels in {time.monotonic() - started:.0f} s, in {folder}")
                return ext
        except Exception as exc:  # no compiler, no ninja, a read-only cache...: the torch calls instead
            say(f"the engine's C++ CPU kernels could not be built ({_last_line(exc)}); {TORCH_INSTEAD}")
            return None


@cache
def _build():
    if os.environ.get("WATCHLLM_CPU_EXTENSIONS", "1") == "0":
        return None
    name, folder = module_name(), build_folder()
    library = folder / f"{name}{LIB_EXT}"
    if (folder / LOCK_FILE).exists():  # a build under way in another process, or one cut short: wait or clear
        try:
            with claimed(folder, _say, WAIT_S, instead=TORCH_INSTEAD) as free:
                if not free:
                    return None
        except OSError:  # a read-only cache: whatever is there
            pass
    if library.is_file():
        try:
            return _import_built(name, library)
        except Exception as exc:
            _say_once(f"the C++ CPU kernels built in {folder} do not load ({_last_line(exc)}); {TORCH_INSTEAD}. "
                      f"Build them again with `python -m engine.cpu_kernels build --force`")
            return None
    if os.environ.get("WATCHLLM_BUILD_KERNELS") == "1":
        _say(f"building the engine's C++ CPU kernels for this CPU and torch (WATCHLLM_BUILD_KERNELS=1; {BUILD_TIME}, "
             f"once) in {folder}")
        return build(_say)
    _say_once(f"the engine's C++ CPU kernels are not built for this machine and torch; {TORCH_INSTEAD}. "
              f"Build them with {HOW_TO_BUILD}")
    return None


def compiled():
    """The built module, or None; never compiles unless WATCHLLM_BUILD_KERNELS=1."""
    with _build_lock:  # two engines loading at once load (or build) it once
        return _build()


def row_helpers():
    """w8a8's (quantize_rows, dequantize_rows, name): the C++ pair when it builds here, else the Python one."""
    ext = compiled()
    if ext is None:
        return quantize_rows_python, dequantize_rows_python, "torch calls"
    return ext.quantize_rows, ext.dequantize_rows, "C++"


def describe(ext) -> str:
    """What a built module runs on this CPU."""
    if ext is None:
        return "torch's calls"
    steps = ("decode attention over the paged KV pool, KV writes (int8 too), RMSNorm / RoPE / silu layer steps, "
             "w8a8 rows, the sampler's rows")
    if ext.weight_only_available():
        amx = " (AMX)" if getattr(ext, "dense_amx", lambda: False)() else ""
        dense = " / ".join(f"bf16{amx}" if d == "bfloat16" else d for d in ext.dense_dtypes())
        vnni = " (on VNNI)" if getattr(ext, "vnni_available", lambda: False)() else ""
        return f"{steps}, AVX-512 {dense} and int8 / int4 weight-only matmuls{vnni} and attention loops"
    return f"{steps} (no AVX-512 in this build: torch's weight-only kernels, the portable attention loops)"


def status() -> str:
    if os.environ.get("WATCHLLM_CPU_EXTENSIONS", "1") == "0":
        return "C++ CPU kernels: off (WATCHLLM_CPU_EXTENSIONS=0): torch's calls run"
    name, folder = module_name(), build_folder()
    library, where = folder / f"{name}{LIB_EXT}", f"key {_build_key()}, {folder}"
    if (folder / LOCK_FILE).exists():
        return (f"C++ CPU kernels: a build is under way or was cut short ({where}): `python -m engine.cpu_kernels "
                f"build` waits for it or clears it")
    if not library.is_file():
        return f"C++ CPU kernels: not built ({where}): torch's calls run; build them with {HOW_TO_BUILD}"
    try:
        ext = _import_built(name, library)
    except Exception as exc:
        return (f"C++ CPU kernels: built but not loadable ({where}: {_last_line(exc)}): torch's calls run; "
                f"`python -m engine.cpu_kernels build --force` builds them again")
    return f"C++ CPU kernels: built ({where}): {describe(ext)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.cpu_kernels",
                                     description="Build the engine's C++ CPU kernels ahead, or say whether they are.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build them for this CPU and torch (ninja's output shown)")
    b.add_argument("--force", action="store_true", help="build again even if a build is there")
    sub.add_parser("status", help="one line: built or not, the key, the folder, what runs")
    args = parser.parse_args(argv)
    if args.command == "status":
        print(status())
        return 0
    say = lambda line: print(line, flush=True)
    library = library_path()
    if not args.force and library.is_file() and not (library.parent / LOCK_FILE).exists():
        with contextlib.suppress(Exception):  # one that does not load is built again below
            ext = _import_built(module_name(), library)
            say(f"the engine's C++ CPU kernels are built (key {_build_key()}, {library.parent}; --force builds them "
                f"again): {describe(ext)}")
            return 0
    say(f"building the engine's C++ CPU kernels ({SOURCE}) for this CPU with torch {torch.__version__} "
        f"({_torch_path()}), key {_build_key()}")
    say(f"into {build_folder()}: gcc and ninja, {' '.join(CFLAGS)}; {BUILD_TIME}")
    if os.environ.get("WATCHLLM_CPU_EXTENSIONS", "1") == "0":
        say("note: WATCHLLM_CPU_EXTENSIONS=0 is set here, so the engine will not use them")
    ext = build(say, verbose=True, force=args.force)
    if ext is None:
        say("the engine runs without them; once the cause is fixed, `make kernels` builds them")
        return 1
    say(f"this build provides on this CPU: {describe(ext)}")
    return 0


if __name__ == "__main__":
    from engine import cpu_kernels  # the module the engine imported, not runpy's second copy of it

    sys.exit(cpu_kernels.main())
