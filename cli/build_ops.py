"""`kvserve build-ops`: build the compiled CPU ops ahead of time (an image build, a pod's init container, a node
warm-up), so no `kvserve serve` on this CPU waits for the compiler or starts on the pure-torch path.

The library is built for the CPU this runs on (-march=native; its feature flags are hashed into the name): built
on another CPU, it is never loaded there, and the first `kvserve serve` builds its own in the background.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HELP = "Build the compiled CPU ops for this CPU into the build cache (--cache-dir / $KVSERVE_CPU_OPS_DIR)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where the build goes (a volume a pod keeps); sets $KVSERVE_CPU_OPS_DIR for this run "
        "(default: $KVSERVE_CPU_OPS_DIR, else torch's extension directory)",
    )


def run(args: argparse.Namespace) -> int:
    if args.cache_dir is not None:
        os.environ["KVSERVE_CPU_OPS_DIR"] = args.cache_dir
    from kvserve.kernels import cpu_ops_build

    started = time.monotonic()
    ok, line = cpu_ops_build.build_now()
    print(f"kvserve build-ops: {line} ({time.monotonic() - started:.1f} s)", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
