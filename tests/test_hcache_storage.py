"""HCache storage: striped chunk files round trip (more chunks than one preadv takes), checksums,
chained prefix hashes, truncation of uncommitted bytes; one chunk written over in place and read
alone (the prefix cache's disk tier slots)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jhybrid.hcache import storage
from jhybrid.hcache.storage import ChunkLayout, CorruptSession, LayerAppender


@pytest.mark.parametrize("num_stripes", [1, 3])
def test_striped_chunks_round_trip(tmp_path, rng, num_stripes):
    layout = ChunkLayout(stripe_dirs=tuple(str(tmp_path / f"d{s}") for s in range(num_stripes)),
                         chunk_tokens=4)
    rows = rng.standard_normal((4 * 1100, 3)).astype(np.float32)  # 1100 chunks > 2 preadv batches
    appender = LayerAppender(layout, "s", 0, 0, rows[:4].nbytes)
    crcs = [appender.append(rows[c * 4:(c + 1) * 4]) for c in range(1100)]
    appender.sync()
    appender.close()
    out = np.empty_like(rows)
    storage.read_layer_chunks(layout, "s", 0, 1100, out)
    np.testing.assert_array_equal(out, rows)
    storage.verify_chunks(out, 4, crcs, "test")
    out[4 * 700 + 1, 2] += 1.0
    with pytest.raises(CorruptSession, match="chunk 700 checksum"):
        storage.verify_chunks(out, 4, crcs, "test")


def test_reopening_truncates_bytes_past_the_committed_chunks(tmp_path):
    layout = ChunkLayout(stripe_dirs=(str(tmp_path),), chunk_tokens=2)
    chunk = np.ones((2, 5), np.float32)
    appender = LayerAppender(layout, "s", 3, 0, chunk.nbytes)
    for _ in range(3):
        appender.append(chunk)
    appender.close()
    with open(layout.layer_file(0, "s", 3), "ab") as f:
        f.write(b"half a chunk")  # a crash mid-append
    LayerAppender(layout, "s", 3, committed_chunks=2, chunk_bytes=chunk.nbytes).close()
    assert os.path.getsize(layout.layer_file(0, "s", 3)) == 2 * chunk.nbytes


@pytest.mark.parametrize("num_stripes", [1, 2])
def test_a_chunk_is_written_over_and_read_alone(tmp_path, rng, num_stripes):
    layout = ChunkLayout(stripe_dirs=tuple(str(tmp_path / f"d{s}") for s in range(num_stripes)), chunk_tokens=2)
    chunks = rng.standard_normal((5, 2, 3)).astype(np.float32)
    appender = LayerAppender(layout, "s", 0, committed_chunks=5, chunk_bytes=chunks[0].nbytes)  # 5 empty slots
    crcs = [appender.write_at(c, chunks[c]) for c in range(5)]
    new = rng.standard_normal((2, 3)).astype(np.float32)
    crcs[3] = appender.write_at(3, new)
    chunks[3] = new
    with pytest.raises(IndexError, match="chunk 5 of layer 0; expected 0 <= chunk < 5"):
        appender.write_at(5, new)
    assert appender.num_chunks == 5
    appender.close()
    for c in range(5):
        out = np.empty((2, 3), np.float32)
        storage.read_chunk(layout, "s", 0, c, out)
        np.testing.assert_array_equal(out, chunks[c])
        storage.verify_chunks(out, 2, [crcs[c]], "test")
    os.truncate(layout.layer_file(4 % num_stripes, "s", 0), 1)
    with pytest.raises(CorruptSession, match="is shorter than chunk 4"):
        storage.read_chunk(layout, "s", 0, 4, np.empty((2, 3), np.float32))
    os.remove(layout.layer_file(0, "s", 0))
    with pytest.raises(CorruptSession, match="layer_000.bin is missing"):
        storage.read_chunk(layout, "s", 0, 0, np.empty((2, 3), np.float32))


def test_chain_hashes_identify_whole_prefixes():
    a = list(range(200))
    b = a[:64] + [7] + a[65:]
    ha, hb = (storage.chain_hashes(t, 64, "model") for t in (a, b))
    assert len(ha) == 3  # full chunks only
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # a change propagates down the chain
    assert storage.chain_hashes(a, 64, "other model")[0] != ha[0]
