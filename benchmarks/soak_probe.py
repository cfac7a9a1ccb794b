"""Where does a long decode's resident memory go? Runs the soak's settings (tests/test_soak.py) for
STEPS steps and prints, at step WARM, STEPS // 2 and STEPS: the process's RSS, the host store's
resident arena bytes (counted page by page, `KVStore.bytes_resident`), the most its rows can make
resident (`bytes_resident_bound`) and its rows in use (`bytes_used`); then the growth beyond the
store, and the mappings of /proc/self/smaps whose resident size changed between WARM and STEPS,
largest first (store arenas named; others with the NumPy / JAX arrays that live in them). Usage:
    PYTHONPATH=. .venv/bin/python benchmarks/soak_probe.py MODE STEPS [WARM]   # MODE: hgca | scout
MALLOC_ARENA_MAX, malloc_trim: the RSS after malloc_trim(0) at the end is printed too.
"""
import ctypes, dataclasses, gc, sys

import numpy as np

from jhybrid.bench.throughput import host_rss_bytes
from jhybrid.generation import Generator, SamplingParams
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> tuple[int, int, int]:
    """glibc's (bytes in use in malloc's arenas, free bytes kept in them, bytes of mmapped chunks)."""
    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = _Mallinfo2
    m = fn()
    return m.uordblks, m.fordblks, m.hblkhd


def smaps() -> dict[int, tuple[int, int, str]]:
    """start address -> (end, Rss bytes, name) of every mapping."""
    out, cur = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = lo
                out[lo] = [hi, 0, head[5] if len(head) > 5 else ""]
            elif head[0] == "Rss:":
                out[cur][1] = int(head[1]) * 1024
            elif head[0] == "AnonHugePages:" and int(head[1]):
                out[cur][2] += f"(huge pages {int(head[1]) // 1024} MiB)"
    return {k: tuple(v) for k, v in out.items()}


def array_owners(lo: int, hi: int) -> list[str]:
    """NumPy and JAX arrays alive whose data lies in [lo, hi) (plain ndarrays are not tracked by
    the collector: they are found among the referents of tracked objects)."""
    found, seen = [], set()
    candidates = gc.get_objects()
    candidates += [r for o in list(candidates) for r in gc.get_referents(o) if not gc.is_tracked(r)]
    for o in candidates:
        try:
            if isinstance(o, np.ndarray):
                p = o.__array_interface__["data"][0]
            elif type(o).__name__ == "ArrayImpl":
                p = o.unsafe_buffer_pointer()
            else:
                continue
        except Exception:
            continue
        if lo <= p < hi and id(o) not in seen:
            seen.add(id(o))
            found.append(f"{type(o).__name__}{tuple(o.shape)} {o.dtype} at +{p - lo:#x}")
    return found[:4]


def store_ranges(store) -> list[tuple[int, int, str]]:
    """(start, end of the reservation, name) of every arena array."""
    out = []
    for kind, arenas in (("store", store.layers), ("context", store.context.layers)):
        for i, arena in enumerate(arenas):
            for name, a in (arena.slots._bases or arena.arrays).items():
                p = a.__array_interface__["data"][0]
                out.append((p, p + a.nbytes, f"{kind} L{i} {name}"))
    return out


def main():
    mode, steps = sys.argv[1], int(sys.argv[2])
    warm = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    config = dataclasses.replace(TINY, max_position_embeddings=steps + 256)
    model = create_model(config, seed=0)
    opts = dict(beta=1.0) if mode == "hgca" else dict(budget=64, recall_blocks=2)
    backend = make_backend(OffloadConfig(window_tokens=72, block_size=16, sink=8, host_threads=1, mode=mode, **opts))
    gen = Generator(model, backend, prefill_chunk=16)
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, 40).tolist()
    readings, maps, blocks, n = {}, {}, {}, [0]

    def on_tokens(t, e):
        n[0] += 1
        if n[0] in (warm, steps // 2, steps):
            gc.collect()
            store = backend.runtime.store
            if n[0] == warm:  # before the RSS reading: the snapshot's own memory is in the baseline
                maps[warm] = smaps()
            readings[n[0]] = (host_rss_bytes(), store.bytes_resident(), store.bytes_resident_bound(),
                              store.bytes_used())
            blocks[n[0]] = (sys.getallocatedblocks(), len(gc.get_objects())) + malloc_in_use()
            if n[0] == steps:
                maps[steps] = smaps()
                maps["ranges"] = store_ranges(store)
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                maps["trimmed"] = host_rss_bytes()

    gen.generate([prompt], max_new_tokens=steps, sampling=SamplingParams(temperature=1.0, seed=1),
                 on_tokens=on_tokens)
    mib = lambda x: f"{x / 2**20:.2f}"
    for step, (rss, resident, bound, used) in sorted(readings.items()):
        print(f"step {step}: RSS {mib(rss)} MiB; store resident {mib(resident)}, bound {mib(bound)}, "
              f"rows in use {mib(used)} MiB; Python: {blocks[step][0]} allocated blocks, "
              f"{blocks[step][1]} tracked objects; malloc: in use {mib(blocks[step][2])}, free "
              f"{mib(blocks[step][3])}, mmapped {mib(blocks[step][4])} MiB")
    (r0, s0, _, u0), (r1, s1, _, u1) = readings[warm], readings[steps]
    print(f"{mode} steps {warm}-{steps}: growth beyond the store's resident arenas {(r1 - r0 - (s1 - s0)) / 2**10:.0f} "
          f"KiB; beyond its rows in use (the old accounting) {(r1 - r0 - (u1 - u0)) / 2**10:.0f} KiB; "
          f"RSS after malloc_trim(0) {mib(maps['trimmed'])} MiB")
    m0, m1, ranges = maps[warm], maps[steps], maps["ranges"]

    def label(lo, hi, name):
        for a, b, what in ranges:
            if a <= lo < b:
                return what + " " + name
        return name

    rows = sorted(((rss - m0.get(lo, (hi, 0, ""))[1], lo, hi, rss, name) for lo, (hi, rss, name) in m1.items()
                   if rss != m0.get(lo, (hi, 0, ""))[1]), reverse=True)
    store_rows = [r for r in rows if label(r[1], r[2], "") != ""]
    print(f"  mappings of the store: {sum(r[0] for r in store_rows) / 2**10:+.0f} KiB; the others:")
    for d, lo, hi, rss, name in [r for r in rows if r not in store_rows][:12]:
        owners = "; ".join(array_owners(lo, hi)) if abs(d) >= 64 << 10 else ""
        print(f"  {d / 2**10:+7.0f} KiB  {lo:#x} size {(hi - lo) / 2**20:8.1f} MiB rss {rss / 2**10:7.0f} KiB {name} {owners}")
    gone = sum(v[1] for lo, v in m0.items() if lo not in m1)
    print(f"  mappings gone: {gone / 2**10:.0f} KiB; all changes {sum(r[0] for r in rows) / 2**10:+.0f} KiB")


if __name__ == "__main__":
    main()
