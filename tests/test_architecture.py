"""The code's shape, checked: modes own what is specific to them, imports point one way.

  * Nothing outside `jhybrid/hybrid/modes/` compares a value with a mode's name: callers ask the mode
    (`OffloadMode`, docs/design.md "The modes own what is specific to them").
  * Nothing probes a backend or a runtime with hasattr / getattr: the interfaces declare what
    callers use.
  * No import cycle between modules (imports inside functions included), and no arrow up: `host`
    and `pallas_kernels` never import `jhybrid` or each other, `jhybrid.attention` never imports
    `jhybrid.hybrid`, `jhybrid.config` never imports `jhybrid.bench`, and the hybrid core never
    imports the benchmarks, the CLI or HCache.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from jhybrid.hybrid.registry import mode_names

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jhybrid", "host", "pallas_kernels")


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _names_of(node) -> list[str] | None:
    """The string constants of a constant, or of a tuple / list / set of constants (else None)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return values if len(values) == len(node.elts) else None
    return None


def test_no_mode_name_checks_outside_the_modes():
    modes = set(mode_names())
    found = []
    for path, tree in _sources():
        if (ROOT / "jhybrid" / "hybrid" / "modes") in path.parents:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for op, (left, right) in zip(node.ops, zip(sides, sides[1:])):
                if isinstance(op, (ast.In, ast.NotIn)):  # x in ("hgca", ...): the container holds names
                    hit = isinstance(right, (ast.Tuple, ast.List, ast.Set)) and set(_names_of(right) or ()) & modes
                else:  # x == "hgca", "full" != x
                    hit = any(set(_names_of(side) or ()) & modes for side in (left, right)
                              if isinstance(side, ast.Constant))
                if hit:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
                    break
    assert not found, "mode names compared outside jhybrid/hybrid/modes/ (ask the mode instead):\n" + "\n".join(found)


def test_no_probes_on_backends_or_runtimes():
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args):
                target = ast.unparse(node.args[0])
                if any(word in target for word in ("backend", "runtime", "mode_host", "host")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "hasattr / getattr on backends or runtimes (declare it on the interface):\n" + "\n".join(found)


def _imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    modules = {_module(path): tree for path, tree in _sources()}
    graph = {}
    for name, tree in modules.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _imports()
    # A package's __init__ importing its own modules is how packages are built, not a cycle.
    edges = {m: {d for d in deps if not (m and d.startswith(m + "."))} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


FORBIDDEN = [  # (importer prefix, imported prefix): arrows up
    ("host", "jhybrid"), ("host", "pallas_kernels"), ("pallas_kernels", "jhybrid"), ("pallas_kernels", "host"),
    ("jhybrid.attention", "jhybrid.hybrid"), ("jhybrid.config", "jhybrid.bench"),
    ("jhybrid.hybrid", "jhybrid.bench"), ("jhybrid.hybrid", "jhybrid.cli"), ("jhybrid.hybrid", "jhybrid.hcache"),
]


def test_imports_point_one_way():
    found = [f"{m} imports {d}" for m, deps in _imports().items() for d in sorted(deps)
             for low, high in FORBIDDEN if (m == low or m.startswith(low + ".")) and (d == high or d.startswith(high + "."))]
    assert not found, "imports against the layering (docs/design.md):\n" + "\n".join(found)


# The logic files one steady-state decode step runs through, as docs/design.md lists them ("One
# decode step"); leaves (kernels, the host store, the model) and data (state.py) are not counted.
LEAVES = ("pallas_kernels/", "host/attention.py", "host/_page_math.py", "host/sparsify.py", "host/gather.py",
          "host/kv_store.py",
          "host/context_cache.py", "host/memory.py", "host/store_format.py", "host/paged_view.py",
          "jhybrid/models/", "jhybrid/hybrid/state.py")
DECODE_STEP_FILES = {
    "hgca": {"jhybrid/generation.py", "jhybrid/hybrid/backend.py", "jhybrid/hybrid/runtime.py",
             "jhybrid/hybrid/eviction.py", "jhybrid/hybrid/modes/base.py", "jhybrid/hybrid/modes/hgca.py",
             "jhybrid/hybrid/window.py", "jhybrid/hybrid/exchange.py", "host/exchange_worker.py", "jhybrid/merge.py"},
    "scout": {"jhybrid/generation.py", "jhybrid/hybrid/backend.py", "jhybrid/hybrid/runtime.py",
              "jhybrid/hybrid/eviction.py", "jhybrid/hybrid/modes/base.py", "jhybrid/hybrid/modes/scout.py",
              "jhybrid/hybrid/selection.py", "jhybrid/hybrid/transfer.py", "jhybrid/hybrid/window.py",
              "jhybrid/hybrid/exchange.py", "host/exchange_worker.py", "jhybrid/merge.py"},
}


@pytest.mark.parametrize("mode", ["hgca", "scout"])
def test_a_decode_step_runs_through_the_documented_files(mode, rng):
    """Trace the Python code of decode steps (the traced step and the host work, every thread) after
    a prefill: only the files docs/design.md lists run, besides leaves (hgca <= 10, scout <= 12)."""
    import gc
    import sys
    import threading

    import jax
    import numpy as np

    from jhybrid.generation import make_step
    from jhybrid.hybrid import make_backend
    from jhybrid.models import create_model
    from tests.hybrid_support import TINY

    extra = dict(budget=32, recall_threshold=0.0, recall_min_interval=1) if mode == "scout" else {}
    model = create_model(TINY, seed=0)
    backend = make_backend(mode, window_tokens=40, sink=8, block_size=16, host_threads=1, **extra)
    step, params = make_step(model, backend)
    batch, prompt = 2, 96
    backend.open(model.config, batch, 160)
    cache = model.init_cache(batch, 160, backend)
    tokens = rng.integers(0, TINY.vocab_size, (batch, prompt)).astype(np.int32)
    for s in range(0, prompt, 16):
        pos = np.broadcast_to(np.arange(s, s + 16, dtype=np.int32), (batch, 16))
        cache = backend.before_step(cache, pos)
        _, cache = step(params, tokens[:, s:s + 16], pos, cache)
    seen: set[str] = set()
    root = str(ROOT) + "/"

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root) and name[len(root):].startswith(("jhybrid/", "host/")):
            seen.add(name[len(root):])

    def decode(n):
        nonlocal cache
        pos = np.full((batch, 1), n, np.int32)
        cache = backend.before_step(cache, pos)
        logits, cache = step(params, np.ones((batch, 1), np.int32), pos, cache)
        jax.block_until_ready(logits)

    # Not traced: steps past an eviction of every sequence (spread over 16 steps), which compile the
    # host programs the decode steps use (Numba's first compile under a profiler takes minutes).
    for n in range(prompt, prompt + 17):
        decode(n)
    # no garbage collection while traced: its callbacks (e.g. the serving engine's GC clock, once
    # another test imported it) run in whatever code allocated, and are not part of a decode step
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        step._clear_cache()  # the jitted step traces again: its Python code counts too
        for n in range(prompt + 17, prompt + 50):  # past another eviction of every sequence
            decode(n)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        gc.enable()
        backend.close()
    logic = {f for f in seen if not f.startswith(LEAVES)}
    assert logic <= DECODE_STEP_FILES[mode], f"undocumented files in a {mode} decode step: {sorted(logic - DECODE_STEP_FILES[mode])}"
    assert len(DECODE_STEP_FILES[mode]) <= {"hgca": 10, "scout": 12}[mode]
