"""RSS over two long generations with one Generator in one process (the soak settings of
tests/test_soak.py): does what a batch adds come back when it closes? Usage:
    PYTHONPATH=. .venv/bin/python benchmarks/soak_twice.py MODE STEPS      # MODE: full | hgca | scout
"""
import dataclasses, gc, sys
import numpy as np
from jhybrid.bench.throughput import host_rss_bytes
from jhybrid.generation import Generator, SamplingParams
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY
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
            gc.collect(); r[n[0]]=host_rss_bytes()
    gen.generate([prompt], max_new_tokens=STEPS, sampling=SamplingParams(temperature=1.0, seed=1), on_tokens=on_tokens)
    print(mode, "run", run, "RSS MiB", round(r[1000]/2**20,1), round(r[STEPS]/2**20,1), "growth per step B", round((r[STEPS]-r[1000])/(STEPS-1000)), flush=True)
