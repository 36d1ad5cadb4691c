"""`kvserve bench planner-grid`: the planner's accuracy over a grid of served configurations, as MAPE
(runtime/bench/planner_grid.py; the same as `python -m kvserve.runtime.bench.planner_grid`)."""

from __future__ import annotations

import argparse

HELP = (
    "planner accuracy: 27 configurations through kvserve serve (5 replicas, one served calibration each), "
    "MAPE of throughput, E2E, TTFT and TPOT p50/p90 predicted vs measured"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.runtime.bench import planner_grid

    planner_grid.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench import planner_grid

    return planner_grid.main_args(args)
