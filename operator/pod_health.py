"""Pure pod diagnosis: the statuses kubelet and the scheduler write -> why an InferenceService's pods fail.

The Deployment only says "progress deadline exceeded" after startupTimeoutSeconds + 600 s (over an hour by
default). The pods say what is wrong at once: a container waiting in CrashLoopBackOff or ImagePullBackOff,
a last termination OOMKilled, the scheduler's Unschedulable message ("0/4 nodes are available: 4 Insufficient
nvidia.com/gpu"), or the runtime's own one-line reason in its termination message. The operator reads the
pods on every reconcile (at least once per resync) and turns the worst finding into Degraded=True.
"""

from __future__ import annotations

from dataclasses import dataclass

# The runtime writes one of these prefixes + a one-line reason to /dev/termination-log when it exits at
# startup (kvserve.runtime.server.termination, which the operator may not import; tests/operator/
# test_pod_health.py keeps the two equal): its plan cannot be honoured on the real GPU, or anything else.
PLAN_REJECTED_PREFIX = "kvserve: plan rejected: "
# `kvserve download` (the model-download init container; kvserve.cli.download keeps the same string).
DOWNLOAD_FAILED_PREFIX = "kvserve: download failed: "
DOWNLOAD_CONTAINER = "model-download"
STARTUP_FAILED_PREFIX = "kvserve: startup failed: "
# spec.adapters (issue 24): a download init container per remote adapter (render/model.py ADAPTER_DOWNLOAD_PREFIX +
# its index), and the engine's start-up failure for a --lora-modules adapter it cannot load, which
# runtime/lora/adapter.LoraLoadError words "adapter 'NAME': ..." (tests/operator/test_adapters.py runs it).
ADAPTER_DOWNLOAD_PREFIX = "adapter-download-"
ADAPTER_STARTUP_PREFIX = STARTUP_FAILED_PREFIX + "adapter '"
MAX_MESSAGE_CHARS = 1024  # the kubelet caps termination messages at 4096 bytes; a condition needs far less

# Most specific first: a reason that names the cause beats one that only names the symptom.
SEVERITY = (
    "DownloadFailed",
    "AdapterLoadFailed",
    "RuntimeRejectedPlan",
    "RuntimeStartupFailed",
    "OOMKilled",
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "CreateContainerConfigError",
    "Unschedulable",
)
_IMAGE_PULL = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
_CONFIG = {"CreateContainerConfigError", "CreateContainerError"}


@dataclass(frozen=True)
class PodFailure:
    reason: str  # one of SEVERITY: the condition and Event reason
    message: str  # names the pod and container; carries the termination or scheduler message
    pod: str


def _terminated(status: dict) -> dict:
    """The container's current termination, else its last one (what a crash loop shows between restarts)."""
    return (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated") or {}


def _exit_text(terminated: dict) -> str:
    detail = f"exit code {terminated.get('exitCode')}"
    message = (terminated.get("message") or "").strip()
    return f"{detail}: {message}" if message else detail


def _container_failure(pod: str, status: dict) -> PodFailure | None:
    if status.get("ready"):
        return None  # running and ready now: an old termination is history
    name = status.get("name", "?")
    waiting = (status.get("state") or {}).get("waiting") or {}
    terminated = _terminated(status)
    where = f"pod {pod} container {name}"
    termination_message = (terminated.get("message") or "").strip()
    if termination_message.startswith(DOWNLOAD_FAILED_PREFIX.strip()) and name.startswith(ADAPTER_DOWNLOAD_PREFIX):
        index = name.removeprefix(ADAPTER_DOWNLOAD_PREFIX)
        return PodFailure("AdapterLoadFailed", f"{where} (spec.adapters[{index}]): {termination_message}", pod)
    if termination_message.startswith(DOWNLOAD_FAILED_PREFIX.strip()):
        return PodFailure("DownloadFailed", f"{where}: {termination_message}", pod)
    if termination_message.startswith(ADAPTER_STARTUP_PREFIX):
        return PodFailure("AdapterLoadFailed", f"{where}: {termination_message}", pod)
    if termination_message.startswith(PLAN_REJECTED_PREFIX.strip()):
        return PodFailure("RuntimeRejectedPlan", f"{where}: {termination_message}", pod)
    if termination_message.startswith(STARTUP_FAILED_PREFIX.strip()) and terminated.get("reason") != "OOMKilled":
        return PodFailure("RuntimeStartupFailed", f"{where}: {termination_message}", pod)
    if terminated.get("reason") == "OOMKilled":
        return PodFailure(
            "OOMKilled",
            f"{where} was OOMKilled ({_exit_text(terminated)}); raise "
            "spec.resources memory or lower the engine's host-memory use",
            pod,
        )
    if waiting.get("reason") == "CrashLoopBackOff":
        last = (
            f"; last termination {terminated.get('reason') or 'Error'}, {_exit_text(terminated)}" if terminated else ""
        )
        return PodFailure(
            "CrashLoopBackOff", f"{where} is in CrashLoopBackOff (restarts: {status.get('restartCount', 0)}){last}", pod
        )
    if waiting.get("reason") in _IMAGE_PULL:
        return PodFailure(
            "ImagePullBackOff",
            f"{where} cannot pull image {status.get('image', '?')}: "
            f"{waiting.get('reason')}: {waiting.get('message', '')}".rstrip(": "),
            pod,
        )
    if waiting.get("reason") in _CONFIG:
        return PodFailure(
            "CreateContainerConfigError",
            f"{where}: {waiting.get('reason')}: {waiting.get('message', '')}".rstrip(": "),
            pod,
        )
    return None


def _pod_failure(pod: dict) -> PodFailure | None:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name = meta.get("name", "?")
    found = [
        f
        for s in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
        if (f := _container_failure(name, s)) is not None
    ]
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            found.append(
                PodFailure("Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message', '')}", name)
            )
    return min(found, key=lambda f: SEVERITY.index(f.reason), default=None)


def diagnose(pods: list[dict]) -> PodFailure | None:
    """The most severe failure among `pods` (ties: the first pod by name, so the message does not flap)."""
    found = [
        f
        for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", ""))
        if not (pod.get("metadata") or {}).get("deletionTimestamp")  # leaving anyway (rollout, scale-down)
        and (f := _pod_failure(pod)) is not None
    ]
    if not found:
        return None
    worst = min(found, key=lambda f: SEVERITY.index(f.reason))
    message = (
        worst.message if len(worst.message) <= MAX_MESSAGE_CHARS else worst.message[: MAX_MESSAGE_CHARS - 3] + "..."
    )
    return PodFailure(worst.reason, message, worst.pod)


def model_ready(pods: list[dict], remote: bool, failure: PodFailure | None) -> tuple[bool, str, str]:
    """ModelReady: (ok, reason, message). Mounted sources are ready as they are; a downloaded one once any pod's
    download init container finished (the cache then holds it), and not while a download failure stands."""
    if not remote:
        return True, "Mounted", "the model is mounted from spec.model.uri"
    if failure is not None and failure.reason == "DownloadFailed":
        return False, "DownloadFailed", failure.message
    for pod in pods:
        for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
            done = (status.get("state") or {}).get("terminated") or {}
            if status.get("name") == DOWNLOAD_CONTAINER and done.get("exitCode") == 0:
                return True, "Downloaded", f"pod {(pod.get('metadata') or {}).get('name', '?')} downloaded the model"
    return False, "Downloading", "waiting for a pod's model-download init container to finish"
