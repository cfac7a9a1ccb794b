"""jhybrid: long-context LLM inference in JAX with hybrid GPU/CPU attention over offloaded KV.

Package map (one concept per module):
  jhybrid.merge        exact log-sum-exp merge of partial attention states (o, lse)
  jhybrid.cli          the `jhybrid` console script
GPU kernels live in the top-level package `pallas_kernels`, CPU-side code in `host`.
"""

from jhybrid.merge import PartialState, merge_partials, merge_two

__all__ = ["PartialState", "merge_partials", "merge_two"]
__version__ = "0.1.0"
