"""Import-time behaviour: no triton needed to import; interpreter chosen at launch, not at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
# tests/ on the path: kernel_testing (the attention oracle) is a test helper, not shipped
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITH_TESTS = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (TESTS_DIR, ENV.get("PYTHONPATH")) if p))


def _run(code: str, env=ENV) -> str:
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_import_without_triton():
    out = _run("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import kvserve.kernels as K
        assert not K.triton_available()
        assert K.paged_attention_ref is not None and K.store_kv_cache_ref is not None
        assert K.kv_cache_dtype_bytes("fp8_e4m3", 2) == 1
        try:
            K.paged_attention
        except ImportError as e:
            print("ImportError", e)
    """)
    assert "ImportError kvserve.kernels.paged_attention needs triton" in out


def test_interpret_env_read_at_launch():
    """triton (and its @jit stdlib) imported in compiled mode first; setting the env later still works."""
    out = _run(
        """
        import os, torch, triton, triton.language as tl
        from triton.runtime.jit import JITFunction
        assert isinstance(tl.standard.zeros, JITFunction)  # compiled-mode stdlib
        from kvserve.kernels import paged_attention, store_kv_cache
        from kernel_testing import dense_causal_attention
        from kvserve.runtime.bench.paged_batch import make_paged_batch, rel_err
        b = make_paged_batch([3, 1], [5, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                             prefilled_new=False)
        try:
            store_kv_cache(b.k_new, b.v_new, b.k_cache, b.v_cache, b.slot_mapping)
        except RuntimeError as e:
            print("no-interp:", e)
        os.environ["TRITON_INTERPRET"] = "1"
        store_kv_cache(b.k_new, b.v_new, b.k_cache, b.v_cache, b.slot_mapping)
        out = paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q,
                              b.max_seqlen_q, b.max_seqlen_k, b.scale)
        print("err", rel_err(out, dense_causal_attention(b)))
        assert isinstance(tl.standard.zeros, JITFunction)  # restored after the launch
    """,
        env=WITH_TESTS,
    )
    assert "no-interp: Triton kernels need CUDA tensors" in out
    err = float(out.split("err ")[1].split()[0])
    assert err < 1e-5
