"""Pure renderer for `spec.kvCache.offload` (issue 41): the engine's tier flags and the disk tier's volume.

What the tiers cost and why a volume per pod: operator/kv_offload.py. The memory request: pod_resources.
"""

from __future__ import annotations

import math
from typing import Any

from kvserve.operator import kv_offload
from kvserve.operator.spec_model import InferenceServiceSpec


def engine_settings(spec: InferenceServiceSpec) -> dict[str, Any]:
    """EngineArgs values for render.engine_settings (empty without spec.kvCache.offload)."""
    tier = kv_offload.offload(spec)
    if tier is None:
        return {}
    out: dict[str, Any] = {"kv_offloading_size": tier.host_size_gib}
    if tier.disk is not None:
        out["kv_offloading_disk_dir"] = kv_offload.DISK_MOUNT
        out["kv_offloading_disk_size"] = tier.disk.size_gib
    if tier.remote_url:
        out["kv_offloading_remote_url"] = tier.remote_url
    return out


def volumes(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, the engine's writable volumeMounts) of the disk tier; empty without one."""
    tier = kv_offload.offload(spec)
    if tier is None or tier.disk is None:
        return [], []
    size = f"{math.ceil(kv_offload.disk_volume_bytes(spec) / kv_offload.MiB)}Mi"
    if tier.disk.storage_class_name:
        claim = {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": tier.disk.storage_class_name,
            "resources": {"requests": {"storage": size}},
        }
        volume = {"name": kv_offload.DISK_VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}
    else:  # the node's disk; the kubelet evicts the pod past sizeLimit, so the headroom matters
        volume = {"name": kv_offload.DISK_VOLUME, "emptyDir": {"sizeLimit": size}}
    return [volume], [{"name": kv_offload.DISK_VOLUME, "mountPath": kv_offload.DISK_MOUNT}]
