// Small SIMD helpers shared by the kvserve CPU ops: dtype <-> fp32 row conversion (round-to-nearest-even,
// bit-identical to c10's scalar conversions), an fp32 exp, dot products and row updates. Every AVX-512 path
// is guarded by the compiler's ISA macros, so the same sources build (scalar loops) on AVX2-only machines.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVS_AVX512 1
#if defined(__AVX512BF16__)
#define KVS_AVX512BF16 1
#endif
#endif

namespace kvserve_cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows per at::parallel_for chunk for an element-wise op: at least kParallelMinElems elements of work, so a
// decode batch (tens of rows of a few hundred elements: microseconds of work) runs on the calling thread instead
// of opening a parallel region. A region costs a fork and a closing barrier; on a busy machine the barrier waits
// for a partner thread the OS has descheduled (measured under load: add_rms_norm 7.7 ms per call on two threads
// against 0.36 ms on one). Rows are independent, so the split never changes a result.
constexpr int64_t kParallelMinElems = 32768;
inline int64_t grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, kParallelMinElems / std::max<int64_t>(1, elems_per_row));
}

// Subnormal (denormal) floats on x86 cost a microcode assist of ~100+ cycles per instruction that produces or
// consumes one. Peaky attention makes them common: exp(score - max) for scores 87..104 below the row's max lands
// in fp32's subnormal range, and the P.V products and alpha rescales of such weights stay there. Measured on one
// Sapphire Rapids core (decode, 32 sequences x 512 keys, 12/4 heads, scores of std 30 vs 1): bf16 10.5 ms vs
// 1.15 ms, fp32 7.2 vs 1.65 ms; with the guard both 1.15 / 1.7 ms. The guard sets flush-to-zero (results) and denormals-are-zero (inputs) for the scope and restores
// the thread's previous mode on exit. It must be taken INSIDE each at::parallel_for body: MXCSR is per thread,
// and the OpenMP workers running the body are not the thread that called the op (nor do they inherit a mode
// set after the pool was created). A subnormal's value is below 2^-126: next to the terms it is summed with
// (a softmax row holds exp(0) = 1; activations are O(1)) it is far below one ulp, so flushing changes no result
// beyond what a different summation order would.
class FlushDenormalsScope {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormalsScope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
  ~FlushDenormalsScope() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtz = 0x8000, kDaz = 0x0040;  // MXCSR bits 15 and 6
  unsigned saved_;
#elif defined(__aarch64__)
  FlushDenormalsScope() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t fz = saved_ | (uint64_t(1) << 24);  // FPCR.FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fz));
  }
  ~FlushDenormalsScope() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#else
 public:
  FlushDenormalsScope() = default;  // no per-thread mode to set, and no assist penalty to avoid
#endif
  FlushDenormalsScope(const FlushDenormalsScope&) = delete;
  FlushDenormalsScope& operator=(const FlushDenormalsScope&) = delete;
};

// ---- scalar conversions (the c10 types round to nearest even, as torch's own kernels do) ----
template <typename T>
inline float to_f32(T x) { return static_cast<float>(x); }
template <typename T>
inline T from_f32(float x) { return static_cast<T>(x); }

// ---- row conversions ----
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}
template <>
inline void store_row<float>(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

#ifdef KVS_AVX512
inline __m512 bf16x16_to_f32(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

// fp32 -> bf16 with round-to-nearest-even and NaN -> 0x7fc0: the same bits as c10::BFloat16(float) (see below).
inline __m256i f32_to_bf16x16(__m512 f) {
#ifdef KVS_AVX512BF16
  // One instruction, round-to-nearest-even like the sequence below; it differs from c10's scalar conversion only
  // on subnormal inputs (flushed, as the ops' FlushDenormalsScope flushes them anyway) and on NaN payloads.
  return (__m256i)_mm512_cvtneps_pbh(f);
#else
  __m512i u = _mm512_castps_si512(f);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), f32_to_bf16x16(_mm512_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}
template <>
inline void load_row<c10::Half>(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void store_row<c10::Half>(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// exp(x) for fp32 lanes (Cephes polynomial after a two-constant ln2 range reduction; about 1 ulp). Lanes below
// ln(FLT_MIN) = -87.34 return 0 instead of a subnormal, so callers never see one whatever the thread's MXCSR
// (exp's true value there is < 2^-126, which vanishes next to the row's exp(0) = 1 it is summed with).
inline __m512 exp_ps(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365402f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(normal, y, n);
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

// 16 lanes of T, masked, widened to fp32 / rounded and narrowed from fp32: the same bits as load_row/store_row,
// so an element-wise op can work in registers in one pass instead of converting whole rows through scratch.
template <typename T>
inline __m512 load16(const T* p, __mmask16 m);
template <>
inline __m512 load16<float>(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p, __mmask16 m) {
  return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
template <typename T>
inline void store16(T* p, __m512 v, __mmask16 m);
template <>
inline void store16<float>(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, f32_to_bf16x16(v));
}
template <>
inline void store16<c10::Half>(c10::Half* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The same, all 16 lanes (no mask: a plain load, for hot loops over whole vectors).
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// v rounded to T and widened back (exact for float): what `to_f32(from_f32<T>(x))` does per lane.
template <typename T>
inline __m512 round_to(__m512 v);
template <>
inline __m512 round_to<float>(__m512 v) { return v; }
template <>
inline __m512 round_to<c10::BFloat16>(__m512 v) { return bf16x16_to_f32(f32_to_bf16x16(v)); }
template <>
inline __m512 round_to<c10::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif  // KVS_AVX512

// x[i] = exp(x[i] - sub); returns the sum of the results.
inline float exp_sub_sum(float* x, int64_t n, float sub) {
#ifdef KVS_AVX512
  __m512 vs = _mm512_set1_ps(sub), acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
    _mm512_mask_storeu_ps(x + i, m, e);
    acc = _mm512_mask_add_ps(acc, m, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] - sub;
    x[i] = d < -87.3365402f ? 0.f : std::exp(d);  // no subnormal results (see exp_ps)
    s += x[i];
  }
  return s;
#endif
}

inline float max_of(const float* x, int64_t n) {
#ifdef KVS_AVX512
  __m512 acc = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_max_ps(acc, _mm512_mask_loadu_ps(acc, tail_mask(n - i), x + i));
  return _mm512_reduce_max_ps(acc);
#else
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
#endif
}

inline float dot_f32(const float* a, const float* b, int64_t n) {
#ifdef KVS_AVX512
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
#endif
}

#ifdef KVS_AVX512BF16
// bf16 dot product with the AVX512-BF16 pair instruction; n must be a multiple of 32.
inline float dot_bf16(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + i + 32), (__m512bh)_mm512_loadu_si512(b + i + 32));
  }
  for (; i < n; i += 32)
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

// acc[0..d) = acc * alpha + sum_j p[j] * v[j][0..d)   (v: row pointers)
inline void scale_add_rows(float* acc, float alpha, const float* p, const float* const* v, int64_t nv, int64_t d) {
#ifdef KVS_AVX512
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t c = 0; c < d; c += 16) {
    __mmask16 m = tail_mask(d - c);
    __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + c), va);
    for (int64_t j = 0; j < nv; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_maskz_loadu_ps(m, v[j] + c), a);
    _mm512_mask_storeu_ps(acc + c, m, a);
  }
#else
  for (int64_t c = 0; c < d; ++c) {
    float a = acc[c] * alpha;
    for (int64_t j = 0; j < nv; ++j) a += p[j] * v[j][c];
    acc[c] = a;
  }
#endif
}

#ifdef KVS_AVX512
// The four lane-sums of a0..a3 as one __m128 (a transposing tree: 13 ops instead of 4 full reductions).
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  __m512 x0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  __m512 x1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  __m512 y = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x0), _mm512_castps_pd(x1))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x0), _mm512_castps_pd(x1))));
  __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

// Interleaves two rows of 32 16-bit values (two keys' 32 dims) into pairs per dim, AMX's B-operand ("VNNI") order:
// *lo = x0[0], x1[0], x0[1], x1[1], ... for dims 0-15, *hi the same for dims 16-31. V's tiles are built this way by
// the attention kernel (token-order caches) and by store_kv's write into the AMX block layout.
alignas(64) inline constexpr uint16_t kPairLoIdx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr uint16_t kPairHiIdx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
inline void interleave_pairs_epi16(__m512i x0, __m512i x1, __m512i* lo, __m512i* hi) {
  *lo = _mm512_permutex2var_epi16(x0, _mm512_load_si512(kPairLoIdx), x1);
  *hi = _mm512_permutex2var_epi16(x0, _mm512_load_si512(kPairHiIdx), x1);
}

// r[i] <- column i of the 16 x 16 matrix of 32-bit lanes whose rows are r[0..15] (unpack 32, unpack 64, then two
// rounds of 128-bit lane shuffles: 64 shuffles for 256 values, where gathering them would take 16 gathers).
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4q + c], 128-bit lane L: column 4L + c of rows 4q..4q+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c = lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

}  // namespace kvserve_cpu
