// Rotary embedding (neox / rotate_half style, as runtime/models/llama.py) applied in place to q and k:
//   x' = x * cos[pos] + rotate_half(x) * sin[pos],  rotate_half(x) = cat(-x[half:], x[:half])
// Each product and the sum are rounded to the dtype, exactly as the eager torch expression does, so the
// result is bit-identical to it (the TU is built with -ffp-contract=off: no fused multiply-adds).
#include "ops.h"

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

template <typename T>
inline float rnd(float x) { return to_f32(from_f32<T>(x)); }

#ifdef KVS_AVX512
// The same per-lane expression as the scalar loop below, 16 lanes at a time (half a multiple of 16), read from and
// written to the rows in registers: each product and sum rounded to T, no fused multiply-add, so the bits are the
// scalar loop's.
template <typename T>
inline void rotate_rows16(T* base, int64_t s1, int64_t heads, int64_t half, const float* c, const float* s) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t h = 0; h < heads; ++h) {
    T* row = base + h * s1;
    for (int64_t d = 0; d < half; d += 16) {
      const __m512 x1 = load16<T>(row + d), x2 = load16<T>(row + d + half);
      const __m512 c1 = _mm512_loadu_ps(c + d), c2 = _mm512_loadu_ps(c + d + half);
      const __m512 s1v = _mm512_loadu_ps(s + d), s2v = _mm512_loadu_ps(s + d + half);
      const __m512 neg_x2 = _mm512_xor_ps(x2, sign);
      const __m512 y1 =
          round_to<T>(_mm512_add_ps(round_to<T>(_mm512_mul_ps(x1, c1)), round_to<T>(_mm512_mul_ps(neg_x2, s1v))));
      const __m512 y2 =
          round_to<T>(_mm512_add_ps(round_to<T>(_mm512_mul_ps(x2, c2)), round_to<T>(_mm512_mul_ps(x1, s2v))));
      store16<T>(row + d, y1, 0xffff);
      store16<T>(row + d + half, y2, 0xffff);
    }
  }
}
#endif

template <typename T>
void rotate_rows(T* base, int64_t s1, int64_t heads, int64_t head_dim, const float* c, const float* s, float* x) {
  const int64_t half = head_dim / 2;
#ifdef KVS_AVX512
  if (half % 16 == 0) return rotate_rows16<T>(base, s1, heads, half, c, s);
#endif
  for (int64_t h = 0; h < heads; ++h) {
    T* row = base + h * s1;
    load_row<T>(row, x, head_dim);
    float* y = x + head_dim;
    for (int64_t d = 0; d < half; ++d) {
      y[d] = rnd<T>(rnd<T>(x[d] * c[d]) + rnd<T>(-x[d + half] * s[d]));
      y[d + half] = rnd<T>(rnd<T>(x[d + half] * c[d + half]) + rnd<T>(x[d] * s[d + half]));
    }
    store_row<T>(y, row, head_dim);
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), head_dim = q.size(2);
  const int64_t max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t], " out of range");
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows((hq + hk) * head_dim), [&](int64_t b, int64_t e) {
    const FlushDenormalsScope no_subnormals;  // per worker thread: see cpu_vec.h
    std::vector<float> c(head_dim), s(head_dim), x(2 * head_dim);
    for (int64_t t = b; t < e; ++t) {
      load_row<T>(cp + pos[t] * head_dim, c.data(), head_dim);
      load_row<T>(sp + pos[t] * head_dim, s.data(), head_dim);
      rotate_rows<T>(qp + t * q.stride(0), q.stride(1), hq, head_dim, c.data(), s.data(), x.data());
      rotate_rows<T>(kp + t * k.stride(0), k.stride(1), hk, head_dim, c.data(), s.data(), x.data());
    }
  });
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary: shapes");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(),
              "rotary: contiguous head dim / tables");
  TORCH_CHECK(q.size(2) % 2 == 0 && cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(), "rotary: table shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == cos.scalar_type() &&
                  q.scalar_type() == sin.scalar_type(),
              "rotary: q, k and the tables must share a dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == q.size(0),
              "rotary: int64 positions, one per token");
  KVS_DISPATCH(q.scalar_type(), "kvserve_rotary", [&] { rotary_impl<scalar_t>(positions, q, k, cos, sin); });
}

}  // namespace kvserve_cpu
