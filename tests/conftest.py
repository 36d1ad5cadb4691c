"""Suite-wide settings.

KVSERVE_CPU_OPS_BUILD=wait: `kvserve serve` defaults to starting on the pure-torch path while the compiled CPU
ops build in the background (kvkernels/cpu_ops_build.py); the suite's servers must run the compiled path the
greedy-parity tests check, so they build first, as the offline API does (a test that wants the background
build sets the variable itself)."""

import os

os.environ.setdefault("KVSERVE_CPU_OPS_BUILD", "wait")
