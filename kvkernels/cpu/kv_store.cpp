// Writes this step's K/V rows into their paged-cache slots (the separate, tiny half of the KV write; the
// attention op then reads them from the cache like every other key). Parallel over tokens. With packed_kv the rows
// are scattered into the AMX block layout (paged_attention_amx.h): K by dim pairs, V by key pairs.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstring>

#include "cpu_vec.h"
#include "paged_attention_amx.h"

namespace kvserve_cpu {

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping, bool packed_kv) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "store_kv: bad ranks");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "store_kv: k/v must have the cache dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "store_kv: contiguous head dim / cache required");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "store_kv: int64 slots");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  TORCH_CHECK(k_cache.size(2) == heads && k_cache.size(3) == head_dim && slot_mapping.size(0) == tokens,
              "store_kv: shapes");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t elt = k.element_size(), row = head_dim * elt;
  const int64_t ks0 = k.stride(0) * elt, ks1 = k.stride(1) * elt, vs0 = v.stride(0) * elt, vs1 = v.stride(1) * elt;
  const int64_t slot_bytes = heads * row;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "store_kv: slot ", slots[t], " out of range (", num_slots, " slots)");
  if (packed_kv) {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && head_dim % 2 == 0 &&
                    k_cache.size(1) % 16 == 0,
                "store_kv: the packed layout takes bf16 caches with an even head_dim and a block_size of 16s");
    const int64_t bs = k_cache.size(1), block_elems = bs * heads * head_dim;
    const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
    const uint16_t* k16 = static_cast<const uint16_t*>(k.data_ptr());
    const uint16_t* v16 = static_cast<const uint16_t*>(v.data_ptr());
    uint16_t* kc16 = static_cast<uint16_t*>(k_cache.data_ptr());
    uint16_t* vc16 = static_cast<uint16_t*>(v_cache.data_ptr());
#ifdef KVS_AVX512
    // A decode's token: its K dim pairs go 16 dwords (one 64-byte tile row) apart.
    const __m512i pair_offsets =
        _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
#endif
    at::parallel_for(0, tokens, grain_rows(2 * heads * head_dim), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e;) {
        const int64_t slot = slots[t];
        if (slot < 0) {
          ++t;
          continue;
        }
        const int64_t blk = slot / bs, off = slot % bs;
#ifdef KVS_AVX512
        // 16 tokens filling keys off .. off + 15 of one block (a prefill's run of slots): K^T by 16 x 16 transposes
        // of dim pairs and V by interleaving pairs of rows, whole 64-byte lines instead of 2- and 4-byte stores.
        bool run16 = off % 16 == 0 && head_dim % 32 == 0 && t + 16 <= e;
        for (int64_t i = 1; run16 && i < 16; ++i) run16 = slots[t + i] == slot + i;
        if (run16) {
          for (int64_t h = 0; h < heads; ++h) {
            for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
              __m512i r[16];
              for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k16 + (t + i) * k0 + h * k1 + d0);
              transpose16x16_epi32(r);  // r[p]: dim pair d0 / 2 + p of the 16 tokens
              uint16_t* kd = kc16 + packed_k_index(block_elems, bs, head_dim, blk, h, off, d0);
              for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kd + p * 32, r[p]);
              for (int64_t i = 0; i < 16; i += 2) {
                const __m512i x0 = _mm512_loadu_si512(v16 + (t + i) * v0 + h * v1 + d0);
                const __m512i x1 = _mm512_loadu_si512(v16 + (t + i + 1) * v0 + h * v1 + d0);
                uint16_t* vd = vc16 + packed_v_index(block_elems, bs, head_dim, blk, h, off + i, d0);
                __m512i lo, hi;
                interleave_pairs_epi16(x0, x1, &lo, &hi);
                _mm512_storeu_si512(vd, lo);
                _mm512_storeu_si512(vd + 32, hi);
              }
            }
          }
          t += 16;
          continue;
        }
        // One token (a decode): K's dim pairs scattered 64 bytes apart, V's dims widened into every
        // other 16-bit lane and written under a mask that keeps the pair's other key.
        if (head_dim % 32 == 0) {
          const __mmask32 lane = off % 2 ? 0xAAAAAAAAu : 0x55555555u;
          for (int64_t h = 0; h < heads; ++h) {
            const uint16_t* ks = k16 + t * k0 + h * k1;
            const uint16_t* vs = v16 + t * v0 + h * v1;
            uint16_t* kd = kc16 + packed_k_index(block_elems, bs, head_dim, blk, h, off, 0);
            uint16_t* vd = vc16 + packed_v_index(block_elems, bs, head_dim, blk, h, off - off % 2, 0);
            for (int64_t d0 = 0; d0 < head_dim; d0 += 32)
              _mm512_i32scatter_epi32(kd + d0 * 16, pair_offsets, _mm512_loadu_si512(ks + d0), 4);
            for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
              __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vs + d0)));
              if (off % 2) x = _mm512_slli_epi32(x, 16);
              _mm512_mask_storeu_epi16(vd + 2 * d0, lane, x);
            }
          }
          ++t;
          continue;
        }
#endif
        for (int64_t h = 0; h < heads; ++h) {
          const uint16_t* ks = k16 + t * k0 + h * k1;
          const uint16_t* vs = v16 + t * v0 + h * v1;
          uint16_t* kd = kc16 + packed_k_index(block_elems, bs, head_dim, blk, h, off, 0);
          uint16_t* vd = vc16 + packed_v_index(block_elems, bs, head_dim, blk, h, off, 0);
          for (int64_t d = 0; d < head_dim; d += 2) std::memcpy(kd + d * 16, ks + d, 4);  // dims d, d + 1: a pair
          for (int64_t d = 0; d < head_dim; ++d) vd[2 * d] = vs[d];
        }
        ++t;
      }
    });
    return;
  }
  at::parallel_for(0, tokens, grain_rows(2 * heads * head_dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(kc + slot * slot_bytes + h * row, kp + t * ks0 + h * ks1, row);
        std::memcpy(vc + slot * slot_bytes + h * row, vp + t * vs0 + h * vs1, row);
      }
    }
  });
}

}  // namespace kvserve_cpu
