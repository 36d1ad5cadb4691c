// Greedy argmax over the rows of fp32 logits, with torch.argmax's answer: the first index of the maximum, or
// the first NaN when a row has one (torch orders NaN above every number). torch's CPU argmax reduces one
// element at a time (about 2 ns an element here: 6 ms for 96 rows of a 32k vocabulary, every decode step);
// this keeps a running maximum and its index per SIMD lane and reduces the lanes once per row.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t row_argmax(const float* x, int64_t n) {
#ifdef KVS_AVX512
  __m512 best = _mm512_set1_ps(kNegInf);
  __m512i best_idx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), m, x + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) return first_nan(x, n);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  // The smallest index among the lanes holding the maximum: the first occurrence in the row.
  return _mm512_mask_reduce_min_epi32(at_top, best_idx);
#else
  int64_t arg = 0;
  float top = x[0];
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], arg = i;
  }
  return arg;
#endif
}

}  // namespace

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "greedy_argmax: float32 [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(n > 0 && n < (int64_t(1) << 31), "greedy_argmax: vocab size out of range");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) o[r] = row_argmax(x + r * stride, n);
  });
  return out;
}

}  // namespace kvserve_cpu
