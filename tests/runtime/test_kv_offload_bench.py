"""`python -m kvserve.runtime.bench.kv_offload` (issue 41 scope 5) on a small random GGUF file: the bench takes
a .gguf path as `kvserve serve` does, runs the tier off and on with identical greedy tokens, and reports loads
only with the tier on and a TTFT split into queue wait and prefill."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from gguf_testing import random_llama_dir, write_gguf  # noqa: E402  (tests/ is on pythonpath)


@pytest.fixture
def gguf_file(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "hf"
    d.mkdir()
    random_llama_dir(d, hidden_size=64, intermediate_size=128, head_dim=16)
    return write_gguf(str(d), str(tmp_path / "m.gguf"))


@pytest.mark.timeout(300)
def test_bench_runs_on_a_gguf_file(gguf_file):
    from kvserve.runtime.bench import kv_offload

    argv = [gguf_file, "--conversations", "6", "--turns", "2", "--system-len", "32", "--question-len", "16"]
    off, on = kv_offload.main([*argv, "--answer-len", "8", "--ratio", "3", "--offload-gib", "0.01"])
    assert off.tier == "off" and off.loaded_tokens == 0
    assert on.loaded_tokens > 0 and on.computed_tokens < off.computed_tokens
    for row in (off, on):
        assert 0 <= row.ttft_p90_queue_s < max(row.ttft_p90_s, row.ttft_p50_s) * 2


@pytest.mark.timeout(300)
def test_bench_paced_arrivals(gguf_file):
    """--conversation-rate: conversations as clients (staggered starts, each next turn after its answer)."""
    from kvserve.runtime.bench import kv_offload

    argv = [gguf_file, "--conversations", "8", "--turns", "2", "--system-len", "32", "--question-len", "16"]
    argv += ["--answer-len", "8", "--ratio", "8", "--offload-gib", "0.01", "--conversation-rate", "1000"]
    argv += ["--think-time", "0.5"]  # every first turn done (and evicted) before the second turns come
    off, on = kv_offload.main(argv)
    assert off.loaded_tokens == 0 and on.loaded_tokens > 0
