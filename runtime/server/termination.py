"""The container's termination message: one line saying why the server exited at startup.

Kubernetes copies /dev/termination-log into `status.containerStatuses[].lastState.terminated.message`
(the rendered pod sets `terminationMessagePolicy: FallbackToLogsOnError`), where the operator reads it and
shows it as a condition and an Event. A plan the runtime cannot honour starts with PLAN_REJECTED_PREFIX,
which the operator maps to reason RuntimeRejectedPlan."""

from __future__ import annotations

import logging
import os

PLAN_REJECTED_PREFIX = "kvserve: plan rejected: "
STARTUP_FAILED_PREFIX = "kvserve: startup failed: "
DEFAULT_PATH = "/dev/termination-log"
MAX_BYTES = 4096  # the kubelet keeps at most 4 KiB of the message

logger = logging.getLogger("kvserve.server")


def termination_message(exc: BaseException) -> str:
    from kvserve.runtime.executor.kv_sizing import PlanRejected

    prefix = PLAN_REJECTED_PREFIX if isinstance(exc, PlanRejected) else STARTUP_FAILED_PREFIX
    text = " ".join(str(exc).split()) or type(exc).__name__
    return (prefix + text)[:MAX_BYTES]


def write_termination_message(exc: BaseException) -> str:
    """Write the one-line reason where the kubelet looks ($KVSERVE_TERMINATION_LOG overrides the path, for
    tests); outside a pod the file usually is not there, which is fine."""
    message = termination_message(exc)
    path = os.environ.get("KVSERVE_TERMINATION_LOG", DEFAULT_PATH)
    try:
        with open(path, "w") as f:
            f.write(message + "\n")
    except OSError as err:
        logger.debug("no termination log written to %s: %s", path, err)
    return message
