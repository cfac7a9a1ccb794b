"""The host end of the native exchange (host/native/exchange.cc): pinned mailboxes and the worker.

Per open hybrid batch, the native library holds one pinned allocation: flags ready[L], done[L],
failed, and one mailbox per layer (the library's "slot" attribute) (q float32 [B, 1, Hq, D], block ids int32 [B, Hkv, k], o float32
[B, 1, Hq, D], lse float32 [B, 1, Hq]). XLA's custom calls fill q (and ids) and raise ready[layer]
in stream order; `ExchangeWorker` answers:

    before a decode step (runtime thread): worker.arm(plan)      # the step's layers, kinds, views
    worker thread: serve_context / serve_blocks (Numba, nogil)   # one call for the whole step:
        for each layer of the plan, in order: wait for ready[layer] >= seq (atomic load),
        attention over the layer's pages (host.attention.attend_pages), o / lse into the slot,
        done[layer] = seq (release)  ->  the stream (or the CPU collect) continues

No Python and no GIL per layer; Python runs once per step on the worker thread (to start the call).
A failure (an exception in the worker, or a step not served within `timeout_s`) writes NaN outputs,
records the error (`raise_pending()` re-raises it at the next step start with the layer and the
worker's traceback) and releases every slot (`jh_exchange_fail`), so neither the stream nor a CPU
collect ever waits forever.

Never imports jax: the device side lives in jhybrid.hybrid.exchange.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import queue
import threading
import time
import traceback
import weakref
import dataclasses
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from host._page_math import load_acquire
from host.attention import attend_pages, attend_pages_into

log = logging.getLogger(__name__)

LIB_ENV = "JHYBRID_NATIVE_LIB"
LIB_NAME = "libjhybrid_exchange.so"


# ---- the native library ---------------------------------------------------------------------------

def library_path() -> str:
    """Where the built library is: $JHYBRID_NATIVE_LIB, else build/native/lib/ of the source tree
    (scripts/setup.sh builds it there)."""
    env = os.environ.get(LIB_ENV)
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "build", "native", "lib", LIB_NAME)


_LIB: list = []  # [CDLL] once loaded


def load_library():
    """The native exchange library (ctypes.CDLL); OSError naming the path when it cannot be loaded."""
    if _LIB:
        return _LIB[0]
    path = library_path()
    if not os.path.exists(path):
        raise OSError(f"native exchange library {path} not found (built by scripts/setup.sh; or set {LIB_ENV})")
    lib = ctypes.CDLL(path)
    i64, c_int, c_double, c_char_p = ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_char_p
    lib.jh_exchange_reserve.restype = c_int
    lib.jh_exchange_open.argtypes = [c_int, c_int, i64, i64, i64, i64, c_int, c_int, c_double, c_int, c_char_p,
                                     c_int]
    lib.jh_exchange_timing.argtypes = [c_int, ctypes.POINTER(c_double)]
    lib.jh_exchange_timing.restype = c_int
    lib.jh_exchange_open.restype = c_int
    lib.jh_exchange_layout.argtypes = [c_int, ctypes.POINTER(i64)]
    lib.jh_exchange_layout.restype = c_int
    lib.jh_exchange_fail.argtypes = [c_int, c_char_p]
    lib.jh_exchange_submitted.argtypes = [c_int, c_int]
    lib.jh_exchange_submitted.restype = i64
    lib.jh_exchange_close.argtypes = [c_int]
    lib.jh_exchange_release.argtypes = [c_int]
    lib.jh_exchange_route.argtypes = [c_int, i64, c_int]
    lib.jh_exchange_route.restype = c_int
    _LIB.append(lib)
    return lib


class NativeExchange:
    """One reserved exchange id for a backend's lifetime (a compile-time attribute of its custom
    calls); `open` installs pinned mailboxes for a batch, `close` frees them."""

    def __init__(self):
        self.lib = load_library()
        self.id = self.lib.jh_exchange_reserve()
        if self.id < 0:
            raise RuntimeError("native exchange: no free exchange id")
        weakref.finalize(self, self.lib.jh_exchange_release, self.id)
        self.mailboxes: Mailboxes | None = None
        # timing()'s output, made once: `ctypes.c_double * 3` per call would build a new array type
        # whenever the collector has freed the last one (ctypes caches them weakly), leaving a
        # trail of cyclic garbage (type objects) every step
        self._timing = (ctypes.c_double * 3)()

    def open(self, n_layers: int, batch: int, hq: int, hkv: int, head_dim: int, max_ids: int, gpu: bool,
             device_ordinal: int = 0, timeout_s: float = 300.0, timing: bool = False) -> "Mailboxes":
        q_bytes = batch * hq * head_dim * 4
        ids_bytes = max(4, batch * hkv * max_ids * 4)
        lse_bytes = batch * hq * 4
        err = ctypes.create_string_buffer(512)
        if self.lib.jh_exchange_open(self.id, n_layers, q_bytes, ids_bytes, q_bytes, lse_bytes, int(gpu),
                                     device_ordinal, float(timeout_s), int(timing), err, len(err)) != 0:
            raise RuntimeError(f"native exchange: {err.value.decode()}")
        self.mailboxes = Mailboxes(self, n_layers, batch, hq, hkv, head_dim, max_ids)
        return self.mailboxes

    def close(self) -> None:
        self.mailboxes = None
        self.lib.jh_exchange_close(self.id)

    def fail(self, message: str) -> None:
        self.lib.jh_exchange_fail(self.id, message.encode()[:4000])

    def timing(self) -> tuple[float, float, int] | None:
        """(ms the stream waited for the host, ms of the exchange's own GPU work, layer exchanges)
        since the last call, over the steps that have completed; None when timing is off."""
        out = self._timing
        if self.lib.jh_exchange_timing(self.id, out) != 0:
            return None
        return out[0], out[1], int(out[2])

    def route(self, ordinal: int, target: "NativeExchange | None") -> None:
        """Tensor parallelism: this exchange's calls made on the device of XLA ordinal `ordinal`
        go to `target` (another reserved exchange; None drops the route)."""
        if self.lib.jh_exchange_route(self.id, int(ordinal), -1 if target is None else target.id) != 0:
            raise ValueError(f"native exchange: cannot route device ordinal {ordinal} (the route table is full)")

    def submitted(self, layer: int) -> int:
        return int(self.lib.jh_exchange_submitted(self.id, layer))


class Mailboxes:
    """NumPy views of an open exchange's pinned memory, one mailbox per layer (q, ids, o, lse rows;
    valid until the next open / close)."""

    def __init__(self, exchange: NativeExchange, n_layers, batch, hq, hkv, head_dim, max_ids):
        layout = (ctypes.c_int64 * 10)()
        if exchange.lib.jh_exchange_layout(exchange.id, layout) != 0:
            raise RuntimeError("native exchange: not open")
        ready, done, failed, q, ids, o, lse, stride, address, total = list(layout)
        memory = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(address))
        self.memory = memory  # keeps the views' base alive with this object

        def rows(offset, dtype, width):  # one C-contiguous 1-D array per layer (what nopython code indexes)
            n_bytes = width * np.dtype(dtype).itemsize
            return tuple(memory[offset + i * stride:offset + i * stride + n_bytes].view(dtype) for i in range(n_layers))

        self.ready = memory[ready:ready + 4 * n_layers].view(np.uint32)
        self.done = memory[done:done + 4 * n_layers].view(np.uint32)
        self.failed = memory[failed:failed + 4].view(np.uint32)
        self.q = rows(q, np.float32, batch * hq * head_dim)
        self.ids = rows(ids, np.int32, max(1, batch * hkv * max_ids))
        self.o = rows(o, np.float32, batch * hq * head_dim)
        self.lse = rows(lse, np.float32, batch * hq)
        self.shape = (n_layers, batch, hq, hkv, head_dim, max_ids)


# ---- nopython pieces ----------------------------------------------------------------------------

@intrinsic
def _store_release(typingctx, arr, index, value):
    """arr[index] = value with release semantics (uint32 array): everything written before is
    visible to whoever sees the value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint32 and isinstance(index, types.Integer)
            and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        aryty, idxty, valty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = context.cast(builder, args[1], idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False, boundscheck=False)
        builder.store_atomic(context.cast(builder, args[2], valty, types.uint32), ptr, "release", 4)
        return context.get_dummy_value()

    return types.none(arr, index, value), codegen


@intrinsic
def _cpu_relax(typingctx):
    """A spin-wait hint (x86 `pause`); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        import platform

        if platform.machine() in ("x86_64", "AMD64", "i686"):
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                   "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _ticks(typingctx):
    """A cheap monotonic tick count (int64): the x86 time-stamp counter, the AArch64 virtual counter
    (cntvct_el0); 0 elsewhere. `tick_seconds()` is the length of one tick."""
    def codegen(context, builder, signature, args):
        import platform

        i64 = ir.IntType(64)
        machine = platform.machine()
        if machine in ("x86_64", "AMD64"):
            read = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, []), "llvm.readcyclecounter")
            return builder.call(read, [])
        if machine in ("aarch64", "arm64"):
            return builder.asm(ir.FunctionType(i64, []), "mrs $0, cntvct_el0", "=r", [], side_effect=True)
        return ir.Constant(i64, 0)

    return types.int64(), codegen


@njit(nogil=True, cache=True)
def _now_ticks() -> int:
    return _ticks()


@functools.cache
def tick_seconds() -> float:
    """Seconds per `_ticks()` tick, measured once against perf_counter over 20 ms (0.0 where the
    counter does not advance: the wait split is then not reported)."""
    _now_ticks()  # loaded (or compiled) outside the measured interval
    t0, c0 = time.perf_counter(), _now_ticks()
    time.sleep(0.02)
    t1, c1 = time.perf_counter(), _now_ticks()
    if c1 <= c0:
        log.info("host exchange: no tick counter on this CPU; the worker's wait for queries is not measured")
        return 0.0
    return (t1 - t0) / (c1 - c0)


@njit(nogil=True, cache=True)
def _wait_ready(ready, layer, seq, abort, stats) -> bool:
    """Spin until ready[layer] reaches seq (cyclic uint32 compare); False when abort[0] is raised.
    The ticks spent (`_ticks`) are added to stats[1]."""
    start = _ticks()
    while True:
        value = load_acquire(ready, layer)
        if np.int32(np.uint32(value - seq)) >= 0:
            stats[1] += _ticks() - start
            return True
        if load_acquire(abort, 0) != 0:
            stats[1] += _ticks() - start
            return False
        _cpu_relax()


@njit(nogil=True, cache=True)
def _answer(slots_o, slots_lse, done, layer, seq, o, lse):
    n_o, n_l = o.size, lse.size
    slots_o[layer][:n_o] = o.reshape(n_o)
    slots_lse[layer][:n_l] = lse.reshape(n_l)
    _store_release(done, layer, seq)


@njit(nogil=True, cache=True)
def serve_context(layers, served, ready, done, abort, slots_q, slots_o, slots_lse, batch, hq, head_dim, hkv,
                  scale, n_threads, fmt, k_pages, v_pages, page_ptr, ptr_off, page_ids, ids_off, unit_tokens, stats):
    """hgca decode step: for each plan entry i (layer layers[i]; its submit's sequence number is
    served[layer] + 1, and served[layer] is advanced once answered) attention of
    that layer's queries over its context-cache pages (k_pages[layer], v_pages[layer]: a tuple over
    layers; page_ptr / page_ids / unit_tokens concatenated over the plan, ptr_off / ids_off [n + 1]
    into them, unit_tokens B * Hkv per entry). stats[1] (int64 [2]) counts the ticks (`_ticks`) spent
    waiting for the layers' queries. Returns the entries served (< n: aborted)."""
    units = batch * hkv
    for i in range(layers.shape[0]):
        layer = layers[i]
        seq = np.uint32(served[layer] + np.uint32(1))
        if not _wait_ready(ready, layer, seq, abort, stats):
            return i
        q = slots_q[layer][:batch * hq * head_dim].reshape(batch, 1, hq, head_dim)
        o, lse = attend_pages(q, k_pages[layer], v_pages[layer], fmt, page_ptr[ptr_off[i]:ptr_off[i + 1]],
                              page_ids[ids_off[i]:ids_off[i + 1]], unit_tokens[i * units:(i + 1) * units],
                              hkv, scale, n_threads)
        _answer(slots_o, slots_lse, done, layer, seq, o, lse)
        served[layer] = seq
    return layers.shape[0]


@njit(nogil=True, cache=True)
def _block_pages(ids, slot_table, n_blocks, hkv, block_size):
    """ids [B, Hkv, k] int32 block numbers (-1 = none) -> (page_ptr [U + 1], page_ids, unit_tokens
    [U]) over the store's pages (slot * Hkv + head), U = B * Hkv; -1 page when a block is unknown."""
    batch, _, k = ids.shape
    units = batch * hkv
    page_ptr = np.zeros(units + 1, np.int64)
    page_ids = np.empty(units * k, np.int64)
    unit_tokens = np.zeros(units, np.int64)
    n = 0
    for b in range(batch):
        for h in range(hkv):
            u = b * hkv + h
            for j in range(k):
                block = ids[b, h, j]
                if block < 0:
                    continue
                if block >= n_blocks[b]:
                    return page_ptr, page_ids[:0], unit_tokens, b * 1000000 + block
                page_ids[n] = slot_table[b, block] * hkv + h
                n += 1
            page_ptr[u + 1] = n
            unit_tokens[u] = (n - page_ptr[u]) * block_size
    return page_ptr, page_ids[:n], unit_tokens, -1


@njit(nogil=True, cache=True)
def serve_blocks(layers, served, ready, done, abort, slots_q, slots_ids, slots_o, slots_lse, batch, hq, head_dim,
                 hkv, k, scale, n_threads, fmt, block_size, k_pages, v_pages, slot_tables, n_blocks, last_ids,
                 stats):
    """topk / scout decode step: for each plan entry i, attention of layer layers[i]'s queries over
    the blocks its ids name (slots_ids: int32 [B, Hkv, k] numbers; slot_tables [n, B, W] int64 store
    slot of each block, n_blocks [n, B]). Each layer's ids are kept in last_ids[layer] (int32
    [L, B * Hkv * k]: scout's recall planner reads them); stats[0] counts the tokens attended.
    stats[1] counts the ticks (`_ticks`) spent waiting for the layers' queries.
    Returns (entries served, -1 or the bad (sequence, block) code of the entry that stopped)."""
    for i in range(layers.shape[0]):
        layer = layers[i]
        seq = np.uint32(served[layer] + np.uint32(1))
        if not _wait_ready(ready, layer, seq, abort, stats):
            return i, -1
        q = slots_q[layer][:batch * hq * head_dim].reshape(batch, 1, hq, head_dim)
        ids = slots_ids[layer][:batch * hkv * k].reshape(batch, hkv, k)
        last_ids[layer, :ids.size] = ids.reshape(ids.size)
        page_ptr, page_ids, unit_tokens, bad = _block_pages(ids, slot_tables[i], n_blocks[i], hkv, block_size)
        if bad >= 0:
            return i, bad
        stats[0] += unit_tokens.sum()
        # o, lse straight into the layer's output slots (no per-layer arrays, no copy), then done
        attend_pages_into(q, k_pages[layer], v_pages[layer], fmt, page_ptr, page_ids, unit_tokens, hkv, scale,
                          n_threads, slots_o[layer][:batch * hq * head_dim].reshape(batch, 1, hq, head_dim),
                          slots_lse[layer][:batch * hq].reshape(batch, 1, hq))
        _store_release(done, layer, seq)
        served[layer] = seq
    return layers.shape[0], -1


@njit(nogil=True, cache=True)
def _clip_units(page_ptr, page_ids, unit_tokens, token_index, unit_limit):
    """Kept tokens of each unit with token_index < unit_limit[u] (a unit's kept tokens are in
    increasing token order): binary search over its pages. token_index [pages, page_tokens] int64."""
    page_tokens = token_index.shape[1]
    out = unit_tokens.copy()
    for u in range(unit_tokens.shape[0]):
        lo, hi = 0, unit_tokens[u]  # first row with index >= limit lies in [lo, hi]
        base = page_ptr[u]
        while lo < hi:
            mid = (lo + hi) // 2
            if token_index[page_ids[base + mid // page_tokens], mid % page_tokens] < unit_limit[u]:
                lo = mid + 1
            else:
                hi = mid
        out[u] = lo
    return out


def clip_to_published(view, token_index: np.ndarray, published_tokens: np.ndarray):
    """The context-cache view (host.paged_view.PagedKV over B * Hkv units) limited to the kept tokens
    of published blocks: token_index < published_tokens[b] (int64 [B]). hgca's sparsification runs
    before its blocks are published, so the context may already hold tokens the GPU still attends."""
    limits = np.repeat(np.asarray(published_tokens, np.int64), view.n_kv_heads)
    return dataclasses.replace(view, unit_tokens=_clip_units(view.page_ptr, view.page_ids, view.unit_tokens,
                                                             token_index, limits))


# ---- the worker ----------------------------------------------------------------------------------

@dataclass
class ContextPages:
    """hgca: every planned layer's context-cache pages. k_pages / v_pages: tuples over ALL layers of
    [pages, page_tokens, D] storage arrays; page_ptr / page_ids int64 concatenated over the plan's
    entries (ptr_off / ids_off int64 [n + 1] into them); unit_tokens int64 [n * B * Hkv]; fmt the
    storage format code."""

    fmt: int
    k_pages: tuple
    v_pages: tuple
    page_ptr: np.ndarray
    ptr_off: np.ndarray
    page_ids: np.ndarray
    ids_off: np.ndarray
    unit_tokens: np.ndarray

    @classmethod
    def of(cls, store, n_layers: int, batch: int, published_tokens: np.ndarray) -> "ContextPages":
        """Every layer's kept tokens of the blocks the host side owns: token_index <
        published_tokens[b] (int64 [B]). Call with the store's lock held."""
        views = [clip_to_published(store.context.snapshot_locked(layer, range(batch)),
                                   store.context.layers[layer].arrays["token_index"], published_tokens)
                 for layer in range(n_layers)]
        return cls(fmt=views[0].fmt, k_pages=tuple([v.k_pages for v in views]), v_pages=tuple([v.v_pages for v in views]),
                   page_ptr=np.concatenate([v.page_ptr for v in views]),
                   ptr_off=np.cumsum([0] + [v.page_ptr.shape[0] for v in views]).astype(np.int64),
                   page_ids=np.concatenate([v.page_ids for v in views]),
                   ids_off=np.cumsum([0] + [v.page_ids.shape[0] for v in views]).astype(np.int64),
                   unit_tokens=np.concatenate([v.unit_tokens for v in views]))

    def serve(self, worker: "ExchangeWorker", layers: np.ndarray) -> tuple[int, int]:
        """Answer the plan's layers in order -> (entries served, -1)."""
        s = worker.mailboxes
        _, batch, hq, hkv, head_dim, _ = s.shape
        served = serve_context(layers, worker.served, s.ready, s.done, worker.abort, s.q, s.o, s.lse, batch, hq,
                               head_dim, hkv, worker.scale, worker.n_threads, self.fmt, self.k_pages, self.v_pages,
                               self.page_ptr, self.ptr_off, self.page_ids, self.ids_off, self.unit_tokens,
                               worker.stats)
        return served, -1


@dataclass
class BlockPages:
    """topk / scout: the store's block pages. k: blocks per (sequence, KV head) in the ids;
    k_pages / v_pages: tuples over ALL layers of [slots * Hkv, block_size, D] storage arrays;
    slot_tables int64 [n, B, W] (the store slot of each block of each sequence, per plan entry),
    n_blocks int64 [n, B]."""

    k: int
    fmt: int
    block_size: int
    k_pages: tuple
    v_pages: tuple
    slot_tables: np.ndarray
    n_blocks: np.ndarray

    @classmethod
    def of(cls, store, k: int, slot_tables: np.ndarray, published: np.ndarray) -> "BlockPages":
        """Every layer's store blocks: k block ids per (sequence, KV head) in a call, slot_tables
        int64 [L, B, W] the store slot of each block (copied), published int64 [B] the blocks the host
        side owns. Call with the store's lock held."""
        from host.store_format import FORMAT_CODE

        c = store.config
        arenas = [store.layers[layer].arrays for layer in range(c.n_layers)]
        return cls(k=k, fmt=FORMAT_CODE[c.kv_dtype], block_size=c.block_size,
                   k_pages=tuple([a["k"].reshape(-1, c.block_size, c.row_width) for a in arenas]),
                   v_pages=tuple([a["v"].reshape(-1, c.block_size, c.row_width) for a in arenas]),
                   slot_tables=slot_tables.copy(),
                   n_blocks=np.broadcast_to(published, (c.n_layers, slot_tables.shape[1])).copy())

    def serve(self, worker: "ExchangeWorker", layers: np.ndarray) -> tuple[int, int]:
        """Answer the plan's layers in order -> (entries served, -1 or the bad (sequence, block) code)."""
        s = worker.mailboxes
        _, batch, hq, hkv, head_dim, _ = s.shape
        return serve_blocks(layers, worker.served, s.ready, s.done, worker.abort, s.q, s.ids, s.o, s.lse, batch, hq,
                            head_dim, hkv, self.k, worker.scale, worker.n_threads, self.fmt, self.block_size,
                            self.k_pages, self.v_pages, self.slot_tables, self.n_blocks, worker.last_ids,
                            worker.stats)


@dataclass
class StepPlan:
    """What one decode step asks of the host: layers int32 [n] in submission order, and `pages()`: run
    on the worker thread before the step is served, it returns the pages to attend (ContextPages or
    BlockPages: each serves itself) and a function to call once the step is served (the store's
    reader bracket)."""

    layers: np.ndarray
    pages: object


class ExchangeWorker:
    """One thread that serves armed steps in order (see the module docstring)."""

    def __init__(self, exchange: NativeExchange, mailboxes: Mailboxes, n_threads: int, scale: float,
                 timeout_s: float = 300.0):
        self.exchange, self.mailboxes = exchange, mailboxes
        self.n_threads, self.scale, self.timeout_s = n_threads, np.float32(scale), timeout_s
        self.abort = np.zeros(1, np.uint32)
        self.closing = False  # close() was called: an abandoned step is not an error
        self.error: BaseException | None = None
        self.serve_s = 0.0  # worker seconds inside serve calls (waiting for queries included)
        self.steps = 0
        n_layers, batch, _, hkv, _, max_ids = mailboxes.shape
        self.last_ids = np.full((n_layers, max(1, batch * hkv * max_ids)), -1, np.int32)  # last step's ids
        self.stats = np.zeros(2, np.int64)  # [tokens attended (blocks kind), ticks waiting for queries]
        self.tick_s = tick_seconds()
        self.served_any = False
        # per layer: the sequence number of the last submit answered. The next submit of a layer
        # carries served + 1 (submits of a layer are answered in order); counting here, not at
        # arm time, keeps the worker right when the caller dispatches steps ahead of their execution.
        self.served = np.zeros(n_layers, np.uint32)
        self._plans: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="jhybrid-exchange", daemon=True)
        self._thread.start()
        # A process that exits with a step armed but never run (its owner not closed: an error or an
        # interrupt between before_step and the call) stops this thread first: the native exchange's
        # release at exit (a weakref.finalize, registered earlier, so run later) would free the
        # mailboxes its wait polls.
        self._close_at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._close_at_exit)

    def arm(self, plan: StepPlan) -> None:
        """Serve `plan` once the step's submits arrive (call before dispatching the step)."""
        self._idle.clear()
        self._plans.put((plan, time.perf_counter()))

    def forget_rows(self, rows) -> None:
        """Rows `rows` of the batch start new sequences: their last step's block ids are none (-1).
        Call while the worker is idle."""
        n_layers, batch, _, hkv, _, max_ids = self.mailboxes.shape
        if max_ids:
            view = self.last_ids[:, :batch * hkv * max_ids].reshape(n_layers, batch, hkv * max_ids)
            view[:, rows] = -1

    @property
    def idle_s(self) -> float:
        """Seconds the worker spent inside serve calls waiting for the device's queries (part of
        serve_s; serve_s - idle_s is the snapshot plus the host attention). 0.0 where the CPU has no
        tick counter (`tick_seconds`)."""
        return float(self.stats[1]) * self.tick_s

    def reset_counters(self) -> None:
        self.wait_idle()
        self.serve_s, self.steps = 0.0, 0
        self.stats[:] = 0

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)

    def raise_pending(self) -> None:
        """Re-raise the worker's first error (once)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self, timeout: float | None = None) -> bool:
        """Stop the worker: an armed step it is serving is abandoned at its next layer (not an error:
        the owner is closing). -> True once the thread has ended (then its pinned mailboxes may be
        freed); False if it is still inside a layer's attention after `timeout` seconds (default
        timeout_s): the caller must then leave the memory it reads alone."""
        atexit.unregister(self._close_at_exit)
        self.closing = True
        self.abort[0] = 1
        self._plans.put(None)
        self._thread.join(timeout=self.timeout_s if timeout is None else timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        numba.set_num_threads(self.n_threads)
        while True:
            item = self._plans.get()
            if item is None:
                return
            plan, armed = item
            watchdog = threading.Timer(self.timeout_s, self._time_out, args=(plan,))
            watchdog.daemon = True
            watchdog.start()
            start = time.perf_counter()
            release = None
            try:
                pages, release = plan.pages()
                self._serve(plan, pages)
            except BaseException as exc:  # noqa: BLE001 - surfaced at the next step start
                if self.closing:  # abandoned by close(): release the stream, no error to report
                    log.debug("host exchange: a step abandoned at close (%s)", exc)
                    self.exchange.fail("closed")
                else:
                    exc.add_note(f"--- raised in the host exchange worker ---\n{traceback.format_exc()}")
                    self._fail(exc)
            finally:
                watchdog.cancel()
                self.serve_s += time.perf_counter() - start
                self.steps += 1
                self.served_any = True
                if release is not None:
                    release()
                if self._plans.empty():
                    self._idle.set()

    def _serve(self, plan: StepPlan, pages) -> None:
        served, bad = pages.serve(self, plan.layers)
        if served < len(plan.layers):
            layer = int(plan.layers[served])
            if bad >= 0:
                raise ValueError(f"host exchange: layer {layer}: block {bad % 1000000} of sequence "
                                 f"{bad // 1000000} is not in the host store")
            if self.abort[0]:
                raise RuntimeError(f"host exchange: stopped at layer {layer} (aborted: closed or timed out)")

    def _time_out(self, plan: StepPlan) -> None:
        self._fail(TimeoutError(f"host exchange: a decode step was not served within {self.timeout_s} s "
                                f"(layers {plan.layers.tolist()[:8]}...)"))
        self.abort[0] = 1

    def _fail(self, error: BaseException) -> None:
        """Poison every output (NaN), keep the error, release every slot (nothing waits forever)."""
        for rows in (self.mailboxes.o, self.mailboxes.lse):
            for row in rows:
                row[:] = np.nan
        if self.error is None:
            self.error = error
        log.error("host exchange failed: %s: %s", type(error).__name__, error)
        self.exchange.fail(f"{type(error).__name__}: {error}")


def _close_at_exit(worker_ref, timeout: float = 5.0) -> None:
    """At interpreter exit: close the worker if it is still alive (`ExchangeWorker.__init__`)."""
    worker = worker_ref()
    if worker is not None:
        worker.close(timeout=timeout)


__all__ = ["NativeExchange", "Mailboxes", "ExchangeWorker", "StepPlan", "ContextPages", "BlockPages",
           "clip_to_published", "load_library", "library_path"]
