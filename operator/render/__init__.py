"""Pure renderer: a resolved InferenceService (spec with defaults + capacity plan) -> child manifests.

No I/O and no owner references here (the apply step adds those), so `kvserve render` prints exactly what the
operator would create, and golden-file tests pin it.
"""

from __future__ import annotations

from typing import Any

from kvserve.operator import adapters, fleet, pod_resources, spec_model, startup_budget
from kvserve.operator import spec as spec_mod
from kvserve.operator.labels import engine_labels, engine_pod_selector, engine_selector
from kvserve.operator.render import disaggregation as render_disaggregation
from kvserve.operator.render import kv_events as render_kv_events
from kvserve.operator.render import kv_offload as render_kv_offload
from kvserve.operator.render import model as render_model
from kvserve.operator.render import multinode as render_multinode
from kvserve.operator.render import router as render_router
from kvserve.operator.render import scaling as render_scaling
from kvserve.operator.render import security as render_security
from kvserve.operator.render.model import MODEL_MOUNT, model_source  # noqa: F401 - re-exported
from kvserve.operator.spec import API_VERSION, KIND, Resolved
from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime import engine_args

METRIC_NAME = "vllm_num_requests_waiting"  # prometheus-adapter's name for vllm:num_requests_waiting

# Scale up by at most 2 pods a minute, down by 1 pod per 5 minutes after a 10-minute window: GPU pods take
# minutes to load weights, so flapping costs far more than a slightly late scale-down.
DEFAULT_BEHAVIOR: dict[str, Any] = {
    "scaleUp": {
        "stabilizationWindowSeconds": 0,
        "selectPolicy": "Max",
        "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}],
    },
    "scaleDown": {
        "stabilizationWindowSeconds": 600,
        "selectPolicy": "Max",
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}],
    },
}


def service_url(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc.cluster.local:{port}"


def served_model_name(spec: InferenceServiceSpec, name: str) -> str:
    return spec.model.served_name or spec.model.name or name


def engine_settings(resolved: Resolved) -> dict[str, Any]:
    """The spec's engine settings (every CRD field EngineArgs maps) plus the planned KV budget per rank."""
    spec = resolved.spec
    values = {name: spec.value_at(path) for path, name in engine_args.crd_settings().items()}
    # The planned budget per GPU rank, in whole blocks: the pod never allocates more KV than planned.
    values["kv_cache_bytes"] = resolved.plan.kv_cache_bytes_per_gpu
    # spec.adapters: --enable-lora --lora-modules --max-loras --max-lora-rank (the slots the plan charged)
    values.update(adapters.engine_settings(list(resolved.adapters)))
    # spec.router.kvEvents: --kv-events-config, the engine's event and replay sockets (issue 40)
    values.update(render_kv_events.engine_settings(spec))
    # spec.kvCache.offload: --kv-offloading-size, the disk tier's directory and size (issue 41)
    values.update(render_kv_offload.engine_settings(spec))
    return values


def runtime_args(resolved: Resolved, name: str, model_dir: str, extra_settings: dict | None = None) -> list[str]:
    """`kvserve serve` with the engine flags generated from EngineArgs (the same definition the runtime
    parses them with), so a setting is never spelled twice. `extra_settings`: more EngineArgs values (a
    LeaderWorkerSet member's pipeline and node flags), placed in EngineArgs' order like the others."""
    spec = resolved.spec
    args = [
        "kvserve",
        "serve",
        model_dir,
        "--host",
        "0.0.0.0",
        "--port",
        str(spec.port),
        "--served-model-name",
        served_model_name(spec, name),
        *engine_args.cli_args({**engine_settings(resolved), **(extra_settings or {})}),
        # The grace period covers the preStop sleep, then the drain, then 10 s before the kubelet's SIGKILL.
        "--drain-timeout",
        str(spec_mod.drain_timeout_seconds(spec)),
    ]
    return args + [str(a) for a in spec.engine.extra_args or []]


def _resources(resolved: Resolved) -> dict:
    spec = resolved.spec
    gpus = str(spec.gpu.tensor_parallel_size)
    resource = spec.gpu.resource_name
    user = spec.resources or spec_model.Resources()
    requests = {
        **pod_resources.default_requests(spec, resolved.layout.nodes if resolved.layout is not None else 1),
        **{k: str(v) for k, v in (user.requests or {}).items()},
    }
    # nvidia.com/gpu cannot be overcommitted: requests must equal limits.
    return {
        "requests": {**requests, resource: gpus},
        "limits": {**{k: str(v) for k, v in (user.limits or {}).items()}, resource: gpus},
    }


def _tolerations(spec: InferenceServiceSpec) -> list[dict]:
    gpu_toleration = {"key": spec.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"}
    user = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations or []]
    return user if any(t.get("key") == gpu_toleration["key"] for t in user) else user + [gpu_toleration]


def _probe(port_name: str, period: int, failures: int) -> dict:
    return {
        "httpGet": {"path": "/health", "port": port_name},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _startup_budget(resolved: Resolved) -> int:
    pods = resolved.layout.nodes if resolved.layout is not None else 1
    return startup_budget.budget_seconds(resolved.spec, resolved.plan, pods)


def deployment(resolved: Resolved, name: str, namespace: str) -> dict:
    spec = resolved.spec
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": engine_labels(name)},
        "spec": {
            "replicas": spec.replicas,
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": _startup_budget(resolved) + startup_budget.PROGRESS_MARGIN_SECONDS,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": engine_selector(name)},
            "template": pod_template(resolved, name),
        },
    }


def pod_template(resolved: Resolved, name: str, extra_settings: dict | None = None) -> dict:
    """The engine pod: the Deployment's template, and a LeaderWorkerSet member's before render_multinode
    adapts it (`extra_settings`: its pipeline and node flags)."""
    spec = resolved.spec
    volumes, mounts, model_dir = model_source(spec)
    adapter_volumes, adapter_mounts, adapter_inits = render_model.adapter_sources(resolved)
    volumes, mounts = volumes + adapter_volumes, mounts + adapter_mounts
    offload_volumes, offload_mounts = render_kv_offload.volumes(spec)  # the disk KV tier (issue 41)
    volumes, mounts = volumes + offload_volumes, mounts + offload_mounts
    volumes = volumes + [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = mounts + [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}]
    node_selector = {"nvidia.com/gpu.product": resolved.gpu_product} if resolved.gpu_product else {}
    node_selector.update(spec.node_selector or {})
    container = {
        "name": "kvserve",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": runtime_args(resolved, name, model_dir, extra_settings),
        "ports": [
            {"name": "http", "containerPort": spec.port, "protocol": "TCP"},
            *render_kv_events.container_ports(spec),
        ],
        "env": [{"name": "HOME", "value": "/tmp"}, *render_security.api_key_env(spec)],
        "resources": _resources(resolved),
        "volumeMounts": mounts,
        # A runtime that rejects its plan writes one line to /dev/termination-log; the operator shows it.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Weights for a 70B model take many minutes to load: the startup probe holds off liveness until then,
        # for as long as the model's size and the start-up phases say (operator/startup_budget.py).
        "startupProbe": _probe(
            "http",
            startup_budget.PERIOD_SECONDS,
            startup_budget.failure_threshold(_startup_budget(resolved)),
        ),
        "readinessProbe": _probe("http", 5, 3),
        # /health answers 503 while draining; 6 x 20 s outlasts the drain so liveness never kills a draining pod.
        "livenessProbe": _probe("http", 20, 6),
        # Keep serving while the endpoint removal propagates (kube-proxy, gateways): SIGTERM, and with it the
        # drain's 503s, comes only after this sleep. The kubelet's own sleep action (Kubernetes >= 1.30; the
        # chart needs 1.31): no binary in the image, no exec.
        **(
            {"lifecycle": {"preStop": {"sleep": {"seconds": spec.drain.pre_stop_seconds}}}}
            if spec.drain.pre_stop_seconds > 0
            else {}
        ),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        **({"initContainers": inits} if (inits := render_model.init_containers(resolved) + adapter_inits) else {}),
        "containers": [container],
        "volumes": volumes,
        "securityContext": render_security.pod_security_context(),
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        # The engine never talks to the Kubernetes API: no token to steal from a compromised pod.
        "automountServiceAccountToken": False,
        "tolerations": _tolerations(spec),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                # ScheduleAnyway: scarce GPU nodes must never leave a replica Pending for the sake of spreading.
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": engine_selector(name)},
            }
        ],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = render_security.pull_secrets(spec)
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    return {
        "metadata": {
            "labels": engine_labels(name),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(spec.port),
                "prometheus.io/path": "/metrics",
                # The adapters this pod serves once ready (status.adapters counts those every ready pod has).
                **(
                    {adapters.POD_ANNOTATION: adapters.annotation(list(resolved.adapters))} if resolved.adapters else {}
                ),
            },
        },
        "spec": pod_spec,
    }


def service(resolved: Resolved, name: str, namespace: str, selector: dict[str, str] | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": engine_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector or engine_selector(name),
            "ports": [{"name": "http", "port": resolved.spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def autoscaler(resolved: Resolved, name: str, namespace: str, target: dict | None = None) -> dict:
    """`target`: the scaled object (default this InferenceService's /scale; a LeaderWorkerSet's for groups)."""
    bounds = resolved.autoscaling  # explicit spec.autoscaling, else spec.slo's plan, else the defaults
    min_replicas, max_replicas, queue_depth = (bounds[k] for k in fleet.BOUND_FIELDS)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": namespace, "labels": engine_labels(name)},
        "spec": {
            # The HPA scales the InferenceService through its /scale subresource; the operator then rolls
            # the replica count into the Deployment, so nothing else fights over Deployment.spec.replicas.
            "scaleTargetRef": target or {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": METRIC_NAME},
                        "target": {"type": "AverageValue", "averageValue": str(queue_depth)},
                    },
                }
            ],
            "behavior": resolved.spec.autoscaling.behavior or DEFAULT_BEHAVIOR,
        },
    }


def disruption_budget(resolved: Resolved, name: str, namespace: str) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": engine_labels(name)},
        "spec": {
            "maxUnavailable": resolved.spec.pod_disruption_budget.max_unavailable,
            "selector": {"matchLabels": engine_selector(name)},
            # Pods still loading weights are not Ready; without this they would block node drains.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render(resolved: Resolved, name: str, namespace: str) -> list[dict]:
    """Every child the InferenceService should have; empty when the capacity plan does not fit."""
    if not resolved.plan.fits:
        return []
    if resolved.pools is not None:  # spec.disaggregation: a prefill and a decode pool (issue 42)
        return render_disaggregation.render(_ENGINE_PARTS, resolved, name, namespace)
    if resolved.layout is not None and resolved.layout.multinode:
        return render_groups(resolved, name, namespace)
    objs = [deployment(resolved, name, namespace), service(resolved, name, namespace)]
    scale_to_zero = spec_mod.scales_to_zero(resolved.spec)
    if resolved.spec.autoscaling.enabled and not scale_to_zero:
        objs.append(autoscaler(resolved, name, namespace))
    if resolved.spec.pod_disruption_budget.enabled:
        objs.append(disruption_budget(resolved, name, namespace))
    *router_source, router_inits = render_model.router_model_source(resolved)
    objs += render_router.render(resolved, name, namespace, tuple(router_source), router_inits)
    if resolved.spec.network_policy.enabled:
        objs.append(render_security.network_policy(resolved, name, namespace))
    # Kinds from optional CRDs last: if the cluster lacks KEDA or GIE, everything else is applied first.
    if scale_to_zero:  # KEDA owns the HPA then (keda-hpa-<name>): no second one on the same target
        behavior = resolved.spec.autoscaling.behavior or DEFAULT_BEHAVIOR
        objs.append(render_scaling.scaled_object(resolved, name, namespace, behavior))
    pool = render_scaling.inference_pool(resolved, name, namespace)
    if pool is not None:
        objs.append(pool)
    return objs


def render_groups(resolved: Resolved, name: str, namespace: str) -> list[dict]:
    """A replica of several pods (resolved.layout.nodes > 1): a LeaderWorkerSet instead of the Deployment, and
    the other children pointed at its leaders or its /scale (render_multinode says why each one is so)."""
    spec = resolved.spec
    render_multinode.check_name(name)
    leaders = {**engine_pod_selector(name), render_multinode.ROLE_LABEL: "leader"}
    leader = render_multinode.leader_template(
        resolved, name, pod_template(resolved, name, render_multinode.node_settings(resolved, "0"))
    )
    worker = render_multinode.worker_template(
        resolved,
        name,
        pod_template(resolved, name, render_multinode.node_settings(resolved, render_multinode.WORKER_INDEX)),
    )
    objs = []
    if render_multinode.owns_authkey(spec):  # first: the pods read it at start
        objs.append(render_multinode.authkey_secret(name, namespace))
    objs.append(service(resolved, name, namespace, selector=leaders))  # the API: leaders only
    scale_to_zero = spec_mod.scales_to_zero(spec)
    target = render_multinode.scale_target(name)
    if spec.autoscaling.enabled and not scale_to_zero:
        objs.append(autoscaler(resolved, name, namespace, target=target))
    if spec.pod_disruption_budget.enabled:
        # Over every member of every group: evicting any member recreates its whole group, whose pods then
        # count as unavailable until it is back, so maxUnavailable pods bounds the groups disrupted at once
        # (one PDB per group could not: groups come and go with the autoscaler, and each would allow one).
        objs.append(disruption_budget(resolved, name, namespace))
    *router_source, router_inits = render_model.router_model_source(resolved)
    objs += render_router.render(resolved, name, namespace, tuple(router_source), router_inits)
    if spec.network_policy.enabled:
        group = render_multinode.group_ingress(name, engine_pod_selector(name))
        objs.append(render_security.network_policy(resolved, name, namespace, extra_ingress=(group,)))
    # Kinds from optional CRDs last (LeaderWorkerSet, KEDA, GIE): everything else is applied first.
    objs.append(render_multinode.leader_worker_set(resolved, name, namespace, leader, worker))
    if scale_to_zero:
        behavior = spec.autoscaling.behavior or DEFAULT_BEHAVIOR
        objs.append(
            render_scaling.scaled_object(
                resolved, name, namespace, behavior, target=target, pods=render_multinode.leader_pods_regex(name)
            )
        )
    pool = render_scaling.inference_pool(resolved, name, namespace, selector=leaders)
    if pool is not None:
        objs.append(pool)
    return objs


# What the disaggregated renderer builds its pools from: this module's own engine renderers (issue 42).
_ENGINE_PARTS = render_disaggregation.EngineParts(
    deployment=deployment,
    pod_template=pod_template,
    service=service,
    disruption_budget=disruption_budget,
    default_behavior=DEFAULT_BEHAVIOR,
    queue_metric=METRIC_NAME,
)
