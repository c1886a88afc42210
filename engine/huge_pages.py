"""The weights a step streams, moved at load into one buffer that Linux backs with 2 MB pages where it can: a decode
step reads every projection's weights once, and over 4 KB pages it misses the TLB every 64 cache lines. Why and how
(madvise over the buffer's 2 MB-aligned part, Tensor.set_), and what it is worth: docs/measurements.md, "The weights
in 2 MB pages, and the snapshot every 50 ms". Where the system gives no huge pages it moves nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

PAGE = 2 << 20  # bytes in a huge page on x86-64 and arm64's default granule
ALIGN = 64  # each tensor's start in the buffer: a cache line, as torch's own allocator gives
MADV_HUGEPAGE = 14
MIN_BYTES = 1 << 20  # smaller tensors (norms, biases, scales of a small layer) are not worth the move
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page setting ("always", "madvise" or "never"); None where there is none."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc


def _movable(t: torch.Tensor) -> bool:
    """A plain CPU tensor that owns all of its storage: moving it frees the old storage and changes no other
    tensor (a view of a larger storage, or an opaque one such as oneDNN's reordered weight, stays put)."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn or not t.is_contiguous():
        return False
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False
    nbytes = t.numel() * t.element_size()
    return nbytes >= MIN_BYTES and t.storage_offset() == 0 and storage.nbytes() == nbytes


def gather(tensors: Iterable[torch.Tensor]) -> int:
    """Move these tensors, in place, into one buffer backed by 2 MB pages where the system gives them: bytes moved."""
    if thp_mode() not in ("always", "madvise"):
        return 0
    libc = _libc()
    if libc is None:
        return 0
    seen, chosen = set(), []
    for t in tensors:
        if _movable(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            chosen.append(t)
    if not chosen:
        return 0
    offsets, size = [], 0
    for t in chosen:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buffer = torch.empty(size + PAGE, dtype=torch.uint8)  # untouched: no page of it exists yet
    base = buffer.data_ptr()
    start = -base % PAGE  # the buffer's first 2 MB boundary
    span = -(-size // PAGE) * PAGE
    if start + span > buffer.numel():
        span -= PAGE
    if span > 0 and libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(span), MADV_HUGEPAGE) != 0:
        return 0  # refused (an old kernel, a seccomp filter): leave the weights where they are
    storage = buffer.untyped_storage()
    moved = 0
    with torch.no_grad():
        for t, offset in zip(chosen, offsets):
            nbytes = t.numel() * t.element_size()
            place = buffer[start + offset:start + offset + nbytes].view(t.dtype).view(t.shape)
            place.copy_(t)
            t.set_(storage, (start + offset) // t.element_size(), t.shape, t.stride())
            moved += nbytes
    # the old places are free now, but glibc keeps those it took from its heap (tensors under its mmap threshold,
    # which rises to 32 MB as large blocks are freed) unless asked to hand them back (docs/measurements.md)
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
    return moved


def scatter(tensors: Iterable[torch.Tensor]) -> None:
    """Each CPU tensor back in ordinary memory of its own, in place (gather's undoing): for measuring what the pages
    are worth (`python -m engine.bench kernel-worth`)."""
    with torch.no_grad():
        for t in tensors:
            if t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn:
                t.set_(t.clone())

