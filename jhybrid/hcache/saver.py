"""Saving a session's per-layer state in two stages (paper §4.2.2).

Stage 1 (`snapshot_to_host`, on the caller's thread): one bulk device->host copy of a forward
call's hidden states into pinned host memory (`memory_kind="pinned_host"`, asynchronous on GPU) —
or `np.asarray` where the backend has no pinned host memory kind (logged once).
Stage 2 (`SessionWriter`'s background thread): waits for that copy, packs each layer's rows into
fixed-size chunk buffers (64 tokens by default) and appends every full chunk to the layer's file
(storage.LayerAppender), recording its crc32. `commit()` drains the queue and returns what a
manifest needs; nothing becomes visible until the manifest is saved (storage.save_manifest).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import jax
import numpy as np

from jhybrid.hcache.storage import ChunkLayout, CorruptSession, LayerAppender, storage_full_error

log = logging.getLogger("jhybrid.hcache")
_logged_copy_path: set[str] = set()


def pinned_host_sharding(device) -> jax.sharding.Sharding | None:
    """SingleDeviceSharding on the device's pinned host memory, or None where unsupported.

    On the CPU backend a device array already is host memory, so there is nothing to pin.
    """
    if device.platform == "cpu":
        return None
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - older runtimes: no memory API
        return None
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def snapshot_to_host(x: jax.Array) -> Callable[[], np.ndarray]:
    """Stage 1: starts one bulk device->host copy of x; returns a function that waits for it and
    gives the host array (zero-copy NumPy view of the pinned buffer where there is one)."""
    device = next(iter(x.devices()))
    sharding = pinned_host_sharding(device)
    path = "pinned_host device_put" if sharding is not None else "np.asarray (no pinned_host)"
    if path not in _logged_copy_path:
        _logged_copy_path.add(path)
        log.info("hcache: device->host snapshots use %s on %s", path, device.platform)
    if sharding is None:
        x.copy_to_host_async()
        return lambda: np.asarray(x)
    pinned = jax.device_put(x, sharding)
    return lambda: np.asarray(pinned)


class SessionWriter:
    """Background packer of one session's layer rows into chunk files.

    row_values: per layer, values per token row (d_model for "hidden", 2*Hkv*D for "kv", 0 for
    "recompute": nothing stored). dtype: the storage dtype (the model's activation dtype).
    Starts from `committed_chunks` full chunks already on disk, `tails` (per layer [t, row] rows of
    the partial chunk) and `crcs` (per layer, crc32 of each committed chunk) of an earlier save.

    A full disk loses nothing: each queued item (rows of some layers) is packed whole or not at all
    (a failed chunk write is undone: the layers' chunk state and files go back to where the item
    began), and an item that could not be written, with every item after it, waits in host memory
    (`backlog`). `commit()` writes the backlog first: it raises StorageFull while the disk is still
    full and succeeds once space is freed. A failed fsync is retried the same way (the chunks written
    since the last good sync are written again from the files, crc-checked). Any other error is
    kept and raised by every later commit (this session can then no longer be saved whole).
    """

    def __init__(self, layout: ChunkLayout, session_id: str, row_values: list[int], dtype,
                 committed_chunks: int = 0, tails: list[np.ndarray] | None = None,
                 crcs: list[list[int]] | None = None):
        self.layout, self.session_id = layout, session_id
        self.row_values, self.dtype = list(row_values), np.dtype(dtype)
        chunk = layout.chunk_tokens
        self.chunk_bufs = [np.empty((chunk, r), self.dtype) if r else None for r in row_values]
        self.fill = [0] * len(row_values)
        self.crcs = [list(c) for c in crcs] if crcs else [[] for _ in row_values]
        self.tokens_written = [committed_chunks * chunk] * len(row_values)
        self.appenders: list[LayerAppender | None] = []
        try:
            for layer, r in enumerate(row_values):
                self.appenders.append(
                    LayerAppender(layout, session_id, layer, committed_chunks,
                                  chunk * r * self.dtype.itemsize) if r else None)
        except OSError as err:
            self._close_appenders()
            raise storage_full_error(err, "opening chunk files", session_id) from err
        self.synced = [committed_chunks] * len(row_values)  # chunks per layer covered by a good fsync
        self.resync = False  # the last sync failed: rewrite chunks synced.. before syncing again
        if tails is not None:
            for layer, tail in enumerate(tails):
                if self.chunk_bufs[layer] is not None and len(tail):
                    self.chunk_bufs[layer][:len(tail)] = tail
                    self.fill[layer] = len(tail)
                    self.tokens_written[layer] += len(tail)
        self.error: BaseException | None = None  # a failure no retry can mend (not a full disk)
        self.backlog: list[tuple[list[int], np.ndarray]] = []  # items waiting for disk space
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"hcache-writer-{session_id[:8]}",
                                       daemon=True)
        self.thread.start()

    # -- producer side (the generation thread) --

    def submit(self, layers: list[int], rows: Callable[[], np.ndarray]) -> None:
        """Queues rows for `layers`: rows() -> [len(layers), T, row] host array (stage 1 result).

        After an error that is not a full disk (logged when it happens) rows are dropped:
        generation goes on, and `commit()` raises the error, since this session's state can no
        longer be saved whole."""
        if self.error is None:
            self.queue.put((layers, rows))

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def commit(self) -> dict:
        """Waits for every queued row, writes what waited for disk space, fsyncs the chunk files,
        returns the manifest's storage part: num_full_chunks, chunk_crc (per layer), tails (per
        layer [t, row] copies). StorageFull while the disk is full (call again once space is freed)."""
        self.queue.join()
        self.raise_if_failed()
        while self.backlog:  # the writer thread is idle: the queue is drained
            layers, host = self.backlog[0]
            try:
                self._pack_item(layers, host)
            except OSError as err:
                raise storage_full_error(err, "appending chunks", self.session_id) from err
            self.backlog.pop(0)
        stored = [n for n, r in zip(self.tokens_written, self.row_values) if r]
        if len(set(stored)) > 1:
            raise RuntimeError(f"hcache: layers hold different token counts {sorted(set(stored))}")
        try:
            for layer, appender in enumerate(self.appenders):
                if appender is not None:
                    if self.resync:
                        appender.rewrite(self.synced[layer], self.crcs[layer])
                    appender.sync()
        except OSError as err:
            self.resync = True
            raise storage_full_error(err, "syncing chunk files", self.session_id) from err
        except CorruptSession as err:
            self.error = err
            raise
        self.resync = False
        self.synced = [a.num_chunks if a is not None else 0 for a in self.appenders]
        full = [len(c) for c, r in zip(self.crcs, self.row_values) if r]
        return {
            "num_full_chunks": full[0] if full else None,
            "chunk_crc": [list(c) for c in self.crcs],
            "tails": [buf[:n].copy() if buf is not None else None
                      for buf, n in zip(self.chunk_bufs, self.fill)],
        }

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self._close_appenders()

    def _close_appenders(self) -> None:
        for appender in self.appenders:
            if appender is not None:
                appender.close()

    # -- stage 2 (background thread) --

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    layers, rows = item
                    host = rows()
                    if self.backlog:  # the disk was full: keep the order, write at the next commit
                        self.backlog.append((layers, np.array(host)))
                    else:
                        try:
                            self._pack_item(layers, host)
                        except OSError as err:
                            self.backlog.append((layers, np.array(host)))
                            log.error("hcache: %s (kept in memory until the next save)",
                                      storage_full_error(err, "appending chunks", self.session_id))
            except BaseException as err:  # noqa: BLE001 - reported to the producer on its next call
                self.error = err
                log.exception("hcache: writer thread failed")
            finally:
                self.queue.task_done()

    def _pack_item(self, layers: list[int], host: np.ndarray) -> None:
        """Packs one item's rows into its layers, whole or not at all: on an OSError every layer of
        the item goes back to its state before the item (chunk buffer, fill, crcs, files)."""
        saved = [(layer, self.fill[layer], self.chunk_bufs[layer][:self.fill[layer]].copy(),
                  len(self.crcs[layer]), self.tokens_written[layer]) for layer in layers]
        try:
            for i, layer in enumerate(layers):
                self._pack(layer, host[i])
        except OSError:
            for layer, fill, rows, num_crcs, written in saved:
                self.chunk_bufs[layer][:fill] = rows
                self.fill[layer], self.tokens_written[layer] = fill, written
                del self.crcs[layer][num_crcs:]
                self.appenders[layer].truncate(num_crcs)
            raise

    def _pack(self, layer: int, rows: np.ndarray) -> None:
        buf, chunk = self.chunk_bufs[layer], self.layout.chunk_tokens
        done = 0
        while done < len(rows):
            take = min(chunk - self.fill[layer], len(rows) - done)
            buf[self.fill[layer]:self.fill[layer] + take] = rows[done:done + take]
            self.fill[layer] += take
            done += take
            if self.fill[layer] == chunk:
                self.crcs[layer].append(self.appenders[layer].append(buf))
                self.fill[layer] = 0
        self.tokens_written[layer] += len(rows)
