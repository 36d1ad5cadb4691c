// SiLU-and-mul for the fused gate/up projection: out = silu(x[:, :I]) * x[:, I:], silu(g) = g / (1 + exp(-g))
// in fp32, rounded to the dtype, then multiplied by up and rounded again (torch's F.silu(gate) * up).
// exp is the ~1 ulp polynomial of cpu_vec.h (torch uses Sleef's), so fp32 results may differ in the last bit.
#include "ops.h"

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

inline void silu_inplace(float* x, int64_t n) {
#ifdef KVS_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    __m512 g = _mm512_maskz_loadu_ps(m, x + i);
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_mask_storeu_ps(x + i, m, _mm512_div_ps(g, _mm512_add_ps(one, e)));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
#endif
}

template <typename T>
void silu_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(3 * inter), [&](int64_t b, int64_t e) {
    const FlushDenormalsScope no_subnormals;  // per worker thread: see cpu_vec.h
    std::vector<float> g(inter), u(inter);
    for (int64_t r = b; r < e; ++r) {
      load_row<T>(xp + r * xs, g.data(), inter);
      load_row<T>(xp + r * xs + inter, u.data(), inter);
      silu_inplace(g.data(), inter);
      if constexpr (!std::is_same<T, float>::value) {
        store_row<T>(g.data(), op + r * os, inter);  // silu rounded to the dtype first
        load_row<T>(op + r * os, g.data(), inter);
      }
      for (int64_t i = 0; i < inter; ++i) g[i] *= u[i];
      store_row<T>(g.data(), op + r * os, inter);
    }
  });
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(1) % 2 == 0 && out.size(1) * 2 == x.size(1) &&
                  out.size(0) == x.size(0),
              "silu_and_mul: x [rows, 2I], out [rows, I]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && x.scalar_type() == out.scalar_type(),
              "silu_and_mul: contiguous rows, one dtype");
  KVS_DISPATCH(x.scalar_type(), "kvserve_silu_and_mul", [&] { silu_mul_impl<scalar_t>(out, x); });
}

}  // namespace kvserve_cpu
