"""fp32 linears: oneDNN on its prepacked weight (KVSERVE_CPU_LINEAR=onednn) against kvserve's panels
(runtime/models/panel_linear.py: the panel kernel up to 128 rows, torch's batched GEMM above), in one process,
interleaved, over SmolLM2-135M's 120 projections (30 layers of qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536: 425 MB, each weight its own tensor, so a pass streams them from memory as a decode step does).
Also times a plain read of the same bytes (`sum`) and the panel path on one layer's weights repeated (`in cache`),
which bound what a pass can take. Best of --rounds, ms per pass of the 120 projections.

    taskset -c 0,1 .venv/bin/python tools/panel_linear_ab.py [--threads 2] [--rows 1 4 12 24 48 128 256 2048]

Random weights and inputs: a GEMM's time does not depend on the values (subnormals aside, which the kernel
flushes). Checks that both paths agree within fp32 rounding.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M's qkv, o, gate_up, down ([out, in])
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 12, 24, 48, 128, 256, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from kvserve.runtime.models import panel_linear

    torch.set_num_threads(args.threads)
    if not panel_linear.usable(torch.zeros(1, 1)):
        raise SystemExit("the panel kernel is unavailable here (compiled CPU ops with AVX-512 needed)")
    weights = [torch.randn(o, i) * 0.02 for _ in range(LAYERS) for (o, i) in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    panels = [panel_linear.pack(w) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    flops_per_row = 2 * nbytes / 4
    print(f"{len(weights)} fp32 projections, {nbytes / 1e6:.0f} MB, {args.threads} threads; ms per pass (GFLOP/s)")
    print("| rows | oneDNN packed | panels | panels, weights in cache | sum of the same bytes | oneDNN / panels |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        times = measure(rows, weights, onednn, panels, args.rounds)

        def cell(name, times=times, rows=rows):
            return f"{times[name]:.1f} ({flops_per_row * rows / times[name] / 1e6:.0f})"

        ratio = times["onednn"] / times["panels"]
        print(f"| {rows} | {cell('onednn')} | {cell('panels')} | {cell('hot')} | {times['sum']:.1f} | {ratio:.2f}x |")


def measure(rows: int, weights: list, onednn: list, panels: list, rounds: int) -> dict[str, float]:
    """Best ms per pass of each path; interleaved: each round times every path once, so a drift of the machine's
    speed hits all alike."""
    from kvserve.runtime.models import panel_linear

    xs = {i: torch.randn(rows, i) for i in {i for _, i in SHAPES}}
    a = torch.ops.mkldnn._linear_pointwise(xs[576], onednn[2], None, "none", [], "")
    torch.testing.assert_close(a, panel_linear.apply(xs[576], panels[2], None), rtol=1e-4, atol=1e-4)

    def run_onednn():
        for w, p in zip(weights, onednn):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def run_panels():
        for w, p in zip(weights, panels):
            panel_linear.apply(xs[w.shape[1]], p, None)

    def run_hot():  # one layer's four weights over and over: they stay in cache
        for i in range(len(weights)):
            panel_linear.apply(xs[weights[i % 4].shape[1]], panels[i % 4], None)

    def run_sum():
        for w in weights:
            w.sum()

    paths = {"onednn": run_onednn, "panels": run_panels, "hot": run_hot, "sum": run_sum}
    times = {name: float("inf") for name in paths}
    for fn in paths.values():  # warm-up: first-call allocations and oneDNN's primitive cache
        fn()
    for _ in range(rounds):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], (time.perf_counter() - t0) * 1e3)
    return times


if __name__ == "__main__":
    main()
