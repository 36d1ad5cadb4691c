"""The CRD without an API server: upstream-valid as a CRD object, in sync with the chart, the Python defaults
and the engine settings' choices. What an API server does with it (install it, default, validate the schema
and the CEL rules) is judged by a real one in test_crd_apiserver.py.
"""

from __future__ import annotations

import copy
import pathlib
import re

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import fleet
from kvserve.operator import spec as spec_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.serving.kvserve.dev.yaml"
CHART_CRD_PATH = ROOT / "charts" / "kvserve" / "crds" / CRD_PATH.name
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


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
    assert info.value.reason == "InvalidEngineSetting"  # the API server's verdict: test_crd_apiserver.py


MINIMAL = {
    "apiVersion": "serving.kvserve.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "m"},
    "spec": {"model": {"name": "llama-3-8b", "uri": "pvc://models/llama3"}, "gpu": {"product": "l4"}},
}
