"""`PagedKV`: what every CPU attention kernel reads — a list of K/V pages per (sequence, KV head).

A *unit* is one (sequence b, KV head h) pair, numbered u = b * Hkv + h. Unit u attends the first
`unit_tokens[u]` tokens of the concatenation of its pages `page_ids[page_ptr[u]:page_ptr[u+1]]`
(only the last page may be partly filled). A page is `page_tokens` contiguous rows of D values:

- the KV store's block `slot` of head h is page `slot * Hkv + h` of `k.reshape(-1, block_size, D)`;
- the context cache's pages are `context_page_tokens` rows of one head's kept tokens.

So kernels (a) context cache, (b) all stored tokens and (c) chosen blocks are one kernel over
different page lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PagedKV:
    k_pages: np.ndarray      # [P, page_tokens, D] uint16 (bf16/fp16 bits) or float32
    v_pages: np.ndarray      # [P, page_tokens, D] same dtype as k_pages
    fmt: int                 # host.store_format.FORMAT_CODE of the storage
    page_ptr: np.ndarray     # int64 [U + 1]
    page_ids: np.ndarray     # int64 [page_ptr[-1]]
    unit_tokens: np.ndarray  # int64 [U]
    n_kv_heads: int

    @property
    def page_tokens(self) -> int:
        return self.k_pages.shape[1]

    @property
    def n_units(self) -> int:
        return self.unit_tokens.shape[0]

    def attended_bytes(self) -> int:
        """Bytes of K and V the kernel reads (attended tokens only)."""
        return int(self.unit_tokens.sum()) * 2 * self.k_pages.shape[2] * self.k_pages.itemsize

