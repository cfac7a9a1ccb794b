"""Reliability of what users save and run (issue 19): one writer per HCache session id across
processes, kill -9 while saving, moved and copied stores, a corrupted newest generation, the store
admin (list / delete / gc), and `jhybrid bench`'s resume keys and exit status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jhybrid.hcache import (CorruptSession, HCacheEngine, SessionLocked, collect_garbage, delete_session,
                            list_sessions)
from jhybrid.hcache import storage
from jhybrid.models import ModelConfig, create_model

CONFIG = ModelConfig(family="llama", vocab_size=97, d_model=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, mlp_dim=96, max_position_embeddings=512)
CHUNK = 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=3)


@pytest.fixture(scope="module")
def prompt():
    return list(np.random.default_rng(5).integers(0, CONFIG.vocab_size, 40))


def engine_at(model, root):
    return HCacheEngine(model, str(root), max_len=256, prefill_chunk=32, chunk_tokens=CHUNK, prefix_reuse=False)


def saved_session(model, root, prompt, turns=1):
    """A session saved `turns` times (one generation per save); returns (id, replies, engine)."""
    engine = engine_at(model, root)
    session = engine.new_session()
    replies = []
    for t in range(turns):
        replies.append(session.generate(prompt[t * 5:] if t else prompt, 4))
        session.save()
    session.close()
    return session.id, replies, engine


def python_child(code: str) -> subprocess.Popen:
    """A Python subprocess running `code` from the repository root (jhybrid importable)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- one writer per session id ----------------------------------------------------------------

def test_second_writer_of_a_session_is_refused_across_processes(model, prompt, tmp_path):
    sid, _, engine = saved_session(model, tmp_path, prompt)
    holder = python_child(f"""
        import sys, time
        from jhybrid.hcache.storage import SessionLock
        lock = SessionLock({str(tmp_path)!r}, {sid!r})
        print("locked", flush=True)
        time.sleep(60)
    """)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for _ in range(3):  # repeated: never a torn save, always the same clear refusal
            with pytest.raises(SessionLocked, match=f"session {sid} is open for writing elsewhere \\(pid {holder.pid}"):
                engine.restore(sid)
        with pytest.raises(SessionLocked):
            delete_session(str(tmp_path), sid)
    finally:
        holder.kill()
        holder.wait()
    # kill -9 released the lock with the process
    restored = engine.restore(sid)
    restored.close()


def test_same_process_second_session_of_one_id_is_refused(model, prompt, tmp_path):
    sid, _, engine = saved_session(model, tmp_path, prompt)
    first = engine.restore(sid)
    with pytest.raises(SessionLocked):
        engine.restore(sid)
    first.close()
    engine.restore(sid).close()


SAVE_LOOP = """
    import os, sys
    import numpy as np
    from jhybrid.hcache import HCacheEngine
    from jhybrid.models import ModelConfig, create_model
    config = ModelConfig(family="llama", vocab_size=97, d_model=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_dim=96, max_position_embeddings=512)
    engine = HCacheEngine(create_model(config, seed=3), sys.argv[1] if len(sys.argv) > 1 else {root!r},
                          max_len=256, prefill_chunk=32, chunk_tokens=16, prefix_reuse=False)
    session = engine.restore({sid!r})
    rng = np.random.default_rng(0)
    print("ready", flush=True)
    while True:
        session.generate(list(rng.integers(0, 97, 20)), 2)
        session.save()
        print("saved", flush=True)
"""


def test_kill_9_while_saving_leaves_a_restorable_session(model, prompt, tmp_path):
    """A child restores and saves in a loop; it is killed at several points of its saves; each time
    the store restores (the newest committed generation, or an older one with a warning)."""
    sid, _, engine = saved_session(model, tmp_path, prompt)
    for delay in (0.0, 0.15, 0.4):
        child = python_child(SAVE_LOOP.format(root=str(tmp_path), sid=sid))
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            child.stdout.readline()  # at least one save committed
            time.sleep(delay)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        session = engine.restore(sid)
        assert len(session.tokens) >= len(prompt)
        session.close()


# ---- moved and copied stores; a corrupted newest generation ------------------------------------

def test_moved_and_copied_stores_restore_from_their_own_files(model, prompt, tmp_path):
    sid, replies, _ = saved_session(model, tmp_path / "a", prompt)
    os.rename(tmp_path / "a", tmp_path / "moved")
    moved = engine_at(model, tmp_path / "moved")
    reply = moved.restore(sid).generate(prompt[:7], 4)
    shutil.copytree(tmp_path / "moved", tmp_path / "copy")
    shutil.rmtree(tmp_path / "moved")  # a copy that read the original's files would now fail
    copy = engine_at(model, tmp_path / "copy")
    session = copy.restore(sid)
    assert session.generate(prompt[:7], 4) == reply
    session.close()
    manifest = storage.load_manifest(str(tmp_path / "copy"), sid)
    assert manifest["stripe_dirs"] == ["data"]


def test_corrupt_newest_generation_falls_back_to_the_older_one(model, prompt, tmp_path, caplog):
    sid, _, engine = saved_session(model, tmp_path, prompt, turns=2)
    generations = storage.committed_generations(str(tmp_path), sid)
    assert generations == [0, 1]
    newest = tmp_path / "sessions" / sid / "1"
    for path in newest.rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00garbage")
    with caplog.at_level("WARNING", logger="jhybrid.hcache"):
        session = engine.restore(sid)
    assert session.generation == 1 and len(session.tokens) + len(session.pending) == len(prompt) + 4
    assert "generation 1" in caplog.text and "unusable" in caplog.text
    session.close()
    for path in (tmp_path / "sessions" / sid / "0").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00garbage")
    with pytest.raises(CorruptSession, match=f"session {sid}: no intact save"):
        engine.restore(sid)


# ---- the store admin -------------------------------------------------------------------------

def test_list_delete_and_collect_garbage(model, prompt, tmp_path):
    keep, _, engine = saved_session(model, tmp_path, prompt)
    drop, _, _ = saved_session(model, tmp_path, prompt[5:])
    orphan = tmp_path / "data" / "deadbeef"
    orphan.mkdir()
    (orphan / "layer_000.bin").write_bytes(b"x" * 100)
    (tmp_path / "data" / keep / "tail-7.bin").write_bytes(b"stale")
    infos = {i.session_id: i for i in list_sessions(str(tmp_path))}
    assert set(infos) == {keep, drop}
    assert infos[keep].generations == (0,) and infos[keep].num_tokens == len(prompt) + 3  # + 4 generated, the last pending
    assert infos[keep].data_bytes > 0 and infos[keep].problem is None
    delete_session(str(tmp_path), drop)
    assert not (tmp_path / "data" / drop).exists() and not (tmp_path / "sessions" / drop).exists()
    report = collect_garbage(str(tmp_path))
    assert report.orphan_data_dirs == (str(orphan),)
    assert report.stale_tail_files == (str(tmp_path / "data" / keep / "tail-7.bin"),)
    assert [i.session_id for i in list_sessions(str(tmp_path))] == [keep]
    session = engine.restore(keep)  # untouched by the collection
    session.close()


def test_sessions_cli_lists_and_reports_bad_roots(model, prompt, tmp_path):
    sid, _, _ = saved_session(model, tmp_path, prompt)
    from jhybrid.cli import main
    assert main(["sessions", "--root", str(tmp_path), "list"]) == 0
    bad = subprocess.run([sys.executable, "-m", "jhybrid.cli", "sessions", "--root", str(tmp_path / "nope"), "list"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "not a session store" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    json.dumps(sid)
