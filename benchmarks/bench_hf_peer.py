"""Peer baseline: Hugging Face transformers' DynamicCache and OffloadedCache decode throughput on the
same shape as jhybrid's headline (Llama-3-8B: 32 layers, 32 query / 8 KV heads of 128, random bf16
weights), same batch and context, on the GPU machine (torch + transformers preinstalled there):

    python3 benchmarks/bench_hf_peer.py --batch 4 --context 32768 --out $OUT/peer-hf-h100.json

The context is written directly as random KV into the cache (as jhybrid's synthetic fill does; no
prefill), then `--warmup` untimed and `--steps` timed greedy decode steps (torch.cuda.synchronize
around each; median step time). OffloadedCache keeps each layer's KV on the CPU and prefetches it
for its layer (transformers' own offloading). Rows: impl, batch, context, layers, decode_tok_s,
tbt_p50_ms, steps; a row with `error` where an implementation fails (e.g. out of memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time


def _offloaded_cache(config):
    """transformers' offloaded cache: OffloadedCache where it exists, else DynamicCache(offloading=True)."""
    import transformers

    if hasattr(transformers, "OffloadedCache"):
        return transformers.OffloadedCache(), "OffloadedCache"
    return transformers.DynamicCache(config=config, offloading=True), "DynamicCache(offloading=True)"


def run(impl: str, model, config, batch: int, context: int, warmup: int, steps: int) -> dict:
    import numpy as np
    import torch
    import transformers

    hkv, d = config.num_key_value_heads, config.head_dim
    if impl == "DynamicCache":
        cache, name = transformers.DynamicCache(config=config), "DynamicCache"
    else:
        cache, name = _offloaded_cache(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer in range(config.num_hidden_layers):  # the context, written layer by layer
        k = torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        cache.update(k, v, layer)
        del k, v
    tokens = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            pos = context + i
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(input_ids=tokens, past_key_values=cache, use_cache=True,
                        position_ids=torch.full((batch, 1), pos, device="cuda"),
                        cache_position=torch.tensor([pos], device="cuda"))
            tokens = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    step = float(np.median(times))
    return {"impl": name, "batch": batch, "context": context, "layers": config.num_hidden_layers,
            "decode_tok_s": round(batch / step, 2), "tbt_p50_ms": round(step * 1e3, 3), "steps": steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[4])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--impl", nargs="+", default=["DynamicCache", "OffloadedCache"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=args.context + 1024, rope_theta=500000.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # random bf16 weights made on the device, no fp32 copy
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).eval()
    rows = []
    for batch in args.batch:
        for impl in args.impl:
            try:
                row = run(impl, model, config, batch, args.context, args.warmup, args.steps)
            except Exception as error:  # noqa: BLE001 - recorded (e.g. out of memory), the others go on
                row = {"impl": impl, "batch": batch, "context": args.context, "layers": args.layers,
                       "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
    doc = {"name": "peer-hf", "device": f"{torch.cuda.get_device_name(0)}, {__import__('os').cpu_count()}-core host",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()},
           "command": "python3 " + " ".join(sys.argv), "config": vars(args), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
