"""The fp32 LM head's greedy tokens from a bf16 screen (runtime/models/greedy_head.py,
kvkernels/cpu/screened_argmax.cpp) against the argmax of the full product.

The reference is the float64 product, and the cases keep the top two logits of every row far apart next to fp32's
rounding, so that "equal to the fp32 argmax" has one answer whatever order a GEMM sums in. The cases are built so
that the bf16 product alone picks the wrong token on many rows (a screen that trusted it fails them), and one case
sets every rounding error the same way (a bound under a sixth of the derived one fails it).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu_ops

if not cpu_ops.load():
    pytest.skip(f"compiled CPU ops unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)
if not torch.backends.mkldnn.is_available():
    pytest.skip("oneDNN unavailable", allow_module_level=True)

from kvserve.runtime.models.greedy_head import ScreenedGreedyHead  # noqa: E402


def reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden.double() @ weight.double().T).argmax(dim=-1)


def clear_winner(hidden: torch.Tensor, weight: torch.Tensor, min_gap: float = 1e-4) -> torch.Tensor:
    """Rows whose two largest exact logits differ by more than min_gap relative to the largest magnitude."""
    top2 = (hidden.double() @ weight.double().T).topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > min_gap * top2[:, 0].abs().clamp_min(1.0)


def near_twins(gen: torch.Generator, vocab: int, dim: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose rows 2k+1 are rows 2k scaled by 1 + 0.2%..0.8% (bf16 keeps 8 bits: its rounding can tie or
    reverse such a pair), and hidden states pointing at the pairs (each twin's logit is the largest of its row)."""
    weight = torch.randn(vocab, dim, generator=gen) * 0.05
    scale = 1 + torch.empty(pairs).uniform_(0.002, 0.008, generator=gen)
    weight[1 : 2 * pairs : 2] = weight[0 : 2 * pairs : 2] * scale[:, None]
    hidden = weight[0 : 2 * pairs : 2] * 40 + torch.randn(pairs, dim, generator=gen) * 0.05
    return weight, hidden


def test_near_twin_rows_get_the_fp32_winner_where_bf16_picks_the_other(gen):
    weight, hidden = near_twins(gen, 4096, 576, 256)
    want = reference(hidden, weight)
    assert bool(clear_winner(hidden, weight).all())
    approx = (hidden.bfloat16() @ weight.bfloat16().T).float().argmax(dim=-1)
    # the case is a real test of the exact pass: 19-41 misses (mean 30) over 60 seeds, mostly twins the bf16 output
    # rounds to one value (the first then wins)
    assert int((approx != want).sum()) >= 8
    assert torch.equal(ScreenedGreedyHead(weight).tokens(hidden), want)


def test_aligned_rounding_errors_the_bound_must_cover(gen):
    """The worst case of the bound: every element of the hidden state and of row A sits just below a bf16 half-way
    point (all rounding errors point the same way, and A is parallel to h, where Cauchy-Schwarz is tight), so the
    screen undervalues A by almost 2 u of its logit; row B is exact in bf16 and the screen puts it above A (1024
    against 1020 after the output rounding) though A is the larger by 1.6. A bound under a sixth of the
    derived one drops A."""
    dim, eps = 1020, 0.99 * 2.0**-8
    weight = torch.randn(3000, dim, generator=gen) * 0.01
    hidden = torch.full((1, dim), 1 + eps)
    weight[1000] = 1 + eps  # row A: bf16 rounds every element down to 1
    weight[2000] = 1.0
    weight[2000, :300] = 1 + 2.0**-7  # row B: exact in bf16
    screen = (hidden.bfloat16() @ weight.bfloat16().T).float()
    assert screen[0, 2000] > screen[0, 1000] and int(reference(hidden, weight)) == 1000
    assert ScreenedGreedyHead(weight).tokens(hidden).tolist() == [1000]


@pytest.mark.parametrize("dim", [576, 64, 80, 33])
def test_random_and_peaky_rows_match_the_full_product(dim, gen):
    """Flat rows (many near-ties to rank) and peaky ones (a large hidden norm, as after a final norm with large
    gains); a vocabulary that is not a multiple of 16 (the op's masked tail)."""
    vocab = 5003
    weight = torch.randn(vocab, dim, generator=gen) * torch.empty(vocab, 1).uniform_(0.01, 0.2, generator=gen)
    hidden = torch.cat([torch.randn(64, dim, generator=gen), torch.randn(64, dim, generator=gen) * 30])
    keep = clear_winner(hidden, weight)
    assert int(keep.sum()) > 100
    got = ScreenedGreedyHead(weight).tokens(hidden)
    assert torch.equal(got[keep], reference(hidden, weight)[keep])


def test_exact_ties_give_the_first_index_as_torch_argmax(gen):
    weight = torch.randn(300, 64, generator=gen) * 0.05
    weight[250] = weight[17]  # identical rows: identical logits, to the bit
    weight[299] = weight[17]
    hidden = weight[17:18].repeat(3, 1) * 50
    assert ScreenedGreedyHead(weight).tokens(hidden).tolist() == [17, 17, 17]


def test_non_finite_rows_fall_back_to_full_logits(gen):
    """NaN or inf in a hidden state: torch.argmax's rule on the full logits (the first NaN), row by row; the
    other rows are still screened."""
    weight = torch.randn(1000, 64, generator=gen) * 0.05
    hidden = torch.randn(4, 64, generator=gen) * 10
    hidden[1, 3] = float("nan")
    hidden[2, 5] = float("inf")
    want = torch.nn.functional.linear(hidden, weight).argmax(dim=-1)
    assert torch.equal(ScreenedGreedyHead(weight).tokens(hidden), want)


def test_bad_arguments_are_refused_naming_the_argument(gen):
    weight = torch.randn(100, 64, generator=gen)
    head = ScreenedGreedyHead(weight)
    approx = torch.zeros(2, 100, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="approx"):
        torch.ops.kvserve_cpu.screened_greedy_argmax(torch.randn(3, 64), approx, weight, head.norms)
    with pytest.raises(RuntimeError, match="weight_norms"):
        torch.ops.kvserve_cpu.screened_greedy_argmax(torch.randn(2, 64), approx, weight, head.norms[:50])
    with pytest.raises(ValueError, match="float32"):
        ScreenedGreedyHead(weight.bfloat16())
