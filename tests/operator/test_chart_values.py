"""The chart's runtime-image values reach the operator, and an InferenceService without spec.image gets them:
default tag = the chart's appVersion (= the package version = spec.DEFAULT_IMAGE's tag)."""

from __future__ import annotations

import copy
import pathlib

import tomllib
import yaml

from kvserve.operator import render
from kvserve.operator import spec as spec_mod
from tests.operator.test_helm_chart import CHART, _template, helm  # noqa: F401  (helm: the fixture)

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llama3-8b-l4.yaml"


def _operator_env(docs: list[dict]) -> dict[str, str]:
    dep = next(d for d in docs if d["kind"] == "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_default_runtime_image_is_the_charts_app_version():
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert spec_mod.DEFAULT_IMAGE == f"ghcr.io/kvserve/kvserve-runtime:{app_version}" and app_version == version


def test_chart_passes_runtime_image_pull_policy_and_secrets(helm):  # noqa: F811
    env = _operator_env(_template(helm))
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert env[spec_mod.RUNTIME_IMAGE_ENV] == f"ghcr.io/kvserve/kvserve-runtime:{app_version}"
    assert env[spec_mod.RUNTIME_PULL_POLICY_ENV] == "IfNotPresent"
    assert spec_mod.RUNTIME_PULL_SECRETS_ENV not in env
    env = _operator_env(
        _template(
            helm,
            "runtime.image.repository=registry.example/ml/kvserve-runtime",
            "runtime.image.tag=0.1.0-cu128",
            "runtime.image.pullPolicy=Always",
            "runtime.imagePullSecrets[0].name=regcred",
            "runtime.imagePullSecrets[1].name=mirror",
        )
    )
    assert env[spec_mod.RUNTIME_IMAGE_ENV] == "registry.example/ml/kvserve-runtime:0.1.0-cu128"
    assert env[spec_mod.RUNTIME_PULL_POLICY_ENV] == "Always"
    assert env[spec_mod.RUNTIME_PULL_SECRETS_ENV] == "regcred,mirror"


def test_operator_defaults_from_its_environment_reach_the_pods_and_spec_wins(monkeypatch):
    env = {
        spec_mod.RUNTIME_IMAGE_ENV: "registry.example/ml/kvserve-runtime:0.1.0-cu128",
        spec_mod.RUNTIME_PULL_POLICY_ENV: "Always",
        spec_mod.RUNTIME_PULL_SECRETS_ENV: "regcred, mirror",
    }
    defaults = spec_mod.runtime_image_defaults(env)
    assert defaults == {
        "image": "registry.example/ml/kvserve-runtime:0.1.0-cu128",
        "imagePullPolicy": "Always",
        "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
    }
    assert spec_mod.runtime_image_defaults({}) == {"image": spec_mod.DEFAULT_IMAGE, "imagePullPolicy": "IfNotPresent"}
    monkeypatch.setattr(spec_mod, "DEFAULTS", {**spec_mod.DEFAULTS, **defaults})
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["spec"].pop("image", None)
    pod = _pod_spec(obj)
    (container,) = pod["containers"]
    assert container["image"] == defaults["image"] and container["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == defaults["imagePullSecrets"]
    own = copy.deepcopy(obj)
    own["spec"].update(image="mine:1", imagePullPolicy="Never", imagePullSecrets=[{"name": "own"}])
    pod = _pod_spec(own)
    assert pod["containers"][0]["image"] == "mine:1" and pod["containers"][0]["imagePullPolicy"] == "Never"
    assert pod["imagePullSecrets"] == [{"name": "own"}]


def _pod_spec(obj: dict) -> dict:
    objects = render.render(spec_mod.resolve(obj["spec"]), obj["metadata"]["name"], "default")
    return next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
