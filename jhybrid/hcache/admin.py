"""Managing a session store without a model: list sessions and their generations, delete a session,
collect orphaned data (`jhybrid sessions list | delete | gc --root DIR`).

    from jhybrid.hcache.admin import list_sessions, delete_session, collect_garbage
    for info in list_sessions(root): print(info.session_id, info.generations, info.num_tokens)

Everything here takes the session's writer lock (storage.SessionLock) before it removes anything, so
a session open for writing elsewhere is never touched (SessionLocked).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from jhybrid.hcache import storage
from jhybrid.hcache.storage import HCacheError, SessionLock, SessionLocked


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """One saved session: its committed generations (oldest first), the token count of the newest
    one a restore would use (None: none is usable), bytes on disk, and `problem`: why the newest
    save is damaged (then which older one restores), or why none is usable; None when the newest is
    intact. Checked from the manifests and file sizes (not the checksums: a restore checks those)."""

    session_id: str
    generations: tuple[int, ...]
    num_tokens: int | None
    data_bytes: int
    problem: str | None = None


def _session_ids(root: str) -> list[str]:
    folder = os.path.join(root, "sessions")
    if not os.path.isdir(folder):
        raise HCacheError(f"{root} is not a session store (no sessions/ folder)")
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))


def _data_dirs(root: str, session_id: str, manifest: dict | None) -> list[str]:
    """The session's chunk folders: those its manifest records, else the default stripe."""
    dirs = storage.resolve_stripe_dirs(root, manifest["stripe_dirs"]) if manifest else (os.path.join(root, "data"),)
    return [os.path.join(d, session_id) for d in dirs]


def _folder_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def _usable_manifest(root: str, sid: str, generations) -> tuple[dict | None, str | None]:
    """(manifest of the newest usable generation or None, problem or None): a generation is usable
    when its manifest reads and its files are all there (storage.missing_files)."""
    damaged = []
    for generation in reversed(generations):
        try:
            manifest = storage.load_manifest(root, sid, generation)
            missing = storage.missing_files(root, manifest)
        except HCacheError as err:
            missing = str(err)
        if missing is None:
            if not damaged:
                return manifest, None
            return manifest, f"newest save damaged ({damaged[0]}); generation {generation} restores"
        damaged.append(f"generation {generation}: {missing}")
    if not generations:
        return None, "no committed save"
    return None, f"no usable save ({damaged[0]})"


def list_sessions(root: str) -> list[SessionInfo]:
    """Every session of the store, oldest id first (SessionInfo: generations, tokens, bytes and
    what is damaged)."""
    root = os.path.abspath(root)
    out = []
    for sid in _session_ids(root):
        generations = tuple(storage.committed_generations(root, sid))
        manifest, problem = _usable_manifest(root, sid, generations)
        data = sum(_folder_bytes(d) for d in _data_dirs(root, sid, manifest))
        out.append(SessionInfo(sid, generations, None if manifest is None else manifest["num_tokens"],
                               data + _folder_bytes(os.path.join(root, "sessions", sid)), problem))
    return out


def delete_session(root: str, session_id: str) -> None:
    """Removes a session: its manifests, chunk files, lock file and prefix-index entries
    (SessionLocked if it is open for writing; SessionNotFound if there is no such session;
    StoreNotWritable for a read-only store)."""
    root = os.path.abspath(root)
    storage.check_session_id(session_id)
    folder = os.path.join(root, "sessions", session_id)
    if not os.path.isdir(folder):
        raise storage.SessionNotFound(f"no saved session {session_id!r} under {root}")
    lock = SessionLock(root, session_id)
    try:
        try:
            manifest = storage.load_manifest(root, session_id)
        except HCacheError:
            manifest = None  # an unreadable session is deleted from the default stripe
        for d in _data_dirs(root, session_id, manifest):
            if os.path.isdir(d):
                shutil.rmtree(d)
        shutil.rmtree(folder)
        _drop_prefix_entries(root, lambda sid: sid == session_id)
        lock.remove()
    except OSError as err:
        if isinstance(err, HCacheError):
            raise
        raise storage.store_error(err, root, f"deleting session {session_id}") from None
    finally:
        lock.release()


def _drop_prefix_entries(root: str, drop) -> int:
    """Removes prefix-index entries whose session id satisfies drop(id) (unreadable ones too)."""
    folder = os.path.join(root, "prefix")
    dropped = 0
    if not os.path.isdir(folder):
        return 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                sid = json.load(f).get("session_id")
        except (OSError, ValueError):
            sid = None  # unreadable entry: dropped too
        if sid is None or drop(sid):
            os.remove(path)
            dropped += 1
    return dropped


@dataclasses.dataclass(frozen=True)
class GarbageReport:
    """What `collect_garbage` removed: chunk folders of sessions with no committed save, tail files
    of generations no manifest keeps, prefix entries naming missing sessions, lock files no one
    held; and skipped ids that were locked (being written)."""

    orphan_data_dirs: tuple[str, ...]
    stale_tail_files: tuple[str, ...]
    prefix_entries: int
    skipped_locked: tuple[str, ...]
    stale_lock_files: tuple[str, ...] = ()


def collect_garbage(root: str) -> GarbageReport:
    """Removes data no committed save refers to (default stripe root/data only: other stripe
    directories are listed in manifests, so orphans there are not discoverable from the store)
    and the lock files of sessions no one has open (StoreNotWritable for a read-only store)."""
    root = os.path.abspath(root)
    try:
        return _collect_garbage(root)
    except OSError as err:
        if isinstance(err, HCacheError):
            raise
        raise storage.store_error(err, root, "collecting garbage") from None


def _collect_garbage(root: str) -> GarbageReport:
    live = {sid for sid in _session_ids(root) if storage.committed_generations(root, sid)}
    orphans, tails, locked, locks = [], [], [], []
    data = os.path.join(root, "data")
    lock_dir = os.path.join(root, "locks")
    candidates = set(os.listdir(data)) if os.path.isdir(data) else set()
    lock_files = {name[:-5] for name in os.listdir(lock_dir) if name.endswith(".lock")} if os.path.isdir(lock_dir) else set()
    for sid in sorted(candidates | lock_files):
        if sid.startswith("."):
            continue
        try:
            lock = SessionLock(root, sid)
        except SessionLocked:
            locked.append(sid)
            continue
        except storage.StoreNotWritable:
            raise
        except HCacheError:
            continue
        try:
            path = os.path.join(data, sid)
            if sid in candidates and os.path.isdir(path):
                if sid not in live:
                    shutil.rmtree(path)
                    orphans.append(path)
                else:
                    tails += storage.drop_stale_tails(path, set(storage.committed_generations(root, sid)))
            lock.remove()  # no one holds it: a stale lock file (the next writer makes a new one)
            locks.append(lock.path)
        finally:
            lock.release()
    dropped = _drop_prefix_entries(root, lambda sid: sid not in live)
    return GarbageReport(tuple(orphans), tuple(tails), dropped, tuple(locked), tuple(locks))


__all__ = ["SessionInfo", "GarbageReport", "list_sessions", "delete_session", "collect_garbage"]
