"""Pure status computation and the apply step's compare-before-write logic."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import yaml

from kvserve.operator import kube, labels
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _resolved():
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    return spec_mod.resolve(doc["spec"])


def _status(resolved, deployment, previous=None, now=T0, generation=3):
    plan = resolved.plan
    return status_mod.compute_status(
        name="llama70b",
        namespace="ml",
        spec=resolved.spec,
        generation=generation,
        plan=plan,
        plan_reason=plan.reason,
        plan_message=plan.message,
        deployment=deployment,
        previous=previous,
        now=now,
    )


def _conds(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def _deployment(ready, updated, replicas=1, generation=2, observed=2, conditions=()):
    return {
        "metadata": {"generation": generation},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "observedGeneration": observed,
            "conditions": list(conditions),
        },
    }


def test_status_lifecycle_and_stable_timestamps():
    r = _resolved()
    creating = _status(r, None)
    assert _conds(creating) == {
        "Ready": ("False", "DeploymentMissing"),
        "CapacityPlanned": ("True", "Fits"),
        "Progressing": ("True", "Creating"),
        "Degraded": ("False", "AsExpected"),
        "ChildConflict": ("False", "NoConflict"),
    }
    assert creating["plan"]["kvTokens"] == r.plan.kv_tokens
    assert creating["plan"]["maxConcurrency"] == r.plan.max_concurrency
    assert creating["selector"] == labels.selector_string("llama70b")
    assert creating["url"] == "http://llama70b.ml.svc.cluster.local:8000"
    assert creating["observedGeneration"] == 3
    loading = _status(r, _deployment(ready=0, updated=1), previous=creating, now=T1)
    assert _conds(loading)["Progressing"] == ("True", "RollingOut")
    ready = _status(r, _deployment(ready=1, updated=1), previous=loading, now=T1)
    assert _conds(ready)["Ready"] == ("True", "AllReplicasReady")
    assert _conds(ready)["Progressing"] == ("False", "Stable")
    assert ready["replicas"] == 1 and ready["readyReplicas"] == 1
    # Recomputing later with nothing changed gives the identical dict: nothing to patch.
    again = _status(r, _deployment(ready=1, updated=1), previous=ready, now="2026-01-02T00:00:00Z")
    assert again == ready
    # The CapacityPlanned condition kept its first transition time throughout.
    cp = next(c for c in ready["conditions"] if c["type"] == "CapacityPlanned")
    assert cp["lastTransitionTime"] == T0
    # A Deployment whose controller has not seen its latest spec is not Ready yet.
    stale = _status(r, _deployment(ready=1, updated=1, generation=3, observed=2), previous=ready)
    assert _conds(stale)["Ready"][0] == "False"


def test_status_degraded_on_progress_deadline():
    r = _resolved()
    dead = _deployment(
        ready=0,
        updated=1,
        conditions=[
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "timed out"}
        ],
    )
    assert _conds(_status(r, dead))["Degraded"] == ("True", "ProgressDeadlineExceeded")


def test_status_when_the_spec_does_not_fit():
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    doc["spec"]["gpu"]["tensorParallelSize"] = 1
    r = spec_mod.resolve(doc["spec"])
    s = _status(r, None)
    assert _conds(s)["CapacityPlanned"] == ("False", "WeightsDoNotFit")
    assert _conds(s)["Ready"] == ("False", "CapacityNotPlanned")
    assert "url" not in s and s["plan"]["weightBytesPerGpu"] == r.plan.weight_bytes_per_gpu
    # With an old Deployment still serving, the object is Degraded, not silently fine.
    s2 = _status(r, _deployment(ready=1, updated=1))
    assert _conds(s2)["Degraded"] == ("True", "SpecNotApplied")


def test_contains_ignores_server_defaults_but_not_edits():
    desired = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "a", "args": ["x"]}]}}}}
    live = {
        "metadata": {"uid": "u"},
        "spec": {
            "replicas": 2,
            "progressDeadlineSeconds": 600,
            "template": {"spec": {"containers": [{"name": "a", "args": ["x"], "imagePullPolicy": "Always"}]}},
        },
    }
    assert kube.contains(live, desired)
    live["spec"]["replicas"] = 3
    assert not kube.contains(live, desired)
    live["spec"]["replicas"] = 2
    live["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"})
    assert not kube.contains(live, desired)


def test_status_patch_is_minimal_and_spares_kopf_keys():
    live = {"kopf": {"progress": {}}, "replicas": 1, "plan": {"kvTokens": 5, "old": 1}, "url": "u"}
    new = {"replicas": 1, "plan": {"kvTokens": 6}, "readyReplicas": 0}
    assert kube.status_patch(live, new) == {"plan": {"kvTokens": 6, "old": None}, "url": None, "readyReplicas": 0}
    assert kube.status_patch(new, new) == {}


def test_owner_reference():
    owner = {"apiVersion": spec_mod.API_VERSION, "kind": spec_mod.KIND, "metadata": {"name": "n", "uid": "u1"}}
    obj = kube.adopt({"kind": "Service", "metadata": {"name": "n", "namespace": "d"}}, owner)
    assert obj["metadata"]["ownerReferences"] == [
        {
            "apiVersion": spec_mod.API_VERSION,
            "kind": spec_mod.KIND,
            "name": "n",
            "uid": "u1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert kube.owned_by(obj, owner)
    assert not kube.owned_by(obj, {"metadata": {"uid": "u2"}})


def test_operator_modules_do_not_import_torch():
    """The operator image installs `.[operator]` only: no kvserve.operator module may pull torch in."""
    modules = sorted(
        ".".join(p.relative_to(ROOT / "operator").with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "operator").rglob("*.py")
    )
    assert {"render", "render.router", "spec", "spec_model", "status", "kube", "handlers", "fleet"} <= set(modules)
    code = (
        "import sys\n"
        f"for m in {modules!r}: __import__('kvserve.operator.' + m)\n"
        "import kvserve.cli.plan, kvserve.cli.render, kvserve.cli.operator\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton'))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_operator_folder_is_a_namespace_portion():
    # An operator/__init__.py would shadow the stdlib `operator` module (see DESIGN.md).
    assert not (ROOT / "operator" / "__init__.py").exists()
    proc = subprocess.run(
        [sys.executable, "-c", "import operator, collections; print(operator.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and str(ROOT / "operator") not in proc.stdout
