"""`kvserve bench pd`: ITL of running decodes while long prompts arrive, P/D against aggregated
(kvserve.runtime.bench.pd_itl)."""

from __future__ import annotations

import argparse

HELP = "benchmark P/D disaggregation against aggregated serving: ITL of running decodes under long prompts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.runtime.bench.pd_itl import add_arguments as bench_arguments

    bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.pd_itl import main

    return main(args)
