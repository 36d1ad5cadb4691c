// Paged attention on CPU that reads K/V straight from the block table (no gather into contiguous tensors).
//
// Layout (the kvserve contract, see runtime/models/attention.py): k_cache / v_cache are
// [num_blocks, block_size, num_kv_heads, head_dim] (with packed_kv: the same shape in the AMX block layout of
// paged_attention_amx.h, read by the AMX path only); the step's tokens are one flat varlen batch (cu_seqlens_q);
// seq_lens counts the whole context including this step's tokens, which are already stored in the cache.
// A query at position p (= seq_len - q_len + i) sees keys 0..p.
//
// Work items are (sequence, tile of query tokens, KV heads: all of them, or one when items are scarce); the G
// query heads that share a KV head ride together, so each K/V row is read once per KV head and tile, and the
// next chunk's cache rows are prefetched. Items are sorted longest first and dealt round-robin to
// at::get_num_threads() workers (so each knows its next item and prefetches its first chunk). Per item: keys in chunks of kChunk
// (kChunkFewRows for items of up to kFewRows rows per KV head),
// scores in fp32, online softmax in fp32, P.V accumulated in fp32, one rounding to the output dtype.
// bf16 caches with head_dim % 32 == 0 compute Q.K with _mm512_dpbf16_ps when the compiler targets
// AVX512-BF16 (both operands are bf16 already, so the products are exact and only the summation order
// differs); other dtypes widen K to fp32 once per chunk. On CPUs with AMX, bf16 items with at least
// kAmxMinRowsPerKvHead query rows per KV head (prefills, extends, decodes of GQA groups >= 4) run both products on
// AMX tiles instead (paged_attention_amx.cpp), in longer query tiles (kMaxRowsAmx). Sequences whose q_len exceeds
// max_q_len, and fresh prefills (no cached prefix) longer than max_fresh_q_len (when >= 0), are skipped: the
// Python backend runs those through SDPA, where its GEMMs win.
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <vector>

#include "cpu_vec.h"
#include "paged_attention_amx.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kChunk = 64;     // keys per online-softmax step (and the size of the per-chunk buffers)
// ... for items of at most kFewRows query rows per KV head (decodes of small GQA groups): their work per key is small,
// and shorter chunks keep the prefetched next chunk (prefetch_span) close to its use. Measured on the 2-vCPU Sapphire
// Rapids (tools/attention_amx_ab.py decode, AVX-512 kernel, 30 layer caches, 16-key vs 64-key chunks, alternated
// builds): 1 row (12/12 heads of 64) 216 / 218 vs 236 / 227 ms, 3 rows (SmolLM2) 66 / 70 vs 73 / 72 ms; 4 and 8 rows
// level (106 vs 108, 153 vs 152); prefill chunks over a prefix 15-20% slower with 16 (so only decodes take it).
constexpr int64_t kChunkFewRows = 16;
constexpr int64_t kFewRows = 3;
inline int64_t chunk_keys(int64_t rows_per_kv_head) { return rows_per_kv_head <= kFewRows ? kChunkFewRows : kChunk; }
constexpr int64_t kMaxRows = 64;   // query rows (tokens x heads of one KV head) per work item
// ... on AMX: an item packs its keys' V rows once for all its rows, so longer tiles amortise that packing.
constexpr int64_t kMaxRowsAmx = 256;

using Item = AttnItem;

// Into L1 (prefetcht0): the next chunk's rows of one KV head (at most 64 keys x 2 x head_dim, 16 KB at head_dim 64)
// fit beside the current ones. Measured on the 2-vCPU Sapphire Rapids (tools/attention_amx_ab.py decode, SmolLM2's
// heads, 30 layer caches, alternated builds): 72.8 / 71.9 ms against 75.3 / 75.0 with prefetcht2; one burst of
// every head's rows at the first head (89 ms) or no prefetch (97 ms) is worse.
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// ---- register-blocked micro-kernels: R query rows (the heads of one token that share a KV head) at a time,
// so each K/V row is loaded, and widened, once per block instead of once per row. Per row, the arithmetic and
// its order are those of the row-at-a-time loops they replaced (Q.K: four keys per pass, one accumulator per key,
// dot_* for the tail; P.V: even and odd keys in two accumulator sets), so the results are bit-identical to them.
template <int R>
inline void qk_rows_f32(const float* const* q, const float* const* k, int64_t nk, int64_t d, float scale, float* sc,
                        int64_t sc_stride) {
  int64_t j = 0;
#ifdef KVS_AVX512
  for (; j + 4 <= nk; j += 4) {
    __m512 s[R][4];
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < 4; ++x) s[r][x] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = tail_mask(d - i);
      const __m512 k0 = _mm512_maskz_loadu_ps(m, k[j] + i), k1 = _mm512_maskz_loadu_ps(m, k[j + 1] + i);
      const __m512 k2 = _mm512_maskz_loadu_ps(m, k[j + 2] + i), k3 = _mm512_maskz_loadu_ps(m, k[j + 3] + i);
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_maskz_loadu_ps(m, q[r] + i);
        s[r][0] = _mm512_fmadd_ps(x, k0, s[r][0]);
        s[r][1] = _mm512_fmadd_ps(x, k1, s[r][1]);
        s[r][2] = _mm512_fmadd_ps(x, k2, s[r][2]);
        s[r][3] = _mm512_fmadd_ps(x, k3, s[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(sc + r * sc_stride + j, _mm_mul_ps(hsum4(s[r][0], s[r][1], s[r][2], s[r][3]), _mm_set1_ps(scale)));
  }
#endif
  for (; j < nk; ++j)
    for (int r = 0; r < R; ++r) sc[r * sc_stride + j] = dot_f32(q[r], k[j], d) * scale;
}

#ifdef KVS_AVX512BF16
template <int R>
inline void qk_rows_bf16(const c10::BFloat16* const* q, const c10::BFloat16* const* k, int64_t nk, int64_t d,
                         float scale, float* sc, int64_t sc_stride) {
  int64_t j = 0;
  for (; j + 4 <= nk; j += 4) {
    __m512 s[R][4];
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < 4; ++x) s[r][x] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k[j] + i), k1 = (__m512bh)_mm512_loadu_si512(k[j + 1] + i);
      const __m512bh k2 = (__m512bh)_mm512_loadu_si512(k[j + 2] + i), k3 = (__m512bh)_mm512_loadu_si512(k[j + 3] + i);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = (__m512bh)_mm512_loadu_si512(q[r] + i);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], x, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], x, k1);
        s[r][2] = _mm512_dpbf16_ps(s[r][2], x, k2);
        s[r][3] = _mm512_dpbf16_ps(s[r][3], x, k3);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(sc + r * sc_stride + j, _mm_mul_ps(hsum4(s[r][0], s[r][1], s[r][2], s[r][3]), _mm_set1_ps(scale)));
  }
  for (; j < nk; ++j)
    for (int r = 0; r < R; ++r) sc[r * sc_stride + j] = dot_bf16(q[r], k[j], d) * scale;
}
#endif

#ifdef KVS_AVX512
// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] * v[j] for R rows of head_dim 16 * NC, V read in the cache dtype and
// widened in registers (exact), even keys into one accumulator set and odd keys into another.
template <int R, int NC, typename T>
inline void pv_rows(float* acc, int64_t acc_stride, const float* alpha, const float* p, int64_t p_stride,
                    const T* const* v, int64_t nv) {
  __m512 a[R][NC], b[R][NC];
  for (int r = 0; r < R; ++r) {
    const __m512 va = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * acc_stride + 16 * c), va);
      b[r][c] = _mm512_setzero_ps();
    }
  }
  int64_t j = 0;
  for (; j + 2 <= nv; j += 2) {
    const T* v0 = v[j];
    const T* v1 = v[j + 1];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m512 x0 = load16<T>(v0 + 16 * c), x1 = load16<T>(v1 + 16 * c);
      for (int r = 0; r < R; ++r) {
        a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * p_stride + j]), x0, a[r][c]);
        b[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * p_stride + j + 1]), x1, b[r][c]);
      }
    }
  }
  if (j < nv) {
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m512 x0 = load16<T>(v[j] + 16 * c);
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * p_stride + j]), x0, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * acc_stride + 16 * c, _mm512_add_ps(a[r][c], b[r][c]));
}

// pv_rows for `rows` rows, in blocks of at most RMAX (registers: 2 * R * NC accumulators).
template <int RMAX, int NC, typename T>
inline void pv_block(float* acc, int64_t acc_stride, const float* alpha, const float* p, int64_t p_stride,
                     const T* const* v, int64_t nv, int64_t rows) {
  for (int64_t r = 0; r < rows;) {
    const int64_t n = std::min<int64_t>(RMAX, rows - r);
    float* a = acc + r * acc_stride;
    const float* pr = p + r * p_stride;
    if constexpr (RMAX >= 3) {
      if (n == 3) {
        pv_rows<3, NC, T>(a, acc_stride, alpha + r, pr, p_stride, v, nv);
        r += 3;
        continue;
      }
    }
    if constexpr (RMAX >= 2) {
      if (n == 2) {
        pv_rows<2, NC, T>(a, acc_stride, alpha + r, pr, p_stride, v, nv);
        r += 2;
        continue;
      }
    }
    pv_rows<1, NC, T>(a, acc_stride, alpha + r, pr, p_stride, v, nv);
    r += 1;
  }
}
#endif

template <typename T>
void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                    double scale_d, int64_t max_q_len, int64_t max_fresh_q_len, bool allow_amx, bool packed_kv) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bts = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const float scale = static_cast<float>(scale_d);
  // bf16 on a CPU with AMX: items with enough query rows run both products on tiles (paged_attention_amx.cpp).
  const bool use_amx =
      std::is_same<T, c10::BFloat16>::value && allow_amx && amx_attention_usable(head_dim, block_size);
  // The AMX block layout (paged_attention_amx.h) is read by the AMX path only, so every item takes it.
  TORCH_CHECK(!packed_kv || (use_amx && amx_packed_kv_usable(head_dim, block_size)),
              "paged_attention: a packed KV cache needs bf16, the AMX path and its shapes");
  AmxAttnArgs amx{};
  if (use_amx) {
    amx = {reinterpret_cast<const c10::BFloat16*>(qp), reinterpret_cast<const c10::BFloat16*>(kc),
           reinterpret_cast<const c10::BFloat16*>(vc), reinterpret_cast<c10::BFloat16*>(op), qs0, qs1, os0, os1, kb, kt,
           kh, vb, vt, vh, bt, bts, lens, cu, group, head_dim, block_size, scale, packed_kv};
  }
  const int64_t tile = std::max<int64_t>(1, (use_amx ? kMaxRowsAmx : kMaxRows) / group);
  const int64_t threads = at::get_num_threads();

  // Work items. A token's KV heads are adjacent in the cache, so an item takes all KV heads of its
  // (sequence, query tile) and streams whole cache rows; only when there are too few items to keep every
  // thread busy are the heads split across items.
  auto skipped = [&](int64_t q_len, int64_t ctx) {
    return q_len <= 0 || q_len > max_q_len || (max_fresh_q_len >= 0 && q_len == ctx && q_len > max_fresh_q_len);
  };
  int64_t tiles = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s];
    if (!skipped(q_len, lens[s])) tiles += (q_len + tile - 1) / tile;
  }
  const int64_t heads_per_item = tiles >= 4 * threads ? num_kv_heads : 1;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s], ctx = lens[s];
    if (skipped(q_len, ctx)) continue;
    TORCH_CHECK(ctx >= q_len, "paged_attention: seq_lens[", s, "] = ", ctx, " < q_len ", q_len);
    TORCH_CHECK((ctx + block_size - 1) / block_size <= block_tables.size(1), "paged_attention: block table too short");
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      const int64_t t1 = std::min(q_len, t0 + tile);
      const int64_t keys = ctx - q_len + t1;
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item)
        items.push_back({(int32_t)s, (int32_t)h, (int32_t)std::min(num_kv_heads, h + heads_per_item), (int32_t)t0,
                         (int32_t)t1, keys * (t1 - t0) * heads_per_item});
    }
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

#ifdef KVS_AVX512BF16
  constexpr bool kIsBf16 = std::is_same<T, c10::BFloat16>::value;
  const bool use_dpbf16 = kIsBf16 && head_dim % 32 == 0;
#else
  const bool use_dpbf16 = false;
#endif
  constexpr bool kIsF32 = std::is_same<T, float>::value;
#ifdef KVS_AVX512
  // P.V with V widened in registers, several rows per V load (head_dim 64 / 128); other sizes use the fp32 copy.
  const bool fast_pv = head_dim == 64 || head_dim == 128;
#else
  const bool fast_pv = false;
#endif
  const int64_t max_rows = tile * group * heads_per_item;

  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(threads, num_items);
  // Worker w takes items w, w + workers, ... (longest first), so it knows its next item and prefetches it.
  at::parallel_for(0, workers, 1, [&](int64_t wb, int64_t we) {
   const FlushDenormalsScope no_subnormals;  // per worker thread: see cpu_vec.h
   for (int64_t worker = wb; worker < we; ++worker) {
    std::optional<AmxAttentionWorker> amx_worker;  // built at this worker's first AMX item
    std::vector<float> qf(max_rows * head_dim), acc(max_rows * head_dim), kf(kChunk * head_dim),
        vf(kChunk * head_dim), m(max_rows), l(max_rows), sc(4 * kChunk);
    std::vector<const T*> qrow(max_rows), kbase(kChunk), vbase(kChunk), nkbase(kChunk), nvbase(kChunk), krow(kChunk),
        vrow(kChunk);
    // kb_out[j] / vb_out[j]: the cache rows (at KV head h0) of keys c .. c + n - 1 of a sequence.
    auto row_pointers = [&](const int32_t* table, int64_t h0, int64_t c, int64_t n, const T** kb_out,
                            const T** vb_out) {
      const T* kc_h0 = kc + h0 * kh;
      const T* vc_h0 = vc + h0 * vh;
      int64_t bi = c / block_size, off = c % block_size;  // one division per chunk, not per key
      for (int64_t j = 0; j < n; ++j, ++off) {
        if (off == block_size) {
          off = 0;
          ++bi;
        }
        const int64_t blk = table[bi];
        kb_out[j] = kc_h0 + blk * kb + off * kt;
        vb_out[j] = vc_h0 + blk * vb + off * vt;
      }
    };
    std::vector<const float*> kr32(kChunk), vr32(kChunk);
    for (int64_t it = worker; it < num_items; it += workers) {
      const Item& w = items[it];
      if (use_amx && (packed_kv || (w.t1 - w.t0) * group >= kAmxMinRowsPerKvHead)) {
        if (!amx_worker) amx_worker.emplace(amx);
        amx_worker->run(w, it + workers < num_items ? &items[it + workers] : nullptr);
        continue;
      }
      const int64_t s = w.seq, h0 = w.h0, h1 = w.h1, t0 = w.t0, t1 = w.t1;
      const int64_t q_len = cu[s + 1] - cu[s], ctx = lens[s], start = ctx - q_len, tok0 = cu[s];
      const int64_t rows_per_head = (t1 - t0) * group, rows = rows_per_head * (h1 - h0);
      // row r: head block hb = r / rows_per_head (KV head h0 + hb), token t0 + (r % rows_per_head) / group
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t hb = r / rows_per_head, rr = r % rows_per_head;
        const int64_t t = t0 + rr / group, head = (h0 + hb) * group + rr % group;
        qrow[r] = qp + (tok0 + t) * qs0 + head * qs1;
        if (!use_dpbf16) load_row<T>(qrow[r], qf.data() + r * head_dim, head_dim);
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.f);
      const int32_t* table = bt + s * bts;
      const int64_t key_end = start + t1;  // the last row sees keys < key_end
      const int64_t chunk = chunk_keys(rows_per_head);
      for (int64_t c0 = 0; c0 < key_end; c0 += chunk) {
        const int64_t n = std::min(chunk, key_end - c0);
        // This chunk's row pointers (computed as "next" during the previous chunk), then the next chunk's, whose
        // rows are prefetched a few at a time while this chunk computes (cache blocks sit anywhere).
        // On the last chunk, "next" is the first chunk of this worker's next item.
        const int64_t c1 = c0 + chunk;
        int64_t n1 = std::max<int64_t>(0, std::min(chunk, key_end - c1));
        if (c0 == 0) row_pointers(table, h0, 0, n, kbase.data(), vbase.data());
        else std::swap(kbase, nkbase), std::swap(vbase, nvbase);
        if (n1 > 0) {
          row_pointers(table, h0, c1, n1, nkbase.data(), nvbase.data());
        } else if (it + workers < num_items) {
          const Item& nx = items[it + workers];
          const int64_t ns = nx.seq, nq = cu[ns + 1] - cu[ns];
          n1 = std::min(chunk_keys((nx.t1 - nx.t0) * group), lens[ns] - nq + nx.t1);
          n1 = nx.h1 - nx.h0 == h1 - h0 ? n1 : 0;
          if (n1 > 0) row_pointers(bt + ns * bts, nx.h0, 0, n1, nkbase.data(), nvbase.data());
        }
        for (int64_t hb = 0; hb < h1 - h0; ++hb) {
          for (int64_t j = 0; j < n; ++j) {
            const T* kptr = kbase[j] + hb * kh;
            const T* vptr = vbase[j] + hb * vh;
            if (j < n1) {
              prefetch_span(nkbase[j] + hb * kh, head_dim * (int64_t)sizeof(T));
              prefetch_span(nvbase[j] + hb * vh, head_dim * (int64_t)sizeof(T));
            }
            krow[j] = kptr;
            vrow[j] = vptr;
            if constexpr (kIsF32) {
              kr32[j] = reinterpret_cast<const float*>(kptr);
              vr32[j] = reinterpret_cast<const float*>(vptr);
            } else {
              if (!use_dpbf16) {
                load_row<T>(kptr, kf.data() + j * head_dim, head_dim);
                kr32[j] = kf.data() + j * head_dim;
              }
              if (!fast_pv) {
                load_row<T>(vptr, vf.data() + j * head_dim, head_dim);
                vr32[j] = vf.data() + j * head_dim;
              }
            }
          }
          // The rows of one token (its query heads on this KV head) see the same keys: a block of them shares
          // every K and V row load.
          for (int64_t tok = 0; tok < t1 - t0; ++tok) {
            const int64_t nr = std::min(n, start + t0 + tok - c0 + 1);
            if (nr <= 0) continue;
            const int64_t r0 = hb * rows_per_head + tok * group;
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
              const int64_t rb = std::min<int64_t>(4, group - g0), rfirst = r0 + g0;
              float* scb = sc.data();  // rb rows of kChunk scores
#ifdef KVS_AVX512BF16
              if (use_dpbf16) {
                const c10::BFloat16* qb[4];
                for (int64_t x = 0; x < rb; ++x) qb[x] = reinterpret_cast<const c10::BFloat16*>(qrow[rfirst + x]);
                const c10::BFloat16* const* kb16 = reinterpret_cast<const c10::BFloat16* const*>(krow.data());
                switch (rb) {
                  case 4: qk_rows_bf16<4>(qb, kb16, nr, head_dim, scale, scb, kChunk); break;
                  case 3: qk_rows_bf16<3>(qb, kb16, nr, head_dim, scale, scb, kChunk); break;
                  case 2: qk_rows_bf16<2>(qb, kb16, nr, head_dim, scale, scb, kChunk); break;
                  default: qk_rows_bf16<1>(qb, kb16, nr, head_dim, scale, scb, kChunk);
                }
              } else
#endif
              {
                const float* qf32[4];
                for (int64_t x = 0; x < rb; ++x) qf32[x] = qf.data() + (rfirst + x) * head_dim;
                switch (rb) {
                  case 4: qk_rows_f32<4>(qf32, kr32.data(), nr, head_dim, scale, scb, kChunk); break;
                  case 3: qk_rows_f32<3>(qf32, kr32.data(), nr, head_dim, scale, scb, kChunk); break;
                  case 2: qk_rows_f32<2>(qf32, kr32.data(), nr, head_dim, scale, scb, kChunk); break;
                  default: qk_rows_f32<1>(qf32, kr32.data(), nr, head_dim, scale, scb, kChunk);
                }
              }
              float alpha[4];
              for (int64_t x = 0; x < rb; ++x) {
                const int64_t r = rfirst + x;
                float* scr = scb + x * kChunk;
                const float m_new = std::max(m[r], max_of(scr, nr));
                alpha[x] = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
                const float sum = exp_sub_sum(scr, nr, m_new);
                l[r] = l[r] * alpha[x] + sum;
                m[r] = m_new;
              }
              float* accb = acc.data() + rfirst * head_dim;
#ifdef KVS_AVX512
              if (fast_pv) {
                if (head_dim == 64)
                  pv_block<3, 4, T>(accb, head_dim, alpha, scb, kChunk, vrow.data(), nr, rb);
                else
                  pv_block<1, 8, T>(accb, head_dim, alpha, scb, kChunk, vrow.data(), nr, rb);
              } else
#endif
              {
                // Other head sizes, and builds without AVX-512: from the fp32 copy of the chunk's V rows.
                for (int64_t x = 0; x < rb; ++x)
                  scale_add_rows(accb + x * head_dim, alpha[x], scb + x * kChunk, vr32.data(), nr, head_dim);
              }
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t hb = r / rows_per_head, rr = r % rows_per_head;
        const int64_t t = t0 + rr / group, head = (h0 + hb) * group + rr % group;
        float* a = acc.data() + r * head_dim;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= inv;
        store_row<T>(a, op + (tok0 + t) * os0 + head * os1, head_dim);
      }
    }
   }
  });
}

}  // namespace

bool packed_kv_usable(int64_t head_dim, int64_t block_size) { return amx_packed_kv_usable(head_dim, block_size); }

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                     double scale, int64_t max_q_len, int64_t max_fresh_q_len, bool allow_amx, bool packed_kv) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "paged_attention: q, out and the caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "paged_attention: float32, bfloat16 or float16 only");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_attention: the head dim must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "paged_attention: head shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_seqlens_q.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous() && cu_seqlens_q.is_contiguous(),
              "paged_attention: block_tables / seq_lens / cu_seqlens_q must be int32");
  TORCH_CHECK(cu_seqlens_q.size(0) == seq_lens.size(0) + 1, "paged_attention: cu_seqlens_q size");
  KVS_DISPATCH(q.scalar_type(), "kvserve_paged_attention", [&] {
    attention_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len,
                             max_fresh_q_len, allow_amx, packed_kv);
  });
}

}  // namespace kvserve_cpu
