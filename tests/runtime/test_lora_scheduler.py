"""Scheduler with LoRA (issue 24): at most max_loras distinct adapters run per step; a request for a
non-resident adapter waits without blocking base requests, and is not starved by a resident adapter's
stream of new requests."""

from __future__ import annotations

from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.request import Request
from kvserve.runtime.sampling_params import SamplingParams

BS = 4


def _sched(max_loras=2):
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64, max_loras=max_loras)
    return Scheduler(cfg, KVCacheManager(200, BS))


_n = iter(range(10_000))


def _req(rid, lora=None, max_tokens=3):
    base = 1000 * next(_n)
    return Request(rid, list(range(base, base + 6)), SamplingParams(max_tokens=max_tokens), lora_name=lora)


def _step(s):
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({x.req_id: 7 for x in out.scheduled if x.sample}))
    return out


def _loras_running(s):
    return {r.lora_name for r in s.running if r.lora_name}


def test_distinct_adapters_capped_and_base_passes():
    s = _sched(max_loras=2)
    for rid, lora in [("a1", "A"), ("b1", "B"), ("c1", "C"), ("base", None), ("a2", "A")]:
        s.add_request(_req(rid, lora))
    out = _step(s)
    ids = {x.req_id for x in out.scheduled}
    assert ids == {"a1", "b1", "base"}  # C has no slot; a2 queues behind C (FCFS among adapters)
    assert len(_loras_running(s)) <= 2
    seen_c = False
    for _ in range(20):
        out = _step(s)
        assert len(_loras_running(s)) <= 2
        seen_c |= any(x.req_id == "c1" for x in out.scheduled)
        if not s.has_unfinished_requests():
            break
    assert seen_c and not s.has_unfinished_requests()


def test_resident_adapter_stream_does_not_starve_waiting_adapter():
    s = _sched(max_loras=1)
    s.add_request(_req("a0", "A"))
    _step(s)
    s.add_request(_req("b0", "B"))  # waits for A's slot
    admitted_b_at = None
    for t in range(30):
        s.add_request(_req(f"a{t + 1}", "A"))  # a steady stream for the resident adapter
        out = _step(s)
        assert len(_loras_running(s)) <= 1
        if any(x.req_id == "b0" for x in out.scheduled):
            admitted_b_at = t
            break
    assert admitted_b_at is not None and admitted_b_at < 10


def test_no_cap_without_lora():
    s = _sched(max_loras=0)
    for i in range(5):
        s.add_request(_req(f"r{i}", f"L{i}"))
    assert len(_step(s).scheduled) == 5


def test_running_and_waiting_adapter_names_for_the_metric():
    """vllm:lora_requests_info's labels come from here: distinct sorted names, swapped counted as waiting."""
    s = _sched(max_loras=2)
    for rid, lora in [("b1", "B"), ("a1", "A"), ("base", None), ("b2", "B"), ("c1", "C")]:
        s.add_request(_req(rid, lora))
    assert s.lora_adapters() == ((), ("A", "B", "C"))
    _step(s)  # two adapter slots: A and B run (with the base request), C waits
    assert s.lora_adapters() == (("A", "B"), ("C",))
