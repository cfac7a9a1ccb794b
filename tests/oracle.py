"""Float64 NumPy oracles shared by the parity tests (independent of the jnp references)."""

from __future__ import annotations

import numpy as np


def attention_f64(q, k, v, visible, scale, softcap=None):
    """Attention over an explicit token set.

    q [R, D], k/v [N, D] (any dtype, upcast to float64), visible [R, N] bool.
    Returns o [R, D] float64 (0 for rows with no visible token) and lse [R] (-inf there).
    """
    q = np.asarray(q, np.float64)
    s = q @ np.asarray(k, np.float64).T * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, initial=-np.inf)
    has = np.isfinite(m)
    m_safe = np.where(has, m, 0.0)
    p = np.where(visible, np.exp(s - m_safe[:, None]), 0.0)
    l = p.sum(axis=1)
    o = np.where(has[:, None], (p @ np.asarray(v, np.float64)) / np.where(has, l, 1.0)[:, None], 0.0)
    lse = np.where(has, m_safe + np.log(np.where(has, l, 1.0)), -np.inf)
    probs = np.where(has[:, None], p / np.where(has, l, 1.0)[:, None], 0.0)
    return o, lse, probs


def rel_err(x, ref):
    """Norm-relative error ||x - ref|| / ||ref|| over finite entries (ref of 0 -> absolute error)."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert not np.isnan(x).any(), "NaN in output"
    denom = np.linalg.norm(ref)
    return np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0)
