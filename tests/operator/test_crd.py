"""The CRD: upstream-valid, in sync with the chart and the Python defaults, and it accepts the examples.

The API server's part (structural defaulting, OpenAPI validation, CEL rules) is re-enacted here from the CRD's
own openAPIV3Schema: jsonschema for the OpenAPI keywords (unknown fields rejected, as `kubectl apply` does),
a top-down defaulting walk, and a deliberately tiny CEL translator for the rule forms the CRD uses.
"""

from __future__ import annotations

import copy
import pathlib
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvserve.operator import fleet
from kvserve.operator import spec as spec_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.serving.kvserve.dev.yaml"
CHART_CRD_PATH = ROOT / "charts" / "kvserve" / "crds" / CRD_PATH.name
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def to_json_schema(node: dict) -> dict:
    out = {
        k: v
        for k, v in node.items()
        if not k.startswith("x-kubernetes-") and k not in ("properties", "items", "additionalProperties")
    }
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields") and node.get("additionalProperties") is None:
            out["additionalProperties"] = False
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    return out


def apply_defaults(node: dict, value):
    if isinstance(value, dict) and "properties" in node:
        value = dict(value)
        for key, sub in node["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in node:
        value = [apply_defaults(node["items"], v) for v in value]
    return value


_CEL_OK = re.compile(
    r"^(\s|\(|\)|'\w+' in self(\['\w+'\])*|self\['\w+'\]\.startswith\('[^']*'\)|(self(\['\w+'\])+)|or|and|not"
    r"|<=|>=|<|>|==|!=|\d+|'\w+')*$"
)


_CEL_ALL_NOT_PREFIX = re.compile(r"^self\.all\((\w+), !\1\.startsWith\('([^']*)'\)\)$")


def cel(rule: str, obj: dict) -> bool:
    prefix_rule = _CEL_ALL_NOT_PREFIX.match(rule)  # list form: self.all(a, !a.startsWith('...'))
    if prefix_rule:
        return all(not str(item).startswith(prefix_rule.group(2)) for item in obj)
    py = re.sub(r"has\(self((?:\.\w+)*)\.(\w+)\)", r"('\2' in self\1)", rule)  # has(self.a.b): 'b' in self.a
    while re.search(r"self(\['\w+'\])*\.(?!startsWith)\w+", py):  # self.a.b -> self['a']['b']
        py = re.sub(r"(self(?:\['\w+'\])*)\.(?!startsWith)(\w+)", r"\1['\2']", py)
    py = py.replace("||", " or ").replace("&&", " and ")
    py = re.sub(r"!(?!=)", " not ", py).replace("'].startsWith(", "'].startswith(")
    assert _CEL_OK.match(py), f"the test's CEL translator does not cover {rule!r}"
    return bool(eval(py, {"__builtins__": {}}, {"self": obj}))  # noqa: S307 - whitelisted above


def cel_errors(node: dict, value) -> list[str]:
    errors = [r["message"] for r in node.get("x-kubernetes-validations", []) if not cel(r["rule"], value)]
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(sub, value[key])
    return errors


def admit(obj: dict) -> dict:
    """What the API server does on create: default, then validate schema and CEL. Returns the stored object."""
    stored = apply_defaults(SCHEMA, obj)
    jsonschema.validate(stored, to_json_schema(SCHEMA))
    errors = cel_errors(SCHEMA, stored)
    if errors:
        raise ValueError("; ".join(errors))
    return stored


def test_crd_validates_against_upstream_apiextensions_schema():
    kubernetes_validate.validate(CRD, "1.33", strict=True)


def test_chart_ships_the_same_crd():
    assert CHART_CRD_PATH.read_text() == CRD_PATH.read_text()


def test_crd_shape():
    assert CRD["metadata"]["name"] == "inferenceservices.serving.kvserve.dev"
    names = CRD["spec"]["names"]
    assert names["kind"] == spec_mod.KIND and names["plural"] == spec_mod.PLURAL
    assert "isvc" not in names["shortNames"] and names["shortNames"]
    assert VERSION["name"] == spec_mod.VERSION and CRD["spec"]["group"] == spec_mod.GROUP
    scale = VERSION["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in VERSION["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    for col in ("Model", "GPU", "TP", "KV Tokens", "Max Seqs", "Replicas", "Ready", "Age"):
        assert col in columns
    # Printer columns point at fields the schema declares.
    status_props = SCHEMA["properties"]["status"]["properties"]
    assert columns["KV Tokens"] == ".status.plan.kvTokens" and "kvTokens" in status_props["plan"]["properties"]
    assert columns["Max Seqs"] == ".status.plan.maxConcurrency"


def _leaf_defaults(node: dict, prefix: tuple = ()) -> dict:
    out = {}
    for key, sub in (node.get("properties") or {}).items():
        if "default" in sub and sub["default"] != {}:
            out[prefix + (key,)] = sub["default"]
        out.update(_leaf_defaults(sub, prefix + (key,)))
    return out


def _flatten(d: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _crd_defaulted(spec: dict, raw: dict | None = None) -> dict:
    """spec without the defaults only the operator applies: the runtime image (spec.OPERATOR_DEFAULTED) and,
    when `raw` (the spec as written) is given, the autoscaling bounds it did not write (fleet.BOUND_FIELDS)."""
    out = {k: v for k, v in spec.items() if k not in spec_mod.OPERATOR_DEFAULTED}
    if raw is not None and "autoscaling" in out:
        written = (raw.get("autoscaling") or {}).keys()
        out["autoscaling"] = {
            k: v for k, v in out["autoscaling"].items() if k not in fleet.BOUND_FIELDS or k in written
        }
    return out


def test_python_defaults_equal_crd_defaults():
    # The autoscaling bounds are defaulted by the operator only: a value the user wrote must be told apart from a
    # default, because it wins over spec.slo's plan (operator/fleet.autoscaling_bounds).
    bounds = {("autoscaling", f) for f in fleet.BOUND_FIELDS}
    python = {k: v for k, v in _flatten(_crd_defaulted(spec_mod.DEFAULTS)).items() if k not in bounds}
    crd = _leaf_defaults(SCHEMA["properties"]["spec"])
    assert python == crd and not bounds & crd.keys()
    spec_props = SCHEMA["properties"]["spec"]["properties"]
    assert not any("default" in spec_props[key] for key in spec_mod.OPERATOR_DEFAULTED)  # the chart decides


def _spec_property(path: str) -> dict:
    section, key = path.split(".")
    return SCHEMA["properties"]["spec"]["properties"][section]["properties"][key]


def test_crd_enums_equal_the_engine_settings_choices():
    """Every CRD field that is an engine setting allows exactly what engine_args.crd_choices says (the
    EngineArgs choices; for model.dtype the dtype table less "auto"), so the CRD can be neither narrower
    than the runtime nor wider than what the operator can plan."""
    from kvserve.runtime import capacity, engine_args

    choices = engine_args.crd_choices()
    for path in engine_args.crd_settings():
        enum = _spec_property(path).get("enum")
        assert (tuple(enum) if enum is not None else None) == choices.get(path), path
    # The tables they come from (the one dtype table, the runtime's block sizes).
    assert choices["engine.kvCacheDtype"] == capacity.KV_CACHE_DTYPES
    assert choices["engine.blockSize"] == engine_args.BLOCK_SIZES
    assert choices["model.dtype"] == tuple(d for d in capacity.WEIGHT_DTYPES if d != "auto")


def test_every_crd_enum_value_is_accepted_by_the_runtime():
    """Each value the CRD admits passes the runtime's own resolution (engine_args.resolve, what
    `kvserve serve` runs) and the operator's planner."""
    from kvserve.runtime import engine_args

    for path, name in engine_args.crd_settings().items():
        for value in _spec_property(path).get("enum") or ():
            settings = engine_args.EngineArgs(model=None, **{name: value})
            resolved = engine_args.resolve(settings, context_limit=4096, auto_dtype="bfloat16")
            assert resolved, (path, value)
            spec = copy.deepcopy(MINIMAL["spec"])
            section, key = path.split(".")
            spec.setdefault(section, {})[key] = value
            spec["gpu"]["product"] = "h200-141gb"
            assert spec_mod.resolve(spec).plan.reason != "InvalidEngineConfig", (path, value)


@pytest.mark.parametrize(
    "path,value",
    [("engine.blockSize", 12), ("engine.kvCacheDtype", "int8"), ("model.dtype", "auto"), ("gpu.tensorParallelSize", 3)],
)
def test_the_operator_checks_the_enums_without_an_api_server(path, value):
    """`kvserve render` / `kvserve plan -f` on a file never meets the API server: spec.resolve refuses a
    value outside the CRD's enum and names the field."""
    spec = copy.deepcopy(MINIMAL["spec"])
    section, key = path.split(".")
    spec.setdefault(section, {})[key] = value
    with pytest.raises(spec_mod.SpecError, match=rf"spec\.{re.escape(path)} must be one of") as info:
        spec_mod.resolve(spec)
    assert info.value.reason == "InvalidEngineSetting"
    obj = copy.deepcopy(MINIMAL)
    obj["spec"] = spec
    with pytest.raises(jsonschema.ValidationError, match="is not one of"):
        admit(obj)  # and the API server refuses it as well


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_and_defaulted_like_the_operator_does(path):
    obj = yaml.safe_load(path.read_text())
    stored = admit(obj)
    assert stored["spec"] == _crd_defaulted(spec_mod.with_defaults(obj["spec"]), obj["spec"]) | {
        k: obj["spec"][k] for k in spec_mod.OPERATOR_DEFAULTED if k in obj["spec"]
    }


MINIMAL = {
    "apiVersion": "serving.kvserve.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "m"},
    "spec": {"model": {"name": "llama-3-8b", "uri": "pvc://models/llama3"}, "gpu": {"product": "l4"}},
}


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda s: s["gpu"].update(tensorParallelSize=3), "is not one of"),
        (lambda s: s.update(replicas=-1), "less than the minimum"),
        (lambda s: s["engine"].update(gpuMemoryUtilization=1.5), "greater than the maximum"),
        (lambda s: s["model"].update(uri="gs://bucket/model"), "does not match"),
        (lambda s: s["model"].update(uri="hf://org/name/extra"), "does not match"),
        (lambda s: s["model"].update(uri="s3://B/model"), "does not match"),
        (lambda s: s["model"].update(revision="main"), "model.revision applies to hf://"),
        (lambda s: s["model"].update(cache={"claimName": "c"}), "model.cache applies to hf://"),
        (lambda s: s["model"].update(credentials={"secretRef": {"name": "s"}}), "model.credentials applies"),
        (lambda s: s["model"].update(uri="hf://o/n", cache={"claimName": "c", "hostPath": "/d"}), "exactly one of"),
        (lambda s: s["model"].update(uri="hf://o/n", cache={}), "exactly one of"),
        (lambda s: s["model"].update(uri="hf://o/n", credentials={}), "'secretRef' is a required property"),
        (lambda s: s["engine"].update(blockSize=12), "is not one of"),
        (lambda s: s.update(replica=2), "Additional properties"),
        (lambda s: s["model"].pop("name"), "model.name"),
        (lambda s: s["gpu"].pop("product"), "gpu.memoryMiB"),
        (lambda s: s["autoscaling"].update(minReplicas=5, maxReplicas=2), "minReplicas must be <="),
        (lambda s: s["engine"].update(enableChunkedPrefill=False, maxModelLen=16384), "without chunked prefill"),
        (lambda s: s["engine"].update(extraArgs=["--api-key=k"]), "must not carry --api-key"),
        (lambda s: s.update(auth={"apiKeySecretRef": {"name": "s"}}), "'key' is a required property"),
        (lambda s: s.update(networkPolicy={"from": [{"ipBlock": {}}]}), "'cidr' is a required property"),
    ],
)
def test_invalid_specs_are_rejected(mutate, expect):
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].update(engine={}, autoscaling={})
    admit(obj)  # the baseline is fine
    mutate(obj["spec"])
    with pytest.raises((jsonschema.ValidationError, ValueError), match=expect):
        admit(obj)


@pytest.mark.parametrize(
    "model",
    [
        {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"},  # no name, no shape: planned from config.json
        {
            "uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct@5f0b02c75b57c5855da9ae460ce51323ea669d8a",
            "credentials": {"secretRef": {"name": "hf-token"}},
            "cache": {"claimName": "model-cache"},
        },
        {"uri": "hf://org/name", "revision": "v1.0", "cache": {"hostPath": "/var/lib/kvserve"}},
        {"uri": "s3://models.example/llama/3-8b", "credentials": {"secretRef": {"name": "s3"}}},
        {"name": "llama-3-8b", "uri": "s3://bucket"},
    ],
)
def test_model_sources_are_admitted(model):
    obj = copy.deepcopy(MINIMAL)
    obj["spec"]["model"] = model
    assert admit(obj)["spec"]["model"]["uri"] == model["uri"]


def test_defaults_fill_a_minimal_spec():
    stored = admit(copy.deepcopy(MINIMAL))
    assert stored["spec"]["engine"]["maxModelLen"] == 8192
    assert stored["spec"]["gpu"]["tensorParallelSize"] == 1
    assert stored["spec"]["autoscaling"] == {"enabled": False}  # the bounds: the operator's defaults, or the plan's
    assert spec_mod.resolve(stored["spec"]).autoscaling == {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 5}
    assert stored["spec"] == _crd_defaulted(spec_mod.with_defaults(MINIMAL["spec"]), MINIMAL["spec"])
    assert "image" not in stored["spec"]  # the operator's default (the chart's runtime.image) applies
