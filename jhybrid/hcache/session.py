"""The session API: generate, save, evict, restore and continue; prefix reuse.

    engine = HCacheEngine(model, "/path/to/store")           # plan: "hidden" | "kv" | "recompute" | "auto"
    session = engine.new_session()
    reply = session.generate(prompt_ids, max_new_tokens=64)  # prefill + decode, hidden states saved
    session_id = session.save()                               # visible once this returns
    session.close()                                            # evict: the device KV is dropped
    ...
    session = engine.restore(session_id)                      # KV rebuilt from the saved state
    reply2 = session.generate(next_prompt_ids, 64)            # same tokens as never evicted (greedy)

A session's history is every token fed to the model; the last sampled token (also a stop token)
is "pending": it is fed at the start of the next `generate`. The device KV lives in a `full`
backend cache of `max_len` slots (restorer.FullCacheWriter), or, with
`HCacheEngine(..., backend=OffloadConfig(mode="hgca", ...))`, in that hybrid mode's GPU window +
host store: every step runs through the hybrid backend, and `engine.restore(session_id)` places
the restored KV into window + store (jhybrid.hybrid.ingest.HybridCacheWriter) so the session
continues in that mode. A hybrid backend serves one open session at a time (its host runtime holds
one batch): close the open one before opening or restoring another.

Prefix reuse: at save, every full chunk of the history is indexed by a hash chained over its
token ids (and the model's config hash). The first `generate` of a new session looks up the
longest saved prefix of its prompt, checks the stored tokens really equal the prompt's (a hash
match alone is not trusted), restores that prefix and prefills only the rest.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import uuid
import weakref
import zlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jhybrid.generation import SamplingParams, sample_tokens
from jhybrid.hcache import storage
from jhybrid.hcache.planner import LayerCosts, RestorePlan, confirm_plan, plan_restore, profile_costs
from jhybrid.hcache.restorer import (CollectingSink, FullCacheWriter, LayerKernels, SessionFileSource,
                                     restore_kv, row_values, validate_plan)
from jhybrid.hcache.saver import SessionWriter, snapshot_to_host
from jhybrid.hcache.storage import (ChunkLayout, CorruptSession, HCacheError, ModelMismatch,
                                    StorageFull)
from jhybrid.models.decoder import CausalLM

log = logging.getLogger("jhybrid.hcache")


class HCacheEngine:
    """Saves and restores sessions of one model under `root`.

    plan: how layers are stored and restored — "hidden" (every layer's input hidden states),
        "kv", "recompute" (token ids only), "auto" (profile this machine's disk and device for a
        history of `plan_tokens` and let the planner choose per layer), or an explicit tuple of
        per-layer methods.
    stripe_dirs: directories to stripe chunks over round-robin (default: root/data).
    max_len: device cache slots per session (default min(model context, 4096)).
    prefill_chunk: tokens per prefill forward call (at most the hybrid ring's max_prefill_chunk).
    backend: None (`full`), an OffloadConfig (its mode's backend is built here) or an attention
        backend instance (FullAttention / HybridAttention, not shared with other users).
    """

    def __init__(self, model: CausalLM, root: str, *, plan="hidden", chunk_tokens: int = 64,
                 stripe_dirs: Sequence[str] | None = None, max_len: int | None = None,
                 prefill_chunk: int = 64, plan_tokens: int = 1024, prefix_reuse: bool = True,
                 backend=None):
        from jhybrid.attention.base import AttentionBackend
        from jhybrid.attention.full import FullAttention
        from jhybrid.hybrid import OffloadConfig, make_backend

        for name, value in (("chunk_tokens", chunk_tokens), ("prefill_chunk", prefill_chunk),
                            ("plan_tokens", plan_tokens), ("max_len", 1 if max_len is None else max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HCacheEngine {name}={value!r}; expected an int >= 1")
        self.model, self.config = model, model.config
        if backend is None:
            backend = FullAttention()
        elif isinstance(backend, OffloadConfig):
            backend = make_backend(backend, context=max_len or min(model.config.max_position_embeddings, 4096))
        elif not isinstance(backend, AttentionBackend):
            raise TypeError(f"backend={backend!r}: expected None, an OffloadConfig or an attention backend")
        self.backend = backend
        self.hybrid = not isinstance(backend, FullAttention)
        self.open_hybrid_session: "Session | None" = None
        self.sessions: weakref.WeakSet = weakref.WeakSet()  # open sessions (closed by close())
        self.root = os.path.abspath(root)
        try:
            os.makedirs(os.path.join(self.root, "sessions"), exist_ok=True)
        except OSError as err:
            raise storage.store_error(err, self.root, "creating the session store") from None
        dirs = tuple(os.path.abspath(d) for d in (stripe_dirs or [os.path.join(self.root, "data")]))
        self.layout = ChunkLayout(stripe_dirs=dirs, chunk_tokens=chunk_tokens)
        self.max_len = max_len or min(self.config.max_position_embeddings, 4096)
        self.prefill_chunk = min(prefill_chunk, backend.max_prefill_chunk or prefill_chunk)
        if self.prefill_chunk < prefill_chunk:
            log.info("hcache: prefill chunk %d -> %d (the %s ring's max_prefill_chunk)", prefill_chunk,
                     self.prefill_chunk, backend.name)
        self.prefix_reuse = prefix_reuse
        self.dtype = np.dtype(jnp.dtype(self.config.dtype))
        self.config_hash = storage.config_hash(self.config)
        self.weights_fingerprint = storage.weights_fingerprint(model)
        self.kernels = LayerKernels(model)
        self.graphdef, self.params = nnx.split(model)
        self.read_buffers: dict = {}  # host buffers reused by every restore of this engine
        self.costs: LayerCosts | None = None
        self.restore_plan: RestorePlan | None = None
        if plan == "auto":
            self.restore_plan = self.profile_and_plan(plan_tokens)
            plan = self.restore_plan.methods
        elif isinstance(plan, str):
            if plan not in storage.METHODS:
                raise ValueError(f"plan={plan!r}: use hidden, kv, recompute, auto or a tuple")
            plan = (plan,) * self.config.num_layers
        self.methods = validate_plan(plan, self.config.num_layers)

    # -- lifetime --

    def close(self) -> None:
        """Closes every session still open on this engine (their unsaved turns are lost) and the
        backend's host side. Ownership: the engine owns its backend's host side, whoever built the
        backend object: each session opens it for its cache (closing the previous session's batch)
        and leaves it open after its own close (counters stay readable); `close()`, or the end of a
        `with HCacheEngine(...) as engine:` block, closes it. The engine can be used again after."""
        for session in list(self.sessions):
            session.close()
        self.backend.close()

    def __enter__(self) -> "HCacheEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- device work --

    def _forward(self, hidden_layers, params, tokens, positions, cache, kv_layers=()):
        cache = self.backend.before_step(cache, positions)
        return _forward(self.graphdef, self.backend, hidden_layers, kv_layers, params, tokens,
                        positions, cache)

    def _claim(self, session: "Session") -> None:
        """A hybrid backend's host side holds one batch: one open session at a time."""
        if not self.hybrid:
            return
        other = self.open_hybrid_session
        if other is not None and not other.closed and other is not session:
            raise RuntimeError(f"session {other.id} is still open on this engine's {self.backend.name} "
                               "backend (one batch at a time): close it before opening another")
        self.open_hybrid_session = session

    def new_cache(self):
        """An empty device cache of one sequence for this engine's backend (its host side opened)."""
        self.backend.open(self.config, 1, self.max_len)
        return self.model.init_cache(1, self.max_len, self.backend)

    def restore_sink(self, num_tokens: int):
        """The restore_kv sink that puts num_tokens restored tokens into a fresh cache of this
        engine's backend; `.finish()` -> the KVCache."""
        if self.hybrid:
            from jhybrid.hybrid.ingest import HybridCacheWriter
            return HybridCacheWriter(self.model, self.backend, self.max_len, num_tokens)
        return _FullSink(self.model, self.max_len, num_tokens)

    def profile_and_plan(self, num_tokens: int) -> RestorePlan:
        """Profiles this machine (scratch files in the first stripe directory, page cache dropped
        before every read) and returns the planner's choice for num_tokens of history."""
        scratch = ChunkLayout(stripe_dirs=(os.path.join(self.layout.stripe_dirs[0], ".profile"),),
                              chunk_tokens=self.layout.chunk_tokens)
        chunk = self.layout.chunk_tokens
        num_tokens = -(-num_tokens // chunk) * chunk
        fetch = _scratch_disk_fetch(self.config, scratch, num_tokens, self.dtype)
        self.costs = profile_costs(self.kernels, num_tokens, fetch)
        plan = plan_restore(self.costs, self.config.num_layers)
        tokens = np.zeros(num_tokens, np.int32)

        def measure(methods) -> float:  # one whole restore from the scratch files, device work included
            sink = CollectingSink(self.config.num_layers)
            start = time.perf_counter()
            restore_kv(self.kernels, methods, tokens, fetch, sink, self.prefill_chunk)
            sink.block()
            return time.perf_counter() - start

        for methods in {plan.methods, *((m,) * self.config.num_layers for m in ("hidden", "kv", "recompute"))}:
            measure(methods)  # compile every candidate before timing any
        plan = confirm_plan(plan, measure, repeats=2)
        log.info("hcache planner: %s (estimated %.2f ms; single methods %s) from %s", plan.describe(),
                 plan.estimated_seconds * 1e3,
                 {m: round(s * 1e3, 2) for m, s in plan.single_method_seconds.items()}, self.costs)
        return plan

    # -- sessions --

    def new_session(self) -> "Session":
        return Session(self, uuid.uuid4().hex, methods=self.methods)

    def restore(self, session_id: str) -> "Session":
        """Loads the latest intact save of a session and rebuilds its KV on the device.

        If the newest generation cannot be read (manifest or data corrupt), the next older one is
        restored instead, with a warning naming what was wrong; CorruptSession if none is intact.
        A different model is ModelMismatch at once (no older save would fit either)."""
        storage.check_session_id(session_id)
        generations = storage.committed_generations(self.root, session_id)
        if not generations:
            storage.load_manifest(self.root, session_id)  # raises SessionNotFound with its reason
        problems = []
        for generation in reversed(generations):
            try:
                manifest = storage.load_manifest(self.root, session_id, generation)
                self._check_model(manifest)
                session = Session(self, session_id, methods=tuple(manifest["methods"]), manifest=manifest)
            except CorruptSession as err:
                problems.append(str(err))
                log.warning("hcache: generation %d of session %s is unusable (%s); trying an older one",
                            generation, session_id, err)
                continue
            if problems:
                log.warning("hcache: restored session %s from generation %d, not the newest", session_id,
                            generation)
            return session
        raise CorruptSession(f"session {session_id}: no intact save ({'; '.join(problems)})")

    def _check_model(self, manifest: dict) -> None:
        sid = manifest["session_id"]
        if manifest["config_hash"] != self.config_hash:
            diff = storage.describe_config_difference(json.loads(manifest["config"]),
                                                      json.loads(self.config.to_json()))
            raise ModelMismatch(f"session {sid} was saved by a different model: config hash "
                                f"{manifest['config_hash']} != {self.config_hash} ({diff})")
        if manifest["weights_fingerprint"] != self.weights_fingerprint:
            raise ModelMismatch(f"session {sid} was saved by a model with the same config but "
                                f"different weights (fingerprint {manifest['weights_fingerprint']}"
                                f" != {self.weights_fingerprint})")
        if manifest["dtype"] != self.dtype.name or manifest["chunk_tokens"] != self.layout.chunk_tokens:
            raise ModelMismatch(f"session {sid} was saved with dtype {manifest['dtype']}, chunk "
                                f"{manifest['chunk_tokens']}; this engine uses {self.dtype.name}, "
                                f"{self.layout.chunk_tokens}")

    def layout_of(self, manifest: dict) -> ChunkLayout:
        """Where a saved session's chunks are: the stripe directories it was saved with (relative
        ones under this engine's root, so a moved or copied store reads its own files)."""
        return ChunkLayout(stripe_dirs=storage.resolve_stripe_dirs(self.root, manifest["stripe_dirs"]),
                           chunk_tokens=manifest["chunk_tokens"])

    def _find_prefix(self, prompt: list[int]) -> tuple[dict, int] | None:
        """(manifest, tokens to restore) of the longest verified saved prefix of prompt, or None."""
        chunk = self.layout.chunk_tokens
        hashes = storage.chain_hashes(prompt, chunk, self.config_hash)
        found, session_id = storage.lookup_prefix(self.root, hashes)
        while found and session_id:
            try:
                manifest = storage.load_manifest(self.root, session_id)
                self._check_model(manifest)
            except HCacheError as err:
                log.warning("hcache: prefix entry -> session %s unusable: %s", session_id, err)
                return None
            saved_hashes = manifest["chunk_hashes"]
            n = found * chunk
            if (len(saved_hashes) >= found and saved_hashes[found - 1] == hashes[found - 1]
                    and manifest["tokens"][:n] == list(prompt[:n])):
                if tuple(manifest["methods"]) != self.methods:
                    log.info("hcache: prefix of %d tokens in session %s saved with another plan; "
                             "not reused", n, session_id)
                    return None
                return manifest, min(n, len(prompt) - 1)  # keep >= 1 token to prefill for logits
            log.warning("hcache: prefix hash of %d chunks matched session %s but its tokens "
                        "differ (collision or stale entry); trying a shorter prefix", found, session_id)
            found -= 1
        return None


class _FullSink(FullCacheWriter):
    def finish(self):
        return self.cache()


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(7,))
def _forward(graphdef, backend, hidden_layers, kv_layers, params, tokens, positions, cache):
    """-> logits at the last valid token [B, V], new cache, hidden [len(hidden_layers), B, T, d]
    (the input of each layer in hidden_layers; None when there are none), kv
    [len(kv_layers), B, T, 2*Hkv*D] (k then v of each layer in kv_layers, projected again from the
    layer's input exactly as the layer did — used where the cache is no flat array to copy KV
    rows from, i.e. the hybrid backends; None when kv_layers is empty)."""
    from jhybrid.models.decoder import kv_from_hidden

    model = nnx.merge(graphdef, params)
    final, cache, layer_inputs = model.hidden_states(tokens, positions, cache, backend,
                                                     return_hidden_states=True)
    last = jnp.argmax(positions, axis=1)
    last_hidden = jnp.take_along_axis(final, last[:, None, None], axis=1)[:, 0]
    saved = layer_inputs[jnp.asarray(hidden_layers, jnp.int32)] if hidden_layers else None
    kv = None
    if kv_layers:
        rows = []
        for layer in kv_layers:
            k, v = kv_from_hidden(model.layers[layer], layer_inputs[layer], positions)
            rows.append(jnp.stack([k, v], axis=2).reshape(*k.shape[:2], -1))
        kv = jnp.stack(rows)
    return model.logits(last_hidden), cache, saved, kv


class Session:
    """One conversation: its device KV cache, its history and its save state."""

    def __init__(self, engine: HCacheEngine, session_id: str, methods: tuple[str, ...],
                 manifest: dict | None = None):
        self.engine, self.id, self.methods = engine, session_id, methods
        self.layout = engine.layout if manifest is None else engine.layout_of(manifest)
        self.hidden_layers = tuple(l for l, m in enumerate(methods) if m == "hidden")
        self.kv_layers = tuple(l for l, m in enumerate(methods) if m == "kv")
        self.row_values = row_values(engine.config, methods)
        self.tokens: list[int] = []      # fed to the model; their KV is in the cache
        self.pending: list[int] = []     # sampled, not fed yet
        self.kv_saved_upto = 0           # KV-method layers: tokens handed to the writer
        self.generation = 0              # number of the next save
        self.prefix_tokens_reused = 0
        self.closed = True  # until the lock, the cache and the writer are there
        engine._claim(self)  # this engine's own rule first: its message names the open session
        try:
            self._lock = storage.SessionLock(engine.root, session_id)  # one writer per id (SessionLocked)
        except BaseException:
            if engine.open_hybrid_session is self:
                engine.open_hybrid_session = None
            raise
        try:
            if manifest is None:
                self.cache = engine.new_cache()
                self.writer = SessionWriter(self.layout, session_id, self.row_values, engine.dtype)
            else:
                self._restore_from(manifest)
        except BaseException:
            if engine.open_hybrid_session is self:
                engine.open_hybrid_session = None
            self._lock.release()
            raise
        self.closed = False
        engine.sessions.add(self)

    # -- restore --

    def _restore_from(self, manifest: dict) -> None:
        engine, chunk = self.engine, self.engine.layout.chunk_tokens
        n = manifest["num_tokens"]
        tokens = manifest["tokens"]
        if len(tokens) != n:
            raise CorruptSession(f"session {self.id}: manifest holds {len(tokens)} tokens, says {n}")
        source = SessionFileSource(self.layout, manifest, n, engine.dtype, engine.read_buffers,
                                   pad_to=engine.kernels.padded_length(n))
        sink = engine.restore_sink(n)
        restore_kv(engine.kernels, self.methods, np.asarray(tokens, np.int32), source, sink)
        self.cache = sink.finish()
        self.tokens, self.pending = list(tokens), list(manifest["pending_tokens"])
        self.kv_saved_upto = n
        self.generation = manifest["generation"] + 1
        tails = []
        for layer, row in enumerate(self.row_values):
            if row == 0:
                tails.append(None)
                continue
            begin, end = manifest["tail_offsets"][layer]
            raw = source.tail_bytes[begin:end] if source.tail_bytes is not None else b""
            if zlib.crc32(raw) != manifest["tail_crc"][layer]:
                raise CorruptSession(f"session {self.id} layer {layer}: tail checksum mismatch")
            tails.append(np.frombuffer(raw, engine.dtype).reshape(-1, row))
        self.writer = SessionWriter(self.layout, self.id, self.row_values, engine.dtype,
                                    committed_chunks=manifest["num_full_chunks"] or 0, tails=tails,
                                    crcs=manifest["chunk_crc"])
        log.info("hcache: restored session %s (%d tokens, plan %s)", self.id, n,
                 {m: self.methods.count(m) for m in set(self.methods)})

    def _reuse_prefix(self, feed: list[int]) -> int:
        """Restores the longest saved prefix of feed into this (empty) session; returns its length."""
        engine = self.engine
        found = engine._find_prefix(feed)
        if found is None:
            return 0
        manifest, n = found
        if n <= 0:
            return 0

        def keep_rows(layer, method, rows):  # this session saves the prefix too
            if method == "hidden":
                self.writer.submit([layer], lambda rows=rows.copy(): rows[None])

        source = SessionFileSource(engine.layout_of(manifest), manifest, n, engine.dtype,
                                   engine.read_buffers, pad_to=engine.kernels.padded_length(n))
        sink = engine.restore_sink(n)
        fetch = _capturing(source, keep_rows)
        restore_kv(engine.kernels, self.methods, np.asarray(feed[:n], np.int32), fetch, sink)
        self.cache = sink.finish()
        self.tokens = list(feed[:n])
        self.prefix_tokens_reused = n
        log.info("hcache: session %s reuses a %d-token prefix of session %s", self.id, n,
                 manifest["session_id"])
        return n

    # -- generation --

    def _feed(self, feed: list[int], chunk: int) -> jax.Array:
        """Runs feed through the model in chunks; saves hidden states; -> last logits [1, V]."""
        engine = self.engine
        start = len(self.tokens)
        if start + len(feed) > engine.max_len:
            raise ValueError(f"session {self.id}: {start + len(feed)} tokens exceed max_len="
                             f"{engine.max_len}")
        logits = None
        for begin in range(0, len(feed), chunk):
            part = feed[begin:begin + chunk]
            tokens = np.zeros((1, chunk), np.int32)
            tokens[0, :len(part)] = part
            positions = np.full((1, chunk), -1, np.int32)
            positions[0, :len(part)] = start + begin + np.arange(len(part))
            kv_layers = self.kv_layers if engine.hybrid else ()
            logits, self.cache, hidden, kv = engine._forward(self.hidden_layers, engine.params, tokens,
                                                             positions, self.cache, kv_layers)
            if self.hidden_layers:  # stage 1: one bulk copy of every saved layer's rows
                self.writer.submit(list(self.hidden_layers),
                                   snapshot_to_host(hidden[:, 0, :len(part)]))
            if kv_layers:  # hybrid: KV rows of KV-method layers, saved as they are made
                self.writer.submit(list(kv_layers), snapshot_to_host(kv[:, 0, :len(part)]))
        self.tokens.extend(feed)
        if engine.hybrid:
            self.kv_saved_upto = len(self.tokens)
        return logits

    def generate(self, prompt: Sequence[int], max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), stop_tokens: Sequence[int] = (),
                 return_logits: bool = False):
        """Feeds the pending token + prompt, then generates up to max_new_tokens; returns them
        (a stop token ends generation, is not returned, and becomes the pending token).
        return_logits: also return the logits each sampled token was drawn from, float32
        [number sampled (returned tokens + a stop token), vocab] -> (tokens, logits)."""
        self._check_open("generate")
        feed = self.pending + self._token_ids(prompt)
        if not feed:
            raise ValueError("generate needs at least one prompt token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        self.pending = []
        if not self.tokens and self.engine.prefix_reuse:
            feed = feed[self._reuse_prefix(feed):]
        logits = self._feed(feed, self.engine.prefill_chunk)
        stop, out = set(int(t) for t in stop_tokens), []
        seen = []
        seed_key = jax.random.key(sampling.seed)
        for step in range(max_new_tokens):
            if return_logits:
                seen.append(np.asarray(logits[0], np.float32))
            key = jax.random.fold_in(seed_key, len(self.tokens))  # same key at the same position
            token = int(np.asarray(sample_tokens(logits, key, sampling))[0])
            if token in stop or step == max_new_tokens - 1 or len(self.tokens) >= self.engine.max_len:
                if token not in stop:
                    out.append(token)
                self.pending = [token]
                break
            out.append(token)
            logits = self._feed([token], 1)
        return (out, np.stack(seen)) if return_logits else out

    def _token_ids(self, prompt: Sequence[int]) -> list[int]:
        """The prompt as token ids (ValueError naming the first id outside the vocabulary)."""
        ids = np.asarray(list(prompt))
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"session {self.id}: prompt has {ids.dtype} entries; expected integer token ids")
        vocab = self.engine.config.vocab_size
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            raise ValueError(f"session {self.id}: prompt token {int(bad[0])} is id {int(ids[bad[0]])}; "
                             f"expected ids in [0, {vocab}) (the model's vocabulary)")
        return [int(t) for t in ids]

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise storage.SessionClosed(f"session {self.id} is closed: cannot {what} (engine.restore("
                                        f"{self.id!r}) opens its last save again)")

    # -- saving --

    def save(self) -> str:
        """Commits everything fed so far (+ the pending token); returns the session id.

        Raises StorageFull (disk full) or HCacheError; the session's earlier saves stay intact,
        and nothing fed is dropped: once the cause is gone (space freed), `save()` again commits
        everything. SessionClosed after close().
        """
        self._check_open("save")
        engine, n = self.engine, len(self.tokens)
        if self.kv_layers and n > self.kv_saved_upto:  # KV layers: one bulk copy from the cache
            rows = jnp.stack([
                jnp.stack([self.cache.layers[l]["k"][0, self.kv_saved_upto:n],
                           self.cache.layers[l]["v"][0, self.kv_saved_upto:n]], axis=1)
                .reshape(n - self.kv_saved_upto, -1) for l in self.kv_layers])
            self.writer.submit(list(self.kv_layers), snapshot_to_host(rows))
            self.kv_saved_upto = n
        committed = self.writer.commit()
        gen = self.generation
        tail_file = f"tail-{gen}.bin"
        blobs, offsets, crcs, pos = [], [], [], 0
        for tail in committed["tails"]:
            raw = b"" if tail is None else np.ascontiguousarray(tail).tobytes()
            blobs.append(raw)
            offsets.append([pos, pos + len(raw)])
            crcs.append(zlib.crc32(raw))
            pos += len(raw)
        chunk = self.layout.chunk_tokens
        hashes = storage.chain_hashes(self.tokens, chunk, engine.config_hash)
        full_chunks = committed["num_full_chunks"]
        manifest = {
            "format": storage.MANIFEST_FORMAT, "session_id": self.id, "generation": gen,
            "config_hash": engine.config_hash, "config": engine.config.to_json(),
            "weights_fingerprint": engine.weights_fingerprint, "dtype": engine.dtype.name,
            "chunk_tokens": chunk, "stripe_dirs": storage.stored_stripe_dirs(engine.root, self.layout.stripe_dirs),
            "num_tokens": n, "tokens": list(self.tokens), "pending_tokens": list(self.pending),
            "methods": list(self.methods), "row_values": self.row_values,
            "num_full_chunks": full_chunks if full_chunks is not None else n // chunk,
            "chunk_crc": committed["chunk_crc"], "chunk_hashes": hashes,
            "tail_file": tail_file, "tail_offsets": offsets, "tail_crc": crcs,
        }
        try:
            os.makedirs(self.layout.session_dir(0, self.id), exist_ok=True)
            storage.write_file_atomically(self.layout.tail_file(self.id, gen), b"".join(blobs))
            storage.save_manifest(engine.root, self.id, gen, manifest)
        except OSError as err:
            raise storage.storage_full_error(err, "writing the manifest", self.id) from err
        except Exception as err:  # noqa: BLE001 - Orbax wraps OSErrors in its own exceptions
            cause = err
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                raise storage.storage_full_error(cause, "writing the manifest", self.id) from err
            raise
        self.generation += 1
        try:  # the save is committed; the older tails and the index are housekeeping
            storage.drop_stale_tails(self.layout.session_dir(0, self.id),
                                     set(storage.committed_generations(engine.root, self.id)))
            storage.register_prefix(engine.root, hashes, self.id)
        except OSError as err:
            log.warning("hcache: old tails or prefix index not updated for session %s: %s", self.id, err)
        return self.id

    def close(self) -> None:
        """Drops the device KV, stops the writer (unsaved state is lost) and releases the session's
        writer lock. The backend's host side stays open (its counters readable) until the next
        session opens it again or the engine closes (HCacheEngine.close). Closing twice is a no-op;
        `with engine.new_session() as session:` closes at the end."""
        if not self.closed:
            self.closed = True
            self.cache = None
            self.engine.sessions.discard(self)
            try:
                self.writer.close()
            finally:
                self._lock.release()
                if self.engine.open_hybrid_session is self:
                    self.engine.open_hybrid_session = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _capturing(source, on_rows):
    """Wraps a SessionFileSource so on_rows(layer, method, host_rows) sees each layer's host rows."""
    def fetch(layer, method):
        out = source(layer, method)
        row = source.manifest["row_values"][layer]
        on_rows(layer, method, source.buffers[row][:source.num_tokens])
        return out
    return fetch


def _scratch_disk_fetch(config, layout: ChunkLayout, num_tokens: int, dtype):
    """A layer-0 `fetch` over scratch files holding random rows (for profiling the disk path)."""
    buffers: dict = {}
    from jhybrid.hcache.storage import LayerAppender

    chunk = layout.chunk_tokens
    num_chunks = -(-num_tokens // chunk)
    rng = np.random.default_rng(0)
    manifests = {}
    for method, row in (("hidden", config.d_model), ("kv", 2 * config.num_kv_heads * config.head_dim)):
        sid = f"profile-{method}"
        appender = LayerAppender(layout, sid, 0, 0, chunk * row * np.dtype(dtype).itemsize)
        crcs = [appender.append((rng.standard_normal((chunk, row)) * 0.1).astype(dtype))
                for _ in range(num_chunks)]
        appender.sync()
        appender.close()
        manifests[method] = {"session_id": sid, "methods": [method], "row_values": [row],
                             "num_full_chunks": num_chunks, "chunk_crc": [crcs],
                             "num_tokens": num_chunks * chunk}

    def fetch(layer, method):
        storage.drop_page_cache(layout.layer_file(0, f"profile-{method}", 0))
        return SessionFileSource(layout, manifests[method], num_tokens, dtype, buffers)(0, method)

    return fetch


__all__ = ["HCacheEngine", "Session", "StorageFull", "CorruptSession", "ModelMismatch"]
