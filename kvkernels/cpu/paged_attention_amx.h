// The AMX (Advanced Matrix Extensions) path of the CPU paged attention, bf16 caches only: the work items that
// paged_attention.cpp builds and deals to its workers are run here with both matrix products on AMX tiles.
// See paged_attention_amx.cpp for the formulation and why.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace kvserve_cpu {

// One work item of the paged kernel: sequence `seq`, KV heads [h0, h1), query tokens [t0, t1) of the sequence's
// new tokens; `cost` orders the items longest first.
struct AttnItem {
  int32_t seq, h0, h1, t0, t1;
  int64_t cost;
};

// The paged kernel's operands, as raw pointers and element strides (see paged_attention.cpp for the layout).
struct AmxAttnArgs {
  const c10::BFloat16* q;
  const c10::BFloat16* k_cache;
  const c10::BFloat16* v_cache;
  c10::BFloat16* out;
  int64_t q_stride0, q_stride1, out_stride0, out_stride1;
  int64_t k_stride_block, k_stride_token, k_stride_head;
  int64_t v_stride_block, v_stride_token, v_stride_head;
  const int32_t* block_tables;
  int64_t block_tables_stride;
  const int32_t* seq_lens;
  const int32_t* cu_seqlens_q;
  int64_t group;  // query heads per KV head
  int64_t head_dim;
  int64_t block_size;
  float scale;
  bool packed;  // the caches are in the AMX block layout (below), not [block][token][KV head][D]
};

// The AMX block layout of a bf16 KV cache (store_kv / paged_attention with packed_kv): the cache tensors keep their
// shape [num_blocks, block_size, kv_heads, D] and every whole-block copy (swap, host and disk tiers, NIXL) stays
// valid, but the elements of one block are ordered per KV head as
//   K: [block_size / 16 key groups][D / 2 dim pairs][16 keys][2]    K^T in the pair-interleaved ("VNNI") B layout
//                                                                   of S = Q . K^T, one 16-key tile after another
//   V: [block_size / 2 key pairs][D][2]                             V in the B layout of O = P . V
// so both products load their tiles straight from the cache: the reordering is done once per token when it is
// stored, not on every step that reads it (vLLM's CPU attention prepacks its cache the same way), and both are read
// front to back (a decode is bound by memory: contiguous tiles let the hardware prefetchers stream them; K^T rows of
// the whole block, 4 * block_size bytes apart, ran 10-15% slower). The element of (block b, KV head h, key k of the
// block, dim d) is at
//   K: b * block_size * kv_heads * D + h * block_size * D + (k / 16) * 16 * D + (d / 2) * 32 + (k % 16) * 2 + d % 2
//   V: b * block_size * kv_heads * D + h * block_size * D + (k / 2) * 2 * D + 2 * d + k % 2
// It needs block_size % 16 == 0 and the shapes amx_attention_usable accepts; runtime/models/attention_cpu.py packs
// and unpacks it in torch for its fallbacks and tests.
inline int64_t packed_k_index(int64_t block_elems, int64_t block_size, int64_t D, int64_t b, int64_t h, int64_t k,
                              int64_t d) {
  return b * block_elems + h * block_size * D + (k / 16) * 16 * D + (d / 2) * 32 + (k % 16) * 2 + d % 2;
}
inline int64_t packed_v_index(int64_t block_elems, int64_t block_size, int64_t D, int64_t b, int64_t h, int64_t k,
                              int64_t d) {
  return b * block_elems + h * block_size * D + (k / 2) * 2 * D + 2 * d + k % 2;
}

// True when this build has the AMX path (compiled for AMX-BF16), the OS lets this process use the tile data
// (Linux arch_prctl ARCH_REQ_XCOMP_PERM, asked once) and the shapes fit it: head_dim a multiple of 32 (one tile
// row of bf16) up to 256, block_size a multiple of 16 (a 16-key tile never straddles two cache blocks).
bool amx_attention_usable(int64_t head_dim, int64_t block_size);

// ... and the AMX block layout on top: a V tile spans 32 keys of one block, or 16 when blocks are 16 keys.
inline bool amx_packed_kv_usable(int64_t head_dim, int64_t block_size) {
  return amx_attention_usable(head_dim, block_size) && (block_size == 16 || block_size % 32 == 0);
}

// Items with at least this many query rows per KV head (tokens x query heads per KV head) run on AMX; fewer stay
// on the AVX-512 kernel. Why: with few rows a tile product does little work per 16 keys, and the packing around it
// (Q^T, the S^T transpose, V pairs) costs about what the AVX-512 kernel spends. Measured on the 2-vCPU Sapphire
// Rapids (one thread, a decode step of 128 sequences of 201-241 keys, KV in L2, 8 layers; AMX vs AVX-512, ms):
// 3 rows (9/3 heads of 64, SmolLM2) 8.7 vs 9.1, and 73.0 vs 75.4 with each of 30 layers reading its own cache
// from memory (perf: both wait on the K and V rows' loads); 4 rows (8/2 of 128) 11.9 vs 14.6; 5 rows (20/4 of
// 64) 12.9 vs 19.2; 8 rows (16/2 of 128) 13.8 vs 27.0. Three rows stay on AVX-512: a 3-5% difference, on the
// kernel that has run them longest. Prefills run about 3x faster on AMX (docs/performance.md). On a cache in the
// AMX block layout (below) nothing is packed per step, and every item runs on AMX whatever its rows.
constexpr int64_t kAmxMinRowsPerKvHead = 4;

// The AMX kernel of one worker thread: scratch buffers and the thread's tile configuration live as long as it
// does (the destructor releases the tiles).
class AmxAttentionWorker {
 public:
  explicit AmxAttentionWorker(const AmxAttnArgs& args);
  ~AmxAttentionWorker();
  AmxAttentionWorker(const AmxAttentionWorker&) = delete;
  AmxAttentionWorker& operator=(const AmxAttentionWorker&) = delete;
  // Computes `item`'s rows of out; `next` (or null) is the worker's next item, whose first keys are prefetched.
  void run(const AttnItem& item, const AttnItem* next);

 private:
  const AmxAttnArgs& a_;
  int64_t configured_ = -1;  // the tile configuration loaded on this thread (4 * rows + layout), -1: none
  std::vector<uint16_t> q_rows_;  // [KV heads][rows][D]: the item's query rows, bf16, row-major
  std::vector<uint32_t> q_t_;     // one row group: [KV heads][D / 32][16 dim pairs][rows], Q^T in VNNI pairs
  std::vector<uint32_t> k_pack_;  // [keys / 16][D / 32][16 dim pairs][16 keys]: a chunk's K^T in VNNI pairs
  std::vector<float> m_, l_, acc_;  // per (KV head, query row): running max, sum, and [D] accumulator
  std::vector<uint16_t> v_pack_;    // [keys / 32][D / 16][16 key pairs][32]: a chunk's V in VNNI pairs
  std::vector<uint16_t> p_;         // [16 rows][chunk keys] bf16 probabilities
  std::vector<float> s_;            // [16 rows][chunk keys] scores
  std::vector<uint16_t> v_tail_;    // packed layout: the last V tile of a sequence, zero past its last key
};

}  // namespace kvserve_cpu
