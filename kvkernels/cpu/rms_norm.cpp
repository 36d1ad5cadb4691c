// RMSNorm and residual-add + RMSNorm in Llama's order: fp32 statistics, x * rsqrt(mean(x^2) + eps) in fp32,
// cast to the dtype, then multiplied by the (same-dtype) weight and rounded again, as transformers does.
// Only the summation order of mean(x^2) differs from torch's reduction. Parallel over rows.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

// One row: buf <- the row in fp32 (with the residual: x + residual rounded to the dtype, written back to the
// residual, as torch's add rounds), then out = T(w * T(buf * rsqrt(mean(buf^2) + eps))). The AVX-512 passes work
// in registers; mean(buf^2) is dot_f32 on both paths, so the two give the same bits.
template <typename T>
inline void norm_row(T* res, const T* x, const float* w32, T* out, int64_t n, float eps, float* buf) {
#ifdef KVS_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = load16<T>(x + i, m);
    if (res) {
      v = round_to<T>(_mm512_add_ps(load16<T>(res + i, m), v));
      store16<T>(res + i, v, m);
    }
    _mm512_mask_storeu_ps(buf + i, m, v);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(dot_f32(buf, buf, n) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 normed = round_to<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, buf + i), r));
    store16<T>(out + i, _mm512_mul_ps(normed, _mm512_maskz_loadu_ps(m, w32 + i)), m);
  }
#else
  load_row<T>(x, buf, n);
  if (res) {
    for (int64_t i = 0; i < n; ++i) buf[i] = to_f32(from_f32<T>(buf[i] + to_f32(res[i])));
    store_row<T>(buf, res, n);
  }
  const float r = 1.f / std::sqrt(dot_f32(buf, buf, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) buf[i] = to_f32(from_f32<T>(buf[i] * r)) * w32[i];
  store_row<T>(buf, out, n);
#endif
}

template <typename T>
void norm_impl(at::Tensor& out, at::Tensor* residual, const at::Tensor& x, const at::Tensor& weight, double eps_d) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const float eps = static_cast<float>(eps_d);
  std::vector<float> w32(hidden);
  load_row<T>(weight.data_ptr<T>(), w32.data(), hidden);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t b, int64_t e) {
    const FlushDenormalsScope no_subnormals;  // per worker thread: see cpu_vec.h
    std::vector<float> buf(hidden);
    for (int64_t i = b; i < e; ++i)
      norm_row<T>(rp ? rp + i * hidden : nullptr, xp + i * hidden, w32.data(), op + i * hidden, hidden, eps, buf.data());
  });
}

void check(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous tensors");
  TORCH_CHECK(x.sizes() == out.sizes() && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: shapes");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: x, out and weight must share a dtype");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(out, x, weight);
  KVS_DISPATCH(x.scalar_type(), "kvserve_rms_norm",
                                  [&] { norm_impl<scalar_t>(out, nullptr, x, weight, eps); });
}

void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(out, x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  KVS_DISPATCH(x.scalar_type(), "kvserve_add_rms_norm",
                                  [&] { norm_impl<scalar_t>(out, &residual, x, weight, eps); });
}

}  // namespace kvserve_cpu
