"""Host memory for the offloaded KV: a budget against an optional cap, and arenas of slots that
grow without copying (address space reserved once, physical pages on first touch).

    budget = HostMemoryBudget(cap_bytes)         # reserve / release bytes, HostMemoryCapError past the cap
    arena = SlotArrays(templates, n, what)       # named arrays sharing a leading slot axis; grow(), touch()
    pool = SlotPool()                             # slot numbers: fresh, recycled, retired until no reader
Used by host.kv_store (the offloaded blocks) and host.context_cache (hgca's kept tokens).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import platform
import sys

import numpy as np

log = logging.getLogger(__name__)


class HostMemoryCapError(MemoryError):
    """Raised when growing a host arena would exceed the configured host-memory cap."""


class HostMemoryBudget:
    """Bytes reserved by all host arenas against an optional cap (None = unlimited)."""

    def __init__(self, cap_bytes: int | None):
        if cap_bytes is not None and cap_bytes <= 0:
            raise ValueError(f"host_memory_cap_bytes={cap_bytes}; expected a positive int or None")
        self.cap_bytes = cap_bytes
        self.reserved = 0

    def reserve(self, nbytes: int, what: str) -> None:
        if self.cap_bytes is not None and self.reserved + nbytes > self.cap_bytes:
            raise HostMemoryCapError(
                f"growing {what} by {nbytes / 2**20:.1f} MiB would reserve "
                f"{(self.reserved + nbytes) / 2**20:.1f} MiB of host memory, over the cap of "
                f"{self.cap_bytes / 2**20:.1f} MiB (host_memory_cap_bytes); free sequences or raise the cap")
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes


def grow_arrays(arrays: dict[str, np.ndarray], new_len: int) -> dict[str, np.ndarray]:
    """New arrays with leading axis `new_len`, the old contents copied in front, the rest zero
    (lazily: fresh pages are only faulted in when touched). The copying fallback of `SlotArrays`."""
    grown = {}
    for name, a in arrays.items():
        b = np.zeros((new_len,) + a.shape[1:], a.dtype)
        b[: a.shape[0]] = a
        grown[name] = b
    return grown


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


# mmap.MAP_NORESERVE appears in Python 3.13; its value on x86-64 / aarch64 / arm Linux is 0x4000.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") and
                         platform.machine() in ("x86_64", "aarch64", "arm64", "armv7l", "i686") else 0)
_HUGE_FROM = 4 << 20
# First touch of 512 MiB measured on the 2-core EPYC VM: ~320 ms with 4 KiB pages, ~80 ms with THP.


_PAGE = mmap.PAGESIZE


@functools.lru_cache(maxsize=None)
def _huge_page_bytes() -> int:
    """The transparent huge page size (2 MiB on x86-64; the kernel's hpage_pmd_size)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


@functools.lru_cache(maxsize=None)
def _thp_mode() -> str:
    """'always', 'madvise' or 'never' (the kernel's transparent_hugepage/enabled); 'never' off Linux."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "never"
    for mode in ("always", "madvise", "never"):
        if f"[{mode}]" in text:
            return mode
    return "never"


@functools.lru_cache(maxsize=None)
def _mincore():
    """libc's mincore(addr, length, vec), or None (not Linux / no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def resident_bytes(address: int, nbytes: int) -> int | None:
    """Bytes of the pages overlapping [address, address + nbytes) that are resident now (mincore;
    None where unavailable)."""
    fn = _mincore()
    if fn is None or nbytes <= 0:
        return None if fn is None else 0
    lo = address - address % _PAGE
    n_pages = -(-(address + nbytes - lo) // _PAGE)
    vec = np.zeros(n_pages, np.uint8)
    if fn(lo, n_pages * _PAGE, vec.ctypes.data) != 0:
        return None
    return int(np.count_nonzero(vec & 1)) * _PAGE


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def resident_bound(address: int, nbytes: int, huge_from: int | None) -> int:
    """The most bytes that writing [address, address + nbytes) of an anonymous mapping starting at
    `address` (page aligned) can make resident: its 4 KiB pages, except where transparent huge
    pages may back it (past offset `huge_from` of a region advised MADV_HUGEPAGE; everywhere with
    THP 'always'; None: not advised), which come in whole huge pages, 2 MiB aligned in the address
    space. The bytes beyond nbytes that this rounding adds are at most one huge page."""
    if nbytes <= 0:
        return 0
    end = address + nbytes
    mode = _thp_mode()
    start_huge = {"always": 0, "madvise": huge_from}.get(mode)
    if start_huge is None:
        return _round_up(end, _PAGE) - address
    huge = _huge_page_bytes()
    first_huge = _round_up(address + start_huge, huge)  # the first huge page that fits the region
    return (_round_up(end, huge) if end > first_huge else _round_up(end, _PAGE)) - address


def _reserve_address_space(nbytes: int) -> np.ndarray | None:
    """uint8 [nbytes] over a private anonymous mapping that reserves address space only
    (MAP_NORESERVE): physical pages come on first write, zero-filled; transparent huge pages are
    requested (MADV_HUGEPAGE: 512x fewer first-touch faults). None when the kernel refuses (e.g.
    strict overcommit accounting, vm.overcommit_memory=2, with too little commit headroom)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    try:
        mm = mmap.mmap(-1, max(1, nbytes), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, OverflowError):
        return None
    # Huge pages only past the first few MiB: a small arena keeps 4 KiB pages (no 2 MiB per array).
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes > _HUGE_FROM:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, _HUGE_FROM, nbytes - _HUGE_FROM)
        except OSError:  # THP disabled: 4 KiB pages, still correct
            pass
    return np.frombuffer(mm, np.uint8)


class SlotArrays:
    """Named arrays sharing a leading *slot* axis that grow without copying.

    Each array sits at the front of its own address-space reservation of `max_slots` rows
    (MAP_NORESERVE, so only touched pages use memory); growing to n slots hands out views [:n] of
    the same memory: no copy, no stall proportional to the arena, and views held by readers stay
    valid. `max_slots` is as many slots as fit in `reserve_bytes` (default: the machine's physical
    memory, or the host-memory cap when one is set). Past the reservation, or where the kernel
    refuses to reserve address space, growth falls back to allocate-and-copy, logged as a warning.
    First touch of fresh pages is slow on the lent VMs (seconds per GiB): `touch` faults rows in
    ahead of time (`KVStore.reserve_blocks`), and `touched` counts the rows [0, touched) known done.
    """

    def __init__(self, templates: dict[str, np.ndarray], n_slots: int, what: str,
                 reserve_bytes: int | None = None):
        self.what = what
        self._tails = {name: (t.shape[1:], t.dtype) for name, t in templates.items()}
        slot_bytes = arrays_nbytes(1, templates)
        reserve_bytes = _physical_memory_bytes() if reserve_bytes is None else reserve_bytes
        max_slots = max(n_slots, reserve_bytes // max(1, slot_bytes))
        self._bases: dict[str, np.ndarray] | None = None
        while max_slots >= n_slots:
            bases = {}
            for name, (tail, dt) in self._tails.items():
                row = int(np.prod(tail, dtype=np.int64)) * dt.itemsize
                buf = _reserve_address_space(max_slots * row)
                if buf is None:
                    break
                bases[name] = buf[: max_slots * row].view(dt).reshape((max_slots,) + tail)
            if len(bases) == len(self._tails):
                self._bases = bases
                break
            del bases
            if max_slots == n_slots:
                break
            max_slots = max(n_slots, max_slots // 4)
        if self._bases is None:
            log.warning("%s: could not reserve address space for %d slots; growth will copy the arena",
                        what, n_slots)
            self.max_slots = n_slots
            self.arrays = {name: np.zeros((n_slots,) + tail, dt) for name, (tail, dt) in self._tails.items()}
        else:
            self.max_slots = max_slots
            self.arrays = {name: b[:n_slots] for name, b in self._bases.items()}
        self.touched = 0
        self.copies = 0  # growth events that had to copy (reservation exhausted)

    @property
    def capacity(self) -> int:
        return self.arrays[next(iter(self.arrays))].shape[0]

    def _extents(self, rows: int):
        """Per array: (first page's address, bytes from there to the end of rows [0, rows), offset
        past which huge pages may back it or None, bytes of address space it owns from there)."""
        for a in self.arrays.values():
            start = a.__array_interface__["data"][0]
            row = a[0:1].nbytes
            if self._bases is not None:  # a reservation (page aligned), advised MADV_HUGEPAGE past _HUGE_FROM
                huge_from = _HUGE_FROM if self.max_slots * row > _HUGE_FROM else None
                yield start, min(rows, self.capacity) * row, huge_from, self.max_slots * row
            else:  # NumPy's own allocation (NumPy advises huge pages for large ones): the pages it overlaps
                lo = start - start % _PAGE
                owned = start + a.nbytes - lo
                yield lo, start - lo + min(rows, self.capacity) * row, 0 if a.nbytes >= _HUGE_FROM else None, owned

    def resident_bound(self, rows: int) -> int:
        """The most bytes the arrays can hold resident when only rows [0, rows) were ever written:
        those rows rounded up to whole pages (`resident_bound`), at most one page (4 KiB, or a
        2 MiB huge page past the first 4 MiB) per array beyond the rows themselves."""
        return sum(min(resident_bound(start, nbytes, huge_from), owned)
                   for start, nbytes, huge_from, owned in self._extents(rows))

    def resident_bytes(self) -> int | None:
        """Bytes of the arrays' memory resident now, counted page by page (mincore) over the
        capacity's rows and the pages that round them up; None where that cannot be read."""
        total = 0
        for start, nbytes, huge_from, owned in self._extents(self.capacity):
            got = resident_bytes(start, min(resident_bound(start, nbytes, huge_from), owned))
            if got is None:
                return None
            total += got
        return total

    def grow(self, new_cap: int) -> None:
        """Capacity `new_cap` (>= the current one): a view of the reservation when it fits, else a
        copy into new arrays (logged)."""
        if new_cap <= self.capacity:
            return
        if self._bases is not None and new_cap <= self.max_slots:
            self.arrays = {name: b[:new_cap] for name, b in self._bases.items()}
            return
        log.warning("%s: growing to %d slots beyond the %d-slot address-space reservation copies the "
                    "arena (%.1f MiB)", self.what, new_cap, self.max_slots,
                    arrays_nbytes(self.capacity, self.arrays) / 2**20)
        self.arrays = grow_arrays(self.arrays, new_cap)
        self._bases = None
        self.max_slots = new_cap
        self.copies += 1

    def touch(self, upto: int) -> None:
        """Write zeros to rows [touched, upto) (upto <= capacity): the first touch, done now."""
        upto = min(upto, self.capacity)
        if upto > self.touched:
            for a in self.arrays.values():
                a[self.touched:upto] = 0
            self.touched = upto


def arrays_nbytes(n: int, arrays: dict[str, np.ndarray]) -> int:
    return sum(n * a[0:1].nbytes for a in arrays.values())


class SlotPool:
    """Integer slots [0, capacity) of an arena: fresh ones from a high-water mark, recycled ones
    from a free list; slots released while readers may still see them wait in `retired`."""

    def __init__(self):
        self.high_water = 0
        self.free: list[int] = []
        self.retired: list[int] = []

    def take(self, n: int) -> np.ndarray:
        reuse = [self.free.pop() for _ in range(min(n, len(self.free)))]
        fresh = np.arange(self.high_water, self.high_water + n - len(reuse), dtype=np.int64)
        self.high_water += len(fresh)
        return np.concatenate([np.asarray(reuse, np.int64), fresh])

    def needed_capacity(self, n: int) -> int:
        return self.high_water + max(0, n - len(self.free))

    def n_in_use(self) -> int:
        return self.high_water - len(self.free) - len(self.retired)
