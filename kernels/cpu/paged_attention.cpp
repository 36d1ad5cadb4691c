// Paged attention on CPU that reads K/V straight from the block table (no gather into contiguous tensors).
//
// Layout (the kvserve contract, see runtime/models/attention.py): k_cache / v_cache are
// [num_blocks, block_size, num_kv_heads, head_dim]; the step's tokens are one flat varlen batch (cu_seqlens_q);
// seq_lens counts the whole context including this step's tokens, which are already stored in the cache.
// A query at position p (= seq_len - q_len + i) sees keys 0..p.
//
// Work items are (sequence, KV head, tile of query tokens); the G query heads that share a KV head ride in
// the same item, so each K/V row is read once per KV head and tile. Items are sorted longest first and
// pulled from one atomic counter by at::get_num_threads() workers. Per item: keys in chunks of kChunk,
// scores in fp32, online softmax in fp32, P.V accumulated in fp32, one rounding to the output dtype.
// bf16 caches with head_dim % 32 == 0 compute Q.K with _mm512_dpbf16_ps when the compiler targets
// AVX512-BF16 (both operands are bf16 already, so the products are exact and only the summation order
// differs); other dtypes widen K to fp32 once per chunk. Sequences whose q_len exceeds max_q_len are
// skipped (the Python backend runs those long prefills through SDPA, where GEMMs win).
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu_vec.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kChunk = 64;     // keys per online-softmax step
constexpr int64_t kMaxRows = 64;   // query rows (tokens x heads of one KV head) per work item

struct Item {
  int32_t seq, kv_head, t0, t1;
  int64_t cost;
};

template <typename T>
void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                    double scale_d, int64_t max_q_len) {
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
  const int64_t tile = std::max<int64_t>(1, kMaxRows / group);
  const int64_t max_rows = tile * group;

  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s], ctx = lens[s];
    if (q_len <= 0 || q_len > max_q_len) continue;
    TORCH_CHECK(ctx >= q_len, "paged_attention: seq_lens[", s, "] = ", ctx, " < q_len ", q_len);
    TORCH_CHECK((ctx + block_size - 1) / block_size <= block_tables.size(1), "paged_attention: block table too short");
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      const int64_t t1 = std::min(q_len, t0 + tile);
      const int64_t keys = ctx - q_len + t1;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({(int32_t)s, (int32_t)h, (int32_t)t0, (int32_t)t1, keys * (t1 - t0)});
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

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(max_rows * head_dim), acc(max_rows * head_dim), kf(kChunk * head_dim),
        vf(kChunk * head_dim), m(max_rows), l(max_rows), sc(kChunk);
    std::vector<const T*> qrow(max_rows);
    std::vector<const T*> krow(kChunk);
    std::vector<const float*> kr32(kChunk), vr32(kChunk);
    for (int64_t it = next.fetch_add(1); it < num_items; it = next.fetch_add(1)) {
      const Item& w = items[it];
      const int64_t s = w.seq, h = w.kv_head, t0 = w.t0, t1 = w.t1;
      const int64_t q_len = cu[s + 1] - cu[s], ctx = lens[s], start = ctx - q_len, tok0 = cu[s];
      const int64_t rows = (t1 - t0) * group;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / group, head = h * group + r % group;
        qrow[r] = qp + (tok0 + t) * qs0 + head * qs1;
        if (!use_dpbf16) load_row<T>(qrow[r], qf.data() + r * head_dim, head_dim);
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.f);
      const int32_t* table = bt + s * bts;
      const int64_t key_end = start + t1;  // the last row sees keys < key_end
      for (int64_t c0 = 0; c0 < key_end; c0 += kChunk) {
        const int64_t n = std::min(kChunk, key_end - c0);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t pos = c0 + j, blk = table[pos / block_size], off = pos % block_size;
          const T* kptr = kc + blk * kb + off * kt + h * kh;
          const T* vptr = vc + blk * vb + off * vt + h * vh;
          if constexpr (kIsF32) {
            kr32[j] = reinterpret_cast<const float*>(kptr);
            vr32[j] = reinterpret_cast<const float*>(vptr);
          } else {
            krow[j] = kptr;
            if (!use_dpbf16) {
              load_row<T>(kptr, kf.data() + j * head_dim, head_dim);
              kr32[j] = kf.data() + j * head_dim;
            }
            load_row<T>(vptr, vf.data() + j * head_dim, head_dim);
            vr32[j] = vf.data() + j * head_dim;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t qpos = start + t0 + r / group;
          const int64_t nr = std::min(n, qpos - c0 + 1);
          if (nr <= 0) continue;
#ifdef KVS_AVX512BF16
          if (use_dpbf16) {
            const c10::BFloat16* qb = reinterpret_cast<const c10::BFloat16*>(qrow[r]);
            for (int64_t j = 0; j < nr; ++j)
              sc[j] = dot_bf16(qb, reinterpret_cast<const c10::BFloat16*>(krow[j]), head_dim) * scale;
          } else
#endif
          {
            const float* qr = qf.data() + r * head_dim;
            for (int64_t j = 0; j < nr; ++j) sc[j] = dot_f32(qr, kr32[j], head_dim) * scale;
          }
          const float m_new = std::max(m[r], max_of(sc.data(), nr));
          const float alpha = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
          const float sum = exp_sub_sum(sc.data(), nr, m_new);
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
          scale_add_rows(acc.data() + r * head_dim, alpha, sc.data(), vr32.data(), nr, head_dim);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / group, head = h * group + r % group;
        float* a = acc.data() + r * head_dim;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= inv;
        store_row<T>(a, op + (tok0 + t) * os0 + head * os1, head_dim);
      }
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                     double scale, int64_t max_q_len) {
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
    attention_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len);
  });
}

}  // namespace kvserve_cpu
