"""The typed InferenceService spec (operator/spec_model.py) against the CRD, its one source of shape: every
property, default, bound, enum, length, pattern and required list the same; every example round-trips."""

from __future__ import annotations

import copy
import pathlib

import pydantic
import pytest
import yaml

from kvserve.operator import crd_schema, spec_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
_CHECKED = ("default", "minimum", "maximum", "enum", "minLength", "maxLength", "maxItems", "pattern")


def _model_schema() -> tuple[dict, dict]:
    schema = spec_model.InferenceServiceSpec.model_json_schema(by_alias=True, mode="validation")
    return schema, schema.get("$defs", {})


def _deref(node: dict, defs: dict) -> dict:
    """Follow $ref and unwrap `X | None` (anyOf [X, null]): the CRD says optional by leaving a key out."""
    while True:
        if "$ref" in node:
            node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        elif "anyOf" in node and any(o.get("type") == "null" for o in node["anyOf"]):
            rest = [o for o in node["anyOf"] if o.get("type") != "null"]
            merged = {k: v for k, v in node.items() if k != "anyOf"}
            node = {**rest[0], **merged} if len(rest) == 1 else {"anyOf": rest, **merged}
            if merged.get("default", 0) is None:
                node.pop("default")
        else:
            return node


def _facts(node: dict) -> dict:
    """The CRD-comparable facts of a (model or CRD) schema node, in the CRD's spelling."""
    out = {k: node[k] for k in _CHECKED if k in node}
    if "const" in node:  # a one-value Literal
        out["enum"] = [node["const"]]
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True  # JSON Schema 2020 -> OpenAPI v3
    elif node.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = True
    if node.get("x-kubernetes-int-or-string") or (
        "anyOf" in node and sorted(o.get("type") for o in node["anyOf"]) == ["integer", "string"]
    ):
        out["type"] = "int-or-string"
    elif "enum" in out:
        out["type"] = {bool: "boolean", int: "integer", str: "string"}[type(out["enum"][0])]
    else:
        out["type"] = node.get("type", "object")
    if out.get("default") == {}:  # an object the CRD defaults to {}: the model default-constructs it
        out["default"] = "{}"
    return out


def _compare(crd: dict, model: dict, defs: dict, where: str, found: list[str]) -> None:
    model = _deref(model, defs)
    want, got = _facts(crd), _facts(model)
    if got.get("default") is not None and isinstance(got["default"], dict):
        got["default"] = "{}"
    if "default" not in got and crd.get("default") == {}:
        got["default"] = "{}" if model.get("type") == "object" or "properties" in model else None
    if want != got:
        found.append(f"{where}: CRD {want} != model {got}")
    if sorted(crd.get("required", [])) != sorted(model.get("required", [])):
        found.append(f"{where}: required CRD {crd.get('required', [])} != model {model.get('required', [])}")
    crd_props, model_props = crd.get("properties") or {}, model.get("properties") or {}
    if crd.get("x-kubernetes-preserve-unknown-fields") or isinstance(crd.get("additionalProperties"), dict):
        if model_props:
            found.append(f"{where}: a free-form object in the CRD, typed in the model")
        return
    for key in sorted(crd_props.keys() | model_props.keys()):
        if key not in model_props:
            found.append(f"{where}.{key}: in the CRD, not in the model")
        elif key not in crd_props:
            found.append(f"{where}.{key}: in the model, not in the CRD")
        else:
            _compare(crd_props[key], model_props[key], defs, f"{where}.{key}", found)
    if isinstance(crd.get("items"), dict):
        _compare(crd["items"], _deref(model, defs).get("items", {}), defs, f"{where}[]", found)


def test_the_model_has_every_crd_property_with_its_default_and_bounds():
    schema, defs = _model_schema()
    found: list[str] = []
    _compare(crd_schema.spec_schema(), schema, defs, "spec", found)
    assert found == []


def test_the_comparison_catches_a_drifted_bound():
    """The check above can fail: a CRD with one bound moved is reported, by field."""
    crd = copy.deepcopy(crd_schema.spec_schema())
    crd["properties"]["engine"]["properties"]["maxNumSeqs"]["maximum"] = 8192
    del crd["properties"]["port"]
    schema, defs = _model_schema()
    found: list[str] = []
    _compare(crd, schema, defs, "spec", found)
    assert any(f.startswith("spec.engine.maxNumSeqs: CRD") for f in found), found
    assert "spec.port: in the model, not in the CRD" in found


def _example_specs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):  # the docs and the chart embed no InferenceService
        for i, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceService":
                out.append((f"{path.relative_to(ROOT)}#{i}", doc["spec"]))
    return out


EXAMPLES = _example_specs()


def test_there_are_examples():
    assert len(EXAMPLES) >= 7


@pytest.mark.parametrize("spec", [s for _, s in EXAMPLES], ids=[n for n, _ in EXAMPLES])
def test_every_example_round_trips(spec):
    typed = spec_model.InferenceServiceSpec.model_validate(spec)
    assert typed.model_dump(by_alias=True, exclude_unset=True) == spec


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"engine": {"maxNumSeqs": 0}}, ("engine", "maxNumSeqs")),
        ({"engine": {"blockSize": 12}}, ("engine", "blockSize")),
        ({"port": "8000"}, ("port",)),  # strict: the API server refuses a string for an integer too
        ({"router": {"enabled": "yes"}}, ("router", "enabled")),
        ({"slo": {"ttftP90Seconds": 0, "tpotP99Seconds": 0.1}}, ("slo", "ttftP90Seconds")),
    ],
)
def test_a_break_of_the_schema_is_refused_naming_the_field(patch, field):
    spec = {"model": {"uri": "pvc://models/llama3"}, "gpu": {"product": "l4"}, **patch}
    with pytest.raises(pydantic.ValidationError) as info:
        spec_model.InferenceServiceSpec.model_validate(spec)
    assert [tuple(str(p) for p in e["loc"][: len(field)]) for e in info.value.errors()][0] == field
    assert crd_schema.check(spec)  # the CRD's own check agrees


def test_defaults_are_the_crds():
    typed = spec_model.InferenceServiceSpec.model_validate(
        {"model": {"uri": "pvc://models/llama3"}, "gpu": {"product": "l4"}}
    )
    assert typed.engine.max_model_len == 8192 and typed.engine.kv_cache_dtype == "auto"
    assert typed.router.enabled is False and typed.pod_disruption_budget.max_unavailable == 1
    assert typed.parallelism.gpus_per_node == 8 and typed.gpu.resource_name == "nvidia.com/gpu"


def test_resolve_hands_on_the_typed_spec_and_refuses_a_schema_break_naming_the_field():
    from kvserve.operator import spec as spec_mod

    spec = {"model": {"name": "llama-3-8b", "uri": "pvc://models/llama3"}, "gpu": {"product": "h100"}}
    resolved = spec_mod.resolve(copy.deepcopy(spec))
    assert isinstance(resolved.spec, spec_model.InferenceServiceSpec)
    assert resolved.spec.engine.max_model_len == resolved.plan_input.max_model_len
    with pytest.raises(spec_mod.SpecError, match=r"spec\.engine\.maxNumSeqs must be >= 1") as info:
        spec_mod.resolve({**spec, "engine": {"maxNumSeqs": 0}})
    assert info.value.reason == "InvalidSpec"


def test_best_effort_reads_a_refused_spec_with_defaults_in_place_of_its_broken_values():
    """The status of a spec resolve() refused still needs its router, port and replicas: what breaks the
    schema reads as the default, the rest as written; a model without a uri reports InvalidModelSource."""
    from kvserve.operator import spec as spec_mod

    broken = {
        "model": {"name": "llama-3-8b"},  # no uri
        "gpu": {"product": "h100", "tensorParallelSize": 3},
        "replicas": "two",
        "port": 9000,
        "router": {"enabled": True, "replicas": -1},
    }
    typed = spec_mod.best_effort(broken)
    assert typed.replicas == 1 and typed.gpu.tensor_parallel_size == 1 and typed.gpu.product == "h100"
    assert typed.port == 9000 and typed.router.enabled is True and typed.router.replicas == 1
    with pytest.raises(spec_mod.SpecError) as info:
        spec_mod.model_source(typed.model)
    assert info.value.reason == "InvalidModelSource"
