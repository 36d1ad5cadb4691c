"""Pure: where the engine finds its weights -- volumes, read-only mounts, the model directory, and for hf:// and
s3:// sources the init container that runs `kvserve download` into a shared cache or the pod's own emptyDir.

Cache layout (spec.model.cache): CACHE/models/<uri.cache_key>, one folder per source and revision, written
only by the init containers (staging + rename under a flock beside it), mounted read-only by the engine.
"""

from __future__ import annotations

from kvserve.operator import spec_model
from kvserve.operator.adapters import ADAPTER_MOUNT
from kvserve.operator.pod_health import ADAPTER_DOWNLOAD_PREFIX  # + the adapter's index in spec.adapters
from kvserve.operator.spec import Resolved
from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime.sources import uri as source_uri

MODEL_MOUNT = "/mnt/models"
CACHE_MOUNT = "/mnt/model-cache"
DOWNLOAD_CONTAINER = "model-download"
# The downloader streams in 1 MiB chunks and hashes as it writes: memory stays flat whatever the model size.
DOWNLOAD_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
# Set before huggingface_hub/boto3 import in the pod. Checksums when_required: since botocore 1.36 requests
# carry CRC checksums by default, which several S3-compatible stores reject.
DOWNLOAD_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "HF_HOME", "value": "/tmp/hf"},
    {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    {"name": "AWS_REQUEST_CHECKSUM_CALCULATION", "value": "when_required"},
    {"name": "AWS_RESPONSE_CHECKSUM_VALIDATION", "value": "when_required"},
]
_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def credentials_secret(spec: InferenceServiceSpec) -> str | None:
    credentials = spec.model.credentials
    return credentials.secret_ref.name if credentials is not None else None


def model_source(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict], str]:
    """(volumes, the engine's read-only volumeMounts, model directory inside the container)."""
    source = source_uri.parse(spec.model.uri, spec.model.revision)
    if source.scheme == "pvc":
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.location, "readOnly": True}}
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        return [volume], [mount], f"{MODEL_MOUNT}/{source.path}".rstrip("/")
    if source.scheme == "file":
        return [], [], source.path
    cache = spec.model.cache or spec_model.ModelCache()
    if cache.claim_name:
        volume = {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
    elif cache.host_path:
        volume = {"name": "model-cache", "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    else:  # no cache: every pod downloads into its own emptyDir (on the node's disk)
        volume = {"name": "model", "emptyDir": {}}
        return [volume], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}], f"{MODEL_MOUNT}/model"
    mount = {"name": "model-cache", "mountPath": CACHE_MOUNT, "readOnly": True}
    return [volume], [mount], f"{CACHE_MOUNT}/models/{source_uri.cache_key(source)}"


def init_containers(resolved: Resolved) -> list[dict]:
    """The download init container for hf:// and s3:// sources; none for mounted ones."""
    if not resolved.source.remote:
        return []
    _, mounts, model_dir = model_source(resolved.spec)
    return [_download_container(resolved, mounts, model_dir, weights=True)]


def router_model_source(resolved: Resolved) -> tuple[list[dict], list[dict], str, list[dict]]:
    """(volumes, read-only mounts, tokenizer directory, init containers) for the router's pods. A downloaded
    model's router fetches config and tokenizer files only, into its own emptyDir: it runs on CPU nodes that
    may not see a node-local cache, and must not wait for (or pull) the weights."""
    volumes, mounts, model_dir = model_source(resolved.spec)
    if not resolved.source.remote:
        return volumes, mounts, model_dir, []
    volume = {"name": "model", "emptyDir": {}}
    mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    tokenizer_dir = f"{MODEL_MOUNT}/tokenizer"
    return [volume], [mount], tokenizer_dir, [_download_container(resolved, [mount], tokenizer_dir, weights=False)]


def _download_container(resolved: Resolved, mounts: list[dict], model_dir: str, weights: bool) -> dict:
    spec, source = resolved.spec, resolved.source
    writable = [{**m, "readOnly": False} for m in mounts]
    container = {
        "name": DOWNLOAD_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        # str(source) carries the revision (hf://org/name@rev): one argument, the same one the cache key hashes.
        "command": ["kvserve", "download", str(source), "--dest", model_dir] + ([] if weights else ["--no-weights"]),
        "env": list(DOWNLOAD_ENV),
        "resources": DOWNLOAD_RESOURCES,
        "volumeMounts": writable + [{"name": "tmp", "mountPath": "/tmp"}],
        # `kvserve download` writes "kvserve: download failed: <why>" here; the operator turns it into
        # ModelReady=False (DownloadFailed) and an Event.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _SECURITY,
    }
    secret = credentials_secret(spec)
    if secret:
        # The Secret's keys become variables: HF_TOKEN, HF_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
        # AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION. Only the init container sees them.
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    if not weights:  # a few MB of tokenizer files
        container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    return container


ADAPTER_VOLUME = "adapters"
# An adapter is megabytes to a few hundred: the downloader's memory stays flat anyway (1 MiB chunks).
ADAPTER_DOWNLOAD_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def adapter_sources(resolved: Resolved) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, the engine's read-only volumeMounts, init containers) for spec.adapters: hf:// and s3:// ones
    are downloaded by one init container each (`kvserve download --adapter`) into the pod's own emptyDir at
    ADAPTER_MOUNT/<name> -- like the base model without a cache: every pod, restarted or new, fetches its own
    copy before the engine starts --; a pvc:// one mounts its claim's PATH read-only (subPath) at
    ADAPTER_CLAIM_MOUNT/<name>; a file:// one is a path in the image."""
    volumes: list[dict] = []
    mounts: list[dict] = []
    inits: list[dict] = []
    claims: dict[str, str] = {}  # claim -> volume name (one volume per claim, mounted once per adapter)
    if resolved.source.scheme == "pvc":  # adapters beside the base model: its volume, not a second one
        claims[resolved.source.location] = "model"
    remote = [a for a in resolved.adapters if a.source.remote]
    if remote:
        volumes.append({"name": ADAPTER_VOLUME, "emptyDir": {}})
        mounts.append({"name": ADAPTER_VOLUME, "mountPath": ADAPTER_MOUNT, "readOnly": True})
    for adapter in resolved.adapters:
        if adapter.source.scheme != "pvc":
            continue
        claim = adapter.source.location
        if claim not in claims:
            claims[claim] = f"adapter-claim-{sum(v != 'model' for v in claims.values())}"
            volumes.append({"name": claims[claim], "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mount = {"name": claims[claim], "mountPath": adapter.directory, "readOnly": True}
        if adapter.source.path:
            mount["subPath"] = adapter.source.path
        mounts.append(mount)
    spec = resolved.spec
    for adapter in remote:
        container = {
            "name": f"{ADAPTER_DOWNLOAD_PREFIX}{adapter.index}",
            "image": spec.image,
            "imagePullPolicy": spec.image_pull_policy,
            "command": ["kvserve", "download", str(adapter.source), "--dest", adapter.directory, "--adapter"],
            "env": list(DOWNLOAD_ENV),
            "resources": ADAPTER_DOWNLOAD_RESOURCES,
            "volumeMounts": [
                {"name": ADAPTER_VOLUME, "mountPath": ADAPTER_MOUNT},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
            # "kvserve: download failed: <why>" -> AdaptersReady=False (AdapterLoadFailed) naming this adapter.
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": _SECURITY,
        }
        if adapter.secret:
            container["envFrom"] = [{"secretRef": {"name": adapter.secret}}]
        inits.append(container)
    return volumes, mounts, inits
