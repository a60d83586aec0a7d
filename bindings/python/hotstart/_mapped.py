"""Checkpoint files mapped privately under new tensors, and let go once retention deletes them.

``load()`` into new tensors maps the step's file copy-on-write (as ``safetensors`` does) and
hands out views of the mapping: the page cache reads it, the engine verifies it where it lies,
and nothing is copied. A mapping keeps its file, and so its disk space, for as long as a view
lives, and an optimizer's state loaded this way lives for the whole run, long after retention
deleted the step. So every mapping made here is remembered, and :func:`release_deleted` (run at
the start of every ``save()``) moves the contents of each one whose file was deleted into
anonymous memory at the same address: a copy, then ``mremap(MREMAP_FIXED)`` over the mapping,
which replaces it in one step. The views keep their addresses and their bytes; the file is
freed. The copy is made on the training thread inside ``save()``, where the loop does not
write its state (readers, such as a save still staging, see the same bytes before and after).

The mapping is made with ``mmap(2)`` through ctypes rather than Python's ``mmap`` module, which
keeps a duplicate of the file's descriptor (and so the file) until it is closed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from typing import Any, List, Optional, Tuple

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2

# (address, length, the buffer object whose views are out) of every mapping still alive.
_MAPPINGS: List[Tuple[int, int, "weakref.ref[Any]"]] = []


def map_private(fd: int, n: int) -> Optional[Any]:
    """A private, writable (copy-on-write) mapping of the `n`-byte file open as `fd`, as a
    buffer object (``torch.frombuffer`` and ``numpy.frombuffer`` take it), or None when it
    cannot be mapped (another length: never map past a file's end). Unmapped when the buffer
    and every view of it are gone; `fd` may be closed at once."""
    try:
        if os.fstat(fd).st_size != n or n == 0:
            return None
    except OSError:
        return None
    addr = _libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if addr in (None, _MAP_FAILED):
        return None
    # A subclass of the array type, whose instances (unlike ctypes arrays) take weak references.
    mapped: Any = type("Mapped", (ctypes.c_ubyte * n,), {})
    buf = mapped.from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, n)
    _MAPPINGS.append((addr, n, weakref.ref(buf)))
    return buf


def _deleted_ranges() -> List[Tuple[int, int]]:
    """Address ranges of this process's mappings of files that were deleted (a mapping may be
    split into several ranges, by advice given to parts of it)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.endswith(" (deleted)\n"):
                start, end = line.split(" ", 1)[0].split("-")
                out.append((int(start, 16), int(end, 16)))
    return out


def release_deleted() -> int:
    """Moves every mapping made by :func:`map_private` whose file was deleted into anonymous
    memory at the same address (see the module docs); returns how many."""
    _MAPPINGS[:] = [m for m in _MAPPINGS if m[2]() is not None]
    if not _MAPPINGS:
        return 0
    deleted = _deleted_ranges()
    keep = []
    for addr, n, ref in _MAPPINGS:
        gone = any(s < addr + n and addr < e for s, e in deleted)
        if gone and ref() is not None and _move_to_anonymous(addr, n):
            continue
        keep.append((addr, n, ref))
    released = len(_MAPPINGS) - len(keep)
    _MAPPINGS[:] = keep
    return released


def _move_to_anonymous(addr: int, n: int) -> bool:
    """Replaces the `n`-byte mapping at `addr` with anonymous memory holding the same bytes."""
    new = _libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if new in (None, _MAP_FAILED):
        return False  # no memory now: the file stays mapped, and the next save tries again
    ctypes.memmove(new, addr, n)
    if _libc.mremap(new, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr) != addr:
        _libc.munmap(new, n)
        return False
    return True
