"""kopf handlers: thin glue around observe -> resolve/plan -> render -> apply -> status.

Run with `kvserve operator` or `kopf run -m kvserve.operator.handlers --all-namespaces`.
Triggers: create/update/resume of an InferenceService; any event on a child it owns (a deleted or hand-edited
child is restored at once, and readyReplicas follow the Deployment); a periodic resync of every known
InferenceService as the level-based safety net (KVSERVE_RESYNC_SECONDS, default 60).

The resync is an operator-level task rather than a `@kopf.timer`: kopf puts a finalizer on every object that
has a timer, and a finalizer would block `kubectl delete` whenever the operator is down. Without delete
handlers, timers or daemons the InferenceService carries no finalizer; Kubernetes' garbage collector
removes the children through their ownerReferences.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import secrets
import threading
from typing import Any

import kopf

from kvserve.operator import (
    adapters,
    drift,
    fleet,
    kube,
    kv_offload,
    labels,
    leader,
    metrics,
    model_configs,
    pod_health,
    render,
    transitions,
)
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod
from kvserve.operator.pod_startup import last_replica_startup
from kvserve.operator.render import disaggregation as render_disaggregation
from kvserve.operator.render import multinode as render_multinode
from kvserve.operator.render import router as render_router
from kvserve.operator.render import security as render_security
from kvserve.operator.spec_model import InferenceServiceSpec

log = logging.getLogger("kvserve.operator")
G, V, P = spec_mod.GROUP, spec_mod.VERSION, spec_mod.PLURAL
RESYNC_SECONDS = float(os.environ.get("KVSERVE_RESYNC_SECONDS", "60"))
CHILD_LABELS = {"app.kubernetes.io/managed-by": labels.MANAGED_BY}

_known: set[tuple[str, str]] = set()  # InferenceServices seen on the watch stream, for the resync
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(namespace: str, name: str, measure_drift: bool = False) -> dict[str, str]:
    """Bring one InferenceService's children and status in line with its spec; returns what was done.
    `measure_drift` (the resync's): scrape the engine pods and advance PlanDrift (operator/drift.py)."""
    actions: dict[str, str] = {}
    if not leader.may_write():  # a standby (or a leader that lost its Lease) must not write anything
        return actions
    with _lock(namespace, name):
        parent = kube.get(spec_mod.KIND, namespace, name)  # fresh: the triggering event may be stale
        if parent is None or parent["metadata"].get("deletionTimestamp"):
            metrics.forget(namespace, name)
            drift.forget(namespace, name)
            return actions
        try:
            raw_spec = parent.get("spec") or {}
            # A model outside the catalog is planned from its own config.json (only that file is fetched).
            config = (
                model_configs.fetch(namespace, spec_mod.with_defaults(raw_spec))
                if spec_mod.needs_model_config(raw_spec)
                else None
            )
            resolved = spec_mod.resolve(raw_spec, model_config=config)
            spec, plan, reason, message = resolved.spec, resolved.plan, resolved.plan.reason, resolved.plan.message
            desired = render.render(resolved, name, namespace)
        except spec_mod.SpecError as exc:
            resolved, plan, reason, message, desired = None, None, exc.reason, exc.message, []
            spec = spec_mod.best_effort(parent.get("spec"))
        except (KeyError, TypeError, ValueError) as exc:  # only without the CRD's validation (e.g. no CRD)
            resolved, plan, reason, message, desired = None, None, "InvalidSpec", f"{type(exc).__name__}: {exc}", []
            spec = spec_mod.best_effort(parent.get("spec"))

        desired = _with_api_key_digest(desired, spec, namespace)
        previous = parent.get("status") or {}
        layout = resolved.layout if resolved is not None else None
        multinode = layout is not None and layout.multinode
        # Children are keyed by (kind, name): the router's Deployment/Service/PDB share kinds with the engine's.
        keys = [(kind, name) for kind in kube.CHILD_KINDS] + render_router.child_keys(name, spec, previous)
        keys += render_disaggregation.child_keys(name, spec, previous)  # spec.disaggregation's pools
        lws_key = ("LeaderWorkerSet", render_multinode.lws_name(name))
        if multinode or previous.get("parallelism"):  # a LeaderWorkerSet is wanted, or was (to prune it)
            keys += [lws_key, ("Secret", render_multinode.authkey_secret_name(name))]
        live = {key: kube.get(key[0], namespace, key[1]) for key in keys}
        # Someone else's object under one of our names: adopt nothing, write nothing (a half-built service is
        # worse), and report ChildConflict instead of computing status from an object that is not ours.
        conflicts = tuple(
            _label(key, name)
            for key in ((o["kind"], o["metadata"]["name"]) for o in desired)
            if live.get(key) is not None and not kube.owned_by(live[key], parent)
        )
        if conflicts:
            log.warning(
                "%s/%s: %s exist(s) and not owned by this InferenceService; leaving everything alone",
                namespace,
                name,
                ", ".join(conflicts),
            )
            desired = []
        missing_crds: list[str] = []
        for obj in desired:
            key = (obj["kind"], obj["metadata"]["name"])
            action = _label(key, name)
            try:
                actions[action] = _apply_child(kube.adopt(obj, parent), live.get(key))
            except kube.MissingCRDError as exc:  # e.g. LeaderWorkerSet not installed: say so in the status
                log.warning("%s/%s: %s", namespace, name, exc.message)
                missing_crds.append(exc.message)
                actions[action] = "missing-crd"
                continue
            if actions[action] != "unchanged":
                live[key] = kube.get(key[0], namespace, key[1])
        if plan is not None and plan.fits and not conflicts:
            # Children the spec no longer asks for (the HPA after autoscaling is switched off, ...).
            wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in desired}
            for key, current in live.items():
                if key[0] == "Secret":  # the authkey Secret: create only (no delete on Secrets); GC'd with the CR
                    continue
                if key not in wanted and current is not None and kube.owned_by(current, parent):
                    kube.delete(key[0], namespace, key[1])
                    live[key] = None
                    actions[_label(key, name)] = "deleted"
        # else: an impossible spec creates nothing and leaves a previously working Deployment serving.

        fits = plan is not None and plan.fits
        # The workload the status reads: what the plan renders; with a spec that does not fit, what still serves.
        use_lws = multinode if fits else live.get(lws_key) is not None
        workload = live.get(lws_key) if use_lws else live[("Deployment", name)]
        # spec.disaggregation: the decode pool is the workload /scale and Ready read; status shows both pools.
        pool_set = resolved.pools if resolved is not None and fits else None
        pools_status = None
        if pool_set is not None:
            pool_live = {p.role: live.get(render_disaggregation.workload_key(name, p)) for p in pool_set}
            use_lws, workload = pool_set.decode.layout.multinode, pool_live["decode"]
            pools_status = status_mod.pools_status(pool_set, pool_live)
        pods = kube.list_labelled("Pod", namespace, {labels.OWNER_LABEL: name}) if workload else []
        failure = pod_health.diagnose(pods)
        # PlanDrift (issue 44): measured on the resync only, so each judged window spans a resync interval.
        planned = drift.planned(resolved.fleet, raw_spec) if resolved is not None and fits else None
        if measure_drift:
            drift.observe(namespace, name, planned, pods, spec.port)
        previous_drift = next((c for c in previous.get("conditions") or [] if c.get("type") == drift.CONDITION), None)
        if multinode and fits:
            parallelism = layout.to_status()
        else:  # a multi-pod layout that still serves (a spec that does not fit changes nothing) keeps its entry
            parallelism = previous.get("parallelism") if use_lws else None
        if pool_set is not None:
            parallelism = None  # each pool's pods per replica are in status.disaggregation
        new_status = status_mod.compute_status(
            name=name,
            namespace=namespace,
            spec=spec,
            generation=parent["metadata"].get("generation"),
            plan=plan,
            plan_reason=reason,
            plan_message=message,
            deployment=workload,
            previous=previous,
            now=_now(),
            pod_failure=failure,
            conflicts=conflicts,
            model_ready=_model_ready(spec, pods, failure),
            workload_kind="LeaderWorkerSet" if use_lws else "Deployment",
            parallelism=parallelism,
            missing_crds=tuple(missing_crds),
            adapters=_adapters_served(resolved, pods),
            plan_drift=drift.current(namespace, name, planned, previous_drift),
            pools=pools_status,
            selector=render_disaggregation.scale_selector(name) if pool_set is not None else None,
        )
        # Time to ready of the newest ready pod (kept while none is ready, e.g. scaled to zero): pod_startup.py
        startup = last_replica_startup(pods) or previous.get("lastReplicaStartup")
        if startup:
            new_status["lastReplicaStartup"] = startup
        if resolved is not None and resolved.fleet is not None:  # spec.slo: capacity per replica, HPA bounds
            new_status["fleet"] = fleet.fleet_status(resolved.fleet, fleet.price_source(spec))
            if resolved.fleet.pending:  # planned off the reconcile (operator/fleet.py): reconcile again when done
                fleet.when_planned(resolved.fleet, lambda: _reconcile_logged(namespace, name))
        tier = kv_offload.status(resolved.spec, layout.nodes if layout else 1) if resolved is not None else None
        if tier:  # spec.kvCache.offload (issue 41): the tiers and what they cost each pod
            new_status["kvOffload"] = tier
        bounds = resolved.autoscaling if resolved is not None else None
        metrics.record(namespace, name, spec=spec, plan=plan, status=new_status, bounds=bounds)
        if kube.patch_status(namespace, name, previous, new_status):
            actions["status"] = "patched"
        # After the status: a failed status patch is retried, and re-posting its Events would duplicate them.
        for event_reason, event_message in transitions.warnings(previous, new_status):
            log.warning("%s/%s: %s: %s", namespace, name, event_reason, event_message)
            try:
                kube.post_warning(parent, event_reason, event_message)
            except kube.KubeError as exc:  # an Event is best effort; the condition carries the same text
                log.warning("could not post the %s Event for %s/%s: %s", event_reason, namespace, name, exc)
    return actions


def _apply_child(obj: dict, live: dict | None) -> str:
    """kube.apply, except for the group authkey Secret: created once with a random key and never rewritten
    (the operator may create Secrets but not patch or delete them)."""
    if obj["kind"] == "Secret":
        if live is not None:
            return "unchanged"
        return kube.apply(render_multinode.with_generated_key(obj, secrets.token_urlsafe(32)), None)
    return kube.apply(obj, live)


def _model_ready(
    spec: InferenceServiceSpec, pods: list[dict], failure: pod_health.PodFailure | None
) -> tuple[bool, str, str]:
    try:
        remote = spec_mod.model_source(spec.model).remote
    except spec_mod.SpecError:
        return False, "InvalidModelSource", "spec.model.uri is not a model source (see CapacityPlanned)"
    return pod_health.model_ready(pods, remote, failure)


def _adapters_served(resolved: spec_mod.Resolved | None, pods: list[dict]) -> tuple[int, int] | None:
    if resolved is None or not resolved.adapters:
        return None
    names = [a.name for a in resolved.adapters]
    return adapters.served_by_ready_pods(pods, names), len(names)


def _label(key: tuple[str, str], name: str) -> str:
    """Action key: the kind for the engine's children ("Deployment"), kind/name for the router's."""
    return key[0] if key[1] == name else f"{key[0]}/{key[1]}"


def _with_api_key_digest(desired: list[dict], spec: InferenceServiceSpec, namespace: str) -> list[dict]:
    """Stamp the API-key Secret's digest on the pod templates, so a rotated key rolls the pods."""
    ref = render_security.api_key_ref(spec)
    if ref is None or not desired:
        return desired
    digest = render_security.secret_digest(kube.get("Secret", namespace, ref.name), ref.key)
    if digest is None:  # the pods fail with CreateContainerConfigError, which pod_health reports as Degraded
        log.warning("%s: Secret %r or its key %r is missing", namespace, ref.name, ref.key)
    return render_security.with_api_key_hash(desired, digest)


def _reconcile_or_retry(namespace: str, name: str, trigger: str) -> None:
    try:
        with metrics.timed_reconcile(trigger):
            actions = reconcile(namespace, name)
    except kube.KubeError as exc:
        raise kopf.TemporaryError(f"API error, will retry: {exc}", delay=10) from exc
    if any(v != "unchanged" for v in actions.values()):
        log.info("reconciled %s/%s: %s", namespace, name, actions)


async def _resync_forever() -> None:
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        for namespace, name in sorted(_known):
            try:
                await asyncio.to_thread(_reconcile_logged, namespace, name)
            except Exception:  # one broken object must not stop the resync of the others
                log.exception("resync of %s/%s failed", namespace, name)


def _reconcile_logged(namespace: str, name: str) -> None:
    with metrics.timed_reconcile("resync"):
        actions = reconcile(namespace, name, measure_drift=True)
    if any(v != "unchanged" for v in actions.values()):
        log.info("resync restored %s/%s: %s", namespace, name, actions)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_: Any) -> None:
    _known.clear()  # the watch stream's initial listing refills it
    memo.resync_task = asyncio.create_task(_resync_forever())


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "resync_task", None)
    if task is not None:
        task.cancel()
    fleet.plan_in_background(False)


@kopf.on.event(G, V, P)
def track(namespace: str, name: str, type: str | None, **_: Any) -> None:
    if type == "DELETED":
        _known.discard((namespace, name))
        metrics.forget(namespace, name)
        drift.forget(namespace, name)
    else:
        _known.add((namespace, name))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Only Warnings become Events (the capacity failures); kopf's per-handler success lines would flood them.
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="serving.kvserve.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="serving.kvserve.dev", key="last-handled-configuration"
    )
    if kube._client is None:
        kube.configure()
    fleet.plan_in_background(True)  # an SLO plan never holds a reconcile (operator/fleet.plan_replica)


@kopf.on.resume(G, V, P)
@kopf.on.create(G, V, P)
@kopf.on.update(G, V, P)
def on_change(namespace: str, name: str, **_: Any) -> None:
    _reconcile_or_retry(namespace, name, "change")


def _on_child_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    meta = body.get("metadata", {})
    owner = (meta.get("labels") or {}).get(labels.OWNER_LABEL)
    if owner and any(ref.get("kind") == spec_mod.KIND for ref in meta.get("ownerReferences") or []):
        _reconcile_or_retry(meta["namespace"], owner, "child")


for _group, _version, _plural in map(kube.group_version_plural, kube.OWNED_KINDS):
    kopf.on.event(_group, _version, _plural, labels=CHILD_LABELS, id=f"child-{_plural}")(_on_child_event)
