// SiLU-and-mul for the fused gate/up projection: out = silu(x[:, :I]) * x[:, I:], silu(g) = g / (1 + exp(-g))
// in fp32, rounded to the dtype, then multiplied by up and rounded again (torch's F.silu(gate) * up).
// exp is the ~1 ulp polynomial of cpu_vec.h (torch uses Sleef's), so fp32 results may differ in the last bit.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

#ifdef KVS_AVX512
// One pass over the row in registers (load gate and up, silu, round, multiply, store): the data is read and
// written once, where converting whole rows through fp32 scratch touched it five times.
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 g = load16<T>(gate + i, m);
    const __m512 silu = round_to<T>(_mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(zero, g)))));
    store16<T>(out + i, _mm512_mul_ps(silu, load16<T>(up + i, m)), m);
  }
}
#else
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f32(gate[i]);
    const float silu = to_f32(from_f32<T>(g / (1.f + std::exp(-g))));  // rounded to the dtype first
    out[i] = from_f32<T>(silu * to_f32(up[i]));
  }
}
#endif

template <typename T>
void silu_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(3 * inter), [&](int64_t b, int64_t e) {
    const FlushDenormalsScope no_subnormals;  // per worker thread: see cpu_vec.h
    for (int64_t r = b; r < e; ++r) silu_mul_row<T>(xp + r * xs, xp + r * xs + inter, op + r * os, inter);
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
