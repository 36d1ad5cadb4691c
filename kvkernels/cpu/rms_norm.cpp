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

inline float sum_squares(const float* x, int64_t n) { return dot_f32(x, x, n); }

// buf holds the row in fp32; writes out = T(w * T(buf * r))
template <typename T>
inline void normalize_row(float* buf, const float* w32, T* out, int64_t n, float eps) {
  const float var = sum_squares(buf, n) / static_cast<float>(n);
  const float r = 1.f / std::sqrt(var + eps);
  for (int64_t i = 0; i < n; ++i) buf[i] = to_f32(from_f32<T>(buf[i] * r)) * w32[i];
  store_row<T>(buf, out, n);
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
    std::vector<float> buf(hidden), tmp(hidden);
    for (int64_t i = b; i < e; ++i) {
      if (rp) {
        load_row<T>(rp + i * hidden, buf.data(), hidden);
        load_row<T>(xp + i * hidden, tmp.data(), hidden);
        for (int64_t j = 0; j < hidden; ++j) buf[j] += tmp[j];
        store_row<T>(buf.data(), rp + i * hidden, hidden);      // residual in the dtype, as torch's add rounds
        load_row<T>(rp + i * hidden, buf.data(), hidden);
      } else {
        load_row<T>(xp + i * hidden, buf.data(), hidden);
      }
      normalize_row<T>(buf.data(), w32.data(), op + i * hidden, hidden, eps);
    }
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
