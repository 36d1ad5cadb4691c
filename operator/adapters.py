"""Pure: spec.adapters (LoRA adapters served on every replica, issue 24) -> validated adapters, the engine
settings they become (--enable-lora --lora-modules --max-loras --max-lora-rank) and the directory each one is
found at inside the engine container.

Why start-up flags and not the operator calling /v1/load_lora_adapter on ready pods: an adapter in the pod's
command is part of the pod template, so every pod the Deployment (or LeaderWorkerSet) ever creates -- a
restart, a rescheduled pod, a scale-up, a rollout -- loads it before it reports ready, with no operator in
the loop and no window in which a ready pod lacks it (vLLM issue 12174). The slots it needs are in the
command too, so the capacity plan charges exactly what the runtime allocates. A new adapter rolls the pods,
as any spec change does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.runtime import engine_args
from kvserve.runtime.sources import uri as source_uri

ADAPTER_MOUNT = "/mnt/adapters"  # an emptyDir the adapter-download init containers fill, read-only in the engine
ADAPTER_CLAIM_MOUNT = "/mnt/adapter-claims"  # pvc:// adapters: the claim's PATH mounted here per adapter (subPath)
# --lora-modules is "name=path,name=path" and the name is a folder under ADAPTER_MOUNT: no ',', '=', '/'.
NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$")
MAX_RANK = 512
# Flags that spec.adapters renders: extraArgs must not set them too (the plan would not be what the pod runs).
LORA_FLAGS = ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank")
POD_ANNOTATION = "serving.kvserve.dev/adapters"  # comma-separated names the pod loads at start-up


class AdapterError(ValueError):
    """A bad spec.adapters entry; the message names the field (spec.adapters[i].name / .uri / .rank)."""


@dataclass(frozen=True)
class Adapter:
    index: int  # position in spec.adapters (names its init container and its errors)
    name: str  # what clients send as "model"
    source: source_uri.ModelURI
    rank: int | None
    secret: str | None  # credentials Secret for a download (the adapter's, else spec.model's)

    @property
    def directory(self) -> str:
        """Where the engine reads it: pvc:// mounted per adapter, file:// as it is, downloads in the emptyDir."""
        if self.source.scheme == "file":
            return self.source.path
        if self.source.scheme == "pvc":
            return f"{ADAPTER_CLAIM_MOUNT}/{self.name}"
        return f"{ADAPTER_MOUNT}/{self.name}"


def parse(spec: dict) -> list[Adapter]:
    """spec.adapters, validated (the CRD checks the grammar and unique names too; this names the field for
    `kvserve render` and clusters without the CRD's validation). Raises AdapterError."""
    items = spec.get("adapters") or []
    if not isinstance(items, list):
        raise AdapterError("spec.adapters must be a list of {name, uri, rank}")
    model_secret = (((spec.get("model") or {}).get("credentials") or {}).get("secretRef") or {}).get("name")
    served = spec["model"].get("servedName") or spec["model"].get("name")
    out: list[Adapter] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        where = f"spec.adapters[{i}]"
        if not isinstance(item, dict):
            raise AdapterError(f"{where} must be an object with name and uri")
        unknown = sorted(set(item) - {"name", "uri", "rank", "credentials"})
        if unknown:
            raise AdapterError(f"unknown field {where}.{unknown[0]} (an adapter has name, uri, rank, credentials)")
        name = item.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise AdapterError(
                f"{where}.name must be 1-64 letters, digits, '.', '_' or '-' (starting and ending with a letter "
                f"or digit): it is the model name clients send and a folder name; got {name!r}"
            )
        if name in seen:
            raise AdapterError(f"{where}.name {name!r} duplicates spec.adapters[{seen[name]}].name")
        if served and name == served:
            raise AdapterError(
                f"{where}.name {name!r} is the base model's served name (spec.model.servedName/name): a request "
                "for it could not say which one it means"
            )
        seen[name] = i
        try:
            source = source_uri.parse(item.get("uri", ""), field=f"{where}.uri", revision_field=f"{where}.uri")
        except source_uri.SourceError as exc:
            raise AdapterError(str(exc)) from None
        rank = item.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK):
            raise AdapterError(f"{where}.rank must be an integer in [1, {MAX_RANK}], got {rank!r}")
        secret = ((item.get("credentials") or {}).get("secretRef") or {}).get("name")
        if secret and not source.remote:
            raise AdapterError(
                f"{where}.credentials applies to hf:// and s3:// adapters only; {source.scheme}:// is mounted as it is"
            )
        out.append(Adapter(i, name, source, rank, secret or (model_secret if source.remote else None)))
    if out:
        for arg in (spec.get("engine") or {}).get("extraArgs") or []:
            flag = str(arg).split("=", 1)[0]
            if flag in LORA_FLAGS:
                raise AdapterError(
                    f"spec.engine.extraArgs {flag} conflicts with spec.adapters, which renders "
                    f"{', '.join(LORA_FLAGS)} itself (the capacity plan charges the slots those flags allocate)"
                )
    return out


def slots(adapters: list[Adapter]) -> tuple[int, int]:
    """(max_loras, max_lora_rank): a device slot per adapter -- every adapter stays resident, so a request
    never waits for a swap -- padded to the largest rank given, else the runtime's default rank."""
    if not adapters:
        return 0, int(engine_args.default("max_lora_rank"))
    ranks = [a.rank for a in adapters if a.rank is not None]
    return len(adapters), max(ranks) if ranks else int(engine_args.default("max_lora_rank"))


def engine_settings(adapters: list[Adapter]) -> dict:
    """The EngineArgs values (rendered as `kvserve serve` flags by engine_args.cli_args); {} without adapters."""
    if not adapters:
        return {}
    max_loras, max_rank = slots(adapters)
    return {
        "enable_lora": True,
        "lora_modules": ",".join(f"{a.name}={a.directory}" for a in adapters),
        "max_loras": max_loras,
        "max_lora_rank": max_rank,
    }


def annotation(adapters: list[Adapter]) -> str:
    return ",".join(a.name for a in adapters)


def served_by_ready_pods(pods: list[dict], names: list[str]) -> int:
    """How many of `names` every ready, not-terminating pod serves: a pod becomes ready only after its
    engine loaded every --lora-modules adapter (a bad one exits it at start-up), and its annotation lists
    them; during a rollout an old pod without a new adapter keeps that adapter from counting (a request
    routed there would get a 404). 0 while no pod is ready."""
    ready = [p for p in pods if _ready(p)]
    if not ready:
        return 0
    served = set(names)
    for pod in ready:
        listed = ((pod.get("metadata") or {}).get("annotations") or {}).get(POD_ANNOTATION, "")
        served &= {n for n in listed.split(",") if n}
    return len(served)


def _ready(pod: dict) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
