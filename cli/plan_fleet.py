"""`kvserve plan --slo-ttft-p90 S --slo-tpot-p99 S --request-rate R`: the fleet choice (cheapest GPU x TP x
replicas meeting the SLO at the rate) and the HPA bounds, from runtime/planner/catalog_search.py (what the
operator plans with too); the flags become the planner's Target through operator/fleet.target_from_spec, the
spec.slo parser, so the CLI and the CRD accept the same values."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fleet search (with --slo-ttft-p90 and --slo-tpot-p99; needs --request-rate)")
    g.add_argument("--slo-ttft-p90", type=float, metavar="SECONDS", help="SLO: time to first token, p90")
    g.add_argument("--slo-tpot-p99", type=float, metavar="SECONDS", help="SLO: time per output token, p99")
    g.add_argument(
        "--min-request-rate", type=float, default=0.0, help="req/s at the quietest hour: the HPA's minReplicas"
    )
    g.add_argument("--gpus", help="catalog GPUs to consider, comma-separated (default: all)")
    g.add_argument(
        "--gpu-price",
        action="append",
        default=[],
        metavar="GPU=USD",
        help="USD per GPU-hour for a catalog GPU (repeatable; default the catalog's indicative price)",
    )
    g.add_argument(
        "--disaggregation",
        choices=("off", "auto", "on"),
        default="off",
        help="prefill/decode disaggregation (runtime/planner/disagg.py): off = aggregated replicas only; auto = "
        "also plan each GPU x TP as a prefill and a decode pool and choose the cheaper; on = choose the P/D fleet",
    )
    g.add_argument(
        "--kv-transfer-gb-s",
        type=float,
        default=None,
        metavar="GB_PER_S",
        help="the link P/D moves a prompt's KV over, GB/s per replica (default 25: one 200 Gb/s RDMA NIC)",
    )


# target_from_spec's field names -> this command's flags (longest first: requestRate is in minRequestRate)
FLAG_OF_FIELD = {
    "spec.slo.ttftP90Seconds": "--slo-ttft-p90",
    "spec.slo.tpotP99Seconds": "--slo-tpot-p99",
    "spec.workload.minRequestRate": "--min-request-rate",
    "spec.workload.requestRate": "--request-rate",
    "spec.workload.promptLen": "--prompt-len",
    "spec.workload.outputLen": "--output-len",
    "spec.workload.prefixLen": "--prefix-len",
    "requestRate": "--request-rate",
}


def wanted(args: argparse.Namespace) -> bool:
    return args.slo_ttft_p90 is not None or args.slo_tpot_p99 is not None


def _prices(items: list[str]) -> dict[str, float]:
    from kvserve.runtime.planner import catalog

    out = {}
    for item in items:
        name, _, usd = item.partition("=")
        key = catalog.gpu_key(name)
        try:
            price = float(usd)
        except ValueError:
            raise ValueError(f"--gpu-price: expected GPU=USD, got {item!r}") from None
        if key is None or price <= 0:
            raise ValueError(f"--gpu-price: {item!r}: need a catalog GPU and a price > 0")
        out[key] = price
    return out


def _gpu_keys(text: str | None) -> list[str] | None:
    from kvserve.runtime.planner import catalog

    if not text:
        return None
    keys = [catalog.gpu_key(n) for n in text.split(",") if n.strip()]
    if None in keys or not keys:
        raise ValueError(f"--gpus: {text!r}: use catalog GPUs ({', '.join(sorted(catalog.GPUS))})")
    return keys


def anchor_gpu(args: argparse.Namespace) -> str:
    """The GPU the engine settings resolve against when --gpu is not given: the search varies GPU and TP
    itself, so this only anchors the plan's settings (the first of --gpus, else the H100)."""
    keys = _gpu_keys(args.gpus)
    return keys[0] if keys else "h100-80gb"


def fleet(args: argparse.Namespace, base, calibration: dict | None) -> dict:
    """The search's JSON: slo, workload, choice (None when nothing meets the SLO) and every option.
    Raises ValueError naming the flag."""
    from kvserve.operator import fleet as fleet_mod
    from kvserve.runtime.engine_args import EngineArgs
    from kvserve.runtime.planner import catalog, catalog_search
    from kvserve.runtime.planner.step_time import StepTimeModel

    if args.slo_ttft_p90 is None or args.slo_tpot_p99 is None:
        raise ValueError("the fleet search needs both --slo-ttft-p90 and --slo-tpot-p99")
    if not args.request_rate:
        raise ValueError("the fleet search needs --request-rate (the peak req/s the fleet serves)")
    spec = {
        "slo": {"ttftP90Seconds": args.slo_ttft_p90, "tpotP99Seconds": args.slo_tpot_p99},
        "workload": {
            "requestRate": args.request_rate,
            "minRequestRate": args.min_request_rate,
            "promptLen": args.prompt_len,
            "outputLen": args.output_len,
            "prefixLen": args.prefix_len,
        },
    }
    try:
        target = fleet_mod.target_from_spec(spec)
    except ValueError as exc:  # name the flags, not the CRD fields
        message = str(exc)
        for field, flag in FLAG_OF_FIELD.items():
            message = message.replace(field, flag)
        raise ValueError(message) from None
    calibrated = None
    if calibration is not None and args.gpu:
        key = catalog.gpu_key(args.gpu)
        if key is not None:
            model = StepTimeModel.from_dict(calibration["step_time_model"])
            calibrated = (key, base.tensor_parallel_size, model, calibration.get("device", "?"))
    # The engine settings the user wrote stay; the others are chosen per GPU x TP (catalog_search.py's grids).
    searched = frozenset(catalog_search.SEARCHED_SETTINGS) - EngineArgs.explicit(args)
    options = catalog_search.search_catalog(
        base,
        target,
        _gpu_keys(args.gpus),
        args.gpus_per_node,
        _prices(args.gpu_price),
        calibrated,
        searched,
        getattr(args, "enable_chunked_prefill", True),
    )
    rows = [o.to_dict() for o in options]
    choice = rows[0] if rows and rows[0]["feasible"] else None
    extra = {}
    if args.disaggregation != "off":
        # Each GPU x TP at the settings the aggregated search chose and at the resolved ones: a decode pool has no
        # prefill chunks to keep short, so the settings that held TPOT for an aggregated replica may starve it.
        resolved = catalog_search.candidates(
            base, _gpu_keys(args.gpus) or sorted(catalog.GPUS), args.gpus_per_node, _prices(args.gpu_price), calibrated
        )
        built = [d.build(d.max_num_seqs, d.max_num_batched_tokens) for d in resolved]
        pool = list(dict.fromkeys([o.candidate for o in options] + [c for c in built if c is not None]))
        extra["disaggregation"] = disaggregation(args, target, options, pool)
    return {
        "slo": {"ttft_p90_s": target.slo.ttft_p90_s, "tpot_p99_s": target.slo.tpot_p99_s},
        "request_rate": target.request_rate,
        "min_request_rate": target.min_request_rate,
        "price_source": catalog.PRICE_SOURCE,
        "searched_engine_settings": sorted(searched),
        "choice": choice,
        "options": rows,
        **extra,
    }


def disaggregation(args: argparse.Namespace, target, options: list, candidates: list) -> dict:
    """The `candidates` as prefill + decode pools (runtime/planner/disagg.py) against the aggregated `options`:
    both answers and the decision. Raises ValueError naming the flag."""
    import math

    from kvserve.runtime.planner import disagg

    link = disagg.DEFAULT_KV_TRANSFER_GB_S if args.kv_transfer_gb_s is None else args.kv_transfer_gb_s
    if not link > 0:
        raise ValueError(f"--kv-transfer-gb-s must be > 0, got {link:g}")
    aggregated = options[0].usd_per_hour if options and options[0].hpa is not None else math.inf
    bound = aggregated if args.disaggregation == "auto" else math.inf  # auto: only a cheaper P/D fleet matters
    found = disagg.search_disaggregated(candidates, target.workload, target.slo, target.request_rate, link, bound)
    rows = [o.to_dict() for o in found]
    best = rows[0] if rows and rows[0]["feasible"] else None
    decision = disagg.decide(args.disaggregation, aggregated, found[0].usd_per_hour if best else math.inf)
    return {
        "mode": args.disaggregation,
        "kv_transfer_gb_s": link,
        "decision": decision,
        "aggregated_usd_per_hour": None if math.isinf(aggregated) else aggregated,
        "disaggregated_choice": best,
        "options": rows,
    }


def format_fleet(f: dict) -> str:
    lines = [
        f"fleet search: TTFT p90 <= {f['slo']['ttft_p90_s']:g} s, TPOT p99 <= {f['slo']['tpot_p99_s']:g} s "
        f"at {f['request_rate']:g} req/s (prices: {f['price_source']})",
        f"{'GPU':<12} {'TP':>2} {'SEQS':>4} {'TOKENS':>6} {'REQ/S/REPLICA':>13} {'REPLICAS':>8} {'USD/H':>8}  "
        "HPA min/max/queue  NOTE",
    ]
    for o in f["options"]:
        head = f"{o['gpu']:<12} {o['tensor_parallel_size']:>2} {o['max_num_seqs']:>4} {o['max_num_batched_tokens']:>6}"
        if o["feasible"]:
            h = o["hpa"]
            lines.append(
                f"{head} {o['replica_requests_per_s']:>13.2f} {o['replicas']:>8} {o['usd_per_hour']:>8.2f}  "
                f"{h['min_replicas']}/{h['max_replicas']}/{h['target_queue_depth']}"
            )
        else:
            lines.append(f"{head} {'-':>13} {'-':>8} {'-':>8}  -  {o['reason']}")
    if f.get("searched_engine_settings"):
        lines.append(
            "SEQS/TOKENS: the best of --max-num-seqs / --max-num-batched-tokens per GPU x TP "
            f"(searched: {', '.join(f['searched_engine_settings'])}; a flag you give is kept)"
        )
    c = f["choice"]
    label = "aggregated choice" if f.get("disaggregation") else "choice"  # the decision follows the P/D pools
    if c is None:
        lines.append(f"{label}: none of the candidates meets the SLO")
    else:
        h = c["hpa"]
        lines.append(
            f"{label}: {c['replicas']} x {c['gpu']} TP {c['tensor_parallel_size']} ({c['gpus']} GPUs, "
            f"${c['usd_per_hour']:.2f}/h) with --max-num-seqs {c['max_num_seqs']} --max-num-batched-tokens "
            f"{c['max_num_batched_tokens']} (spec.engine.maxNumSeqs / maxNumBatchedTokens); HPA minReplicas "
            f"{h['min_replicas']}, maxReplicas {h['max_replicas']}, targetQueueDepth {h['target_queue_depth']}; "
            f"step times: {c['step_time_source']}"
        )
    d = f.get("disaggregation")
    if d is not None:
        lines.append(
            f"prefill/decode pools (--disaggregation {d['mode']}, the prompt's KV over {d['kv_transfer_gb_s']:g} "
            "GB/s; each GPU x TP at the engine settings above and at the resolved ones):"
        )
        lines.append(f"  {'GPU':<12} {'TP':>2} {'SEQS':>4} {'TOKENS':>6} {'P:D':>7} {'USD/H':>8}  NOTE")
        for o in d["options"]:
            head = (
                f"{o['gpu']:<12} {o['tensor_parallel_size']:>2} {o['max_num_seqs']:>4} {o['max_num_batched_tokens']:>6}"
            )
            if o["feasible"]:
                lines.append(f"  {head} {o['prefill_decode_ratio']:>7} {o['usd_per_hour']:>8.2f}")
            else:
                lines.append(f"  {head} {'-':>7} {'-':>8}  {o['reason']}")
        b = d["disaggregated_choice"]
        if b is not None:
            lines.append(
                f"P/D: {b['prefill_replicas']} prefill + {b['decode_replicas']} decode x {b['gpu']} TP "
                f"{b['tensor_parallel_size']} with --max-num-seqs {b['max_num_seqs']} --max-num-batched-tokens "
                f"{b['max_num_batched_tokens']} (${b['usd_per_hour']:.2f}/h, TTFT p90 {b['ttft_p90_s']:.3f} s end "
                f"to end with {b['kv_transfer_s'] * 1e3:.1f} ms KV transfer, TPOT p99 {b['tpot_p99_s'] * 1e3:.1f} ms)"
            )
        lines.append(f"decision: {d['decision'] or 'none meets the SLO'}")
    return "\n".join(lines)
