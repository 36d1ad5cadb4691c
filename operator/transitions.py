"""Pure: which Warning Events a status change deserves -- one per transition into a bad state, never one per
reconcile (the resync recomputes the same status every minute; Events must not pile up)."""

from __future__ import annotations

# condition type -> the status that is bad news
BAD_STATUS = {
    "CapacityPlanned": "False",
    "Degraded": "True",
    "ChildConflict": "True",
    "ModelReady": "False",
    "PlanDrift": "True",  # pods measured slower or faster than spec.slo's plan (operator/drift.py)
}
# Conditions whose bad status is news only for some reasons (ModelReady=False while Downloading is normal).
BAD_REASONS = {"ModelReady": {"DownloadFailed"}}
# Already announced by another condition's Event (CapacityPlanned=False says why the spec was not applied;
# ModelReady=False says the download failed).
_ANNOUNCED_ELSEWHERE = {("Degraded", "SpecNotApplied"), ("Degraded", "DownloadFailed")}


def warnings(previous: dict | None, current: dict) -> list[tuple[str, str]]:
    """(reason, message) for each condition that turned bad, or stayed bad with a different reason."""
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    out = []
    for cond in current.get("conditions") or []:
        ctype, bad = cond.get("type"), BAD_STATUS.get(cond.get("type"))
        if bad is None or cond.get("status") != bad or (ctype, cond.get("reason")) in _ANNOUNCED_ELSEWHERE:
            continue
        if ctype in BAD_REASONS and cond.get("reason") not in BAD_REASONS[ctype]:
            continue
        old = before.get(ctype) or {}
        if old.get("status") != bad or old.get("reason") != cond.get("reason"):
            out.append((cond["reason"], cond.get("message", "")))
    return out
