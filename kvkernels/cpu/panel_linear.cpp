// fp32 linears for the row counts of decode steps: out[M, N] = x[M, K] . W[N, K]^T (+ bias) with W kept in
// panels of 32 output columns, panels[N / 32][K][32] (zero-padded past N), so each k step reads one contiguous
// 128-byte line pair of weights.
//
// Why a kernel of our own: at a few to a hundred rows the weights are read once per step from memory, and oneDNN's
// fp32 GEMM on its prepacked weight does not overlap that stream with its arithmetic: on the 2-core Sapphire
// Rapids, SmolLM2's 120 projections (425 MB) at 24 rows took 29.8 ms per pass, about the sum of reading the bytes
// (14.6 ms) and of the arithmetic on weights in cache (14.7 ms). This kernel prefetches the weights into L2 about
// 16 KB ahead of its FMAs (software prefetch: the hardware streamer alone lags as soon as the core is busy), which
// overlaps the two: 21.8 ms (tools/panel_linear_ab.py; the table for 1-2048 rows is in docs/performance.md).
//
// Numerics: every output is one sequential fused multiply-add chain over k = 0..K-1 from 0, plus the bias in one
// final add, whatever M, the row blocking or the thread split: a row's result does not depend on what else is in
// the batch. The scalar path computes the same chain (std::fma), so both paths give the same bits. Subnormal inputs
// read as zero and subnormal results flush to zero (FlushDenormalsScope, the rule of every compiled op here).
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kPanel = 32;  // output columns per panel: two 16-float vectors
constexpr int kMaxBlockRows = 12;  // 12 rows x 2 vectors = 24 accumulators of the 32 zmm registers
// Prefetch distance: 128 k steps of 128 bytes (16 KB) ahead, into L2. 64-256 steps measured within a few percent.
constexpr int64_t kPrefetchSteps = 128;
constexpr int64_t kMinBytesPerThread = 256 * 1024;

#ifdef KVS_AVX512
// rows x 32 outputs of one panel. prefetch: the first row block of a panel brings the weights ahead of use; the
// later blocks find them in L2.
template <int R>
void block(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
           int64_t cols, bool prefetch) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = panel + k * kPanel;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchSteps * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchSteps * kPanel + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    _mm512_mask_storeu_ps(yr, m0, bias != nullptr ? _mm512_add_ps(acc[r][0], b0) : acc[r][0]);
    _mm512_mask_storeu_ps(yr + 16, m1, bias != nullptr ? _mm512_add_ps(acc[r][1], b1) : acc[r][1]);
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, bool);
constexpr BlockFn kBlocks[kMaxBlockRows + 1] = {nullptr,   block<1>, block<2>, block<3>,  block<4>,  block<5>, block<6>,
                                                block<7>, block<8>, block<9>, block<10>, block<11>, block<12>};
#endif

// The scalar chain, the same operations in the same order as the vector path.
[[maybe_unused]] void panel_scalar(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                                   float* y, int64_t ldy, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * ldx + k], panel[k * kPanel + j], acc);
      y[r * ldy + j] = bias != nullptr ? acc + bias[j] : acc;
    }
}

}  // namespace

bool panel_linear_native() {
#ifdef KVS_AVX512
  return true;
#else
  return false;
#endif
}

void panel_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "panel_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel,
              "panel_linear: x [M, K], out [M, N], panels [ceil(N / 32), K, 32]");
  TORCH_CHECK(panels.is_contiguous() && out.is_contiguous() && x.stride(1) == 1,
              "panel_linear: panels and out contiguous, x rows contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = panels.size(0);
  TORCH_CHECK(out.size(0) == M && panels.size(1) == K && P == (N + kPanel - 1) / kPanel,
              "panel_linear: shapes do not match (x ", x.sizes(), ", panels ", panels.sizes(), ", out ", out.sizes(),
              ")");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "panel_linear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Row blocks of near-equal size (13 rows: 7 + 6, not 12 + 1): each keeps a good ratio of FMAs to loads.
  const int64_t nblocks = (M + kMaxBlockRows - 1) / kMaxBlockRows;
  // Threads split the panels: contiguous runs, so each thread's weights are one sequential stream. At least
  // kMinBytesPerThread of weights per thread: a small linear runs on the calling thread instead of paying for a
  // parallel region (cpu_vec.h's grain_rows says what one costs on a busy machine).
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / (K * kPanel * int64_t(sizeof(float))));
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    FlushDenormalsScope ftz;  // a subnormal product would cost a microcode assist (cpu_vec.h)
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * kPanel;
      const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
      const float* bp = b != nullptr ? b + p * kPanel : nullptr;
      int64_t m = 0;
      for (int64_t i = 0; i < nblocks; ++i) {
        const int64_t rows = M / nblocks + (i < M % nblocks ? 1 : 0);
        float* y = yp + m * N + p * kPanel;
#ifdef KVS_AVX512
        kBlocks[rows](xp + m * ldx, ldx, panel, K, bp, y, N, cols, i == 0);
#else
        panel_scalar(xp + m * ldx, ldx, panel, K, bp, y, N, rows, cols);
#endif
        m += rows;
      }
    }
  });
}

}  // namespace kvserve_cpu
