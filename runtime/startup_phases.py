"""How long each start-up phase took, in seconds: what decides how fast a fleet scales out (vLLM issue 19824).

Each phase is timed where it runs and the timings travel to the API server, which exports them as
`kvserve:startup_phase_seconds{phase=...}` and logs them in one line once ready (runtime/server/state.py):

- model_resolve: `kvserve serve` finds the model (MODEL_DIR checked, or the demo model built on first use);
- engine_config: config.json read (no transformers: ModelConfig.hf_config loads in the engine core), the CPU
  attention backend resolved (kernel_compile not included);
- kernel_compile: the compiled CPU ops built (first start on a CPU, KVSERVE_CPU_OPS_BUILD=wait) or found built
  and loaded; absent when they were not loaded in the serving process (GPU, or built in the background);
- tokenizer_load: the API server's tokenizer loaded (transformers' AutoTokenizer, its imports included: most
  of this phase on a warm restart); the engine-core process gets the config after it;
- engine_preload: (overlapped) `kvserve serve` starts the engine-core process before it builds the config, and
  that process imports torch, transformers' config classes and the model code meanwhile
  (engine/core_client.PrestartedCore); these seconds run beside model_resolve and engine_config;
- engine_process_start: the config handed to the engine-core process (or that process spawned, where it was
  not prestarted) until its entry point runs: what the start still waited for (the rest of the preload,
  unpickling the config);
- distributed_init: tensor/pipeline-parallel rank 0's process-group rendezvous (waits for every rank);
- kernel_load: the attention backend loaded in the model runner;
- weight_load: the model built and its weights read (LoRA slots and CPU weight prepacking included);
- memory_profile: the KV block count found (on CUDA a dummy forward at the token budget; free elsewhere);
- kv_cache_allocate: the device KV cache (and host swap space) allocated;
- cuda_graph_capture: decode CUDA graphs captured (only with --cuda-graphs);
- warmup: one forward of each batch shape class (a prefill, a decode, a decode batch) before readiness, so
  the first request does not pay for first-forward work (executor/warmup.py; bounded by
  KVSERVE_WARMUP_BUDGET_S, off with KVSERVE_WARMUP=0);
- total: `kvserve serve` started until the server is ready (the phases above, less the overlapped ones, plus
  everything between).

A phase that did not run is absent. Pure Python (no torch): the operator's layer may import it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

ORDER = (
    "model_resolve",
    "engine_config",
    "kernel_compile",
    "tokenizer_load",
    "engine_preload",
    "engine_process_start",
    "distributed_init",
    "kernel_load",
    "weight_load",
    "memory_profile",
    "kv_cache_allocate",
    "cuda_graph_capture",
    "warmup",
    "total",
)
OVERLAPPED = frozenset({"engine_preload"})  # run beside other phases: not part of the sum that total bounds


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's duration to phases[name] when it completes (a phase that raised has no duration)."""
    start = time.monotonic()
    yield
    phases[name] = phases.get(name, 0.0) + time.monotonic() - start


def ordered(phases: dict[str, float]) -> dict[str, float]:
    """The phases in start-up order (unknown names after the known ones, as given)."""
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(phases.items(), key=lambda item: rank.get(item[0], len(ORDER))))


def describe(phases: dict[str, float]) -> str:
    """One log line's worth: "model_resolve 0.00 s, weight_load 1.23 s, ..., total 4.56 s"."""
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in ordered(phases).items()) or "none timed"
