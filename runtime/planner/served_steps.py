"""A served replica's steps as the simulator needs them: each logged step (KVSERVE_STEP_LOG,
runtime/engine/step_log.py) plus the engine core loop's time until the next step starts.

The step log times EngineCore.step (schedule, forward, sample, update). A served core's loop also spends time
between steps, every step: it turns the step's outputs into messages and sends them to the API server, and
receives and adds new requests (core_process._busy_loop). The simulator advances its clock by one step-time per
step and nothing between them, so a model fitted on the steps alone runs the replica too fast: over the
accuracy grid's replicas here (2 shared cores), the gap's median was 2-6% of a decode step, under 1% of a step
with a prefill (docs/planner.md). Folding each gap into the step before it makes the fitted model the
step-to-step period, which is what queueing and throughput depend on.

An idle core's gap is waiting for work, not overhead: a gap is folded only when the core stayed busy, which a
caller knows for a calibration burst (every step but the burst's last) and which a pod's log shows only
indirectly: there a gap counts when it is at most the step's own seconds (`BUSY_GAP_RATIO`): the loop's work is
a fraction of a step, an idle wait is unbounded.
"""

from __future__ import annotations

from kvserve.runtime.planner.step_time import StepSample

BUSY_GAP_RATIO = 1.0


def gaps(lines: list[dict]) -> list[float | None]:
    """The seconds from each step's end to the next step's start (None for the last line, or where a line has
    no end_s: a log written before it was recorded)."""
    out: list[float | None] = []
    for a, b in zip(lines, lines[1:]):
        if "end_s" in a and "end_s" in b:
            out.append(max(0.0, b["end_s"] - b["seconds"] - a["end_s"]))
        else:
            out.append(None)
    return out + [None] * min(1, len(lines))


def with_loop_gaps(lines: list[dict], busy_to_end: bool = False) -> list[StepSample]:
    """Each line as a StepSample whose seconds include the loop's gap after it, where that gap is the loop's work
    rather than idle waiting. `busy_to_end`: the caller knows the core was busy from the first line to the last
    (a calibration burst), so every gap but the last counts; otherwise a gap counts when it is at most
    BUSY_GAP_RATIO times the step's seconds. Lines without end_s keep their own seconds."""
    out = []
    for d, gap in zip(lines, gaps(lines)):
        seconds = d["seconds"]
        if gap is not None and (busy_to_end or gap <= BUSY_GAP_RATIO * seconds):
            seconds += gap
        out.append(
            StepSample(d["num_tokens"], d["context_tokens"], seconds, d["num_sampled"], d.get("attention_pairs", 0))
        )
    return out
