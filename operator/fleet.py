"""The operator's side of SLO planning: spec.slo + spec.workload parsed into the planner's Target, the plan of
the spec's own deployment computed off the reconcile, the HPA bounds it gives and status.fleet. The planning
maths (candidates, roofline step times, the search) is runtime/planner/catalog_search.py, which `kvserve plan
--slo-*` calls too: one source of truth."""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading

from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime.planner import catalog, catalog_search, kv_plan
from kvserve.runtime.planner.catalog_search import SEARCH_NUM_REQUESTS, Target
from kvserve.runtime.planner.fleet import Option, evaluate
from kvserve.runtime.planner.simulator import LengthSpec, Workload
from kvserve.runtime.planner.slo import SLO


def target_from_spec(spec: dict) -> Target | None:
    """None when the spec has neither spec.slo nor spec.workload. Raises ValueError naming the field."""
    slo, work = spec.get("slo"), spec.get("workload")
    if slo is None and work is None:
        return None
    if slo is None or work is None:
        missing = "spec.slo" if slo is None else "spec.workload"
        raise ValueError(f"{missing} is required with {'spec.workload' if slo is None else 'spec.slo'}")

    def number(section: dict, key: str, where: str, default: float | None = None) -> float:
        value = section.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"spec.{where}.{key} must be a number, got {value!r}")
        return float(value)

    ttft, tpot = number(slo, "ttftP90Seconds", "slo"), number(slo, "tpotP99Seconds", "slo")
    rate = number(work, "requestRate", "workload")
    floor = number(work, "minRequestRate", "workload", 0.0)
    if rate <= 0:
        raise ValueError(f"spec.workload.requestRate must be > 0, got {rate:g}")
    if not 0 <= floor <= rate:
        raise ValueError(f"spec.workload.minRequestRate must be in [0, requestRate], got {floor:g}")
    try:
        target_slo = SLO(ttft, tpot)
    except ValueError:
        raise ValueError(f"spec.slo.ttftP90Seconds and tpotP99Seconds must be > 0, got {ttft:g}, {tpot:g}") from None
    workload = Workload(
        prompt_len=LengthSpec.parse(work.get("promptLen", 512), "spec.workload.promptLen"),
        output_len=LengthSpec.parse(work.get("outputLen", 128), "spec.workload.outputLen"),
        num_requests=SEARCH_NUM_REQUESTS,
        request_rate=rate,
        prefix_len=int(work.get("prefixLen", 0)),
    )
    return Target(target_slo, workload, rate, floor)


# Planning off the reconcile (issue 44: "the operator's reconcile never blocks on planning"). A plan is seconds
# of CPU; the first reconcile of a new spec.slo starts it on this thread and reads a pending Option (the HPA
# keeps spec.autoscaling's bounds, status.fleet says it is planning); the plan's end starts the reconciles that
# waited for it (`when_planned`), which read the result from `_plans`. `kvserve plan -f` waits (background=False).
_planner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-slo-plan")
_plans: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
_plans_guard = threading.Lock()
PLANS_KEPT = 64
PLANNING = "planning: the SLO plan is being computed off the reconcile; the HPA keeps spec.autoscaling's bounds"
_background = False


def plan_in_background(enabled: bool) -> None:
    """The operator plans off its reconciles (handlers' startup); the CLI waits for each plan (the default)."""
    global _background
    _background = enabled


def plan_replica(
    inp: kv_plan.PlanInput,
    plan: kv_plan.Plan,
    gpu_key: str | None,
    target: Target,
    usd_per_gpu_hour: float | None = None,
) -> Option:
    """The operator's view: this spec's own GPU, TP and engine settings (it chooses none of them), its SLO
    capacity and the HPA bounds for the workload; the fleet's cost at the catalog's price or `usd_per_gpu_hour`
    (spec.gpu.usdPerGpuHour). Cached per input: reconciles repeat with the same inputs. In the background
    (`plan_in_background`), an Option with `pending` set while the plan runs."""
    candidate = catalog_search.replica_candidate(inp, plan, gpu_key, usd_per_gpu_hour)
    key = (candidate, target)
    with _plans_guard:
        future = _plans.get(key)
        if future is None:
            future = _plans[key] = _planner.submit(
                evaluate, candidate, target.workload, target.slo, target.request_rate, target.min_request_rate
            )
            while len(_plans) > PLANS_KEPT:
                _plans.popitem(last=False)
        _plans.move_to_end(key)
    if _background and not future.done():
        return Option(candidate, 0.0, 0, math.inf, None, math.nan, math.nan, PLANNING, pending=True)
    return future.result()


def when_planned(option: Option, callback) -> None:
    """Call `callback()` (on its own thread) once the pending plan of `option` is done."""
    with _plans_guard:
        futures = [f for (c, _), f in _plans.items() if c == option.candidate and not f.done()]
    if not futures:
        threading.Thread(target=callback, daemon=True).start()
        return
    for future in futures:
        future.add_done_callback(lambda _: threading.Thread(target=callback, daemon=True).start())


BOUND_FIELDS = ("minReplicas", "maxReplicas", "targetQueueDepth")


def autoscaling_bounds(autoscaling: dict, option: Option | None, explicit: frozenset[str] = frozenset()) -> dict:
    """{minReplicas, maxReplicas, targetQueueDepth} the HPA / KEDA render: each field the user set in
    spec.autoscaling (`explicit`) wins; the others come from the SLO plan when spec.slo was planned and is
    feasible, else from spec.autoscaling's defaults. A planned bound that crosses an explicit one gives way
    (an explicit minReplicas 6 with a planned maximum of 4 runs 6..6). Raises ValueError naming the fields when
    an explicit bound crosses a default one (the CRD refuses two explicit bounds that cross)."""
    planned = {}
    if option is not None and option.hpa is not None:
        h = option.hpa
        planned = {
            "minReplicas": h.min_replicas,
            "maxReplicas": h.max_replicas,
            "targetQueueDepth": h.target_queue_depth,
        }
    out = {k: autoscaling[k] if k in explicit or k not in planned else planned[k] for k in BOUND_FIELDS}
    if out["minReplicas"] > out["maxReplicas"]:
        lo_set, hi_set = "minReplicas" in explicit, "maxReplicas" in explicit
        if lo_set and not hi_set and "maxReplicas" in planned:
            out["maxReplicas"] = out["minReplicas"]
        elif hi_set and not lo_set and "minReplicas" in planned:
            out["minReplicas"] = out["maxReplicas"]
        else:
            why = (
                "set minReplicas <= maxReplicas"
                if lo_set and hi_set
                else f"{'minReplicas' if hi_set else 'maxReplicas'} is the default; set it too"
            )
            raise ValueError(
                f"spec.autoscaling.minReplicas ({out['minReplicas']}) > spec.autoscaling.maxReplicas "
                f"({out['maxReplicas']}): {why}"
            )
    return out


PRICE_FIELD = "spec.gpu.usdPerGpuHour"


def gpu_price(spec: dict) -> float | None:
    """spec.gpu.usdPerGpuHour (None: the catalog's). Raises ValueError naming the field."""
    value = (spec.get("gpu") or {}).get("usdPerGpuHour")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{PRICE_FIELD} must be a number > 0 (USD per GPU-hour), got {value!r}")
    return float(value)


def price_source(spec: InferenceServiceSpec) -> str:
    return PRICE_FIELD if spec.gpu.usd_per_gpu_hour is not None else catalog.PRICE_SOURCE


def fleet_status(option: Option, source: str = catalog.PRICE_SOURCE) -> dict:
    """status.fleet: what one replica serves within spec.slo, the HPA bounds derived from it, and what the fleet
    costs an hour at those bounds (replicas x GPUs per replica x the GPU-hour price, said where it came from)."""
    c = option.candidate
    if option.pending:  # no numbers yet (operator/fleet.plan_replica runs it off the reconcile)
        return {"feasible": False, "planning": True, "stepTimeSource": c.step_time_source, "reason": option.reason}
    out = {
        "feasible": option.hpa is not None,
        "replicaRequestsPerSecond": round(option.replica_requests_per_s, 3),
        "ttftP90SecondsAtCapacity": round(option.ttft_p90_s, 4),
        "tpotP99SecondsAtCapacity": round(option.tpot_p99_s, 5),
        "stepTimeSource": option.candidate.step_time_source,
    }
    if option.hpa is not None:
        gpu_hour = c.tensor_parallel_size * c.usd_per_gpu_hour
        out.update(
            minReplicas=option.hpa.min_replicas,
            maxReplicas=option.hpa.max_replicas,
            targetQueueDepth=option.hpa.target_queue_depth,
            usdPerGpuHour=c.usd_per_gpu_hour,
            usdPerHourAtMinReplicas=round(option.hpa.min_replicas * gpu_hour, 2),
            usdPerHourAtMaxReplicas=round(option.hpa.max_replicas * gpu_hour, 2),
            priceSource=source,
        )
    else:
        out["reason"] = f"spec.slo cannot be met, the HPA keeps spec.autoscaling's bounds: {option.reason}"
    return out
