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

from host.store_format import FORMAT_CODE, INT8_SCALE_BYTES, KV_DTYPES, STORAGE_DTYPE


@dataclass(frozen=True)
class PagedKV:
    k_pages: np.ndarray      # [P, page_tokens, W] uint16 (bf16/fp16 bits), float32, or int8 rows + scale
    v_pages: np.ndarray      # [P, page_tokens, W] same dtype as k_pages (W = D, or D + 4 for int8)
    fmt: int                 # host.store_format.FORMAT_CODE of the storage
    page_ptr: np.ndarray     # int64 [U + 1]
    page_ids: np.ndarray     # int64 [page_ptr[-1]]
    unit_tokens: np.ndarray  # int64 [U]
    n_kv_heads: int

    @property
    def page_tokens(self) -> int:
        return self.k_pages.shape[1]

    @property
    def head_dim(self) -> int:
        """D: the row width less int8's inline scale (host.store_format)."""
        return self.k_pages.shape[2] - (INT8_SCALE_BYTES if self.fmt == FORMAT_CODE["int8"] else 0)

    @property
    def n_units(self) -> int:
        return self.unit_tokens.shape[0]

    def check_format(self) -> None:
        """fmt names a known format and the pages hold its storage dtype (else a ValueError)."""
        names = {code: name for name, code in FORMAT_CODE.items()}
        if self.fmt not in names:
            raise ValueError(f"fmt={self.fmt!r}; expected a FORMAT_CODE of {KV_DTYPES}")
        want = STORAGE_DTYPE[names[self.fmt]]
        if self.k_pages.dtype != want or self.v_pages.dtype != want:
            raise ValueError(f"pages of dtype {self.k_pages.dtype} / {self.v_pages.dtype} for format "
                             f"{names[self.fmt]!r}; expected {want}")

    def attended_bytes(self) -> int:
        """Bytes of K and V the kernel reads (attended tokens only)."""
        return int(self.unit_tokens.sum()) * 2 * self.k_pages.shape[2] * self.k_pages.itemsize

