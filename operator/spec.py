"""InferenceService spec: the CRD's defaults applied in Python, and the spec -> planner input mapping.

The API server applies the CRD's structural defaults; `kvserve render` on a file and the K8s emulator in the
e2e tests do not, so `with_defaults` applies the same ones (tests/operator/test_crd.py checks that every
default here equals the CRD's). Validation that needs the catalogs (unknown model or GPU, TP split) lives
here, and so does the enum check of engine settings (`check_enums`, from the same EngineArgs definition the
CRD's enums are tested against); shape/range validation is the CRD schema's job.

`resolve` reads the manifest as written (its checks name the user's fields, and run before the typed parse
so that their words win), then hands on the typed spec (spec_model.InferenceServiceSpec): everything after
it, the renderers, status and metrics, reads attributes, not string keys.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic

from kvserve.operator import adapters as adapters_mod
from kvserve.operator import crd_schema, fleet, kv_events, kv_offload, pod_resources, pools, spec_model
from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime import capacity, engine_args
from kvserve.runtime.planner import catalog, kv_plan
from kvserve.runtime.planner.layout import DEFAULT_GPUS_PER_NODE, Layout, ParallelismError, choose
from kvserve.runtime.sources import uri as source_uri

GROUP = "serving.kvserve.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

DEFAULT_IMAGE = "ghcr.io/kvserve/kvserve-runtime:0.1.0"  # the chart's appVersion (tests/operator/test_chart_values.py)
# The runtime image, pull policy and pull secrets of pods whose InferenceService names none are the operator's
# defaults, not the CRD's: the chart sets them per installation (values runtime.image.*, runtime.imagePullSecrets;
# the tag defaults to its appVersion), so the API server must not stamp one fixed image into every object.
RUNTIME_IMAGE_ENV = "KVSERVE_RUNTIME_IMAGE"
RUNTIME_PULL_POLICY_ENV = "KVSERVE_RUNTIME_IMAGE_PULL_POLICY"
RUNTIME_PULL_SECRETS_ENV = "KVSERVE_RUNTIME_IMAGE_PULL_SECRETS"  # comma-separated Secret names
OPERATOR_DEFAULTED = ("image", "imagePullPolicy", "imagePullSecrets")


def runtime_image_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """spec.image / imagePullPolicy / imagePullSecrets defaults from the operator's environment."""
    out: dict[str, Any] = {
        "image": environ.get(RUNTIME_IMAGE_ENV) or DEFAULT_IMAGE,
        "imagePullPolicy": environ.get(RUNTIME_PULL_POLICY_ENV) or "IfNotPresent",
    }
    names = [n.strip() for n in (environ.get(RUNTIME_PULL_SECRETS_ENV) or "").split(",") if n.strip()]
    if names:
        out["imagePullSecrets"] = [{"name": n} for n in names]
    return out


def _engine_defaults() -> dict[str, dict[str, Any]]:
    """The engine settings the CRD exposes, with their defaults, from the one EngineArgs definition."""
    out: dict[str, dict[str, Any]] = {}
    for path, default in engine_args.crd_defaults().items():
        section, key = path.split(".")
        out.setdefault(section, {})[key] = default
    return out


_ENGINE = _engine_defaults()
DEFAULTS: dict[str, Any] = {
    "model": {**_ENGINE["model"]},
    "gpu": {**_ENGINE["gpu"], "resourceName": "nvidia.com/gpu"},
    "engine": {**_ENGINE["engine"]},
    "replicas": 1,
    "autoscaling": {"enabled": False, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 5},
    **runtime_image_defaults(os.environ),
    "port": 8000,
    "shmSize": "16Gi",
    "terminationGracePeriodSeconds": 120,
    "drain": {"preStopSeconds": 5},
    "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
    "router": {"enabled": False, "replicas": 1, "kvEvents": {"port": 5557, "replayPort": 5558}},
    "networkPolicy": {"enabled": True, "allowSameNamespace": True},
    "parallelism": {"gpusPerNode": DEFAULT_GPUS_PER_NODE},
}


class SpecError(ValueError):
    """A spec the planner cannot even start on (unknown model or GPU). `reason` becomes the condition reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def _merge_defaults(value: dict, defaults: dict) -> dict:
    out = dict(value)
    for key, default in defaults.items():
        if key not in out:
            out[key] = copy.deepcopy(default)
        elif isinstance(default, dict) and isinstance(out[key], dict):
            out[key] = _merge_defaults(out[key], default)
    return out


def with_defaults(spec: dict) -> dict:
    return _merge_defaults(copy.deepcopy(dict(spec or {})), DEFAULTS)


@dataclass(frozen=True)
class Resolved:
    spec: InferenceServiceSpec  # defaults applied, typed: what everything after resolve() reads
    source: source_uri.ModelURI  # spec.model.uri (+ revision), parsed
    model: catalog.ModelShape
    gpu_memory_bytes: int
    gpu_product: str | None  # node-selector value; None when the spec names no known product
    plan: kv_plan.Plan
    plan_input: kv_plan.PlanInput | None = None  # what `plan` was computed from (kvserve plan's multi-node retry)
    # Pods per replica and why (issue 28): one pod renders a Deployment, more a LeaderWorkerSet.
    layout: Layout | None = None
    # spec.adapters, validated: LoRA adapters every replica loads at start-up (operator/adapters.py)
    adapters: tuple[adapters_mod.Adapter, ...] = ()
    # spec.slo + spec.workload (issue 25): one replica's SLO capacity and the HPA bounds (operator/fleet.py)
    fleet: fleet.Option | None = None
    # {minReplicas, maxReplicas, targetQueueDepth} the HPA / KEDA use: the user's explicit values, else the
    # SLO plan's, else the defaults (fleet.autoscaling_bounds)
    autoscaling: dict = dataclasses.field(default_factory=dict)
    # spec.disaggregation (issue 42): the prefill and decode pools, each planned at its own TP (operator/pools.py);
    # None for an aggregated service. With pools, `plan` is pools.plan() and `layout` None.
    pools: pools.Pools | None = None


_SHAPE_FIELDS = {
    "numLayers": "num_layers",
    "numAttentionHeads": "num_attention_heads",
    "numKeyValueHeads": "num_kv_heads",
    "headDim": "head_dim",
    "hiddenSize": "hidden_size",
    "numParameters": "num_parameters",
    "maxPositionEmbeddings": "max_position_embeddings",
    "intermediateSize": "intermediate_size",
    "vocabSize": "vocab_size",
    "expertsPerToken": "experts_per_token",
    "numExperts": "num_experts",
    "architecture": "architecture",
    "tieWordEmbeddings": "tie_word_embeddings",
    "attentionBias": "attention_bias",
    "qkNorm": "qk_norm",
}
_OPTIONAL_SHAPE_FIELDS = {
    "expertsPerToken",
    "numExperts",
    "architecture",
    "tieWordEmbeddings",
    "attentionBias",
    "qkNorm",
}


def model_source(model_spec: dict | spec_model.ModelSpec) -> source_uri.ModelURI:
    """spec.model.uri + revision, validated (the CRD checks the grammar too; this names the field)."""
    if isinstance(model_spec, spec_model.ModelSpec):
        model_spec = model_spec.model_dump(by_alias=True, exclude_none=True)
    try:
        source = source_uri.parse(model_spec.get("uri", ""), model_spec.get("revision"))
    except source_uri.SourceError as exc:
        raise SpecError("InvalidModelSource", str(exc)) from None
    for key in ("cache", "credentials"):
        if model_spec.get(key) and not source.remote:
            raise SpecError(
                "InvalidModelSource",
                f"spec.model.{key} applies to hf:// and s3:// sources only; {source.scheme}:// is mounted as it is",
            )
    cache = model_spec.get("cache")
    if cache is not None and bool((cache or {}).get("claimName")) == bool((cache or {}).get("hostPath")):
        raise SpecError(
            "InvalidModelSource",
            "spec.model.cache: set exactly one of claimName (a ReadWriteMany PVC) and hostPath (a node-local folder)",
        )
    return source


def needs_model_config(spec: dict) -> bool:
    """Must the operator read the model's config.json to plan it? Only for a remote source whose shape is
    neither in the catalog nor fully given in spec.model.shape."""
    model_spec = (spec or {}).get("model") or {}
    if model_spec.get("name") and catalog.lookup_model(model_spec["name"]) is not None:
        return False
    overrides = model_spec.get("shape") or {}
    if all(k in overrides for k in _SHAPE_FIELDS if k not in _OPTIONAL_SHAPE_FIELDS):
        return False
    try:
        return source_uri.parse(model_spec.get("uri", ""), model_spec.get("revision")).remote
    except source_uri.SourceError:
        return False  # resolve() reports it


def model_shape(model_spec: dict, model_config: dict | None = None) -> catalog.ModelShape:
    """The catalog entry, else the shape read from the model's config.json (`model_config`), with
    spec.model.shape's overrides on top; without either, every shape field must be given."""
    base = catalog.lookup_model(model_spec["name"]) if model_spec.get("name") else None
    overrides = model_spec.get("shape") or {}
    if base is None and model_config is not None:
        archs = model_config.get("architectures") or []
        if archs and not any(a in capacity.SUPPORTED_ARCHITECTURES for a in archs):
            raise SpecError(
                "UnsupportedArchitecture",
                f"the model's config.json names architectures {', '.join(archs)}, which the runtime "
                f"does not serve; supported: {', '.join(capacity.SUPPORTED_ARCHITECTURES)}",
            )
        try:
            base = capacity.shape_from_hf_config(model_config)
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(
                "InvalidModelConfig",
                f"the model's config.json lacks or mangles a shape field "
                f"({type(exc).__name__}: {exc}); give spec.model.shape",
            ) from None
    if base is None:
        missing = [k for k in _SHAPE_FIELDS if k not in _OPTIONAL_SHAPE_FIELDS and k not in overrides]
        if missing:
            known = ", ".join(sorted(catalog.MODELS))
            raise SpecError(
                "UnknownModel",
                f"model {model_spec.get('name')!r} is not in the catalog ({known}); "
                f"give spec.model.shape with {', '.join(missing)}, or an hf:// or s3:// "
                "spec.model.uri (the operator then plans from its config.json)",
            )
        fields = {py: overrides[k] for k, py in _SHAPE_FIELDS.items() if k in overrides}
        return catalog.ModelShape(**fields)
    replace = {py: overrides[k] for k, py in _SHAPE_FIELDS.items() if k in overrides}
    return catalog.ModelShape(**{**base.__dict__, **replace})


def check_no_api_key_in_args(spec: dict) -> None:
    """An API key in extraArgs would sit in plain text in the CR, the Deployment and `ps`: refuse it.

    The CRD rejects it too (CEL); this covers clusters without the CRD's validation and `kvserve render`.
    """
    for arg in (spec.get("engine") or {}).get("extraArgs") or []:
        if str(arg).split("=", 1)[0] == "--api-key":
            raise SpecError(
                "ApiKeyInArgs",
                "spec.engine.extraArgs must not carry --api-key (it would be readable "
                "in the CR, the Deployment and the process list); put the key in a "
                "Secret and set spec.auth.apiKeySecretRef {name, key}",
            )


def check_enums(spec: dict) -> None:
    """The CRD's enums on engine settings (engine_args.crd_choices, the one definition the CRD is checked
    against), for `kvserve render` / `kvserve plan -f` and clusters without the CRD's validation."""
    for path, choices in engine_args.crd_choices().items():
        section, key = path.split(".")
        value = (spec.get(section) or {}).get(key)
        if value not in choices or isinstance(value, bool):
            raise SpecError(
                "InvalidEngineSetting",
                f"spec.{path} must be one of {', '.join(str(c) for c in choices)}, got {value!r}",
            )


def scales_to_zero(spec: InferenceServiceSpec) -> bool:
    return spec.autoscaling.enabled and spec.autoscaling.min_replicas == 0


def check_scale_to_zero(spec: InferenceServiceSpec) -> None:
    """minReplicas 0 works only through the router: at zero replicas something must accept the requests,
    hold them and export their count, which is what scales the model up (the CRD refuses it too, with CEL)."""
    if scales_to_zero(spec) and not spec.router.enabled:
        raise SpecError(
            "ScaleToZeroNeedsRouter",
            "spec.autoscaling.minReplicas 0 (scale from zero) needs spec.router.enabled: true: with no "
            "replica up, the router holds the requests and its held count is what KEDA scales the model "
            "up on; enable the router or set spec.autoscaling.minReplicas >= 1",
        )


# -- spec.router.kvEvents (issue 40; operator/kv_events.py, rendered by render/kv_events.py) ----------------
def check_kv_events(spec: InferenceServiceSpec) -> None:
    problem = kv_events.check(spec)
    if problem:
        raise SpecError("InvalidKVEvents", problem)


# -- spec.kvCache.offload (issue 41; operator/kv_offload.py) -------------------------------------------------
def check_kv_offload(spec: InferenceServiceSpec, layout: Layout, model: catalog.ModelShape) -> None:
    """The tiers the runtime would refuse, and a memory request or limit that cannot hold them."""
    pods = layout.nodes if layout.multinode else 1
    problem = kv_offload.check(spec, pods, model.num_sliding_layers or 0) or pod_resources.check_memory(spec, pods)
    if problem:
        raise SpecError("InvalidKVCacheOffload", problem)


GATEWAY_FIELDS = {"inferencePool": {"endpointPickerRef"}}
ENDPOINT_PICKER_FIELDS = {"group", "kind", "name", "port", "failureMode"}


def check_gateway(spec: dict) -> None:
    """Unknown spec.gateway fields are an error, named by path (the API server prunes them with a warning,
    or refuses them under kubectl's strict validation; `kvserve render` and a cluster without the CRD's
    schema get the same answer here)."""
    gateway = spec.get("gateway")
    if gateway is None:
        return
    if not isinstance(gateway, dict):
        raise SpecError("InvalidGateway", "spec.gateway must be an object")
    paths = [f"spec.gateway.{k}" for k in gateway if k not in GATEWAY_FIELDS]
    pool = gateway.get("inferencePool")
    if isinstance(pool, dict):
        paths += [f"spec.gateway.inferencePool.{k}" for k in pool if k not in GATEWAY_FIELDS["inferencePool"]]
        ref = pool.get("endpointPickerRef")
        if not isinstance(ref, dict) or not ref.get("name"):
            raise SpecError(
                "InvalidGateway",
                "spec.gateway.inferencePool.endpointPickerRef.name is required (the endpoint picker's Service)",
            )
        paths += [f"spec.gateway.inferencePool.endpointPickerRef.{k}" for k in ref if k not in ENDPOINT_PICKER_FIELDS]
        if ref.get("kind", "Service") == "Service" and not isinstance((ref.get("port") or {}).get("number"), int):
            raise SpecError(
                "InvalidGateway",
                "spec.gateway.inferencePool.endpointPickerRef.port.number is required for a Service endpoint picker",
            )
    elif pool is not None:
        raise SpecError("InvalidGateway", "spec.gateway.inferencePool must be an object")
    if paths:
        raise SpecError(
            "InvalidGateway", f"unknown field {paths[0]} (spec.gateway knows: inferencePool.endpointPickerRef)"
        )


KILL_MARGIN_SECONDS = 10  # left to the kubelet after the drain, before its SIGKILL


def drain_timeout_seconds(spec: InferenceServiceSpec) -> int:
    """The pod's --drain-timeout: the grace period (which starts with the preStop sleep) less the preStop sleep
    and KILL_MARGIN_SECONDS. Raises SpecError when less than 1 s of drain would be left."""
    grace, pre_stop = spec.termination_grace_period_seconds, spec.drain.pre_stop_seconds
    drain = grace - pre_stop - KILL_MARGIN_SECONDS
    if drain < 1:
        raise SpecError(
            "InvalidDrain",
            f"spec.drain.preStopSeconds ({pre_stop}) + {KILL_MARGIN_SECONDS} s for the "
            f"kubelet + at least 1 s of drain must fit in "
            f"spec.terminationGracePeriodSeconds ({grace}): lower "
            f"spec.drain.preStopSeconds to at most {grace - KILL_MARGIN_SECONDS - 1} "
            "or raise terminationGracePeriodSeconds",
        )
    return drain


def resolve(spec: dict, model_config: dict | None = None) -> Resolved:
    """Defaults + catalogs + planner. Raises SpecError for an unknown model/GPU, a bad model source, an engine
    setting outside the CRD's enum, an API key in extraArgs or any other break of the CRD's schema.
    `model_config`: the model's config.json, for models outside the catalog."""
    # Which autoscaling bounds the user wrote (the CRD does not default them, so that they can win over spec.slo's
    # plan): read before the defaults fill the rest in.
    explicit_bounds = frozenset(((spec or {}).get("autoscaling") or {}).keys() & set(fleet.BOUND_FIELDS))
    written = spec or {}
    spec = with_defaults(spec)
    check_enums(spec)
    check_no_api_key_in_args(spec)
    check_gateway(spec)
    try:
        pools.check_written(spec)
    except pools.PoolError as exc:
        raise SpecError("InvalidDisaggregation", str(exc)) from None
    source = model_source(spec["model"])
    try:
        adapters = tuple(adapters_mod.parse(spec))
    except adapters_mod.AdapterError as exc:
        raise SpecError("InvalidAdapter", str(exc)) from None
    max_loras, max_lora_rank = adapters_mod.slots(list(adapters))
    model = model_shape(spec["model"], model_config)
    gpu_spec, engine = spec["gpu"], spec["engine"]
    gpu = catalog.lookup_gpu(gpu_spec["product"]) if gpu_spec.get("product") else None
    if gpu_spec.get("memoryMiB"):
        memory_bytes = int(gpu_spec["memoryMiB"]) * catalog.MiB
    elif gpu is not None:
        memory_bytes = gpu.memory_bytes
    else:
        raise SpecError(
            "UnknownGPU",
            f"GPU {gpu_spec.get('product')!r} is not in the catalog ({', '.join(sorted(catalog.GPUS))}); "
            "give spec.gpu.memoryMiB",
        )
    product = gpu_spec.get("nodeSelectorProduct") or (gpu.product if gpu else gpu_spec.get("product"))
    mib = catalog.MiB
    plan_input = kv_plan.PlanInput(
        model=model,
        gpu_memory_bytes=memory_bytes,
        tensor_parallel_size=gpu_spec["tensorParallelSize"],
        dtype=spec["model"]["dtype"],
        kv_cache_dtype=engine["kvCacheDtype"],
        max_model_len=engine["maxModelLen"],
        block_size=engine["blockSize"],
        gpu_memory_utilization=engine["gpuMemoryUtilization"],
        max_num_batched_tokens=engine["maxNumBatchedTokens"],
        max_num_seqs=engine["maxNumSeqs"],
        activation_reserve_bytes=engine["activationReserveMiB"] * mib if "activationReserveMiB" in engine else None,
        runtime_overhead_bytes=engine["runtimeOverheadMiB"] * mib if "runtimeOverheadMiB" in engine else None,
        # the adapter slots the pod's --max-loras/--max-lora-rank allocate come off the KV budget
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
    )
    try:
        plan, layout = choose(
            plan_input,
            kv_plan.plan(plan_input),
            nodes=None if (nodes := spec["parallelism"].get("nodes")) is None else int(nodes),
            gpus_per_node=int(spec["parallelism"]["gpusPerNode"]),
            extra_args=[str(a) for a in engine.get("extraArgs") or []],
        )
    except ParallelismError as exc:
        raise SpecError("InvalidParallelism", str(exc)) from None
    if layout.multinode:  # the plan the pods run: PP stages of TP GPUs each
        plan_input = dataclasses.replace(plan_input, pipeline_parallel_size=layout.pipeline_parallel_size)
        if adapters and plan.fits:  # the runtime refuses --enable-lora with --pipeline-parallel-size > 1
            plan = dataclasses.replace(
                plan,
                fits=False,
                reason="PipelineParallelUnsupported",
                message=f"spec.adapters (LoRA) cannot be combined with pipeline parallelism: this replica needs "
                f"{layout.nodes} pods ({layout.reason}); serve the adapters on a model that fits one pod "
                "(a larger gpu.tensorParallelSize, a smaller maxModelLen or dtype fp8)",
            )
    budget_error = engine_args.chunked_prefill_budget_error(
        engine["enableChunkedPrefill"],
        engine["maxNumBatchedTokens"],
        engine["maxModelLen"],
        names=("maxNumBatchedTokens", "maxModelLen"),
    )
    if plan.fits and budget_error:
        plan = kv_plan.Plan(
            **{
                **plan.to_dict(),
                "fits": False,
                "reason": "InvalidEngineConfig",
                "message": budget_error,
            }
        )
    fleet_option = _plan_fleet(spec, plan_input, plan, layout)
    try:
        autoscaling = fleet.autoscaling_bounds(spec["autoscaling"], fleet_option, explicit_bounds)
    except ValueError as exc:
        raise SpecError("InvalidAutoscaling", str(exc)) from None
    # The CRD's types, bounds, patterns and required fields, last: the named checks above say more about the
    # fields they know. From here on the spec is typed.
    typed = parse(written)
    check_scale_to_zero(typed)
    drain_timeout_seconds(typed)
    check_kv_events(typed)  # issue 40
    check_kv_offload(typed, layout, model)  # issue 41
    # spec.disaggregation: each pool planned at its own TP by the same planner; the service's plan is theirs.
    try:
        pool_set = pools.resolve(
            typed,
            plan_input,
            gpus_per_node=typed.parallelism.gpus_per_node,
            extra_args=[str(a) for a in engine.get("extraArgs") or []],
            refuse=budget_error,
        )
    except pools.PoolError as exc:
        raise SpecError("InvalidDisaggregation", str(exc)) from None
    if pool_set is not None:
        plan, layout = pool_set.plan(), None
    return Resolved(
        spec=typed,
        source=source,
        model=model,
        gpu_memory_bytes=memory_bytes,
        gpu_product=product,
        plan=plan,
        plan_input=plan_input,
        layout=layout,
        adapters=adapters,
        fleet=fleet_option,
        autoscaling=autoscaling,
        pools=pool_set,
    )


def parse(spec: dict | None) -> InferenceServiceSpec:
    """The spec as written, defaults applied, as the typed model. Raises SpecError InvalidSpec naming every
    field that breaks the CRD's schema (in crd_schema.check's words where the CRD ships, else pydantic's)."""
    try:
        return InferenceServiceSpec.model_validate(with_defaults(spec))
    except pydantic.ValidationError as exc:
        found = crd_schema.check(spec or {}) or [
            f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        ]
        raise SpecError("InvalidSpec", "; ".join(found)) from None


def best_effort(spec: dict | None) -> InferenceServiceSpec:
    """The typed spec of one resolve() refused, for the status and metrics of what still runs: each value that
    breaks the schema reads as its default (an object missing a required field as absent), and a model
    without a usable uri keeps uri "" (model_source then reports InvalidModelSource, as the status says)."""
    data = with_defaults(spec)
    for _ in range(64):  # each pass drops at least one value
        try:
            return InferenceServiceSpec.model_validate(data)
        except pydantic.ValidationError as exc:
            errors = exc.errors()
        dropped = False
        for err in reversed(errors):  # deepest list items last-first: earlier indices stay valid
            loc = list(err["loc"])[:-1] if err["type"] == "missing" else list(err["loc"])
            if loc[:1] == ["model"] and (len(loc) == 1 or loc[1] == "uri"):
                data["model"] = spec_model.ModelSpec.model_construct(uri="")
                dropped = True
            else:
                dropped = _drop(data, loc) or dropped
        if not dropped:
            break
    return InferenceServiceSpec.model_construct(
        model=spec_model.ModelSpec.model_construct(uri=""), gpu=spec_model.GPUSpec()
    )


def _drop(data: dict, loc: list) -> bool:
    """Delete the deepest value of `loc` present in `data` (a union's member tags in loc are skipped)."""
    parent: Any = None
    node: Any = data
    key: Any = None
    for part in loc:
        if (
            isinstance(node, dict)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and part < len(node)
        ):
            parent, key, node = node, part, node[part]
        else:
            break
    if parent is None:
        return False
    del parent[key]
    return True


def _plan_fleet(spec: dict, plan_input: kv_plan.PlanInput, plan: kv_plan.Plan, layout: Layout) -> fleet.Option | None:
    """spec.slo + spec.workload -> this replica's SLO capacity and HPA bounds (None without them or when the
    plan does not fit: nothing is deployed then). Raises SpecError InvalidSLO naming the field."""
    try:
        target = fleet.target_from_spec(spec)
        price = fleet.gpu_price(spec)
    except ValueError as exc:
        raise SpecError("InvalidSLO", str(exc)) from None
    if target is None or not plan.fits:
        return None
    if layout.multinode:
        raise SpecError(
            "InvalidSLO",
            f"spec.slo is not planned for replicas of several pods yet ({layout.reason}): remove spec.slo and "
            "spec.workload and set spec.autoscaling yourself",
        )
    key = catalog.gpu_key(spec["gpu"]["product"]) if spec["gpu"].get("product") else None
    if key is None:
        raise SpecError(
            "InvalidSLO",
            f"spec.slo needs a catalog GPU in spec.gpu.product ({', '.join(sorted(catalog.GPUS))}): its "
            f"datasheet FLOPs and bandwidth are the step-time model, got {spec['gpu'].get('product')!r}",
        )
    return fleet.plan_replica(plan_input, plan, key, target, price)
