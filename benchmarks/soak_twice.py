"""RSS over two long generations with one Generator in one process (the soak settings of
tests/test_soak.py): does what a batch adds come back when it closes? Each reading is taken after
gc.collect() and malloc_trim(0) (tests/test_soak.py, `settled_rss`), with the host store's resident
arena pages (`KVStore.bytes_resident`) beside it. Usage:
    PYTHONPATH=. .venv/bin/python benchmarks/soak_twice.py MODE STEPS      # MODE: full | hgca | scout
"""
import dataclasses, sys
import numpy as np
from jhybrid.generation import Generator, SamplingParams
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY
from tests.test_soak import settled_rss
STEPS=int(sys.argv[2]); mode=sys.argv[1]
config = dataclasses.replace(TINY, max_position_embeddings=STEPS + 256)
model = create_model(config, seed=0)
backend = None if mode=="full" else make_backend(OffloadConfig(window_tokens=72, block_size=16, sink=8, host_threads=1, mode=mode, **({"beta":1.0} if mode=="hgca" else {"budget":64,"recall_blocks":2} if mode=="scout" else {})))
gen = Generator(model, backend, prefill_chunk=16)
prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, 40).tolist()
for run in range(2):
    r={}; n=[0]
    def on_tokens(t,e):
        n[0]+=1
        if n[0] in (1000, STEPS):
            store = None if backend is None else backend.runtime.store
            r[n[0]] = (settled_rss(), 0 if store is None else store.bytes_resident())
    gen.generate([prompt], max_new_tokens=STEPS, sampling=SamplingParams(temperature=1.0, seed=1), on_tokens=on_tokens)
    (rss0, st0), (rss1, st1) = r[1000], r[STEPS]
    print(mode, "run", run, "RSS MiB", round(rss0/2**20,1), round(rss1/2**20,1), "store resident MiB", round(st0/2**20,2),
          round(st1/2**20,2), "growth beyond the store KiB", round((rss1-rss0-(st1-st0))/2**10), flush=True)
