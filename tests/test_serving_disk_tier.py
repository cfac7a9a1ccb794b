"""The prefix cache's disk tier store (jhybrid/serving/disk_tier.py) alone:

  * blocks written and read back are equal bit for bit (bfloat16 and float32, fresh random data);
    freed slots are reused, the capacity is a hard limit;
  * the files are an HCache store's layer files: HCache's own reader (`read_layer_chunks`) finds
    each block's layer l in its slot as "kv" rows [block_size, 2*Hkv*D] (a token's K then V), its
    chunks pass `verify_chunks` with the index's crc32s, also striped over two directories;
  * a damaged chunk (a flipped byte, a short or missing file) reads as None, logged and counted;
  * the index: saved and loaded back (slots and checksums adopted); another fingerprint or block
    layout discards the blocks with one log line naming both values.
"""

from __future__ import annotations

import json
import logging
import os

import ml_dtypes
import numpy as np
import pytest

from jhybrid.hcache.storage import ChunkLayout, read_layer_chunks, verify_chunks
from jhybrid.serving.disk_tier import INDEX_FILE, SESSION_ID, DiskBlockStore, SavedBlock

SHAPE = (3, 2, 4, 2, 8)  # [L, 2, block_size, Hkv, D]


def random_block(rng, dtype) -> np.ndarray:
    return rng.standard_normal(SHAPE).astype(dtype)


def kv_rows(block: np.ndarray, layer: int) -> np.ndarray:
    """HCache's "kv" rows of one layer, [block_size, 2*Hkv*D], built as HCacheEngine.save builds
    them from a cache's k, v [n, Hkv, D]: stack([k, v], axis=1).reshape(n, -1)."""
    k, v = block[layer, 0], block[layer, 1]
    return np.stack([k, v], axis=1).reshape(k.shape[0], -1)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_round_trip_slot_reuse_and_capacity(dtype, tmp_path, rng):
    store = DiskBlockStore(str(tmp_path), 3, SHAPE, dtype)
    blocks = [random_block(rng, dtype) for _ in range(5)]
    slots = [store.write(blocks[i]) for i in range(3)]
    assert slots == [0, 1, 2] and store.free_slots == 0 and store.used_slots == [0, 1, 2]
    with pytest.raises(RuntimeError, match="all 3 slots are used"):
        store.write(blocks[3])
    for slot, block in zip(slots, blocks):
        assert store.read(slot).tobytes() == block.tobytes()
    store.free(1)
    assert store.write(blocks[3]) == 1  # the freed slot, written over
    assert store.read(1).tobytes() == blocks[3].tobytes()
    assert store.read(0).tobytes() == blocks[0].tobytes() and store.read(2).tobytes() == blocks[2].tobytes()
    assert store.read_errors == 0
    with pytest.raises(ValueError, match=r"block \(3, 2, 4, 2, 4\)"):
        store.write(blocks[4][..., :4])
    store.close()


@pytest.mark.parametrize("stripes", [1, 2])
def test_the_files_are_hcache_layout(stripes, tmp_path, rng):
    """HCache's reader and checksum check, given the tier's layout, see every block's layer l as
    "kv" rows in its slot, with the crc32s the index records."""
    dirs = tuple(str(tmp_path / f"stripe{s}") for s in range(stripes))
    store = DiskBlockStore(str(tmp_path), 4, SHAPE, ml_dtypes.bfloat16, stripe_dirs=dirs)
    blocks = [random_block(rng, ml_dtypes.bfloat16) for _ in range(4)]
    for block in blocks:
        store.write(block)
    store.save_index([SavedBlock(key=slot + 1, parent_key=None, tokens=np.zeros(4, np.int32).tobytes(), slot=slot)
                      for slot in range(4)], fingerprint="f")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    layout = ChunkLayout(stripe_dirs=dirs, chunk_tokens=SHAPE[2])
    row = 2 * SHAPE[3] * SHAPE[4]
    for layer in range(SHAPE[0]):
        assert os.path.exists(layout.layer_file(stripes - 1, SESSION_ID, layer))
        out = np.empty((4 * SHAPE[2], row), ml_dtypes.bfloat16)
        read_layer_chunks(layout, SESSION_ID, layer, 4, out)
        verify_chunks(out, SHAPE[2], [entry["crc"][layer] for entry in index["blocks"]], f"layer {layer}")
        for slot, block in enumerate(blocks):
            assert out[slot * SHAPE[2]:(slot + 1) * SHAPE[2]].tobytes() == kv_rows(block, layer).tobytes()
    store.close()


@pytest.mark.parametrize("damage", ["flip", "short", "missing"])
def test_a_damaged_chunk_reads_as_none(damage, tmp_path, rng, caplog):
    store = DiskBlockStore(str(tmp_path), 2, SHAPE, np.float32)
    blocks = [random_block(rng, np.float32) for _ in range(2)]
    for block in blocks:
        store.write(block)
    path = os.path.join(tmp_path, SESSION_ID, "layer_002.bin")
    chunk_bytes = SHAPE[2] * 2 * SHAPE[3] * SHAPE[4] * 4
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(chunk_bytes + 11)
            byte = f.read(1)[0]
            f.seek(chunk_bytes + 11)
            f.write(bytes([byte ^ 1]))
    elif damage == "short":
        os.truncate(path, 2 * chunk_bytes - 1)
    else:
        os.remove(path)
    with caplog.at_level(logging.WARNING, logger="jhybrid.serving"):
        assert store.read(1) is None
    assert store.read_errors == 1 and len(caplog.records) == 1 and "slot 1" in caplog.records[0].getMessage()
    if damage == "missing":
        assert store.read(0) is None and store.read_errors == 2
    else:
        assert store.read(0).tobytes() == blocks[0].tobytes()  # the other slot is intact
    store.close()


def test_the_index_is_saved_and_loaded(tmp_path, rng):
    store = DiskBlockStore(str(tmp_path), 4, SHAPE, ml_dtypes.bfloat16)
    blocks = [random_block(rng, ml_dtypes.bfloat16) for _ in range(3)]
    slots = [store.write(block) for block in blocks]
    store.free(slots[1])
    saved = [SavedBlock(key=11, parent_key=None, tokens=np.arange(4, dtype=np.int32).tobytes(), slot=slots[0]),
             SavedBlock(key=12, parent_key=11, tokens=np.arange(4, 8, dtype=np.int32).tobytes(), slot=slots[2])]
    store.save_index(saved, fingerprint="model-x")
    store.close()
    store = DiskBlockStore(str(tmp_path), 4, SHAPE, ml_dtypes.bfloat16)
    assert store.load_index("model-x") == saved
    assert not os.path.exists(tmp_path / INDEX_FILE)
    assert store.used_slots == [0, 2] and store.free_slots == 2
    assert store.read(0).tobytes() == blocks[0].tobytes() and store.read(2).tobytes() == blocks[2].tobytes()
    assert store.write(blocks[1]) == 1  # the lowest free slot
    assert store.load_index("model-x") == []  # no index any more
    store.close()


def test_a_smaller_capacity_loads_only_the_slots_it_holds(tmp_path, rng):
    store = DiskBlockStore(str(tmp_path), 3, SHAPE, np.float32)
    blocks = [random_block(rng, np.float32) for _ in range(3)]
    saved = [SavedBlock(key=k, parent_key=None, tokens=b"\0" * 16, slot=store.write(b)) for k, b in enumerate(blocks)]
    store.save_index(saved, fingerprint=None)
    store.close()
    store = DiskBlockStore(str(tmp_path), 2, SHAPE, np.float32)
    assert store.load_index(None) == saved[:2] and store.free_slots == 0
    assert store.read(1).tobytes() == blocks[1].tobytes()
    store.close()


@pytest.mark.parametrize("change", ["fingerprint", "shape", "dtype"])
def test_another_fingerprint_or_layout_discards_the_blocks(change, tmp_path, rng, caplog):
    store = DiskBlockStore(str(tmp_path), 2, SHAPE, np.float32)
    store.save_index([SavedBlock(key=1, parent_key=None, tokens=b"\0" * 16,
                                 slot=store.write(random_block(rng, np.float32)))], fingerprint="old")
    store.close()
    shape, dtype, fingerprint = SHAPE, np.float32, "old"
    if change == "fingerprint":
        fingerprint = "new"
    elif change == "shape":
        shape = (3, 2, 4, 1, 8)
    else:
        dtype = ml_dtypes.bfloat16
    store = DiskBlockStore(str(tmp_path), 2, shape, dtype)
    with caplog.at_level(logging.WARNING, logger="jhybrid.serving"):
        assert store.load_index(fingerprint) == []
    message = caplog.records[-1].getMessage()
    if change == "fingerprint":
        assert "'old'" in message and "'new'" in message
    else:
        assert change.replace("shape", "block_shape") in message
    assert not os.path.exists(tmp_path / INDEX_FILE) and store.free_slots == 2
    assert os.path.getsize(os.path.join(tmp_path, SESSION_ID, "layer_000.bin")) == 2 * store.block_bytes // shape[0]
    store.close()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"block_shape=\(2, 3, 4, 1, 1\); expected \(num_layers, 2"):
        DiskBlockStore(str(tmp_path), 1, (2, 3, 4, 1, 1), np.float32)
    with pytest.raises(ValueError, match="capacity=0; expected an integer >= 1"):
        DiskBlockStore(str(tmp_path), 0, SHAPE, np.float32)


def test_one_open_store_per_folder(tmp_path):
    from jhybrid.hcache.storage import SessionLocked

    store = DiskBlockStore(str(tmp_path), 1, SHAPE, np.float32)
    with pytest.raises(SessionLocked, match=f"prefix cache disk tier {tmp_path} is in use by another prefix cache"):
        DiskBlockStore(str(tmp_path), 1, SHAPE, np.float32)
    store.close()
    DiskBlockStore(str(tmp_path), 1, SHAPE, np.float32).close()  # free again once closed
