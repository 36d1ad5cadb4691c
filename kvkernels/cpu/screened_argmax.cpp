// Greedy tokens of an fp32 LM head from a bf16 screen: the caller computes approx = bf16(hidden) . bf16(W)^T on
// oneDNN (AMX / AVX512-BF16: a quarter of the fp32 GEMM's time, half its weight bytes); this op proves, per vocab row,
// how far approx can lie from the fp32 logit, keeps the rows that could still be the maximum, and computes only
// those in fp32. Why it is exact: for every v,
//   |approx_v - logit_v| <= (2u + u^2 + 3 gamma_H) * ||h|| * ||w_v|| + u (1 + u) |approx_v|
// with u = 2^-8 (bf16 round-to-nearest of h, of w_v and of the output) and gamma_H = H 2^-24 / (1 - H 2^-24) (fp32
// summation of H products in any order, for the screen's GEMM and for the fp32 GEMM it stands in for), by
// |sum_i x_i y_i| <= ||x|| ||y|| (Cauchy-Schwarz). Every v whose upper bound lies below the largest lower bound
// cannot be the fp32 argmax; the rest (2.7 rows of SmolLM2's 49,152 on average, 19 at most, in a measurement over
// real decode steps) are recomputed in fp32 and the first maximum wins, as torch.argmax's. The fp32 dot here sums in
// its own order, so a tie to the last bit between two survivors may break differently from a full fp32 GEMM, as
// between any two GEMM libraries. A row with a non-finite hidden state, screen value or recomputed logit returns -1:
// the caller computes that row's full fp32 logits (torch.argmax's NaN rule needs them).
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

constexpr double kBf16Unit = 1.0 / 256;  // unit roundoff of bf16 round-to-nearest (8 significant bits)
// The bound itself is evaluated in fp32 (a few roundings per vocab row): 1% slack covers them many times over.
constexpr double kSlack = 1.01;

#ifdef KVS_AVX512
// 16 screen values from v on (masked) and their error bounds alpha * ||w_v|| + beta * |approx_v|: one definition for
// both passes, so the lower bounds of pass 1 and the upper bounds of pass 2 are the same numbers.
inline __m512 screen16(const c10::BFloat16* a, const float* norms, int64_t v, __mmask16 m, __m512 alpha, __m512 beta,
                       __m512* bound) {
  const __m512 x = load16<c10::BFloat16>(a + v, m);
  *bound = _mm512_fmadd_ps(beta, _mm512_abs_ps(x), _mm512_mul_ps(alpha, _mm512_maskz_loadu_ps(m, norms + v)));
  return x;
}
#endif
inline float screen1(const c10::BFloat16* a, const float* norms, int64_t v, float alpha, float beta, float* bound) {
  const float x = static_cast<float>(a[v]);
  *bound = alpha * norms[v] + beta * std::fabs(x);
  return x;
}

// One row: returns the token, or -1 when the row needs full logits.
int64_t screened_row(const float* h, const c10::BFloat16* a, const float* w, int64_t w_stride, const float* norms,
                     int64_t vocab, int64_t hidden, double abs_coef, double rel_coef) {
  double sq = 0.0;
  for (int64_t i = 0; i < hidden; ++i) sq += double(h[i]) * h[i];
  const double h_norm = std::sqrt(sq);
  if (!std::isfinite(h_norm)) return -1;
  const float alpha = float(abs_coef * h_norm * kSlack), beta = float(rel_coef * kSlack);
  // Pass 1: the largest lower bound (every finite logit's bound is finite, so lb ends finite or a NaN shows).
  float lb = kNegInf;
  bool finite = true;
#ifdef KVS_AVX512
  {
    __m512 lbv = _mm512_set1_ps(kNegInf);
    const __m512 av = _mm512_set1_ps(alpha), bv = _mm512_set1_ps(beta);
    __mmask16 bad = 0;
    for (int64_t v = 0; v < vocab; v += 16) {
      const __mmask16 m = tail_mask(vocab - v);
      __m512 e;
      const __m512 x = screen16(a, norms, v, m, av, bv, &e);
      lbv = _mm512_mask_max_ps(lbv, m, lbv, _mm512_sub_ps(x, e));
      // inf - inf, NaN, or an infinite screen value: full logits decide
      bad |= _mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(x), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
    }
    lb = _mm512_reduce_max_ps(lbv);
    finite = bad == 0;
  }
#else
  for (int64_t v = 0; v < vocab; ++v) {
    float e;
    const float x = screen1(a, norms, v, alpha, beta, &e);
    if (!std::isfinite(x)) finite = false;
    lb = std::max(lb, x - e);
  }
#endif
  if (!finite || !std::isfinite(lb)) return -1;
  // Pass 2: the survivors (upper bound >= lb), in vocab order, recomputed in fp32; the first maximum wins.
  int64_t best = -1;
  float best_logit = kNegInf;
  auto consider = [&](int64_t v) -> bool {
    const float logit = dot_f32(h, w + v * w_stride, hidden);
    if (std::isnan(logit)) return false;
    if (best < 0 || logit > best_logit) best = v, best_logit = logit;
    return true;
  };
#ifdef KVS_AVX512
  const __m512 av = _mm512_set1_ps(alpha), bv = _mm512_set1_ps(beta), lbv = _mm512_set1_ps(lb);
  for (int64_t v = 0; v < vocab; v += 16) {
    const __mmask16 m = tail_mask(vocab - v);
    __m512 e;
    const __m512 x = screen16(a, norms, v, m, av, bv, &e);
    uint32_t keep = _mm512_mask_cmp_ps_mask(m, _mm512_add_ps(x, e), lbv, _CMP_GE_OQ);
    while (keep) {
      const int bit = __builtin_ctz(keep);
      keep &= keep - 1;
      if (!consider(v + bit)) return -1;
    }
  }
#else
  for (int64_t v = 0; v < vocab; ++v) {
    float e;
    const float x = screen1(a, norms, v, alpha, beta, &e);
    if (x + e >= lb && !consider(v)) return -1;
  }
#endif
  return best;
}

}  // namespace

at::Tensor screened_greedy_argmax(const at::Tensor& hidden, const at::Tensor& approx, const at::Tensor& weight,
                                  const at::Tensor& weight_norms) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.stride(1) == 1,
              "screened_greedy_argmax: hidden must be float32 [rows, hidden] with contiguous rows");
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kBFloat16 && approx.stride(1) == 1 &&
                  approx.size(0) == hidden.size(0),
              "screened_greedy_argmax: approx must be bfloat16 [rows, vocab] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.stride(1) == 1 &&
                  weight.size(0) == approx.size(1) && weight.size(1) == hidden.size(1),
              "screened_greedy_argmax: weight must be float32 [vocab, hidden] with contiguous rows");
  TORCH_CHECK(weight_norms.dim() == 1 && weight_norms.scalar_type() == at::kFloat && weight_norms.is_contiguous() &&
                  weight_norms.size(0) == weight.size(0),
              "screened_greedy_argmax: weight_norms must be float32 [vocab]");
  const int64_t rows = hidden.size(0), vocab = weight.size(0), dim = hidden.size(1);
  const double g = double(dim) * std::ldexp(1.0, -24);
  const double gamma = g / (1.0 - g);
  const double u = kBf16Unit;
  const double abs_coef = 2 * u + u * u + 3 * gamma, rel_coef = u * (1 + u);
  at::Tensor out = at::empty({rows}, hidden.options().dtype(at::kLong));
  const float* h = hidden.data_ptr<float>();
  const c10::BFloat16* a = approx.data_ptr<c10::BFloat16>();
  const float* w = weight.data_ptr<float>();
  const float* n = weight_norms.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t hs = hidden.stride(0), as = approx.stride(0), ws = weight.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) o[r] = screened_row(h + r * hs, a + r * as, w, ws, n, vocab, dim, abs_coef, rel_coef);
  });
  return out;
}

}  // namespace kvserve_cpu
