"""`kvserve plan`: how much KV cache fits, from the model's shape and the GPU's memory (the operator's math).

The engine flags are EngineArgs' own (the same type, default and help as `kvserve serve`'s), and their
model-dependent defaults resolve with engine_args.resolve, the function `kvserve serve` resolves them with:
`kvserve plan --model-config DIR` with no flags plans the server `kvserve serve DIR` starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.runtime import engine_args

# The engine settings a capacity plan depends on (engine_args.ResolvedSettings).
PLAN_SETTINGS = (
    "tensor_parallel_size",
    "dtype",
    "max_model_len",
    "block_size",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_chunked_prefill",
    "kv_cache_dtype",
)

# --enable-lora's slot settings: the adapter slots come off the KV budget (runtime/capacity.py). Not in the
# CRD yet (the operator's spec.adapters will carry them), so they apply on top of the operator's resolution.
LORA_SETTINGS = ("enable_lora", "max_loras", "max_lora_rank")

HELP = "Capacity plan: KV bytes/token, blocks, KV tokens and max concurrency for a model on a GPU"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        help="plan the InferenceService(s) in this YAML file exactly as the "
        "operator would (shape overrides, gpu.memoryMiB, engine settings)",
    )
    parser.add_argument("--list", action="store_true", help="list the catalog's models and GPUs")
    parser.add_argument("--model", help="catalog entry, e.g. llama-3-70b (see --list)")
    parser.add_argument(
        "--model-config",
        metavar="FILE|URI",
        help="plan a model from its own config.json: a file, a model folder, a GGUF file (its header), or "
        "hf://ORG/NAME[@REV], s3://BUCKET/PREFIX, file:///DIR (only config.json is fetched; HF_TOKEN, HF_ENDPOINT and "
        "AWS_* from the environment)",
    )
    parser.add_argument("--gpu", help="catalog entry or GFD product label, e.g. a100-80gb")
    # `kvserve serve`'s flags, from EngineArgs. For a catalog model (no config.json) --dtype auto plans the
    # operator's default (model.dtype in the CRD) and --max-model-len defaults to the catalog's positions.
    engine_args.EngineArgs.add_cli_args(parser, only=PLAN_SETTINGS)
    engine_args.EngineArgs.add_cli_args(parser, only=LORA_SETTINGS)
    # A CPU calibration with no --gpu plans that CPU server, its KV pool as `kvserve serve` sizes it (plan_cpu.py).
    engine_args.EngineArgs.add_cli_args(parser, only=("kv_cache_bytes",))
    parser.add_argument("--gpu-memory-mib", type=int, help="override the GPU's memory")
    parser.add_argument("--activation-reserve-mib", type=int, help="override the estimated activation reserve")
    parser.add_argument("--runtime-overhead-mib", type=int, help="override the non-torch overhead")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="when --tensor-parallel-size >= this does not fit one node: plan TP = this x the fewest "
        "pipeline stages (nodes) that fit",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="output format: the table, or JSON with every plan field",
    )
    parser.add_argument("--json", dest="output", action="store_const", const="json", help="same as -o json")
    # Prediction (runtime/planner): simulate one replica under a workload with a calibrated step-time model.
    parser.add_argument("--calibration", metavar="FILE", help="`kvserve calibrate` JSON: predict latency/throughput")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop: clients each with one request in flight")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals, requests/s")
    load.add_argument("--trace", metavar="JSONL", help="requests {arrival_s, prompt_len, output_len} per line")
    parser.add_argument("--prompt-len", default="512", help="prompt tokens: N or LO:HI (uniform)")
    parser.add_argument("--output-len", default="128", help="output tokens: N or LO:HI (uniform)")
    parser.add_argument("--num-requests", type=int, default=1000, help="requests to simulate")
    parser.add_argument("--prefix-len", type=int, default=0, help="tokens every prompt shares (prefix cache)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the simulated workload (--calibration)")
    spec_help = "--calibration: speculative decoding, up to this many drafts per decoding request and step"
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help=spec_help)
    rate_help = "with --num-speculative-tokens: each draft's acceptance (vllm:spec_decode accepted / draft tokens)"
    parser.add_argument("--spec-acceptance-rate", type=float, default=None, help=rate_help)
    from kvserve.cli import plan_fleet

    plan_fleet.add_arguments(parser)


def load_model_config(where: str) -> dict:
    """config.json from a file, a folder, or a source URI. Raises SystemExit(2) with a clear message."""
    import os

    from kvserve.runtime.sources import model_config
    from kvserve.runtime.sources import uri as source_uri

    try:
        if "://" in where:
            return model_config.fetch_config(source_uri.parse(where, field="--model-config"))
        if where.lower().endswith(".gguf"):  # the shape from the GGUF header (the tensors are not read)
            from kvserve.runtime import gguf_config
            from kvserve.runtime.errors import InvalidParameter

            try:
                return gguf_config.hf_config(where)
            except InvalidParameter as exc:
                raise SystemExit(f"error: --model-config: {exc}") from None
        path = os.path.join(where, "config.json") if os.path.isdir(where) else where
        with open(path) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        return config
    except (source_uri.SourceError, source_uri.FetchError) as exc:
        raise SystemExit(f"error: --model-config: {exc}") from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: --model-config {where}: {exc}") from None


def resolve_like_operator(spec: dict):
    """spec.resolve(), fetching a non-catalog model's config.json as the operator does, but with this shell's
    credentials (HF_TOKEN, HF_ENDPOINT, AWS_*) instead of the Secret's. Raises SpecError."""
    from kvserve.operator import spec as spec_mod

    config = None
    if spec_mod.needs_model_config(spec):
        from kvserve.runtime.sources import model_config
        from kvserve.runtime.sources import uri as source_uri

        try:
            config = model_config.fetch_config(spec_mod.model_source(spec_mod.with_defaults(spec)["model"]))
        except (source_uri.FetchError, source_uri.SourceError) as exc:
            raise spec_mod.SpecError("ModelConfigUnavailable", f"cannot read the model's config.json: {exc}") from None
    return spec_mod.resolve(spec, model_config=config)


def shape_line(shape) -> str:
    experts = f", {shape.num_experts} experts (top-{shape.experts_per_token})" if shape.num_experts else ""
    return (
        f"model: {shape.architecture}, {shape.num_layers} layers, {shape.num_attention_heads} heads / "
        f"{shape.num_kv_heads} KV heads x {shape.head_dim}, hidden {shape.hidden_size}, intermediate "
        f"{shape.intermediate_size}, vocab {shape.vocab_size}"
        f"{', tied embeddings' if shape.tie_word_embeddings else ''}, "
        f"{shape.max_position_embeddings} positions{experts}, {shape.num_parameters:,} parameters"
    )


def model_and_settings(args: argparse.Namespace) -> tuple[dict | None, object, engine_args.ResolvedSettings]:
    """--model-config's config.json (None for a catalog --model), the model's shape and the resolved engine
    settings. Raises SpecError / InvalidParameter naming the field."""
    from kvserve.operator import spec as spec_mod

    config = load_model_config(args.model_config) if args.model_config else None
    shape = spec_mod.model_shape({"name": args.model}, config)
    return config, shape, resolve_settings(args, config, shape)


def resolve_settings(args: argparse.Namespace, config: dict | None, shape) -> engine_args.ResolvedSettings:
    """The engine settings this plan describes, resolved as `kvserve serve` resolves them: from the model's
    config.json when there is one, else from the catalog shape (its positions; the operator's dtype default
    for auto). Raises InvalidParameter naming the setting."""
    settings = engine_args.EngineArgs.from_cli_args(None, args)
    if config is not None:
        return engine_args.resolve_for_config(settings, config, args.model_config)
    return engine_args.resolve(settings, shape.max_position_embeddings, engine_args.crd_defaults()["model.dtype"])


def _spec(args: argparse.Namespace, settings: engine_args.ResolvedSettings) -> dict:
    """An InferenceService spec that carries every resolved engine setting (no operator default applies)."""
    values = {name: getattr(settings, name) for name in PLAN_SETTINGS}
    spec: dict = {"model": {"uri": "file:///model"}, "gpu": {"product": args.gpu}, "engine": {}}
    for path, name in engine_args.crd_settings().items():
        if name in values:
            section, key = path.split(".")
            spec[section][key] = values[name]
    engine, gpu, model = spec["engine"], spec["gpu"], spec["model"]
    if args.activation_reserve_mib is not None:
        engine["activationReserveMiB"] = args.activation_reserve_mib
    if args.runtime_overhead_mib is not None:
        engine["runtimeOverheadMiB"] = args.runtime_overhead_mib
    if args.gpu_memory_mib:
        gpu["memoryMiB"] = args.gpu_memory_mib
    if args.model:
        model["name"] = args.model
    if getattr(args, "gpus_per_node", None):
        spec["parallelism"] = {"gpusPerNode": args.gpus_per_node}  # the operator's one-pod-or-group choice
    return spec


def settings_line(settings: engine_args.ResolvedSettings) -> str:
    return "engine: " + ", ".join(
        f"{engine_args.cli_flag(name)[2:]} {getattr(settings, name)}" for name in PLAN_SETTINGS
    )


def format_table(plan: dict) -> str:
    gb = lambda n: f"{n:,} B ({n / 1e9:.2f} GB, {n / 2**30:.2f} GiB)"  # noqa: E731
    rows = [
        ("fits", f"{plan['fits']} ({plan['reason']})"),
        ("KV bytes per token (model)", f"{plan['kv_bytes_per_token']:,} B ({plan['kv_bytes_per_token'] / 1024:g} KiB)"),
        ("KV bytes per token per GPU", f"{plan['kv_bytes_per_token_per_gpu']:,} B"),
        ("weights per GPU", gb(plan["weight_bytes_per_gpu"])),
        ("GPU memory", gb(plan["gpu_memory_bytes"])),
        ("budget per GPU (x utilization)", gb(plan["memory_budget_bytes_per_gpu"])),
        ("activation reserve per GPU", gb(plan["activation_reserve_bytes"])),
        ("runtime overhead per GPU", gb(plan["runtime_overhead_bytes"])),
        *(
            (("LoRA adapter slots per GPU", gb(plan["lora_slot_bytes_per_gpu"])),)
            if plan.get("lora_slot_bytes_per_gpu")
            else ()
        ),
        ("KV cache per GPU (--kv-cache-bytes)", gb(plan["kv_cache_bytes_per_gpu"])),
        ("blocks per GPU", f"{plan['num_blocks_per_gpu']:,} x {plan['block_size']} tokens"),
        ("KV tokens per replica", f"{plan['kv_tokens']:,}"),
        (f"max concurrency at {plan['max_model_len']:,} tokens", f"{plan['max_concurrency']:,}"),
        ("longest single sequence", f"{plan['max_model_len_fit']:,} tokens"),
    ]
    if plan.get("num_kv_cache_groups", 1) > 1:  # sliding-window model: what a full-context charge would give
        rows += [
            (
                "sliding window (KV cache groups)",
                f"{plan['sliding_window']:,} tokens ({plan['num_kv_cache_groups']} groups)",
            ),
            (
                "  if every layer kept the full context",
                f"max concurrency {plan['max_concurrency_full_context']:,}, "
                f"longest {plan['max_model_len_fit_full_context']:,} tokens",
            ),
        ]
    if "prediction" in plan:
        rows += prediction_rows(plan["prediction"])
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + f"\n{plan['message']}"


def prediction_rows(p: dict) -> list[tuple[str, str]]:
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    return [
        ("predicted (simulated, one replica)", f"{p['num_requests']} requests, calibration {p['calibration_device']}"),
        ("  throughput", f"{p['output_tokens_per_s']:.1f} output tok/s, {p['requests_per_s']:.2f} req/s"),
        ("  TTFT p50/p90/p99", " / ".join(ms(p["ttft_s"][q]) for q in ("p50", "p90", "p99"))),
        ("  TPOT p50/p99", " / ".join(ms(p["tpot_s"][q]) for q in ("p50", "p99"))),
        ("  KV peak usage, preemptions", f"{p['kv_peak_usage']:.0%}, {p['num_preemptions']}"),
    ]


def _predict(args: argparse.Namespace, plan: dict, settings: dict) -> dict:
    from kvserve.runtime.planner import predict, simulator

    if not (args.concurrency or args.request_rate or args.trace):
        raise ValueError("--calibration needs a workload: --concurrency N, --request-rate R or --trace FILE")
    workload = simulator.Workload(
        prompt_len=simulator.LengthSpec.parse(args.prompt_len, "--prompt-len"),
        output_len=simulator.LengthSpec.parse(args.output_len, "--output-len"),
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        concurrency=args.concurrency,
        prefix_len=args.prefix_len,
        trace=simulator.load_trace(args.trace) if args.trace else (),
        seed=args.seed,
    )
    spec = predict.SpecDecoding.parse(args.num_speculative_tokens, args.spec_acceptance_rate)
    return predict.predict(plan, settings, predict.load_calibration(args.calibration), workload, spec)


def _error_text(exc: Exception) -> str:
    """One error line's text: a SpecError's message (it names the spec field), an InvalidParameter with its
    setting, anything else as it reads."""
    from kvserve.operator import spec as spec_mod
    from kvserve.runtime.errors import InvalidParameter

    if isinstance(exc, spec_mod.SpecError):
        return exc.message
    if isinstance(exc, InvalidParameter):
        return f"{exc.param}: {exc}"
    return str(exc)


def _plan_cpu(args: argparse.Namespace) -> int | None:
    """The CPU server a CPU calibration measured (plan_cpu.py); None when the calibration is a GPU's."""
    from kvserve.cli import plan_cpu
    from kvserve.operator import spec as spec_mod
    from kvserve.runtime.errors import InvalidParameter
    from kvserve.runtime.planner.predict import load_calibration

    try:
        calibration = load_calibration(args.calibration)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    if not plan_cpu.wanted(args, calibration):
        device = calibration.get("device") or calibration.get("engine_device") or "?"
        print(f"error: the calibration was measured on {device}: give --gpu (the catalog GPU it names)")
        return 2
    if not (args.model or args.model_config):
        print("error: give --model-config (or --model) for the calibrated model")
        return 2
    try:
        config, shape, settings = model_and_settings(args)
        plan = plan_cpu.cpu_plan(settings, shape, args.kv_cache_bytes)
        plan["prediction"] = _predict(args, plan, settings.__dict__)
    except (spec_mod.SpecError, InvalidParameter, ValueError, RuntimeError) as exc:
        print(f"error: {_error_text(exc)}")
        return 2
    if args.output == "json":
        print(json.dumps({**plan, "engine": settings.__dict__}, indent=2))
    else:
        rows = prediction_rows(plan["prediction"])
        width = max(len(k) for k, _ in rows)
        print(settings_line(settings) + "\n" + plan_cpu.format_cpu_plan(plan))
        print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if not plan["fits"]:
        print(f"error: {plan['message']}", file=sys.stderr)
        return 1
    return 0


def list_catalog() -> str:
    from kvserve.runtime import capacity
    from kvserve.runtime.planner import catalog

    lines = [f"{'MODEL':<16} {'ARCHITECTURE':<20} {'PARAMS':>8} {'LAYERS':>6} {'KV HEADS':>8} {'POSITIONS':>9}  SERVED"]
    for key, m in sorted(catalog.MODELS.items()):
        served = "yes" if capacity.unsupported_architecture_error(m) is None else "no (planner refuses)"
        lines.append(
            f"{key:<16} {m.architecture:<20} {m.num_parameters / 1e9:>7.1f}B {m.num_layers:>6} "
            f"{m.num_kv_heads:>8} {m.max_position_embeddings:>9}  {served}"
        )
    lines += ["", f"{'GPU':<12} {'MEMORY MiB':>10}  GFD PRODUCT LABEL"]
    lines += [f"{key:<12} {g.memory_mib:>10}  {g.product}" for key, g in sorted(catalog.GPUS.items())]
    return "\n".join(lines)


def plan_file(path: str, output: str) -> int:
    """Each InferenceService in the file, resolved by the operator's own code; JSON carries status.plan's
    fields (camelCase) and the parallel layout (status.parallelism's fields) beside the CapacityPlanned verdict."""
    from kvserve.cli import manifests
    from kvserve.operator import fleet, kv_offload, startup_budget
    from kvserve.operator import spec as spec_mod
    from kvserve.operator.status import plan_status

    docs = [d for d in manifests.load_documents(path) if d and d.get("kind", spec_mod.KIND) == spec_mod.KIND]
    results, rc = [], 0
    for doc in docs:
        name = (doc.get("metadata") or {}).get("name", "")
        try:
            resolved = resolve_like_operator(doc.get("spec") or {})
            plan = resolved.plan
        except spec_mod.SpecError as exc:
            results.append({"name": name, "fits": False, "reason": exc.reason, "message": exc.message})
            rc = 2
            continue
        rc = rc or (0 if plan.fits else 1)
        results.append(
            {
                "name": name,
                "fits": plan.fits,
                "reason": plan.reason,
                "message": plan.message,
                "plan": plan_status(plan),
                # The layout as data (the --model form's tensor/pipeline_parallel_size fields): pods per replica,
                # TP per pod, PP stages, each stage's layers and why; status.parallelism's fields, for one pod too.
                "parallelism": _layout(resolved),
                "_table": plan.to_dict(),
            }
        )
        if resolved.fleet is not None:  # spec.slo: the operator's status.fleet, the same function
            results[-1]["fleet"] = fleet.fleet_status(resolved.fleet, fleet.price_source(resolved.spec))
        pods = resolved.layout.nodes if resolved.layout is not None else 1
        if tier := kv_offload.status(resolved.spec, pods):  # spec.kvCache.offload: the operator's status.kvOffload
            results[-1]["kvOffload"] = tier
        if plan.fits:  # the engine's startupProbe budget and the phases it is made of (operator/startup_budget.py)
            results[-1]["startup"] = {
                "budgetSeconds": startup_budget.budget_seconds(resolved.spec, plan, pods),
                "expectedPhaseSeconds": {
                    k: round(v, 1) for k, v in startup_budget.expected_phase_seconds(resolved.spec, plan, pods).items()
                },
            }
    if output == "json":
        out = [{k: v for k, v in r.items() if k != "_table"} for r in results]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        for r in results:
            print(f"== {r['name']}")
            print(format_table(r["_table"]) if "_table" in r else f"error: {r['message']}")
            if "fleet" in r:
                print("fleet (spec.slo): " + ", ".join(f"{k} {v}" for k, v in r["fleet"].items()))
            if "kvOffload" in r:
                print(kv_offload.describe(r["kvOffload"]))
            if "startup" in r:
                print(f"startup probe: {r['startup']['budgetSeconds']} s (operator/startup_budget.py)")
    return rc


def _layout(resolved) -> dict | None:
    """status.parallelism's fields for any layout; one pod is one stage holding every layer."""
    if resolved.layout is None:
        return None
    out = resolved.layout.to_status()
    if not resolved.layout.multinode:
        out["stageLayers"] = [resolved.model.num_layers]
    return out


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB"


def with_lora_slots(args: argparse.Namespace, resolved):
    """(plan, plan input) of the operator's resolution, with --enable-lora's adapter slots taken off the KV
    budget (--max-loras x --max-lora-rank; the server this command line starts allocates exactly these)."""
    import dataclasses

    from kvserve.runtime.planner import kv_plan

    pin = resolved.plan_input
    # The operator's own verdict on the engine settings (InvalidEngineConfig) stays as it is.
    if not getattr(args, "enable_lora", False) or pin is None or resolved.plan.reason == "InvalidEngineConfig":
        return resolved.plan, pin
    pin = dataclasses.replace(pin, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    return kv_plan.plan(pin), pin


def fitting_tensor_parallel_size(args, settings, shape, config) -> int | None:
    """The smallest larger --tensor-parallel-size (one node: <= --gpus-per-node) whose plan fits, else None."""
    import dataclasses

    from kvserve.operator import spec as spec_mod
    from kvserve.runtime.planner import suggest

    def fits(tp: int) -> bool:
        wider = dataclasses.replace(settings, tensor_parallel_size=tp)
        return with_lora_slots(args, spec_mod.resolve(_spec(args, wider), model_config=config))[0].fits

    return suggest.wider_tensor_parallel_size(shape, settings.tensor_parallel_size, args.gpus_per_node, fits)


def fitting_gpu(args, settings, config) -> str | None:
    """The catalog GPU with the least memory above --gpu's whose plan fits at this --tensor-parallel-size (ties:
    the cheaper), else None: the other way out when no --tensor-parallel-size fits."""
    from kvserve.operator import spec as spec_mod
    from kvserve.runtime.planner import catalog, suggest

    current = catalog.lookup_gpu(args.gpu)
    if current is None:
        return None

    def fits(key: str) -> bool:
        other = argparse.Namespace(**{**vars(args), "gpu": key})
        return with_lora_slots(other, spec_mod.resolve(_spec(other, settings), model_config=config))[0].fits

    return suggest.bigger_gpu(current, fits)


def _across_nodes(args, settings, tp: int, config) -> str:
    """' as TP t x PP p across p nodes' when TP t fits only as several pipeline stages (a whole node per
    stage, issue 28), so the hint does not read as 'one node of t GPUs holds it'."""
    import dataclasses

    from kvserve.operator import spec as spec_mod

    wider = dataclasses.replace(settings, tensor_parallel_size=tp)
    layout = spec_mod.resolve(_spec(args, wider), model_config=config).layout
    if layout is None or not layout.multinode:
        return ""
    return f" as TP {tp} x PP {layout.pipeline_parallel_size} across {layout.nodes} nodes"


def does_not_fit_line(args, plan: dict, settings, shape, config) -> str:
    """Why the plan does not fit, by how much, and the --tensor-parallel-size that would (CLI flag names)."""
    model = args.model or args.model_config
    tp = settings.tensor_parallel_size
    needed = (
        plan["weight_bytes_per_gpu"]
        + plan["activation_reserve_bytes"]
        + plan["runtime_overhead_bytes"]
        + plan.get("lora_slot_bytes_per_gpu", 0)
    )
    budget = plan["memory_budget_bytes_per_gpu"]
    where = f"{model} does not fit {args.gpu} at --tensor-parallel-size {tp}"
    if needed > budget:
        parts = "weights + activations + overhead" + (" + LoRA slots" if plan.get("lora_slot_bytes_per_gpu") else "")
        why = (
            f"{parts} need {_gb(needed)} per GPU, {_gb(needed - budget)} over the "
            f"{_gb(budget)} budget (--gpu-memory-utilization {settings.gpu_memory_utilization:g})"
        )
    else:
        why = f"{plan['reason']}: {plan['message']}"
    wider = fitting_tensor_parallel_size(args, settings, shape, config)
    if wider is not None:
        hint = f"; --tensor-parallel-size {wider} would fit" + _across_nodes(args, settings, wider, config)
    else:
        hint = f"; no --tensor-parallel-size up to --gpus-per-node {args.gpus_per_node} fits"
        gpu = fitting_gpu(args, settings, config)
        if gpu is not None:
            hint += f"; --gpu {gpu} would fit at --tensor-parallel-size {tp}"
        if plan["reason"] != "WeightsDoNotFit":
            hint += " (try a smaller --max-model-len)"
    return f"{where}: {why}{hint}"


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(list_catalog())
        return 0
    if args.filename:
        return plan_file(args.filename, args.output)
    from kvserve.cli import plan_fleet

    searching = plan_fleet.wanted(args)
    if args.calibration and not args.gpu and not searching:
        code = _plan_cpu(args)
        if code is not None:
            return code
    if args.kv_cache_bytes is not None:
        print(
            "error: --kv-cache-bytes plans a CPU server (with a CPU --calibration and no --gpu); "
            "on a GPU the plan sizes the KV cache"
        )
        return 2
    if searching and not args.gpu:
        try:
            args.gpu = plan_fleet.anchor_gpu(args)
        except ValueError as exc:
            print(f"error: {exc}")
            return 2
    if not (args.model or args.model_config) or not args.gpu:
        print("error: give --model (or --model-config) and --gpu, -f FILE.yaml, or --list")
        return 2
    from kvserve.operator import spec as spec_mod
    from kvserve.runtime.errors import InvalidParameter

    try:
        config, shape, settings = model_and_settings(args)
        resolved = spec_mod.resolve(_spec(args, settings), model_config=config)
    except (spec_mod.SpecError, InvalidParameter) as exc:
        print(f"error: {_error_text(exc)}")
        return 2
    chosen = resolved.plan
    # The spec path already chose one pod or a group of PP stages (runtime/planner/layout.py): say why.
    why = resolved.layout.reason if resolved.layout is not None and resolved.layout.multinode else ""
    # Only when a whole node (TP = GPUs per node) does not fit: a smaller TP's refusal stays a refusal.
    pin = resolved.plan_input
    lora = getattr(args, "enable_lora", False)
    if lora and pin is not None and pin.pipeline_parallel_size > 1:
        print("error: enable_lora: enable_lora needs pipeline_parallel_size 1")
        return 2
    chosen, pin = with_lora_slots(args, resolved)
    if not chosen.fits and not lora and pin is not None and pin.tensor_parallel_size >= args.gpus_per_node:
        from kvserve.runtime.planner.kv_plan import plan_multinode

        chosen, why = plan_multinode(pin, args.gpus_per_node)
    plan = chosen.to_dict()
    if why:
        plan["layout_reason"] = why
    try:
        calibration = None
        if args.calibration:
            from kvserve.runtime.planner.predict import load_calibration

            calibration = load_calibration(args.calibration)
            if args.concurrency or args.trace or not searching:
                plan["prediction"] = _predict(args, plan, settings.__dict__)
        if searching:
            plan["fleet"] = plan_fleet.fleet(args, pin, calibration)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}")
        return 2
    if not plan["fits"]:
        # One line in `kvserve serve`'s flag names (the plan's own message speaks the CRD's spec.* names).
        print(f"error: {does_not_fit_line(args, plan, settings, resolved.model, config)}", file=sys.stderr)
        if args.output != "json":
            return 1
    if args.output == "json":
        # "engine": the settings the plan assumed, named as EngineArgs (and `kvserve serve`'s flags) name them.
        out = {**plan, "engine": settings.__dict__}
        print(json.dumps({**out, "model": resolved.model.__dict__} if config else out, indent=2))
    else:
        print(
            (shape_line(resolved.model) + "\n" if config else "") + settings_line(settings) + "\n" + format_table(plan)
        )
        if why:
            print(f"layout: TP {chosen.tensor_parallel_size} x PP {chosen.pipeline_parallel_size}: {why}")
        if "fleet" in plan:
            print(plan_fleet.format_fleet(plan["fleet"]))
    if "fleet" in plan:  # the search's verdict: a chosen fleet, whatever --gpu's own plan said
        if "disaggregation" in plan["fleet"]:
            return 0 if plan["fleet"]["disaggregation"]["decision"] is not None else 1
        return 0 if plan["fleet"]["choice"] is not None else 1
    return 0 if plan["fits"] else 1
