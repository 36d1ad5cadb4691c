"""Pod Security Standards, "restricted" profile (which includes "baseline"), checked field by field on every
pod the operator renders and on the chart's operator pod.

The controls and allowed values follow https://kubernetes.io/docs/concepts/security/pod-security-standards/
(policy version 1.33). There is no Python port of the API server's PodSecurity admission, so each control is
written out below with the fields it reads; test_each_control_catches_its_violation shows every one of them
can fail.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from kvserve.operator import render
from kvserve.operator import spec as spec_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUME_SOURCES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def _containers(pod: dict) -> list[tuple[str, dict]]:
    return [
        (f"{field}[{c.get('name')}]", c)
        for field in ("initContainers", "containers", "ephemeralContainers")
        for c in pod.get(field) or []
    ]


def restricted_violations(pod: dict, annotations: dict | None = None) -> list[str]:
    """Every PSS baseline + restricted violation of one pod spec, as 'control: field'."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = _containers(pod)
    contexts = [("spec.securityContext", psc)] + [
        (f"{n}.securityContext", c.get("securityContext") or {}) for n, c in containers
    ]
    # --- baseline ---
    for where, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}.windowsOptions.hostProcess")
        app_armor = (sc.get("appArmorProfile") or {}).get("type")
        if app_armor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"AppArmor: {where}.appArmorProfile.type={app_armor}")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"SELinux: {where}.seLinuxOptions={se}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where}.seccompProfile.type=Unconfined")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"Host Namespaces: spec.{field}")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"Sysctls: spec.securityContext.sysctls {sysctl.get('name')}")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"AppArmor: metadata.annotations[{key}]={value}")
    for name, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {name}.securityContext.privileged")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"Capabilities: {name} adds {sorted(added - BASELINE_CAPABILITIES)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"Host Ports: {name}.ports[].hostPort")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc Mount Type: {name}.securityContext.procMount")
    for vol in pod.get("volumes") or []:
        if "hostPath" in vol:
            out.append(f"HostPath Volumes: spec.volumes[{vol.get('name')}].hostPath")
    # --- restricted ---
    for vol in pod.get("volumes") or []:
        sources = set(vol) - {"name"}
        if not sources <= RESTRICTED_VOLUME_SOURCES:
            out.append(f"Volume Types: spec.volumes[{vol.get('name')}] uses {sorted(sources)}")
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in SECCOMP_OK
    if psc.get("runAsUser") == 0:
        out.append("Running as Non-root user: spec.securityContext.runAsUser=0")
    for name, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {name}.securityContext.allowPrivilegeEscalation must be false")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            out.append(f"Running as Non-root: {name} (runAsNonRoot true on the pod or the container)")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {name}.securityContext.runAsUser=0")
        container_seccomp = (sc.get("seccompProfile") or {}).get("type")
        if not (container_seccomp in SECCOMP_OK or (container_seccomp is None and pod_seccomp)):
            out.append(f"Seccomp: {name} needs RuntimeDefault or Localhost (pod or container)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {name}.securityContext.capabilities.drop must include ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"Capabilities: {name} may add only NET_BIND_SERVICE")
    return out


def pod_templates(objs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(name, pod spec, pod annotations) of every pod any of `objs` would create."""
    out = []
    for obj in objs:
        if obj["kind"] == "Pod":
            out.append((obj["metadata"]["name"], obj["spec"], obj["metadata"].get("annotations") or {}))
        template = (obj.get("spec") or {}).get("template")
        if template is not None:
            out.append(
                (
                    f"{obj['kind']}/{obj['metadata']['name']}",
                    template["spec"],
                    (template.get("metadata") or {}).get("annotations") or {},
                )
            )
        group = (obj.get("spec") or {}).get("leaderWorkerTemplate") or {}  # a LeaderWorkerSet: leader and workers
        for role in ("leaderTemplate", "workerTemplate"):
            if group.get(role) is not None:
                t = group[role]
                out.append(
                    (
                        f"{obj['kind']}/{obj['metadata']['name']}/{role}",
                        t["spec"],
                        (t.get("metadata") or {}).get("annotations") or {},
                    )
                )
        job = ((obj.get("spec") or {}).get("jobTemplate") or {}).get("spec", {}).get("template")
        if job is not None:
            out.append((f"{obj['kind']}/{obj['metadata']['name']}", job["spec"], {}))
    return out


def _variants() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        out.append((path.stem, doc))
        rich = copy.deepcopy(doc)
        rich["spec"].update(
            auth={"apiKeySecretRef": {"name": "k", "key": "token"}},
            serviceAccountName="sa",
            imagePullSecrets=[{"name": "pull"}],
            priorityClassName="high",
        )
        for key in ("revision", "credentials", "cache"):  # hf:// / s3:// settings: meaningless for file://
            rich["spec"]["model"].pop(key, None)
        rich["spec"]["model"]["uri"] = "file:///models/in-image"
        rich["spec"]["engine"]["extraArgs"] = ["--preemption-mode", "swap"]
        out.append((path.stem + "-all-options", rich))
    return out


@pytest.mark.parametrize("name,doc", _variants(), ids=[n for n, _ in _variants()])
def test_every_rendered_pod_meets_restricted(name, doc):
    objs = render.render(spec_mod.resolve(doc["spec"]), doc["metadata"]["name"], "ml")
    pods = pod_templates(objs)
    assert pods, "the render produced no pod at all"
    for pod_name, pod, pod_annotations in pods:
        assert restricted_violations(pod, pod_annotations) == [], pod_name


def _helm_chart_tests():
    """tests/operator/test_helm_chart.py as a module (pytest's importlib mode puts no test dir on sys.path)."""
    import importlib.util

    path = pathlib.Path(__file__).with_name("test_helm_chart.py")
    module_spec = importlib.util.spec_from_file_location("kvserve_test_helm_chart", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_chart_operator_pod_meets_restricted():
    chart = _helm_chart_tests()
    for sets in ((), ("operator.leaderElection.enabled=false", "operator.watchNamespaces={ml}")):
        docs = chart._template(chart._find_helm(), *sets)
        pods = pod_templates(docs)
        assert [n for n, _, _ in pods] == ["Deployment/kvs-kvserve"]
        for pod_name, pod, pod_annotations in pods:
            assert restricted_violations(pod, pod_annotations) == [], pod_name


MUTATIONS = [
    ("HostProcess", lambda p, c: p["securityContext"].update(windowsOptions={"hostProcess": True})),
    ("Host Namespaces", lambda p, c: p.update(hostNetwork=True)),
    ("Host Namespaces", lambda p, c: p.update(hostPID=True)),
    ("Privileged Containers", lambda p, c: c["securityContext"].update(privileged=True)),
    ("Capabilities", lambda p, c: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"])),
    ("Capabilities", lambda p, c: c["securityContext"]["capabilities"].update(add=["CHOWN"])),  # baseline-only
    ("Capabilities", lambda p, c: c["securityContext"]["capabilities"].update(drop=["NET_RAW"])),
    ("HostPath Volumes", lambda p, c: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}})),
    ("Host Ports", lambda p, c: c["ports"][0].update(hostPort=8000)),
    ("AppArmor", lambda p, c: c["securityContext"].update(appArmorProfile={"type": "Unconfined"})),
    ("SELinux", lambda p, c: p["securityContext"].update(seLinuxOptions={"type": "spc_t"})),
    ("/proc Mount Type", lambda p, c: c["securityContext"].update(procMount="Unmasked")),
    ("Seccomp", lambda p, c: p["securityContext"].pop("seccompProfile")),
    ("Seccomp", lambda p, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"})),
    ("Sysctls", lambda p, c: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}])),
    ("Volume Types", lambda p, c: p["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}})),
    ("Privilege Escalation", lambda p, c: c["securityContext"].pop("allowPrivilegeEscalation")),
    ("Running as Non-root", lambda p, c: p["securityContext"].pop("runAsNonRoot")),
    ("Running as Non-root", lambda p, c: c["securityContext"].update(runAsNonRoot=False)),
    ("Running as Non-root user", lambda p, c: c["securityContext"].update(runAsUser=0)),
    (
        "Privilege Escalation",
        lambda p, c: p.setdefault("initContainers", []).append(
            {"name": "init", "image": "x", "securityContext": {"capabilities": {"drop": ["ALL"]}}}
        ),
    ),
]


@pytest.mark.parametrize("control,mutate", MUTATIONS, ids=[f"{i}-{m[0]}" for i, m in enumerate(MUTATIONS)])
def test_each_control_catches_its_violation(control, mutate):
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    objs = render.render(spec_mod.resolve(doc["spec"]), "llama70b", "ml")
    pod = copy.deepcopy(pod_templates(objs)[0][1])
    mutate(pod, pod["containers"][0])
    assert any(v.startswith(control + ":") for v in restricted_violations(pod)), control
    annotated = {"container.apparmor.security.beta.kubernetes.io/kvserve": "unconfined"}
    assert any(v.startswith("AppArmor:") for v in restricted_violations(pod_templates(objs)[0][1], annotated))
