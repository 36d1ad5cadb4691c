"""The InferenceService spec as a typed pydantic model: what the operator reads instead of string keys.

Field names are snake_case; the aliases are the CRD's camelCase keys (`model_validate(dict)` takes the
manifest as written, `model_dump(by_alias=True, exclude_unset=True)` gives it back). The CRD
(crds/inferenceservices.serving.kvserve.dev.yaml) stays the one source of the spec's shape: every property,
default, bound, enum, length, pattern and required list here is checked against it by
tests/operator/test_spec_model.py, and the engine settings' defaults come from EngineArgs (engine_args.
crd_defaults, the definition the CRD's defaults are tested against). The CRD's CEL rules are spec.py's checks.

Objects the manifests pass through as the user wrote them (resources, tolerations' siblings, HPA behavior,
label selectors) are plain dicts: the operator copies them, it does not read them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from kvserve.runtime import engine_args

_DEFAULT = engine_args.crd_defaults()  # "engine.maxModelLen" -> 8192, ...
# spec.model.uri and spec.adapters[].uri: the source grammar runtime/sources/uri.py parses
URI_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|file:///.*|"
    r"hf://[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?/[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?(@[^@\s]+)?|"
    r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?)$"
)
IntOrString = int | str  # x-kubernetes-int-or-string
Quantities = dict[str, IntOrString]


class _Part(BaseModel):
    """camelCase aliases, snake_case attributes; unknown keys are dropped (the API server prunes them, the CLI
    reports them: cli/manifests, spec.check_gateway); frozen, as a spec is read, never written."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True, strict=True)


class SecretName(_Part):
    name: Annotated[str, Field(min_length=1, max_length=253)]


class Credentials(_Part):
    secret_ref: SecretName


class SecretKeyRef(_Part):
    name: Annotated[str, Field(min_length=1)]
    key: Annotated[str, Field(min_length=1)]


class ModelCache(_Part):
    claim_name: Annotated[str, Field(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")] | None = None
    host_path: Annotated[str, Field(pattern=r"^/.+")] | None = None


class ModelShapeSpec(_Part):
    num_layers: Annotated[int, Field(ge=1)] | None = None
    num_attention_heads: Annotated[int, Field(ge=1)] | None = None
    num_key_value_heads: Annotated[int, Field(ge=1)] | None = None
    head_dim: Annotated[int, Field(ge=1)] | None = None
    hidden_size: Annotated[int, Field(ge=1)] | None = None
    intermediate_size: Annotated[int, Field(ge=1)] | None = None
    vocab_size: Annotated[int, Field(ge=1)] | None = None
    num_parameters: Annotated[int, Field(ge=1)] | None = None
    max_position_embeddings: Annotated[int, Field(ge=1)] | None = None
    experts_per_token: Annotated[int, Field(ge=1)] | None = None
    num_experts: Annotated[int, Field(ge=0)] | None = None
    architecture: str | None = None
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None
    qk_norm: bool | None = None


class ModelSpec(_Part):
    name: str | None = None
    served_name: str | None = None
    uri: Annotated[str, Field(max_length=1024, pattern=URI_PATTERN)]
    revision: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    credentials: Credentials | None = None
    cache: ModelCache | None = None
    dtype: Literal["float32", "bfloat16", "float16", "fp8"] = _DEFAULT["model.dtype"]
    shape: ModelShapeSpec | None = None


class GPUSpec(_Part):
    product: str | None = None
    memory_mib: Annotated[int, Field(ge=1024)] | None = Field(None, alias="memoryMiB")
    usd_per_gpu_hour: Annotated[float, Field(gt=0)] | None = None
    node_selector_product: str | None = None
    tensor_parallel_size: Literal[1, 2, 4, 8] = _DEFAULT["gpu.tensorParallelSize"]
    resource_name: str = "nvidia.com/gpu"


class EngineSpec(_Part):
    max_model_len: Annotated[int, Field(ge=16, le=1048576)] = _DEFAULT["engine.maxModelLen"]
    block_size: Literal[1, 8, 16, 32, 64, 128, 256] = _DEFAULT["engine.blockSize"]
    enable_prefix_caching: bool = _DEFAULT["engine.enablePrefixCaching"]
    enable_chunked_prefill: bool = _DEFAULT["engine.enableChunkedPrefill"]
    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] = _DEFAULT["engine.maxNumSeqs"]
    max_num_batched_tokens: Annotated[int, Field(ge=16)] = _DEFAULT["engine.maxNumBatchedTokens"]
    gpu_memory_utilization: Annotated[float, Field(ge=0.1, le=0.99)] = _DEFAULT["engine.gpuMemoryUtilization"]
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = _DEFAULT["engine.kvCacheDtype"]
    activation_reserve_mib: Annotated[int, Field(ge=0)] | None = Field(None, alias="activationReserveMiB")
    runtime_overhead_mib: Annotated[int, Field(ge=0)] | None = Field(None, alias="runtimeOverheadMiB")
    extra_args: list[str] | None = None


class AutoscalingSpec(_Part):
    enabled: bool = False
    # no CRD default: an unset bound is the SLO plan's, else the operator's (fleet.autoscaling_bounds)
    min_replicas: Annotated[int, Field(ge=0)] | None = None
    max_replicas: Annotated[int, Field(ge=1)] | None = None
    idle_period_seconds: Annotated[int, Field(ge=0)] | None = None
    prometheus_address: Annotated[str, Field(pattern=r"^https?://.+")] | None = None
    target_queue_depth: Annotated[int, Field(ge=1)] | None = None
    behavior: dict[str, Any] | None = None  # the HPA's behavior, passed through


class Resources(_Part):
    requests: Quantities | None = None
    limits: Quantities | None = None


class Toleration(_Part):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class LocalObjectReference(_Part):
    name: str


class DrainSpec(_Part):
    pre_stop_seconds: Annotated[int, Field(ge=0)] = 5


class PodDisruptionBudgetSpec(_Part):
    enabled: bool = True
    max_unavailable: Annotated[int, Field(ge=1)] = 1


# -- spec.router.kvEvents (issue 40): the engines publish KV events, the routers subscribe ------------------
class RouterKVEventsSpec(_Part):
    # no CRD default: unset is on with router.replicas >= 2 (render/kv_events.enabled says why)
    enabled: bool | None = None
    port: Annotated[int, Field(ge=1, le=65535)] = 5557
    replay_port: Annotated[int, Field(ge=1, le=65535)] = 5558


class RouterSpec(_Part):
    enabled: bool = False
    replicas: Annotated[int, Field(ge=0)] = 1
    max_held_requests: Annotated[int, Field(ge=1)] | None = None
    hold_timeout_seconds: Annotated[int, Field(ge=1)] | None = None
    resources: Resources | None = None
    kv_events: RouterKVEventsSpec = Field(default_factory=RouterKVEventsSpec)


class PortNumber(_Part):
    number: Annotated[int, Field(ge=1, le=65535)]


class EndpointPickerRef(_Part):
    group: Annotated[str, Field(max_length=253)] | None = None
    kind: Annotated[str, Field(min_length=1, max_length=63)] | None = None
    name: Annotated[str, Field(min_length=1, max_length=253)]
    port: PortNumber | None = None
    failure_mode: Literal["FailOpen", "FailClose"] | None = None


class InferencePool(_Part):
    endpoint_picker_ref: EndpointPickerRef


class GatewaySpec(_Part):
    inference_pool: InferencePool | None = None


class AuthSpec(_Part):
    api_key_secret_ref: SecretKeyRef | None = None


class AdapterSpec(_Part):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$")]
    uri: Annotated[str, Field(max_length=1024, pattern=URI_PATTERN)]
    rank: Annotated[int, Field(ge=1, le=512)] | None = None
    credentials: Credentials | None = None


class ParallelismSpec(_Part):
    nodes: Annotated[int, Field(ge=1)] | None = None
    gpus_per_node: Literal[1, 2, 4, 8] = 8
    auth_key_secret_ref: SecretKeyRef | None = None


class SLOSpec(_Part):
    ttft_p90_seconds: Annotated[float, Field(gt=0)]
    tpot_p99_seconds: Annotated[float, Field(gt=0)]


class WorkloadSpec(_Part):
    request_rate: Annotated[float, Field(gt=0)]
    min_request_rate: Annotated[float, Field(ge=0)] | None = None
    prompt_len: IntOrString | None = None  # a token count or a distribution ("lognormal:...": fleet.py)
    output_len: IntOrString | None = None
    prefix_len: Annotated[int, Field(ge=0)] | None = None


class IPBlock(_Part):
    cidr: str
    except_: list[str] | None = Field(None, alias="except")


class NetworkPolicyPeer(_Part):
    pod_selector: dict[str, Any] | None = None
    namespace_selector: dict[str, Any] | None = None
    ip_block: IPBlock | None = None


class NetworkPolicySpec(_Part):
    enabled: bool = True
    allow_same_namespace: bool = True
    from_: list[NetworkPolicyPeer] | None = Field(None, alias="from")
    metrics_namespace_selector: dict[str, Any] | None = None


# -- spec.kvCache (issue 41): the tiered KV cache below the device pool --------------------------------------
class KVOffloadDiskSpec(_Part):
    size_gib: Annotated[float, Field(gt=0)] = Field(alias="sizeGiB")
    # set: a generic ephemeral volume (a PVC per pod, of this class); unset: an emptyDir on the node's disk
    storage_class_name: Annotated[str, Field(min_length=1, max_length=253)] | None = None


class KVOffloadSpec(_Part):
    host_size_gib: Annotated[float, Field(gt=0)] = Field(alias="hostSizeGiB")
    disk: KVOffloadDiskSpec | None = None
    # an existing Redis / Valkey every pod reaches (--kv-offloading-remote-url): the store is not deployed here
    remote_url: Annotated[str, Field(max_length=2048, pattern=r"^(redis|rediss|unix)://.+")] | None = None


class KVCacheSpec(_Part):
    offload: KVOffloadSpec | None = None


# spec.disaggregation (issue 42): prefill and decode pools. No CRD defaults below it (the operator's live in
# operator/pools.py), so that an InferenceService without disaggregation carries no such object.
class PrefillAutoscalingSpec(_Part):
    """The prefill pool's HPA (present = enabled): it scales on the pool's own queue."""

    min_replicas: Annotated[int, Field(ge=1)] | None = None
    max_replicas: Annotated[int, Field(ge=1)]
    target_waiting_requests: Annotated[int, Field(ge=1)] | None = None  # vllm:num_requests_waiting per pod
    behavior: dict[str, Any] | None = None


class DecodeAutoscalingSpec(_Part):
    """The decode pool's HPA (present = enabled): it scales on running requests and KV-cache usage."""

    min_replicas: Annotated[int, Field(ge=1)] | None = None
    max_replicas: Annotated[int, Field(ge=1)]
    target_running_requests: Annotated[int, Field(ge=1)] | None = None  # vllm:num_requests_running per pod
    target_kv_cache_usage_percent: Annotated[int, Field(ge=1, le=100)] | None = Field(
        None, alias="targetKVCacheUsagePercent"
    )
    behavior: dict[str, Any] | None = None


class PrefillPoolSpec(_Part):
    replicas: Annotated[int, Field(ge=1)] | None = None
    tensor_parallel_size: Literal[1, 2, 4, 8] | None = None
    autoscaling: PrefillAutoscalingSpec | None = None
    resources: Resources | None = None


class DecodePoolSpec(_Part):
    """Its replica count is spec.replicas (what the /scale subresource writes)."""

    tensor_parallel_size: Literal[1, 2, 4, 8] | None = None
    autoscaling: DecodeAutoscalingSpec | None = None
    resources: Resources | None = None


class DisaggregationSpec(_Part):
    connector: Literal["NixlConnector"] | None = None
    transfer_port: Annotated[int, Field(ge=1024, le=65535)] | None = None
    prefill: PrefillPoolSpec
    decode: DecodePoolSpec


class InferenceServiceSpec(_Part):
    """An InferenceService's .spec. The objects the CRD defaults to {} are default-constructed here too."""

    model: ModelSpec
    gpu: GPUSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replicas: Annotated[int, Field(ge=0)] = 1
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    resources: Resources | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = None
    # no CRD default: the operator's per-installation runtime image (spec.runtime_image_defaults)
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[LocalObjectReference] | None = None
    service_account_name: str | None = None
    priority_class_name: str | None = None
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    shm_size: Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")] = "16Gi"
    # no CRD default: unset is the budget derived from the model and the start-up phases (startup_budget.py)
    startup_timeout_seconds: Annotated[int, Field(ge=60)] | None = None
    termination_grace_period_seconds: Annotated[int, Field(ge=15)] = 120
    drain: DrainSpec = Field(default_factory=DrainSpec)
    pod_disruption_budget: PodDisruptionBudgetSpec = Field(default_factory=PodDisruptionBudgetSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    gateway: GatewaySpec | None = None
    auth: AuthSpec | None = None
    adapters: Annotated[list[AdapterSpec], Field(max_length=256)] | None = None
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    slo: SLOSpec | None = None
    workload: WorkloadSpec | None = None
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    kv_cache: KVCacheSpec | None = None  # issue 41
    disaggregation: DisaggregationSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        """The spec as the manifest's camelCase dict (every field this object holds, set or defaulted)."""
        return self.model_dump(by_alias=True, exclude_none=True)

    def value_at(self, path: str) -> Any:
        """The value at a CRD path ("engine.maxModelLen"): how engine_args' CRD table addresses a setting."""
        node: Any = self
        for key in path.split("."):
            node = getattr(node, _field_name(type(node), key))
        return node


def _field_name(model: type[BaseModel], alias: str) -> str:
    for name, field in model.model_fields.items():
        if (field.alias or name) == alias:
            return name
    raise KeyError(f"{model.__name__} has no field {alias!r}")
