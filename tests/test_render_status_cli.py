"""`kvserve render --status` (issue 26 item 5: it printed nothing before): each InferenceService's status as the
operator's first reconcile writes it, after that service's manifests, as a comment `kubectl apply` ignores."""

from __future__ import annotations

import json
import pathlib

import yaml

from kvserve.cli.main import main
from kvserve.operator import spec as spec_mod

ROOT = pathlib.Path(__file__).resolve().parents[1]
MULTINODE = ROOT / "examples" / "llama405b-multinode.yaml"


def _render(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["render", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _commented_status(out: str) -> dict:
    lines = [line[2:] for line in out.splitlines() if line.startswith("# ") and not line.startswith("# default/")]
    return yaml.safe_load("\n".join(lines))["status"]


def _conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_follows_the_manifests_and_is_the_operators(capsys):
    rc, plain, _ = _render(capsys, "-f", str(MULTINODE))
    rc_status, out, err = _render(capsys, "-f", str(MULTINODE), "--status")
    assert rc == rc_status == 0 and err == ""
    # The manifests are unchanged (comments are not YAML content), and the status comes after them.
    assert [d for d in yaml.safe_load_all(out) if d] == [d for d in yaml.safe_load_all(plain) if d]
    assert out.index("kind: LeaderWorkerSet") < out.index("# default/llama405b: the status the operator writes first")
    status = _commented_status(out)
    resolved = spec_mod.resolve(yaml.safe_load(MULTINODE.read_text())["spec"])
    assert status["plan"]["kvCacheBytesPerGpu"] == resolved.plan.kv_cache_bytes_per_gpu
    assert status["parallelism"] == resolved.layout.to_status()
    cond = _conditions(status)
    assert cond["CapacityPlanned"]["status"] == "True"
    assert cond["Progressing"]["message"] == "creating the LeaderWorkerSet"
    assert status["url"] == "http://llama405b.default.svc.cluster.local:8000"


def test_status_of_a_spec_that_does_not_fit_says_why(capsys, tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    doc["spec"]["gpu"]["tensorParallelSize"] = 1
    path = tmp_path / "tp1.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, out, err = _render(capsys, "-f", str(path), "--status")
    assert rc == 1 and len(err.splitlines()) == 1 and "WeightsDoNotFit" in err
    assert "apiVersion" not in out  # nothing rendered, only the status
    cond = _conditions(_commented_status(out))
    assert cond["CapacityPlanned"]["status"] == "False" and cond["CapacityPlanned"]["reason"] == "WeightsDoNotFit"
    assert cond["Ready"]["reason"] == "CapacityNotPlanned"


def test_json_output_carries_the_statuses_by_name(capsys):
    rc, out, _ = _render(capsys, "-f", str(MULTINODE), "--status", "-o", "json")
    data = json.loads(out)
    assert rc == 0 and data["kind"] == "List" and len(data["items"]) == 6
    assert data["statuses"]["default/llama405b"]["parallelism"]["nodes"] == 2
    rc, out, _ = _render(capsys, "-f", str(MULTINODE), "-o", "json")
    assert "statuses" not in json.loads(out)
