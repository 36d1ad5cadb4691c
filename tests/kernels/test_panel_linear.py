"""fp32 linears in panels of 32 columns (kvkernels/cpu/panel_linear.cpp, runtime/models/panel_linear.py):
the panel kernel (up to MAX_KERNEL_ROWS rows) and the batched GEMM over the panels (above) against the float64
product, within the error bound of fp32 summation; the kernel's promise that a row's result does not depend on the
batch, the row blocking or the thread count; and the packing choices of models/cpu_linear.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.kernels import cpu_ops
from kvserve.runtime.models import cpu_linear, panel_linear

if not cpu_ops.load():
    pytest.skip(f"compiled CPU ops unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)
if not torch.ops.kvserve_cpu.panel_linear_native():
    pytest.skip("the panel kernel is vectorised only with AVX-512", allow_module_level=True)

UNIT = 2.0**-24  # fp32 unit roundoff


def within_fp32_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """|y - exact| <= gamma_(K+1) * (|x| |w|^T + |bias|): any fp32 summation order of K products and a bias."""
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact += bias.double()
        scale += bias.double().abs()
    k = x.shape[1] + 1
    gamma = k * UNIT / (1 - k * UNIT)
    return bool(((y.double() - exact).abs() <= gamma * scale + 1e-30).all())


SHAPES = [  # rows, out features, in features: single rows, every row-block size, N off the panel width, prefill sizes
    (1, 576, 576),
    (3, 70, 33),
    (12, 960, 576),
    (13, 64, 1536),
    (25, 100, 200),
    (128, 3072, 576),
    (129, 96, 64),
    (700, 70, 200),
]


@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_exact_product_within_fp32_rounding(gen, seed, rows, out_features, in_features, with_bias):
    w = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) * 4 if with_bias else None
    y = panel_linear.apply(x, panel_linear.pack(w), bias)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    assert within_fp32_bound(y, x, w, bias), f"seed {seed}"


def test_leading_dims_strided_rows_and_empty_batches(gen, seed):
    w = torch.randn(96, 64, generator=gen)
    packed = panel_linear.pack(w)
    wide = torch.randn(2, 5, 100, generator=gen)
    x = wide[..., :64]  # rows 100 floats apart
    y = panel_linear.apply(x, packed, None)
    assert y.shape == (2, 5, 96)
    assert torch.equal(y, panel_linear.apply(x.contiguous(), packed, None)), f"seed {seed}"
    assert panel_linear.apply(torch.empty(0, 64), packed, None).shape == (0, 96)


def test_a_row_does_not_depend_on_the_batch_or_the_threads(gen, seed):
    """Every output is one FMA chain over k: the same bits alone, in any batch the kernel takes, on any thread count."""
    w = torch.randn(300, 576, generator=gen)
    x = torch.randn(panel_linear.MAX_KERNEL_ROWS, 576, generator=gen)
    packed = panel_linear.pack(w)
    full = panel_linear.apply(x, packed, None)
    for start, size in ((0, 1), (5, 1), (0, 12), (7, 13), (40, 31), (100, 28)):
        part = panel_linear.apply(x[start : start + size], packed, None)
        assert torch.equal(part, full[start : start + size]), f"rows {start}+{size}, seed {seed}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(panel_linear.apply(x, packed, None), full), f"seed {seed}"
    finally:
        torch.set_num_threads(threads)


def test_non_finite_inputs_reach_only_their_own_row(gen):
    w = torch.randn(64, 32, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    y = panel_linear.apply(x, panel_linear.pack(w), None)
    assert bool(y[1].isnan().all()) and not bool(y[2].isfinite().any())
    assert bool(y[[0, 3]].isfinite().all())


def test_bad_arguments_are_refused_with_the_op_named():
    packed = panel_linear.pack(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="panel_linear"):
        torch.ops.kvserve_cpu.panel_linear(torch.empty(2, 40), torch.randn(2, 17), packed.panels, None)
    with pytest.raises(RuntimeError, match="panel_linear: float32"):
        torch.ops.kvserve_cpu.panel_linear(torch.empty(2, 40), torch.randn(2, 16).double(), packed.panels, None)


class _Two(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a = nn.Linear(64, 96, bias=True, dtype=dtype)
        self.b = nn.Linear(96, 40, bias=False, dtype=dtype)


@pytest.mark.parametrize("env,fp32_kind", [(None, "panels"), ("auto", "panels"), ("onednn", "onednn")])
def test_packing_puts_fp32_weights_in_panels_and_bf16_on_onednn(monkeypatch, env, fp32_kind):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN unavailable")
    if env is None:
        monkeypatch.delenv(cpu_linear.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_linear.ENV, env)
    for dtype, kind in ((torch.float32, fp32_kind), (torch.bfloat16, "onednn")):
        model = _Two(dtype)
        x = torch.randn(3, 64, dtype=dtype)
        want = model.b(model.a(x))
        assert cpu_linear.pack_linears(model, (nn.Linear,)) == 2
        state = model.a.__dict__
        assert (cpu_linear._PANELS in state, cpu_linear._ATTR in state) == (kind == "panels", kind == "onednn")
        assert model.a.weight.device.type == "meta"  # one copy: the packed one
        got = cpu_linear.linear(cpu_linear.linear(x, model.a, model.a.bias), model.b, None)
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_an_unknown_mode_is_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "fast")
    with pytest.raises(ValueError, match="KVSERVE_CPU_LINEAR='fast'"):
        cpu_linear.packing_enabled()
