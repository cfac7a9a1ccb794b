"""Where saved sessions live on disk, and how they are made crash-safe.

Layout under an engine's `root` (S = number of stripe directories, default 1 = `root/data`):

  root/sessions/<session_id>/<generation>/   the manifest of one save: an Orbax checkpoint
                                             (JsonCheckpointHandler) written by an Orbax
                                             CheckpointManager, which writes to a temporary
                                             folder and renames it when complete.
  <stripe_dir[s]>/<session_id>/layer_<l>.bin  per layer, the full chunks c with c % S == s, in
                                             order: chunk c sits at byte (c // S) * chunk_bytes.
                                             All chunks of a layer (in one stripe) are contiguous,
                                             so a layer restores with one sequential read per stripe.
  <stripe_dir[0]>/<session_id>/tail-<g>.bin  the partial last chunk of every layer at save g.
  root/prefix/<hash>.json                    prefix index: chained chunk hash -> session id.
  root/locks/<session_id>.lock               held (flock) by the one process writing the session.

Stripe directories inside `root` are recorded relative to it, so a moved or copied store restores
from its own files; directories outside `root` are recorded as given (absolute).

One writer per session id: a Session takes the session's lock when it is created or restored and
holds it until closed; another process (or another Session in this one) gets SessionLocked. A
killed process's lock goes with it (flock).

Crash safety: data files are append-only and a full chunk, once written, never changes. A manifest
names how many chunks it covers (and their crc32 checksums), so a save becomes visible only when
Orbax commits its manifest folder; a crash or a full disk while appending leaves bytes past what
any committed manifest covers, which the next writer of that session truncates away. Earlier saves
stay readable.

A chunk row holds one token of one layer: `d_model` values for a layer saved as hidden states,
`2 * Hkv * D` values (k then v) for a layer saved as KV, nothing for a layer restored by recompute.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger("jhybrid.hcache")

MANIFEST_FORMAT = 1
DEFAULT_CHUNK_TOKENS = 64
METHODS = ("hidden", "kv", "recompute")


class HCacheError(Exception):
    """Base class of every HCache error."""


class SessionNotFound(HCacheError, KeyError):
    def __str__(self):  # KeyError would quote the message
        return str(self.args[0])


class CorruptSession(HCacheError):
    """A checksum or size did not match what the manifest recorded."""


class SessionLocked(HCacheError):
    """Another process (or Session) is writing this session id."""


class ModelMismatch(HCacheError):
    """The session was saved by a different model (config or weights)."""


class _StoreOSError(HCacheError, OSError):
    """An OSError of the store, said as its message alone (no "[Errno N]" in front)."""

    def __str__(self):
        return str(self.strerror) if self.strerror else super().__str__()


class StorageFull(_StoreOSError):
    """The disk filled up while saving; earlier saves of the session are intact, and the session
    can save again once space is freed (nothing it fed is dropped)."""


class StoreNotWritable(_StoreOSError):
    """The session store cannot be written (read-only file system, no permission): sessions can
    be listed there, not opened for writing, deleted or collected."""


class SessionClosed(HCacheError, RuntimeError):
    """A closed Session was asked to generate or save (restore it to go on)."""


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def store_error(err: OSError, root: str, what: str) -> HCacheError:
    """An OSError met while writing the store at `root` as one HCacheError naming the store and
    what was being done: StoreNotWritable for a read-only / forbidden store, StorageFull for a
    full disk, HCacheError otherwise."""
    reason = err.strerror or str(err)
    if err.errno in _NOT_WRITABLE:
        return StoreNotWritable(err.errno, f"session store {root} is not writable ({reason}) while {what}; "
                                "expected a writable store (copy it somewhere writable to change it)")
    if err.errno == errno.ENOSPC:
        return StorageFull(errno.ENOSPC, f"disk full under {root} while {what}; free space and retry")
    return HCacheError(f"{what} under {root} failed: {reason}" + (f" ({err.filename})" if err.filename else ""))


# ----------------------------------------------------------------------------- model identity


def config_hash(config) -> str:
    """sha256 (16 hex) of the ModelConfig's JSON: any shape or switch difference changes it."""
    return hashlib.sha256(config.to_json().encode()).hexdigest()[:16]


def weights_fingerprint(model) -> str:
    """crc32 of a few parameter bytes per layer (embedding row 0, each layer's K/V kernel row 0).

    Cheap (a few KB to the host) and catches a different checkpoint with the same config.
    """
    parts = [np.asarray(model.embed.embedding[...][0])]
    for layer in model.layers:
        parts.append(np.asarray(layer.attention.k_proj.kernel[...][0]))
        parts.append(np.asarray(layer.attention.v_proj.kernel[...][0]))
    crc = 0
    for part in parts:
        crc = zlib.crc32(np.ascontiguousarray(part).tobytes(), crc)
    return f"{crc:08x}"


def describe_config_difference(saved: dict, current: dict) -> str:
    """'num_layers: saved 3, this model 4; ...' for the fields that differ."""
    keys = sorted(set(saved) | set(current))
    diffs = [f"{k}: saved {saved.get(k)!r}, this model {current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    return "; ".join(diffs) or "(no field differs)"


# ----------------------------------------------------------------------------- prefix hashes


def chain_hashes(tokens, chunk_tokens: int, seed: str) -> list[str]:
    """Hash of each FULL chunk of `tokens`, chained: h_c = sha256(h_{c-1} || tokens of chunk c).

    seed: the model's config hash, so two models never share a prefix entry. A hash identifies the
    whole prefix up to and including chunk c, not just chunk c.
    """
    tokens = np.asarray(tokens, np.int64)
    out, prev = [], seed.encode()
    for c in range(len(tokens) // chunk_tokens):
        prev = hashlib.sha256(prev + tokens[c * chunk_tokens:(c + 1) * chunk_tokens].tobytes()).digest()
        out.append(prev.hex()[:32])
    return out


# ----------------------------------------------------------------------------- files


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: str, data: bytes) -> None:
    """Writes to path.tmp, fsyncs, renames: readers see the old file or the new one, never half.
    On failure (e.g. a full disk) the temporary file is removed and the error raised."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def drop_stale_tails(folder: str, kept) -> list[str]:
    """Removes the tail files (`tail-<g>.bin`) in a session's first stripe folder whose generation
    g is not in `kept` (the committed generations); returns the paths removed."""
    removed = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.startswith("tail-") and name.endswith(".bin"):
            try:
                generation = int(name[5:-4])
            except ValueError:
                continue
            if generation not in kept:
                os.remove(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
    return removed


def drop_page_cache(path: str) -> None:
    """Asks the kernel to drop a file's cached pages (posix_fadvise DONTNEED; the file must be
    fsynced, dirty pages are not dropped) so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def storage_full_error(err: OSError, what: str, session_id: str) -> HCacheError:
    """A save's OSError as an HCacheError: StorageFull for a full disk (the session can save again
    once space is freed), StoreNotWritable for a read-only store, HCacheError otherwise."""
    if err.errno == errno.ENOSPC:
        return StorageFull(errno.ENOSPC, f"disk full while {what} for session {session_id}; the "
                           "session's earlier saves are intact, this save was not committed (free "
                           "space and save again: nothing is lost)")
    if err.errno in _NOT_WRITABLE:
        return StoreNotWritable(err.errno, f"{what} for session {session_id} failed: the store is not "
                                f"writable ({err.strerror or err}); expected a writable store")
    return HCacheError(f"{what} for session {session_id} failed: {err}")


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """How one session's chunks map to files.

    stripe_dirs: S directories; chunk c of every layer goes to stripe c % S.
    chunk_tokens: tokens per chunk (64 by default, as in the paper).
    """

    stripe_dirs: tuple[str, ...]
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def session_dir(self, stripe: int, session_id: str) -> str:
        return os.path.join(self.stripe_dirs[stripe], session_id)

    def layer_file(self, stripe: int, session_id: str, layer: int) -> str:
        return os.path.join(self.session_dir(stripe, session_id), f"layer_{layer:03d}.bin")

    def tail_file(self, session_id: str, generation: int) -> str:
        return os.path.join(self.session_dir(0, session_id), f"tail-{generation}.bin")

    def chunks_in_stripe(self, num_chunks: int, stripe: int) -> int:
        """How many of chunks 0..num_chunks-1 live in this stripe."""
        num_stripes = len(self.stripe_dirs)
        return max(0, (num_chunks - stripe + num_stripes - 1) // num_stripes)


class LayerAppender:
    """Appends full chunks of one layer to its stripe files (the writer side of ChunkLayout).

    Each chunk is written with pwrite at its own offset (no buffering, no file position), so a
    failed write (a full disk) is undone by `truncate(num_chunks)` and can simply be made again."""

    def __init__(self, layout: ChunkLayout, session_id: str, layer: int, committed_chunks: int,
                 chunk_bytes: int):
        self.layout, self.session_id, self.layer = layout, session_id, layer
        self.chunk_bytes = chunk_bytes
        self.num_chunks = committed_chunks
        self.fds: list[int] = []
        try:
            for s in range(len(layout.stripe_dirs)):
                os.makedirs(layout.session_dir(s, session_id), exist_ok=True)
                self.fds.append(os.open(layout.layer_file(s, session_id, layer), os.O_RDWR | os.O_CREAT, 0o644))
            # Bytes past the last committed chunk come from a save that never committed.
            self.truncate(committed_chunks)
        except BaseException:
            self.close()
            raise

    def _where(self, chunk: int) -> tuple[int, int]:
        """(fd, byte offset) of a chunk."""
        stripes = len(self.fds)
        return self.fds[chunk % stripes], (chunk // stripes) * self.chunk_bytes

    def append(self, chunk: np.ndarray) -> int:
        """Writes one full chunk [chunk_tokens, row] and returns its crc32 (OSError: nothing counted)."""
        data = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        assert data.nbytes == self.chunk_bytes
        self._write(self.num_chunks, data)
        self.num_chunks += 1
        return zlib.crc32(data)

    def write_at(self, chunk: int, rows: np.ndarray) -> int:
        """Writes one full chunk [chunk_tokens, row] over chunk `chunk` (0 <= chunk < num_chunks: a
        slot the files already hold, e.g. a slot store's reused slot; sessions only `append`) and
        returns its crc32. num_chunks is unchanged."""
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} of layer {self.layer}; expected 0 <= chunk < {self.num_chunks}")
        data = memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8))
        assert data.nbytes == self.chunk_bytes
        self._write(chunk, data)
        return zlib.crc32(data)

    def _write(self, chunk: int, data) -> None:
        fd, offset = self._where(chunk)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)

    def truncate(self, num_chunks: int) -> None:
        """Cuts every stripe file back to the first num_chunks chunks (undoes later appends)."""
        for s, fd in enumerate(self.fds):
            os.ftruncate(fd, self.layout.chunks_in_stripe(num_chunks, s) * self.chunk_bytes)
        self.num_chunks = num_chunks

    def rewrite(self, first: int, crcs: list[int]) -> None:
        """Writes chunks first.. again from what the files hold, checked against their crc32s
        (after a failed fsync the kernel may have dropped those pages: writing them again makes the
        next sync cover them). CorruptSession when a chunk no longer reads back as written."""
        buf = bytearray(self.chunk_bytes)
        for c in range(first, self.num_chunks):
            fd, offset = self._where(c)
            if os.preadv(fd, [buf], offset) != self.chunk_bytes or zlib.crc32(buf) != crcs[c]:
                raise CorruptSession(f"session {self.session_id} layer {self.layer}: chunk {c}, written since "
                                     "the last save, was lost by the failed sync; this session cannot be "
                                     "saved whole any more (its earlier saves are intact)")
            self._write(c, memoryview(buf))

    def sync(self) -> None:
        for fd in self.fds:
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def read_layer_chunks(layout: ChunkLayout, session_id: str, layer: int, num_chunks: int,
                      out: np.ndarray) -> None:
    """Reads full chunks 0..num_chunks-1 of a layer into out[:num_chunks * chunk_tokens].

    out: [>= num_chunks * chunk_tokens, row] C-contiguous host buffer (preallocated, reused).
    One sequential read per stripe file, scattered straight into the chunk slots with preadv.
    """
    chunk_tokens, num_stripes = layout.chunk_tokens, len(layout.stripe_dirs)
    flat = memoryview(out.reshape(-1).view(np.uint8))
    chunk_bytes = out[:chunk_tokens].nbytes
    for s in range(num_stripes):
        count = layout.chunks_in_stripe(num_chunks, s)
        if count == 0:
            continue
        path = layout.layer_file(s, session_id, layer)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptSession(f"session {session_id}: {path} is missing; its manifest records {count} "
                                 "chunks in it") from None
        try:
            if os.fstat(fd).st_size < count * chunk_bytes:
                raise CorruptSession(f"session {session_id}: {path} is shorter than the "
                                     f"{count} chunks its manifest records")
            chunks = list(range(s, num_chunks, num_stripes))
            for begin in range(0, len(chunks), 512):  # stay below IOV_MAX (1024)
                views = [flat[c * chunk_bytes:(c + 1) * chunk_bytes] for c in chunks[begin:begin + 512]]
                got = os.preadv(fd, views, begin * chunk_bytes)
                if got != len(views) * chunk_bytes:
                    raise CorruptSession(f"session {session_id}: short read from {path}")
        finally:
            os.close(fd)


def read_chunk(layout: ChunkLayout, session_id: str, layer: int, chunk: int, out: np.ndarray) -> None:
    """Reads the one full chunk `chunk` of a layer (from stripe chunk % S) into out.

    out: [chunk_tokens, row] C-contiguous host buffer. CorruptSession when the stripe file is
    missing or too short to hold the chunk (as read_layer_chunks)."""
    num_stripes = len(layout.stripe_dirs)
    path = layout.layer_file(chunk % num_stripes, session_id, layer)
    view = memoryview(out.reshape(-1).view(np.uint8))
    offset = (chunk // num_stripes) * view.nbytes
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptSession(f"session {session_id}: {path} is missing; chunk {chunk} is recorded in it") from None
    try:
        if os.preadv(fd, [view], offset) != view.nbytes:
            raise CorruptSession(f"session {session_id}: {path} is shorter than chunk {chunk} it should hold")
    finally:
        os.close(fd)


_crc_pool = ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 1))),
                               thread_name_prefix="hcache-crc")


def verify_chunks(buf: np.ndarray, chunk_tokens: int, expected: list[int], what: str) -> None:
    """Checks crc32 of each chunk of buf [num_chunks * chunk_tokens, row] (zlib releases the GIL,
    so chunks are checked on a small thread pool)."""
    flat = memoryview(buf.reshape(-1).view(np.uint8))
    chunk_bytes = buf[:chunk_tokens].nbytes

    def crc(c):
        return zlib.crc32(flat[c * chunk_bytes:(c + 1) * chunk_bytes])

    got = list(_crc_pool.map(crc, range(len(expected)))) if len(expected) > 4 else \
        [crc(c) for c in range(len(expected))]
    for c, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            raise CorruptSession(f"{what}: chunk {c} checksum {g:08x} != saved {e:08x}")


def _itemsize(dtype_name: str) -> int:
    """Bytes per stored value of a manifest's dtype name (bfloat16 is no NumPy name)."""
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}.get(dtype_name) or np.dtype(dtype_name).itemsize


def missing_files(root: str, manifest: dict) -> str | None:
    """What of a committed save's data is missing or short on disk, found from file sizes only (no
    read, no checksum): None when every layer file and the tail file are there and long enough."""
    sid = manifest["session_id"]
    layout = ChunkLayout(stripe_dirs=resolve_stripe_dirs(root, manifest["stripe_dirs"]),
                         chunk_tokens=manifest["chunk_tokens"])
    itemsize = _itemsize(manifest["dtype"])
    full = manifest.get("num_full_chunks") or 0
    for layer, row in enumerate(manifest["row_values"]):
        chunk_bytes = row * layout.chunk_tokens * itemsize
        for stripe in range(len(layout.stripe_dirs)) if row else ():
            count = layout.chunks_in_stripe(full, stripe)
            path = layout.layer_file(stripe, sid, layer)
            if count and not os.path.exists(path):
                return f"{path} is missing"
            if count and os.path.getsize(path) < count * chunk_bytes:
                return f"{path} is shorter than the {count} chunks the save records"
    tail = os.path.join(layout.session_dir(0, sid), manifest["tail_file"])
    ends = [end for _, end in manifest["tail_offsets"]]
    if ends and max(ends) > 0 and (not os.path.exists(tail) or os.path.getsize(tail) < max(ends)):
        return f"{tail} is missing or short"
    return None


# ----------------------------------------------------------------------------- writer lock


class SessionLock:
    """The exclusive writer lock of one session id (`root/locks/<id>.lock`, flock, non-blocking).
    The file holds the owner's pid for the error message; the lock itself is the flock.

    A lock file may be removed (`remove()`, by its holder: `jhybrid sessions gc` removes those no
    one holds): a locker that opened the file just before checks, once it holds the flock, that
    the path still names the file it locked, and otherwise locks the new file. A lock never
    released is closed when its object is collected or at interpreter exit (weakref.finalize),
    without any message."""

    def __init__(self, root: str, session_id: str):
        check_session_id(session_id)
        folder = os.path.join(root, "locks")
        self.path = os.path.join(folder, f"{session_id}.lock")
        self._fd = None
        self._finalizer = None
        try:
            os.makedirs(folder, exist_ok=True)
            fd = self._lock_file(session_id)
        except OSError as err:
            if err.errno in _NOT_WRITABLE:
                raise store_error(err, root, f"locking session {session_id} for writing") from None
            raise HCacheError(f"cannot lock session {session_id} ({self.path}): {err}") from err
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def _lock_file(self, session_id: str) -> int:
        """Opens and flocks the lock file; -> its fd (SessionLocked when another holder has it)."""
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES):
                    raise SessionLocked(f"session {session_id} is open for writing elsewhere (pid {owner}, lock "
                                        f"{self.path}): close it there first") from None
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # removed (or replaced) while we waited for it: lock the current file

    def remove(self) -> None:
        """Removes the lock file, then releases the lock (only while holding it: see the class)."""
        if self._fd is not None:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.release()

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the fd once: drops the flock
        self._fd = None


def check_session_id(session_id) -> None:
    if not isinstance(session_id, str) or not session_id or os.sep in session_id or session_id.startswith("."):
        raise SessionNotFound(f"invalid session id {session_id!r}")


def stored_stripe_dirs(root: str, dirs) -> list[str]:
    """Stripe directories as a manifest records them: relative to root when inside it."""
    out = []
    for d in dirs:
        rel = os.path.relpath(os.path.abspath(d), root)
        out.append(d if rel == ".." or rel.startswith(".." + os.sep) else rel)
    return out


def resolve_stripe_dirs(root: str, recorded) -> tuple[str, ...]:
    """A manifest's stripe directories as paths (relative entries are under root)."""
    return tuple(d if os.path.isabs(d) else os.path.join(root, d) for d in recorded)


# ----------------------------------------------------------------------------- manifests (Orbax)


def _manager(root: str, session_id: str, create: bool):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=create,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.join(root, "sessions", session_id), options=options,
                                 item_handlers=ocp.JsonCheckpointHandler())


def save_manifest(root: str, session_id: str, generation: int, manifest: dict) -> None:
    """Commits one save: Orbax writes the manifest to a temporary folder and renames it."""
    import orbax.checkpoint as ocp

    manager = _manager(root, session_id, create=True)
    manager.save(generation, args=ocp.args.JsonSave(manifest), force=True)
    manager.wait_until_finished()
    manager.close()


def load_manifest(root: str, session_id: str, generation: int | None = None) -> dict:
    """A committed manifest of a session: the latest, or `generation` (SessionNotFound if there is
    none; CorruptSession naming the folder if it cannot be read)."""
    import orbax.checkpoint as ocp

    check_session_id(session_id)
    if not os.path.isdir(os.path.join(root, "sessions", session_id)):
        raise SessionNotFound(f"no saved session {session_id!r} under {root}")
    manager = _manager(root, session_id, create=False)
    step = manager.latest_step() if generation is None else generation
    if step is None:
        raise SessionNotFound(f"session {session_id!r} under {root} has no committed save")
    folder = os.path.join(root, "sessions", session_id, str(step))
    try:
        manifest = manager.restore(step, args=ocp.args.JsonRestore())
    except Exception as err:  # noqa: BLE001 - any unreadable manifest is a corrupt session
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorruptSession(f"session {session_id}: manifest {folder} is unreadable: {first}") from err
    finally:
        manager.close()
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CorruptSession(f"session {session_id}: manifest {folder} has an unknown format")
    return manifest


def committed_generations(root: str, session_id: str) -> list[int]:
    path = os.path.join(root, "sessions", session_id)
    if not os.path.isdir(path):
        return []
    manager = _manager(root, session_id, create=False)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


# ----------------------------------------------------------------------------- prefix index


def register_prefix(root: str, hashes: list[str], session_id: str) -> None:
    """Points each chained chunk hash at the session (atomic per entry; last writer wins)."""
    folder = os.path.join(root, "prefix")
    os.makedirs(folder, exist_ok=True)
    for c, h in enumerate(hashes):
        path = os.path.join(folder, f"{h}.json")
        write_file_atomically(path, json.dumps({"session_id": session_id, "chunk": c}).encode())


def lookup_prefix(root: str, hashes: list[str]) -> tuple[int, str | None]:
    """Longest run of leading chunk hashes in the index: (number of chunks, session id)."""
    best = (0, None)
    for c, h in enumerate(hashes):
        path = os.path.join(root, "prefix", f"{h}.json")
        try:
            with open(path) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            break
        if entry.get("chunk") != c:
            break
        best = (c + 1, entry["session_id"])
    return best
