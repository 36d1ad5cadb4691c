"""Fleet planning from the catalogs: candidates (GPU x TP with the KV plan and a step-time model) for the
planner's SLO search (runtime/planner/fleet.py), and the HPA bounds of one InferenceService's spec.slo +
spec.workload. `kvserve plan --slo-*` and the operator both call this module: one source of truth.

Step times: a calibration from the serving machine when the caller has one (`kvserve calibrate`); otherwise
the roofline of the catalog GPU's datasheet numbers (catalog.GPU), an estimate with stated efficiency factors
that every output labels as such.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import threading
from dataclasses import dataclass

from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime.planner import catalog, kv_plan
from kvserve.runtime.planner.fleet import Candidate, Deployment, Option, evaluate, search
from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload
from kvserve.runtime.planner.slo import SLO
from kvserve.runtime.planner.step_time import StepTimeModel

# Stated assumptions of the roofline (not measured): fractions of the datasheet peak a serving step reaches,
# the host's per-step cost (scheduling, sampling, launches), and per layer two TP all-reduces of a few
# microseconds each on NVLink.
FLOPS_EFFICIENCY = 0.5
BANDWIDTH_EFFICIENCY = 0.7
HOST_OVERHEAD_S = 0.004
ALLREDUCE_S = 10e-6
SEARCH_NUM_REQUESTS = 200  # per simulated trial: p99 from 200 requests (the 2nd worst); seconds per candidate


def roofline_source(gpu_key: str) -> str:
    return (
        f"roofline estimate from the {gpu_key} datasheet (peak x {FLOPS_EFFICIENCY:g} FLOPs, "
        f"x {BANDWIDTH_EFFICIENCY:g} bandwidth, {HOST_OVERHEAD_S * 1e3:g} ms host overhead): not measured"
    )


def roofline_step_model(model: catalog.ModelShape, gpu: catalog.GPU, plan: kv_plan.Plan) -> StepTimeModel:
    """Per GPU rank: a step reads the rank's weights once, spends 2 x params / TP FLOPs per token and reads
    each context token's KV slice once; TP > 1 adds two all-reduces per layer."""
    if not (gpu.peak_bf16_tflops > 0 and gpu.memory_bandwidth_gb_s > 0):
        raise ValueError(f"GPU {gpu.product} has no peak FLOPs / bandwidth in the catalog: give a calibration")
    tp = plan.tensor_parallel_size
    allreduce_s = 2 * model.num_layers * ALLREDUCE_S if tp > 1 else 0.0
    return StepTimeModel.from_hardware(
        num_params=model.num_parameters / tp,
        kv_bytes_per_token=plan.kv_bytes_per_token_per_gpu,
        peak_flops=gpu.peak_bf16_tflops * 1e12,
        mem_bandwidth_bytes_s=gpu.memory_bandwidth_gb_s * 1e9,
        weight_bytes=plan.weight_bytes_per_gpu,
        flops_efficiency=FLOPS_EFFICIENCY,
        bandwidth_efficiency=BANDWIDTH_EFFICIENCY,
        host_overhead_s=HOST_OVERHEAD_S + allreduce_s,
    )


def engine_shape(inp: kv_plan.PlanInput, plan: kv_plan.Plan) -> EngineShape:
    return EngineShape(
        num_blocks=plan.num_blocks_per_gpu,
        block_size=plan.block_size,
        max_num_seqs=inp.max_num_seqs,
        max_num_batched_tokens=inp.max_num_batched_tokens,
        max_model_len=inp.max_model_len,
    )


# The engine settings the fleet search tries per GPU x TP (runtime/planner/fleet.tune), around `kvserve serve`'s
# defaults (256 sequences, a 2048-token budget): fewer slots and a smaller budget shorten the steps a decode waits
# for (TPOT), more of each batch more work per step (throughput, and TTFT under load).
MAX_NUM_SEQS_GRID = (16, 32, 64, 128, 256, 512)
MAX_NUM_BATCHED_TOKENS_GRID = (512, 1024, 2048, 4096, 8192)
SEARCHED_SETTINGS = ("max_num_seqs", "max_num_batched_tokens")


def _build_candidate(
    inp: kv_plan.PlanInput,
    key: str,
    price: float,
    calibrated: tuple[StepTimeModel, str] | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> Candidate | None:
    """The candidate on GPU `key` at TP inp.tensor_parallel_size with these engine settings (None: its KV plan
    does not fit). `calibrated`: (model, device) measured on this deployment, else the roofline."""
    at = dataclasses.replace(inp, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    plan = kv_plan.plan(at)
    if not plan.fits:
        return None
    if calibrated is not None:
        step, source = calibrated[0], f"calibration ({calibrated[1]})"
    else:
        step, source = roofline_step_model(inp.model, catalog.GPUS[key], plan), roofline_source(key)
    return Candidate(
        key, inp.tensor_parallel_size, price, engine_shape(at, plan), step, source, plan.kv_bytes_per_token
    )


def candidates(
    base: kv_plan.PlanInput,
    gpu_keys: list[str],
    gpus_per_node: int,
    prices: dict[str, float] | None = None,
    calibrated: tuple[str, int, StepTimeModel, str] | None = None,
    searched: frozenset[str] = frozenset(),
    chunked_prefill: bool = True,
) -> list[Deployment]:
    """Every (GPU, TP <= gpus_per_node) whose KV plan fits with the engine settings of `base`, as a Deployment
    whose `searched` settings (of SEARCHED_SETTINGS) the search may change. The token budget is searched only
    with chunked prefill (without it the budget must hold a whole max_model_len prompt).
    `calibrated`: (gpu key, TP, model, device) measured on that deployment; it replaces the roofline there (a
    calibration's step times do not depend on the engine settings: they are per step)."""
    unknown = set(searched) - set(SEARCHED_SETTINGS)
    if unknown:
        raise ValueError(f"cannot search engine settings {sorted(unknown)}: only {', '.join(SEARCHED_SETTINGS)}")
    out = []
    for key in gpu_keys:
        gpu = catalog.GPUS[key]
        price = (prices or {}).get(key, gpu.usd_per_gpu_hour)
        for tp in kv_plan.valid_tensor_parallel_sizes(base.model, limit=gpus_per_node):
            inp = dataclasses.replace(base, gpu_memory_bytes=gpu.memory_bytes, tensor_parallel_size=tp)
            if not kv_plan.plan(inp).fits:
                continue

            own = calibrated[2:] if calibrated is not None and calibrated[:2] == (key, tp) else None
            build = functools.partial(_build_candidate, inp, key, price, own)  # picklable: the search's workers
            out.append(
                Deployment(
                    build,
                    inp.max_num_seqs,
                    inp.max_num_batched_tokens,
                    MAX_NUM_SEQS_GRID if "max_num_seqs" in searched else (),
                    MAX_NUM_BATCHED_TOKENS_GRID if "max_num_batched_tokens" in searched and chunked_prefill else (),
                )
            )
    return out


@dataclass(frozen=True)
class Target:
    """spec.slo + spec.workload (or `kvserve plan`'s flags), parsed."""

    slo: SLO
    workload: Workload  # lengths, prefix, seed; the rate is set per trial by the search
    request_rate: float  # peak req/s the fleet must serve
    min_request_rate: float = 0.0


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
    candidate = _replica_candidate(inp, plan, gpu_key, usd_per_gpu_hour)
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


def _replica_candidate(
    inp: kv_plan.PlanInput, plan: kv_plan.Plan, gpu_key: str | None, usd_per_gpu_hour: float | None
) -> Candidate:
    if gpu_key is None:
        raise ValueError("spec.slo needs a catalog GPU (spec.gpu.product) for its roofline step-time model")
    gpu = catalog.GPUS[gpu_key]
    return Candidate(
        gpu_key,
        plan.tensor_parallel_size,
        usd_per_gpu_hour if usd_per_gpu_hour is not None else gpu.usd_per_gpu_hour,
        engine_shape(inp, plan),
        roofline_step_model(inp.model, gpu, plan),
        roofline_source(gpu_key),
        plan.kv_bytes_per_token,
    )


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


def search_catalog(
    base: kv_plan.PlanInput,
    target: Target,
    gpu_keys: list[str] | None = None,
    gpus_per_node: int = 8,
    prices: dict[str, float] | None = None,
    calibrated: tuple[str, int, StepTimeModel, str] | None = None,
    searched: frozenset[str] = frozenset(SEARCHED_SETTINGS),
    chunked_prefill: bool = True,
) -> list[Option]:
    """`kvserve plan --slo-*`: every catalog GPU x TP at its best `searched` engine settings, cheapest feasible
    first."""
    keys = gpu_keys or sorted(catalog.GPUS)
    cands = candidates(base, keys, gpus_per_node, prices, calibrated, searched, chunked_prefill)
    return search(cands, target.workload, target.slo, target.request_rate, target.min_request_rate)
