"""The C++ CPU kernels' build (engine/cpu_kernels.py): its key, the lock a build cut short leaves behind, a live build
waited for at most WAIT_S, and never a silent compile at run time. The compiler is replaced by a recorder (and
torch's own load() by a failure), so nothing here compiles; a cache folder of the test's own holds the build."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch.utils.cpp_extension

from engine import build_folder, cpu_kernels

FAKE = SimpleNamespace(weight_only_available=lambda: False, quantize_rows=None, dequantize_rows=None)


class Compiler:
    """Stands in for cpu_kernels._compile: records each call with what the folder held at that moment."""

    def __init__(self, capsys=None, result=FAKE):
        self.calls, self.capsys, self.result = [], capsys, result

    def __call__(self, folder, name, verbose):
        said = self.capsys.readouterr() if self.capsys is not None else None
        self.calls.append(SimpleNamespace(folder=folder, name=name, verbose=verbose,
                                          lock=(folder / build_folder.LOCK_FILE).exists(),
                                          builder=build_folder.read_builder(folder), said=said))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def no_torch_build(*args, **kwargs):
    raise AssertionError("torch's cpp_extension.load ran: the engine compiled at run time")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, no environment switches, nothing said yet, torch's build forbidden."""
    monkeypatch.setenv("WATCHLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("WATCHLLM_CPU_EXTENSIONS", raising=False)
    monkeypatch.delenv("WATCHLLM_BUILD_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "_said", set())
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_torch_build)
    cpu_kernels._build.cache_clear()
    yield tmp_path
    cpu_kernels._build.cache_clear()


def test_the_build_key_changes_with_torch_s_install_path(monkeypatch):
    key, folder = cpu_kernels._build_key(), cpu_kernels.build_folder()
    assert cpu_kernels._build_key() == key  # the same environment finds its own build again
    monkeypatch.setattr(cpu_kernels.torch, "__file__", "/another/venv/lib/site-packages/torch/__init__.py")
    assert cpu_kernels._build_key() != key
    assert cpu_kernels.build_folder() != folder and cpu_kernels.build_folder().parent == folder.parent
    assert cpu_kernels.library_path().name == f"watchllm_cpu_kernels_{cpu_kernels._build_key()}.so"


def test_a_missing_build_is_said_once_and_torch_calls_run_without_compiling(cache, monkeypatch, capsys):
    compiler = Compiler()
    monkeypatch.setattr(cpu_kernels, "_compile", compiler)
    assert cpu_kernels.compiled() is None
    cpu_kernels._build.cache_clear()  # even asked again (a second engine in the process): the line is said once
    assert cpu_kernels.compiled() is None
    assert cpu_kernels.row_helpers()[2] == "torch calls"
    assert compiler.calls == []
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["watch-llm: the engine's C++ CPU kernels are not built for this machine and torch; torch's calls "
                     "run instead (the same results, more slowly). Build them with `make kernels` or "
                     "`python -m engine.cpu_kernels build`"]
    assert not cpu_kernels.build_folder().exists()  # nothing written either
    assert cpu_kernels.status().startswith("C++ CPU kernels: not built (key ")


def test_watchllm_build_kernels_builds_at_first_use_saying_so_first(cache, monkeypatch, capsys):
    monkeypatch.setenv("WATCHLLM_BUILD_KERNELS", "1")
    compiler = Compiler(capsys)
    monkeypatch.setattr(cpu_kernels, "_compile", compiler)
    assert cpu_kernels.compiled() is FAKE
    assert cpu_kernels.compiled() is FAKE  # cached: built once
    [call] = compiler.calls
    assert call.folder == cpu_kernels.build_folder() and call.name == cpu_kernels.module_name()
    assert not call.lock and call.builder["pid"] == os.getpid()  # its pid written before the build
    [before] = call.said.err.splitlines()
    assert before.startswith("watch-llm: building the engine's C++ CPU kernels for this CPU and torch "
                             "(WATCHLLM_BUILD_KERNELS=1; about a minute")
    assert "built the C++ CPU kernels in" in capsys.readouterr().err
    assert build_folder.read_builder(call.folder) is None  # emptied after the build


def test_a_failed_build_says_why_and_torch_calls_run(cache, monkeypatch, capsys):
    monkeypatch.setenv("WATCHLLM_BUILD_KERNELS", "1")
    monkeypatch.setattr(cpu_kernels, "_compile", Compiler(result=RuntimeError("Error building extension\nno c++")))
    assert cpu_kernels.compiled() is None
    err = capsys.readouterr().err
    assert ("watch-llm: the engine's C++ CPU kernels could not be built (no c++); torch's calls run instead (the "
            "same results, more slowly)") in err


def test_off_means_never_even_when_asked_to_build(cache, monkeypatch, capsys):
    monkeypatch.setenv("WATCHLLM_CPU_EXTENSIONS", "0")
    monkeypatch.setenv("WATCHLLM_BUILD_KERNELS", "1")
    compiler = Compiler()
    monkeypatch.setattr(cpu_kernels, "_compile", compiler)
    assert cpu_kernels.compiled() is None and compiler.calls == []
    assert capsys.readouterr().err == ""
    assert cpu_kernels.status() == "C++ CPU kernels: off (WATCHLLM_CPU_EXTENSIONS=0): torch's calls run"


def test_a_build_in_its_folder_is_imported_as_it_is(cache, monkeypatch):
    library = cpu_kernels.library_path()
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    imported = []
    monkeypatch.setattr(cpu_kernels, "_import_built", lambda name, path: imported.append((name, path)) or FAKE)
    monkeypatch.setattr(cpu_kernels, "_compile", Compiler(result=AssertionError("compiled")))
    assert cpu_kernels.compiled() is FAKE
    assert imported == [(cpu_kernels.module_name(), library)]


def test_the_real_build_loads_from_its_file_without_ninja_or_the_compiler(monkeypatch):
    """The machine's own build, where `make kernels` made one: imported from <folder>/<name>.so as torch would."""
    if os.environ.get("WATCHLLM_CPU_EXTENSIONS", "1") == "0" or not cpu_kernels.library_path().is_file():
        pytest.skip("the C++ kernels are not built here (`make kernels`)")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_torch_build)
    monkeypatch.setattr(cpu_kernels, "_compile", Compiler(result=AssertionError("compiled")))
    cpu_kernels._build.cache_clear()
    try:
        ext = cpu_kernels.compiled()
        assert ext is not None and ext.__file__ == str(cpu_kernels.library_path())
        assert callable(ext.decode_attention) and isinstance(ext.weight_only_available(), bool)
        assert cpu_kernels.status().startswith("C++ CPU kernels: built (key ")
    finally:
        cpu_kernels._build.cache_clear()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("who", ["dead", "reused pid"])
def test_a_lock_left_by_a_builder_that_is_gone_is_removed_and_the_build_runs(cache, monkeypatch, capsys, who):
    folder = cpu_kernels.build_folder()
    folder.mkdir(parents=True)
    (folder / build_folder.LOCK_FILE).touch()
    # "reused pid": a running process (this one) under the pid, started at another time than the builder was
    pid, start = (dead_pid(), None) if who == "dead" else (os.getpid(), "1")
    (folder / build_folder.PID_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "start": start}))
    compiler = Compiler()
    monkeypatch.setattr(cpu_kernels, "_compile", compiler)
    assert cpu_kernels.build() is FAKE
    [call] = compiler.calls
    assert not call.lock and call.builder["pid"] == os.getpid()  # torch's baton would have waited on it forever
    err = capsys.readouterr().err
    assert (f"watch-llm: removed the build lock left in {folder} by process {pid}, which is no longer running "
            f"(a build cut short)") in err


def test_a_lock_no_builder_is_named_for_is_removed_only_once_old(cache, monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels, "WAIT_S", 0.5)
    folder = cpu_kernels.build_folder()
    folder.mkdir(parents=True)
    lock = folder / build_folder.LOCK_FILE
    lock.touch()
    compiler = Compiler()
    monkeypatch.setattr(cpu_kernels, "_compile", compiler)
    assert cpu_kernels.build() is None and compiler.calls == []  # young: perhaps a build under way, waited for
    assert lock.exists() and "waiting for another process" in capsys.readouterr().err
    old = time.time() - build_folder.LOCK_STALE_S - 60
    os.utime(lock, (old, old))
    assert cpu_kernels.build() is FAKE and len(compiler.calls) == 1 and not compiler.calls[0].lock
    assert "removed a build lock left in" in capsys.readouterr().err


BUILDER = textwrap.dedent("""
    import fcntl, json, os, socket, sys, time
    folder, finish_after = sys.argv[1], float(sys.argv[2])
    f = open(os.path.join(folder, "builder.pid"), "a+")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    f.truncate(0)
    json.dump({"pid": os.getpid(), "host": socket.gethostname(), "start": None}, f)
    f.flush()
    open(os.path.join(folder, "lock"), "w").close()
    print("building", flush=True)
    time.sleep(finish_after)
    open(sys.argv[3], "w").close()  # its module
    os.remove(os.path.join(folder, "lock"))
    f.truncate(0)
    f.close()
""")


def start_builder(finish_after: float):
    """Another process building in the folder as cpu_kernels.build() does: builder.pid flocked and naming it,
    torch's lock held; after finish_after seconds it leaves its module and lets go."""
    pytest.importorskip("fcntl")
    folder = cpu_kernels.build_folder()
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(folder), str(finish_after),
                             str(cpu_kernels.library_path())], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "building"
    return proc


@pytest.mark.slow
def test_a_live_build_is_waited_for_at_most_wait_s_then_torch_calls_run(cache, monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels, "WAIT_S", 1.0)
    compiler = Compiler()
    monkeypatch.setattr(cpu_kernels, "_compile", compiler)
    proc = start_builder(finish_after=60)
    try:
        started = time.monotonic()
        assert cpu_kernels.build() is None
        assert 1.0 <= time.monotonic() - started < 10
        assert cpu_kernels.compiled() is None  # a start waits as long, then runs torch's calls
        assert compiler.calls == [] and (cpu_kernels.build_folder() / build_folder.LOCK_FILE).exists()
        err = capsys.readouterr().err
        assert f"waiting for process {proc.pid}, which is building the C++ CPU kernels in" in err
        assert ("another process was still building the C++ CPU kernels in "
                f"{cpu_kernels.build_folder()} after 1 s; torch's calls run instead") in err
    finally:
        proc.kill()
        proc.wait()


def test_a_build_that_finishes_while_waited_for_is_used_not_built_again(cache, monkeypatch, capsys):
    compiler = Compiler()
    monkeypatch.setattr(cpu_kernels, "_compile", compiler)
    monkeypatch.setattr(cpu_kernels, "_import_built", lambda name, path: FAKE)
    proc = start_builder(finish_after=1.0)
    try:
        assert cpu_kernels.build() is FAKE
        assert compiler.calls == []
        assert f"waiting for process {proc.pid}" in capsys.readouterr().err
    finally:
        proc.kill()
        proc.wait()


def test_the_commands_say_what_they_do(cache, monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels, "_compile", Compiler())
    assert cpu_kernels.main(["status"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("C++ CPU kernels: not built (key ") and "make kernels" in line
    assert cpu_kernels.main(["build"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("building the engine's C++ CPU kernels (")
    assert "built the C++ CPU kernels in " in out
    assert out.splitlines()[-1] == ("this build provides on this CPU: " + cpu_kernels.describe(FAKE))
    assert "no AVX-512 in this build" in out
    monkeypatch.setattr(cpu_kernels, "_compile", Compiler(result=RuntimeError("ninja is required")))
    assert cpu_kernels.main(["build", "--force"]) == 1
    out = capsys.readouterr().out
    assert "could not be built (ninja is required); torch's calls run instead" in out
    assert out.splitlines()[-1].startswith("the engine runs without them")


@pytest.mark.slow
def test_the_source_compiles_for_cpus_without_avx512():
    """The build uses -march=native, so this machine's compile says nothing of a laptop's: the source must also
    compile for a plain x86-64, for AVX2 (no AVX-512: the portable loops and torch's weight-only kernels) and for
    AVX-512 without BF16 or VNNI. A definition left inside an #if once broke every build without AVX-512."""
    import shutil
    import sysconfig

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    includes = [f"-I{p}" for p in [*torch.utils.cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    flags = [f for f in cpu_kernels.CFLAGS if not f.startswith(("-march", "-O"))]
    procs = {arch: subprocess.Popen([compiler, "-std=c++17", "-fsyntax-only", f"-march={arch}", *flags,
                                     "-DTORCH_EXTENSION_NAME=syntax_check", *includes, str(cpu_kernels.SOURCE)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for arch in ("x86-64", "haswell", "skylake-avx512")}
    errors = {arch: [line for line in p.communicate(timeout=300)[1].splitlines() if "error" in line]
              for arch, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()) and not any(errors.values()), errors
