"""The CPU engine's own kernels (csrc/cpu_kernels.cpp), built ahead by `make kernels` / `make install` (`python -m
engine.cpu_kernels build`: torch's cpp_extension with gcc and ninja, -march=native, about a minute, ninja's output
shown) into the cache, one folder per source, CPU, Python and torch install; Python's torch calls otherwise. Each
replaces torch calls that spent most of their time outside the arithmetic for the few rows of a decode step:

- w8a8's per-row work around fbgemm's matmul: quantizing each token's activations before it and scaling the int32
  sums back after. As torch calls each is about a dozen small operations, which took longer than the matmul
  itself at decode sizes (docs/measurements.md, "The engine's own weight-only kernels"). Both paths compute the
  same floats, operation for operation (the test compares them bit for bit), so which one runs changes the speed
  only.
- decode attention straight over the paged KV pool (attention/sdpa.py): one query per row against its own slots,
  without first gathering K and V into a padded batch for SDPA (an int8 pool dequantized as it is read). Its sums
  run in another order than SDPA's, so it agrees with it to float rounding (tested), not bit for bit. With AVX-512
  (head sizes 16-128) each query and its sums stay in vector registers, several times faster than the portable
  loops and than SDPA over the gathered batch (docs/measurements.md, "int4 beats llama.cpp on the AMD CPU"). It
  asks for each row's K and V some keys ahead (a row's slots are scattered over the pool, too few bytes in a row
  for the hardware's prefetchers), scores a bf16 pool with AVX-512 BF16's dot products where the CPU has them, and
  splits the rows between the threads by the slots they read (docs/measurements.md, "The attention kernel's
  memory, and the table again").
- writing a step's K and V into the pool, one call a layer: as they are (torch's two scatters), or into an int8
  pool, each token and KV head quantized and stored, where quantize_int8's torch calls, their dequantization and
  four scatters were ~26, a good share of an int4 token at batch 1; in one call the int8 cache costs a token
  nothing (docs/measurements.md, "On a CPU"). The same integers and scales bit for bit (tested).
- int8 and int4 weight-only matmuls (models/linear.py), the weights widened in registers as they are read, the
  next block's prefetched, the activations taken as they come (fp32 or bf16) with fp32 sums: torch's kernels
  take bf16 activations only and streamed the weights more slowly at one row (docs/measurements.md, "The engine's
  own weight-only kernels"). Built with AVX-512 only (elsewhere torch's kernels run); a row's result is the same
  in any batch (tested). With AVX-512 VNNI they run int4_matmul_vnni and int8_matmul_vnni instead: the weights
  stay integers and each row's activations are made integers once per call, in two 8-bit parts per run of 32
  features (about 15 bits), for VNNI's integer dot products: widening every weight to a float had run out of
  instructions before the memory ran out of bytes (int4 most). A precision change, measured: the quality table's
  int4 and int8 rows moved by at most 0.1 point of agreement (docs/measurements.md, "Against the machine's
  limits").
- float32 and bf16 matmuls for the unquantized projections (quant/linear.py's Linear), over a weight packed once
  into blocks of 16 outputs, each k's (bf16: each pair's) weights of a block one 64-byte vector: one fused
  multiply-add (bf16: one AVX-512 BF16 dot product) per block and k, no reduction across lanes, groups of blocks
  taken from a shared counter so a thread the OS pauses leaves its share to the other. A decode step's
  projections and LM head run faster than on oneDNN's linear (what ran before) at a few rows, and about as fast
  at hundreds (docs/measurements.md, "The projections in C++, and the table again"). Built with
  AVX-512 (bf16: AVX-512 BF16). On a CPU with AMX, bf16 runs on its tiles over the same packed weight (each block's
  pairs are the tile's layout): as fast as the dot products at one row and as oneDNN's AMX linear at hundreds
  (docs/measurements.md, "Against the machine's limits"), where the dot products alone fell far behind it. A row's
  result is the same in any batch (tested).
- a decoder layer's elementwise steps (models/llama.py): RMSNorm with the residual add before it, RoPE, and
  silu(gate) * up, one call each where the torch formulas are 7, 6 and 4 calls, whose dispatch was a large share
  of an int4 token's time at batch 1 (with the attention above, it took int4 past llama.cpp's speed in the same
  runs: docs/measurements.md, "int4 beats llama.cpp on the AMD CPU"). Each rounds where transformers' formula
  rounds; RoPE is bit for bit the same, the norm's sum of squares and silu's exp differ in the last bits (tested;
  greedy tokens the same with and without).

At run time (compiled(): app.py, LLM(), the tests) nothing is compiled: a build present in its folder is imported as
it is, and without one a single line on stderr says how to build it and torch's calls run (the same results, more
slowly). WATCHLLM_BUILD_KERNELS=1 builds it at first use instead, saying so first; WATCHLLM_CPU_EXTENSIONS=0 keeps to
the torch calls. A build cut short (Ctrl-C, a timeout, a restarted kernel) leaves torch's lock file behind: the next
build or start sees that the process named in the folder's builder.pid is gone and removes it; a live build is
waited for at most WAIT_S seconds. `python -m engine.cpu_kernels status` says in one line what runs here.
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
    """x [T, K] fp32 -> (q - 128 as fp32 [T, K], scale [T], zero - 128 [T]): quant.quantize_uint8's rows, centred
    on fbgemm's zero point."""
    q, scale, zero = quantize_uint8(x)
    return q.float().sub_(W8A8_ZERO_POINT), scale, zero.sub_(W8A8_ZERO_POINT)


def dequantize_rows_python(y: torch.Tensor, scale: torch.Tensor, shifted: torch.Tensor,
                           unit: torch.Tensor) -> torch.Tensor:
    """y [T, N] in place: (y - shifted[t] * unit[n]) * scale[t]."""
    return y.sub_(torch.outer(shifted, unit)).mul_(scale.unsqueeze(-1))


def _torch_path() -> str:
    return str(Path(torch.__file__).resolve().parent)


def _build_key() -> str:
    """What the machine code depends on: the source and the flags it is built with, the CPU's flags (it is built for
    this CPU), Python, torch's version and its install path (two environments with the same torch each build their
    own). Each its own folder, so two checkouts or environments never rebuild over each other."""
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
    """The module torch's build leaves in the folder: <folder>/<name>.so."""
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
    """The built module straight from its file, as torch's cpp_extension imports it after a build, without running
    ninja or the compiler; once per process."""
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
    """torch's cpp_extension build (gcc and ninja) into folder; the module it leaves there, imported."""
    from torch.utils.cpp_extension import load
    return load(name, [str(SOURCE)], build_directory=str(folder), extra_ldflags=LDFLAGS, extra_cflags=CFLAGS,
                verbose=verbose)


# ---- building and loading ----------------------------------------------------------------------------------------

def build(say=_say, verbose: bool = False, force: bool = False):
    """Build the module into build_folder() (or load the build already there, unless force) and return it; None if
    it could not be built (said why, in one line)."""
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
    """The built module, or None: WATCHLLM_CPU_EXTENSIONS=0, not built (said once), or the build failed (said).
    Never compiles unless WATCHLLM_BUILD_KERNELS=1."""
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
    """One line: built or not, the key, the folder, and what runs."""
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
