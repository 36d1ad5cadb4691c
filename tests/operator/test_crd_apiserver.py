"""The CRD against a real API server (etcd + apiextensions-apiserver, tests/operator/apiserver.py).

The server is the one judge of the CRD's schema and CEL rules: both copies of the CRD install, every example is
admitted and defaulted as the operator resolves it, and a table of valid and invalid InferenceServices gets the
same verdict from the server (a dry-run create under fieldValidation=Strict) and from the operator's own
`kvserve render` (unknown fields, spec.resolve, the plan). Objects of the upstream kinds the operator renders
(LeaderWorkerSet, KEDA ScaledObject, GIE InferencePool) are created against their vendored CRDs.
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable

import pytest
import yaml

from kvserve.cli import manifests
from kvserve.cli.errors import CLIError
from kvserve.cli.render import render_documents
from kvserve.operator import fleet
from kvserve.operator import spec as spec_mod
from tests.operator import upstream_crds
from tests.operator.apiserver import ApiError, ApiServer
from tests.operator.conftest import NAMESPACE as NS
from tests.operator.conftest import Refused
from tests.operator.conftest import create as create_in

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.serving.kvserve.dev.yaml"
CHART_CRD_PATH = ROOT / "charts" / "kvserve" / "crds" / CRD_PATH.name
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(crd_server: ApiServer) -> ApiServer:
    return crd_server


def create(server: ApiServer, obj: dict, dry_run: bool = True) -> dict:
    api_version, kind = obj["apiVersion"], obj["kind"]
    plural = spec_mod.PLURAL if kind == spec_mod.KIND else upstream_crds.plural(api_version, kind)
    return create_in(server, obj, plural, dry_run)


def operator_refusal(doc: dict) -> str | None:
    """`kvserve render`'s verdict on one InferenceService: None when it renders, else its error line."""
    try:
        manifests.check_known_fields(doc, "table")
    except CLIError as exc:
        return str(exc)
    _, errors, _ = render_documents([doc], NS)
    return errors[0] if errors else None


def _crd_defaulted(spec: dict, raw: dict) -> dict:
    """The operator's defaults less those only the operator applies: the runtime image (spec.OPERATOR_DEFAULTED)
    and the autoscaling bounds the user did not write (fleet.BOUND_FIELDS: they can come from spec.slo's plan)."""
    out = {k: v for k, v in spec.items() if k not in spec_mod.OPERATOR_DEFAULTED}
    written = (raw.get("autoscaling") or {}).keys()
    out["autoscaling"] = {k: v for k, v in out["autoscaling"].items() if k not in fleet.BOUND_FIELDS or k in written}
    return out | {k: raw[k] for k in spec_mod.OPERATOR_DEFAULTED if k in raw}


def test_both_crd_copies_install(apiserver):
    """The chart's copy (what `helm install` applies) and crds/ (what `kubectl apply -f crds/` applies)."""
    for path in (CHART_CRD_PATH, CRD_PATH):
        live = apiserver.apply_crd(yaml.safe_load(path.read_text()))
        assert live["spec"]["names"]["kind"] == spec_mod.KIND


def test_a_cel_rule_reading_a_missing_field_refuses_the_crd(apiserver):
    """Why every rule guards its fields with has(): the server runs the rules on engine's `default: {}`."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    crd["metadata"]["name"], crd["spec"]["group"] = "inferenceservices.unguarded.kvserve.dev", "unguarded.kvserve.dev"
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    engine["x-kubernetes-validations"][0]["rule"] = "self.enableChunkedPrefill || self.maxNumBatchedTokens >= 16"
    with pytest.raises(ApiError, match="no such key: enableChunkedPrefill"):
        apiserver.apply_crd(crd)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_and_defaulted_like_the_operator_does(server, path):
    for obj in yaml.safe_load_all(path.read_text()):
        if obj and obj.get("kind") == spec_mod.KIND:
            stored = create(server, obj)
            assert stored["spec"] == _crd_defaulted(spec_mod.with_defaults(obj["spec"]), obj["spec"])
            assert operator_refusal(obj) is None


MINIMAL = {
    "apiVersion": spec_mod.API_VERSION,
    "kind": spec_mod.KIND,
    "metadata": {"name": "m", "namespace": NS},
    "spec": {"model": {"name": "llama-3-8b", "uri": "pvc://models/llama3"}, "gpu": {"product": "h200-141gb"}},
}


def test_defaults_fill_a_minimal_spec(server):
    stored = create(server, copy.deepcopy(MINIMAL))
    assert stored["spec"]["engine"]["maxModelLen"] == 8192 and stored["spec"]["gpu"]["tensorParallelSize"] == 1
    assert stored["spec"]["autoscaling"] == {"enabled": False}  # the bounds: the operator's defaults, or the plan's
    assert stored["spec"] == _crd_defaulted(spec_mod.with_defaults(MINIMAL["spec"]), MINIMAL["spec"])
    assert spec_mod.resolve(stored["spec"]).autoscaling == {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 5}
    assert "image" not in stored["spec"]  # the operator's default (the chart's runtime.image) applies


SHAPE = {
    "numLayers": 2,
    "numAttentionHeads": 8,
    "numKeyValueHeads": 2,
    "headDim": 64,
    "hiddenSize": 512,
    "numParameters": 50_000_000,
    "maxPositionEmbeddings": 8192,
    "intermediateSize": 1024,
    "vocabSize": 32000,
}


def _set(path: str, value) -> Callable[[dict], None]:
    def mutate(spec: dict) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    mutate.__name__ = f"{path}={value!r}"
    return mutate


def _pop(path: str) -> Callable[[dict], None]:
    def mutate(spec: dict) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node[key]
        del node[leaf]

    mutate.__name__ = f"del {path}"
    return mutate


_ON = {"enabled": True}
_PD = {"prefill": {}, "decode": {}}


def _pd(**pools: dict) -> dict:
    return {**_PD, **pools}


# (mutation of MINIMAL's spec, refused?, a fragment of the server's message when refused). Every CEL rule of the
# CRD has a row each way, every bound a row at and past it, and unknown fields at several depths.
TABLE: list[tuple[Callable[[dict], None], bool, str]] = [
    # CEL: spec.model
    (_pop("model.name"), True, "set model.name"),
    (_set("model.uri", "hf://o/n"), False, ""),
    (_set("model", {"uri": "pvc://models/m", "shape": SHAPE}), False, ""),
    (_set("model.uri", "gs://bucket/model"), True, "spec.model.uri"),
    (_set("model.uri", "file:///models/llama"), False, ""),
    (_set("model.revision", "main"), True, "model.revision applies to hf://"),
    (_set("model.cache", {"claimName": "c"}), True, "model.cache applies to hf:// and s3://"),
    (_set("model.credentials", {"secretRef": {"name": "s"}}), True, "model.credentials applies"),
    (lambda s: s["model"].update(uri="hf://o/n", cache={"claimName": "c", "hostPath": "/d"}), True, "exactly one of"),
    (lambda s: s["model"].update(uri="hf://o/n", cache={}), True, "exactly one of"),
    (lambda s: s["model"].update(uri="hf://o/n", cache={"hostPath": "/d"}, revision="v1"), False, ""),
    # CEL: spec.gpu
    (_pop("gpu.product"), True, "set gpu.product"),
    (lambda s: s["gpu"].update(memoryMiB=81920) or s["gpu"].pop("product"), False, ""),
    # CEL: spec.engine (chunked prefill)
    (lambda s: s.update(engine={"enableChunkedPrefill": False, "maxModelLen": 16384}), True, "without chunked"),
    (lambda s: s.update(engine={"enableChunkedPrefill": False, "maxNumBatchedTokens": 8192}), False, ""),
    (_set("engine.extraArgs", ["--api-key=k"]), True, "must not carry --api-key"),
    (_set("engine.extraArgs", ["--api-key", "k"]), True, "must not carry --api-key"),
    # CEL: spec (scale to zero, TP within a node)
    (lambda s: s.update(autoscaling={"enabled": True, "minReplicas": 0}), True, "needs router.enabled"),
    (lambda s: s.update(autoscaling={"enabled": True, "minReplicas": 0}, router={"enabled": True}), False, ""),
    (
        lambda s: s.update(gpu={"product": "h200-141gb", "tensorParallelSize": 4}, parallelism={"gpusPerNode": 2}),
        True,
        "tensorParallelSize must be <= parallelism.gpusPerNode",
    ),
    # CEL: spec.autoscaling
    (lambda s: s.update(autoscaling={"minReplicas": 5, "maxReplicas": 2}), True, "minReplicas must be <="),
    (lambda s: s.update(autoscaling={"minReplicas": 2, "maxReplicas": 2}), False, ""),
    # CEL: spec.gateway.inferencePool.endpointPickerRef
    (_set("gateway", {"inferencePool": {"endpointPickerRef": {"name": "epp"}}}), True, "port is required"),
    (_set("gateway", {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}), False, ""),
    # OpenAPI: enums and bounds
    (_set("gpu.tensorParallelSize", 3), True, "Unsupported value"),
    (_set("engine.blockSize", 12), True, "Unsupported value"),
    (_set("engine.kvCacheDtype", "int8"), True, "Unsupported value"),
    (_set("replicas", -1), True, "should be greater than or equal to 0"),
    (_set("replicas", 0), False, ""),
    (_set("engine.gpuMemoryUtilization", 1.5), True, "should be less than or equal to 0.99"),
    (_set("engine.gpuMemoryUtilization", 0.05), True, "should be greater than or equal to 0.1"),
    (_set("engine.gpuMemoryUtilization", 0), True, "gpuMemoryUtilization must be >= 0.1"),  # an integer 0
    (_set("gpu.usdPerGpuHour", 0), True, "should be greater than 0"),
    (_set("gpu.usdPerGpuHour", 0.5), False, ""),
    (_set("slo", {"ttftP90Seconds": 0, "tpotP99Seconds": 0.1}), True, "should be greater than 0"),
    (_set("slo", {"ttftP90Seconds": 1, "tpotP99Seconds": 0.05}), True, "spec.slo and spec.workload go together"),
    (_set("workload", {"requestRate": 5}), True, "spec.slo and spec.workload go together"),
    (lambda s: s.update(slo={"ttftP90Seconds": 1, "tpotP99Seconds": 0.05}, workload={"requestRate": 5}), False, ""),
    (
        lambda s: s.update(
            slo={"ttftP90Seconds": 1, "tpotP99Seconds": 0.05}, workload={"requestRate": 5, "minRequestRate": 9}
        ),
        True,
        "minRequestRate must be <=",
    ),
    (
        lambda s: s.update(slo={"ttftP90Seconds": 1, "tpotP99Seconds": 0.05}, workload={"requestRate": 0}),
        True,
        "should be greater than 0",
    ),
    (_set("slo", {"ttftP90Seconds": 1}), True, "Required value"),
    (_set("engine.maxModelLen", 8), True, "should be greater than or equal to 16"),
    (_set("engine.maxNumSeqs", 0), True, "should be greater than or equal to 1"),
    (_set("engine.maxNumSeqs", 5000), True, "should be less than or equal to 4096"),
    (_set("gpu.memoryMiB", 512), True, "should be greater than or equal to 1024"),
    (_set("port", 70000), True, "should be less than or equal to 65535"),
    # OpenAPI: patterns, required, types
    (_set("model.uri", "hf://org/name/extra"), True, "spec.model.uri"),
    (_set("model.uri", "s3://B/model"), True, "spec.model.uri"),
    (_set("auth", {"apiKeySecretRef": {"name": "s"}}), True, "Required value"),
    (_set("networkPolicy", {"from": [{"ipBlock": {}}]}), True, "Required value"),
    (_set("replicas", "two"), True, "must be of type integer"),
    # spec.disaggregation (issue 42): CEL and bounds, each way
    (_set("disaggregation", {"prefill": {}, "decode": {}}), True, "disaggregation needs router.enabled"),
    (lambda s: s.update(disaggregation=_PD, router={"enabled": True}), False, ""),
    (lambda s: s.update(disaggregation=_pd(prefill={"replicas": 0}), router=_ON), True, "greater than or equal to 1"),
    (
        lambda s: s.update(disaggregation=_pd(decode={"autoscaling": {"maxReplicas": 0}}), router=_ON),
        True,
        "greater than or equal to 1",
    ),
    (lambda s: s.update(disaggregation=_pd(decode={"autoscaling": {}}), router=_ON), True, "Required value"),
    (
        lambda s: s.update(
            disaggregation=_pd(prefill={"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}), router=_ON
        ),
        True,
        "prefill.autoscaling.minReplicas must be <= maxReplicas",
    ),
    (
        lambda s: s.update(
            disaggregation=_pd(decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 2}}), router=_ON
        ),
        False,
        "",
    ),
    (lambda s: s.update(disaggregation=_pd(prefill={"tensorParallelSize": 3}), router=_ON), True, "Unsupported value"),
    (
        lambda s: s.update(
            disaggregation=_pd(decode={"tensorParallelSize": 4}), router=_ON, parallelism={"gpusPerNode": 2}
        ),
        True,
        "decode.tensorParallelSize must be <= parallelism.gpusPerNode",
    ),
    (
        lambda s: s.update(
            disaggregation=_pd(prefill={"tensorParallelSize": 2}), router=_ON, parallelism={"gpusPerNode": 2}
        ),
        False,
        "",
    ),
    (lambda s: s.update(disaggregation={"prefill": {}}, router=_ON), True, "Required value"),
    (lambda s: s.update(disaggregation={**_PD, "connector": "Mooncake"}, router=_ON), True, "Unsupported value"),
    (lambda s: s.update(disaggregation={**_PD, "transferPort": 80}, router=_ON), True, "greater than or equal to 1024"),
    (
        lambda s: s.update(disaggregation=_PD, router=_ON, autoscaling={"enabled": True}),
        True,
        "not autoscaling.enabled",
    ),
    (lambda s: s.update(disaggregation=_PD, router=_ON, parallelism={"nodes": 2}), True, "remove parallelism.nodes"),
    (
        lambda s: s.update(
            disaggregation=_PD,
            router=_ON,
            slo={"ttftP90Seconds": 1, "tpotP99Seconds": 0.05},
            workload={"requestRate": 5},
        ),
        True,
        "spec.slo is not planned for disaggregated pools",
    ),
    (
        lambda s: s.update(disaggregation={**_PD, "prefil": {}}, router=_ON),
        True,
        'unknown field "spec.disaggregation.prefil"',
    ),
    # Unknown fields (strict field validation)
    (_set("replica", 2), True, 'unknown field "spec.replica"'),
    (_set("engine.maxModelLength", 4096), True, 'unknown field "spec.engine.maxModelLength"'),
    (
        _set("gateway", {"inferencePool": {"endpointPickerRef": {"name": "e", "port": {"number": 1}, "x": 1}}}),
        True,
        "unknown field",
    ),
    # spec.router.kvEvents (issue 40): CEL both ways, bounds, types, unknown fields
    (_set("router", {"enabled": True, "replicas": 2}), False, ""),
    (_set("router", {"enabled": True, "replicas": 2, "kvEvents": {"port": 6000, "replayPort": 6001}}), False, ""),
    (_set("router.kvEvents", {"port": 6000, "replayPort": 6000}), True, "kvEvents.port and router.kvEvents.replayPort"),
    (_set("router.kvEvents", {"port": 8000}), True, "must differ from spec.port"),
    (_set("router.kvEvents", {"replayPort": 8000}), True, "must differ from spec.port"),
    (lambda s: s.update(port=9000, router={"kvEvents": {"port": 8000}}), False, ""),
    (_set("router.kvEvents.port", 0), True, "should be greater than or equal to 1"),
    (_set("router.kvEvents.replayPort", 65536), True, "should be less than or equal to 65535"),
    (_set("router.kvEvents.enabled", "yes"), True, "must be of type boolean"),
    (_set("router.kvEvents.topic", "kv"), True, 'unknown field "spec.router.kvEvents.topic"'),
    # spec.kvCache.offload (issue 41): CEL both ways, bounds, required, unknown fields
    (_set("kvCache.offload", {"hostSizeGiB": 16}), False, ""),
    (_set("kvCache.offload", {"hostSizeGiB": 0.5, "disk": {"sizeGiB": 100}}), False, ""),
    (_set("kvCache.offload", {"hostSizeGiB": 16, "disk": {"sizeGiB": 100, "storageClassName": "fast"}}), False, ""),
    (_set("kvCache.offload", {"hostSizeGiB": 0}), True, "should be greater than 0"),
    (_set("kvCache.offload", {}), True, "Required value"),
    (_set("kvCache.offload", {"hostSizeGiB": 16, "disk": {}}), True, "Required value"),
    (_set("kvCache.offload", {"hostSizeGiB": 16, "disk": {"sizeGiB": 0}}), True, "should be greater than 0"),
    (_set("kvCache.offload", {"hostSizeGiB": 16, "disk": {"sizeGiB": 9, "storageClassName": ""}}), True, "at least 1"),
    (_set("kvCache.offload", {"hostSizeGiB": 16, "remoteUrl": "redis://kv.cache.svc:6379/0"}), False, ""),
    (_set("kvCache.offload", {"hostSizeGiB": 16, "remoteUrl": "http://kv:6379"}), True, "should match"),
    (
        lambda s: s.update(
            kvCache={"offload": {"hostSizeGiB": 16, "disk": {"sizeGiB": 9}}}, gpu={**s["gpu"], "tensorParallelSize": 2}
        ),
        True,
        "kvCache.offload.disk runs with one GPU rank only",
    ),
    (
        lambda s: s.update(kvCache={"offload": {"hostSizeGiB": 16}}, gpu={**s["gpu"], "tensorParallelSize": 2}),
        False,
        "",
    ),
    (
        lambda s: s.update(kvCache={"offload": {"hostSizeGiB": 16}}, engine={"enablePrefixCaching": False}),
        True,
        "kvCache.offload needs engine.enablePrefixCaching true",
    ),
    (_set("kvCache.offload.hostBytes", 1), True, 'unknown field "spec.kvCache.offload.hostBytes"'),
]


@pytest.mark.parametrize("mutate,refused,fragment", TABLE, ids=lambda v: getattr(v, "__name__", None))
def test_the_server_and_the_operator_give_the_same_verdict(server, mutate, refused, fragment):
    obj = copy.deepcopy(MINIMAL)
    mutate(obj["spec"])
    try:
        create(server, obj)
        server_refusal = None
    except Refused as exc:
        server_refusal = str(exc)
    assert (server_refusal is not None) == refused, f"the server: {server_refusal or 'admitted'}"
    assert fragment in (server_refusal or ""), server_refusal
    operator = operator_refusal(obj)
    assert (operator is not None) == refused, (
        f"the server {'refused' if refused else 'admitted'} it ({server_refusal}); kvserve render: "
        f"{operator or 'rendered it'}"
    )


@pytest.fixture(scope="module")
def upstream(server: ApiServer) -> ApiServer:
    for crd in upstream_crds.crds():
        server.apply_crd(crd)
    return server


def test_every_rendered_upstream_object_is_created(upstream):
    """Each LeaderWorkerSet, ScaledObject and InferencePool `kvserve render` makes of the examples, created
    (not dry-run) against its upstream CRD: schema, defaults and CEL rules, all from the real server."""
    made: dict[str, int] = {}
    for path in EXAMPLES:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        objs, errors, _ = render_documents(docs, NS)
        assert not errors, errors
        for obj in objs:
            if upstream_crds.is_upstream_custom(obj):
                obj = {**obj, "metadata": {**obj["metadata"], "namespace": NS}}
                stored = create(upstream, obj, dry_run=False)
                assert stored["metadata"]["uid"] and stored["spec"]
                made[obj["kind"]] = made.get(obj["kind"], 0) + 1
    assert set(made) == {"LeaderWorkerSet", "ScaledObject", "InferencePool"}, made
