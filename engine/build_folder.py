"""Who builds in a folder: one build at a time across processes, and a build cut short never blocks the next.

torch's cpp_extension waits forever on the lock file a killed build leaves (LOCK_FILE): every later start hung,
silently. Here the builder also writes PID_FILE and holds an flock on it, which the system drops when the builder
dies, so a lock whose builder is gone is removed, saying so, and a live build is waited for, saying whom.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

PID_FILE = "builder.pid"  # who is building in a folder: {"pid", "host", "start"}, emptied when the build ends
LOCK_FILE = "lock"  # torch's FileBaton: a build killed halfway leaves it, and torch then waits on it forever
LOCK_STALE_S = 600.0  # a lock whose builder cannot be checked (none named, another host) is left over past this age
POLL_S = 0.2


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from the builder's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid())}


def read_builder(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / PID_FILE).read_text() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def _alive(record: dict) -> bool | None:
    """Whether the builder a record names is running: True, False, or None where this machine cannot tell (another
    host, or Windows, where os.kill would end the process)."""
    pid = record["pid"]
    if os.name == "nt" or record.get("host") != socket.gethostname() or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    except OSError:
        return None
    start = record.get("start")
    return start is None or start == _process_start(pid)  # a new process under the dead builder's pid: not it


def _age(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return None


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _lock_cleared(folder: Path, say) -> bool:
    """True when torch's lock is not in folder, or was left by a build that no longer runs (then removed, saying
    so); False while a build that may be running holds it."""
    lock = folder / LOCK_FILE
    if not lock.exists():
        return True
    record = read_builder(folder)
    alive = None if record is None else _alive(record)
    if alive is False:
        remove(lock)
        say(f"removed the build lock left in {folder} by process {record['pid']}, which is no longer running "
            f"(a build cut short)")
        return True
    if alive is None:
        age = _age(lock)
        if age is None:
            return True
        if age > LOCK_STALE_S:
            remove(lock)
            say(f"removed a build lock left in {folder} {age / 60:.0f} min ago by no builder this machine can see "
                f"(a build cut short)")
            return True
    return False


def _try_flock(f) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows: builder.pid and the lock's age only
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _wait(ready, folder: Path, deadline: float, say, what: str) -> bool:
    """Poll ready() until it holds (True) or the deadline passes (False), saying whom it waits for each minute."""
    started, said = time.monotonic(), 0
    while not ready():
        waited = time.monotonic() - started
        if time.monotonic() >= deadline:
            return False
        if waited >= 60 * said:
            record = read_builder(folder)
            who = f"process {record['pid']}" if record else "another process"
            say(f"waiting for {who}, which is building {what} in {folder} "
                f"({waited:.0f} s so far, at most {max(0.0, deadline - started):.0f} s)")
            said += 1
        time.sleep(POLL_S)
    return True


@contextlib.contextmanager
def claimed(folder: Path, say, wait_s: float, what: str = "the C++ CPU kernels", instead: str = ""):
    """Hold folder for one build: yields True once no other process builds there (a build cut short's lock removed
    on the way), False if one still did after wait_s."""
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    with open(folder / PID_FILE, "a+") as f:
        if not (_wait(lambda: _try_flock(f), folder, deadline, say, what)
                and _wait(lambda: _lock_cleared(folder, say), folder, deadline, say, what)):
            say(f"another process was still building {what} in {folder} after {wait_s:.0f} s; {instead}")
            yield False
            return
        f.seek(0)
        f.truncate()
        json.dump(_me(), f)
        f.flush()
        try:
            yield True
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
    # closing the file dropped the flock
