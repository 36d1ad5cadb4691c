"""Fleet planning from the catalogs (pure, torch-free): each GPU x TP of the catalog as a candidate (the KV plan
and a step-time model) for the SLO search (fleet.py), and one deployment's candidate for the operator's plan of
an InferenceService. `kvserve plan --slo-*` and the operator (operator/fleet.py) both call this module.

Step times: a calibration from the serving machine when the caller has one (`kvserve calibrate`); otherwise
the roofline of the catalog GPU's datasheet numbers (catalog.GPU), an estimate with stated efficiency factors
that every output labels as such.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from kvserve.runtime.planner import catalog, kv_plan
from kvserve.runtime.planner.fleet import Candidate, Deployment, Option, search
from kvserve.runtime.planner.simulator import EngineShape, Workload
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


def replica_candidate(
    inp: kv_plan.PlanInput, plan: kv_plan.Plan, gpu_key: str | None, usd_per_gpu_hour: float | None
) -> Candidate:
    """The operator's deployment: this spec's own GPU, TP and engine settings, priced at `usd_per_gpu_hour` or
    the catalog's, with the roofline step times of its GPU."""
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
