// The AMX path of the CPU paged attention (bf16 caches): Q.K^T and P.V on AMX tiles instead of AVX-512 dot
// products. Why: a tile product does a 16 x 16 x 32 block in one instruction and needs no horizontal sums; on the
// 2-vCPU Sapphire Rapids, one thread, SmolLM2's heads, 8 prompts of 32-320 tokens take 68 ms on AMX against 204 ms
// on the AVX-512 kernel and 150 ms in torch's SDPA, prefill chunks over a cached prefix 154 vs 484 ms, one
// 1024-token prompt 138 ms against SDPA's 164 (tools/attention_amx_ab.py, docs/performance.md). Items with few query
// rows per KV head stay on AVX-512 (kAmxMinRowsPerKvHead in the header says why).
//
// Per work item (sequence, query tokens, KV heads) and KV head, the item's query rows (tokens x the G heads that
// share the KV head) go in groups of up to 16 rows (a tile's height), over the keys in chunks of kChunkKeys with an
// online softmax between chunks:
// * scores: S[n rows x 16 keys] = Q[n x D] . K^T. Q is the tile's A operand, its rows copied once per item into a
//   row-major buffer (the rows of a GQA group are not evenly spaced in q); K^T is the B operand, packed once per
//   chunk and KV head into AMX's pair-interleaved ("VNNI") layout by a 16 x 16 transpose of 32-bit key pairs in
//   registers. Every row group of the item reuses the packed chunk, and the S tile is stored straight into the
//   per-row score lines. An item of one row group (a decode, a short extend) reuses nothing, so it computes
//   S^T = K . Q^T instead: K is the A operand loaded straight from the cache, Q^T is packed once, and each S^T tile
//   is transposed back in registers (one transpose per 16 keys instead of D / 32). (The first version did that for
//   every item, reading S^T back with gathers; the gathers and Q^T's scalar packing were a third of its prefill
//   time in perf.)
// * softmax in fp32 per row (max, exp, sum, the online rescale), keys past the row's causal limit never enter it;
//   the probabilities are rounded to bf16 for the second product (as torch's own CPU flash attention does).
// * O[n rows x D] += P[n x 32 keys] . V[32 keys x D]: P is the A operand as written; V is the B operand, packed per
//   chunk into pairs of key rows interleaved per dimension (one permute per 32 values), zero past the last key
//   (0 x garbage could be NaN). The product of a chunk lands in tiles, is stored and added to the fp32
//   accumulator with the chunk's alpha, so only the accumulate order differs from the AVX-512 kernel.
// Tiles are per thread: each worker loads its configuration when it starts (oneDNN's GEMMs on the same thread
// load their own) and releases the tiles when it is done.
#include "paged_attention_amx.h"

#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(KVS_AVX512BF16) && defined(__linux__)
#define KVS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <utility>
#include <vector>

namespace kvserve_cpu {

#ifdef KVS_AMX
namespace {

constexpr int64_t kChunkKeys = 256;  // keys per online-softmax step (a multiple of 32)
constexpr int64_t kTileRows = 16;
constexpr int64_t kMaxHeadDim = 256;

// Tile registers: the configuration below gives each operand its own, so one configuration serves both products.
// The asm wrappers are ours rather than GCC's _tile_* macros because those declare no memory effect for
// tileloadd / ldtilecfg, which would let the compiler move our packing stores past the loads that read them.
#define KVS_TILE_LOAD(t, base, stride_bytes) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(base)), "r"((long)(stride_bytes)) : "memory")
#define KVS_TILE_STORE(t, base, stride_bytes) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void*)(base)), "r"((long)(stride_bytes)) : "memory")
#define KVS_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define KVS_TILE_DP_BF16(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
// tmm0: S (n rows x 16 keys fp32)   tmm1: Q (n rows x 32 dims bf16)   tmm2: K^T (16 dim pairs x 16 keys, interleaved)
// tmm3: P (n rows x 32 keys)          tmm4: V (16 key pairs x 16 dims, interleaved)
// tmm5, tmm6, tmm7 and (after the scores) tmm0: O (n x 16 dims each). One row group, and the packed cache with
// 16-key blocks: see load_tile_config.

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

enum TileLayout : int64_t { kRowsLayout = 0, kTransposedLayout = 1, kPacked16Layout = 2 };

// n: the row group's rows; layout: S = Q . K^T with 32-key V tiles (also the packed cache with blocks of 32+ keys),
// the one-group layout (S^T = K . Q^T, see run()), or the packed cache with 16-key blocks (16-key P and V tiles).
void load_tile_config(int64_t n, TileLayout layout) {
  const bool transposed = layout == kTransposedLayout;
  TileConfig c{};
  c.palette_id = 1;
  auto set = [&](int t, int64_t rows, int64_t colsb) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = static_cast<uint16_t>(colsb);
  };
  if (transposed) {  // tmm0: S^T (16 keys x n), tmm1: K (16 keys x 32 dims; also V), tmm2: Q^T (16 pairs x n)
    set(0, kTileRows, 4 * n);
    set(1, kTileRows, 64);
    set(2, kTileRows, 4 * n);
  } else {
    set(0, n, 64);
    set(1, n, 64);
    set(2, kTileRows, 64);
  }
  const int64_t v_keys = layout == kPacked16Layout ? 16 : 32;  // keys per P.V product
  set(3, n, 2 * v_keys);
  set(4, v_keys / 2, 64);
  if (layout == kPacked16Layout) {  // tmm7 takes every other V tile (32-dim passes: tmm5 and tmm6 accumulate)
    set(5, n, 64);
    set(6, n, 64);
    set(7, v_keys / 2, 64);
    __asm__ volatile("ldtilecfg %0" ::"m"(c) : "memory");
    return;
  }
  set(5, n, 64);
  set(6, n, 64);
  set(7, n, 64);
  __asm__ volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

bool request_amx_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool amx_attention_usable(int64_t head_dim, int64_t block_size) {
  static const bool permitted = request_amx_permission();
  return permitted && head_dim % 32 == 0 && head_dim <= kMaxHeadDim && block_size % kTileRows == 0;
}

// Walks the cache rows of one sequence's keys in order: the block table is read once per block, not divided per key.
struct RowWalker {
  const int32_t* table = nullptr;
  int64_t block_size = 0, block = 0, offset = 0;
  void start(const int32_t* t, int64_t bs, int64_t key) {
    table = t, block_size = bs, block = key / bs, offset = key % bs;
  }
  // (physical block, row in block) of the current key, then advances.
  std::pair<int64_t, int64_t> next() {
    if (offset == block_size) offset = 0, ++block;
    return {table[block], offset++};
  }
};

AmxAttentionWorker::AmxAttentionWorker(const AmxAttnArgs& args) : a_(args) {
  if (args.packed) {
    v_tail_.resize(kTileRows * 2 * args.head_dim);
  } else {
    v_pack_.resize((kChunkKeys / 32) * (args.head_dim / 16) * kTileRows * 32);
    k_pack_.resize((kChunkKeys / kTileRows) * (args.head_dim / 32) * kTileRows * kTileRows);
  }
  p_.assign(kTileRows * kChunkKeys, 0);
  s_.resize(kTileRows * kChunkKeys);
}

AmxAttentionWorker::~AmxAttentionWorker() {
  if (configured_ >= 0) __asm__ volatile("tilerelease" ::);
}

void AmxAttentionWorker::run(const AttnItem& item, const AttnItem* next) {
  const AmxAttnArgs& a = a_;
  const int64_t D = a.head_dim, G = a.group, slices = D / 32, dtiles = D / 16;
  alignas(64) float o[kTileRows * 64];  // one pass of the P.V tiles: [16 rows][64 dims]
  const int64_t head_bytes = D * 2;
  auto key_end_of = [&](const AttnItem& x) {
    return a.seq_lens[x.seq] - (a.cu_seqlens_q[x.seq + 1] - a.cu_seqlens_q[x.seq]) + x.t1;
  };
  const int64_t s = item.seq, t0 = item.t0, t1 = item.t1, h0 = item.h0, heads = item.h1 - item.h0;
  const int64_t q_len = a.cu_seqlens_q[s + 1] - a.cu_seqlens_q[s], ctx = a.seq_lens[s];
  const int64_t start = ctx - q_len, tok0 = a.cu_seqlens_q[s];
  const int64_t rows = (t1 - t0) * G, groups = (rows + kTileRows - 1) / kTileRows;
  const int64_t key_end = start + t1;  // the item's last row sees keys < key_end
  const int32_t* table = a.block_tables + s * a.block_tables_stride;
  // Per (KV head hb, row r): row r is token t0 + r / G, query head (h0 + hb) * G + r % G.
  // One row group (decodes, short extends): S^T = K . Q^T, with K the A operand loaded straight from the cache and
  // Q^T (B) packed here, one 16 x 16 transpose per 32-dim slice; S^T is transposed back per 16 keys. Packing K^T
  // instead, as the multi-group layout does, costs D / 32 transposes per 16 keys where this costs one: measured on
  // decodes (tools/attention_amx_ab.py decode --kv-in-l2), the multi-group layout lost most of AMX's lead there.
  // More groups (prefills) share each packed K^T chunk, so they take S = Q . K^T with Q rows copied as they are.
  // The packed cache (AmxAttnArgs::packed) holds K^T and V in tile layout already: every item takes S = Q . K^T
  // and loads both B operands straight from the cache, whatever its rows.
  const bool packed = a.packed, transposed = !packed && groups == 1;
  const int64_t bs = a.block_size, head_elems = bs * D;  // packed: one KV head's K (or V) in a block
  const int64_t v_keys = packed ? std::min<int64_t>(32, bs) : 32;  // keys per P.V product
  const TileLayout layout = transposed ? kTransposedLayout : v_keys == 16 ? kPacked16Layout : kRowsLayout;
  auto q_row = [&](int64_t hb, int64_t r) {
    return a.q + (tok0 + t0 + r / G) * a.q_stride0 + ((h0 + hb) * G + r % G) * a.q_stride1;
  };
  if (transposed) {
    q_t_.resize(heads * slices * kTileRows * rows);
    const __mmask16 row_mask = static_cast<__mmask16>((1u << rows) - 1u);
    for (int64_t hb = 0; hb < heads; ++hb)
      for (int64_t sl = 0; sl < slices; ++sl) {
        __m512i r[16];
        for (int64_t j = 0; j < kTileRows; ++j)
          r[j] = j < rows ? _mm512_loadu_si512(q_row(hb, j) + 32 * sl) : _mm512_setzero_si512();
        transpose16x16_epi32(r);  // r[pair] = that dim pair of every row
        uint32_t* dst = q_t_.data() + (hb * slices + sl) * kTileRows * rows;
        for (int64_t pr = 0; pr < kTileRows; ++pr) _mm512_mask_storeu_epi32(dst + pr * rows, row_mask, r[pr]);
      }
  } else {
    q_rows_.resize(heads * rows * D);
    for (int64_t hb = 0; hb < heads; ++hb)
      for (int64_t r = 0; r < rows; ++r) {
        const c10::BFloat16* qr = q_row(hb, r);
        uint16_t* dst = q_rows_.data() + (hb * rows + r) * D;
        for (int64_t d = 0; d < D; d += 32) _mm512_storeu_si512(dst + d, _mm512_loadu_si512(qr + d));
      }
  }
  // v_tail_ <- the V tile of keys key .. key + v_keys - 1 of one KV head (src: its first key pair in the packed
  // cache), keys from `valid` on zero.
  auto fill_v_tail = [&](const c10::BFloat16* src, int64_t valid) {
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(src);
    for (int64_t pr = 0; pr < v_keys / 2; ++pr) {
      uint16_t* dst = v_tail_.data() + pr * 2 * D;
      for (int64_t e = 0; e < 2 * D; e += 32) {
        // element 2d + x is key 2 * pr + x's dim d: a mask of the even lanes keeps only key 2 * pr
        const __mmask32 keep = 2 * pr + 1 < valid ? 0xFFFFFFFFu : 2 * pr < valid ? 0x55555555u : 0u;
        _mm512_storeu_si512(dst + e, _mm512_maskz_loadu_epi16(keep, sp + pr * 2 * D + e));
      }
    }
  };
  m_.assign(heads * rows, kNegInf);
  l_.assign(heads * rows, 0.f);
  acc_.assign(heads * rows * D, 0.f);

  for (int64_t c0 = 0; c0 < key_end; c0 += kChunkKeys) {
    const int64_t nk = std::min(kChunkKeys, key_end - c0), nk32 = (nk + 31) / 32 * 32;
    // The next chunk of keys (this item's, else the first of this worker's next item) is fetched into L2 while
    // this one computes, a few rows per row of V packed: a tile load waits for all its 16 rows, so without it
    // every 16 keys would wait a memory latency. Row by row rather than all at once: a burst of prefetches
    // would fill the line-fill buffers and stall the core instead.
    RowWalker pf;
    int64_t pf_left = 0, pf_h0 = 0, pf_heads = 0;
    if (c0 + kChunkKeys < key_end) {
      pf.start(table, a.block_size, c0 + kChunkKeys);
      pf_left = std::min(kChunkKeys, key_end - c0 - kChunkKeys), pf_h0 = h0, pf_heads = heads;
    } else if (next != nullptr) {
      const AttnItem& nx = *next;
      pf.start(a.block_tables + nx.seq * a.block_tables_stride, a.block_size, 0);
      pf_left = std::min<int64_t>(kChunkKeys, key_end_of(nx)), pf_h0 = nx.h0, pf_heads = nx.h1 - nx.h0;
    }
    const int64_t pf_per_row = (pf_left + nk - 1) / std::max<int64_t>(1, nk);  // rows ahead per row packed
    // Packed cache: the unit is one KV head's 16 keys (a K^T tile group and the V pairs, 16 * D * 2 bytes each, both
    // contiguous), into L1, spread evenly over every head's score steps of this chunk. Measured on decodes, one
    // process, alternated: without it 3% slower; into L2, non-temporally or every other line 2-160% slower (those
    // three before K^T's tiles were contiguous).
    const int64_t pf_units = pf_heads * ((pf_left + kTileRows - 1) / kTileRows);
    const int64_t pf_units_per_step = (pf_units + heads * ((nk + 15) / 16) - 1) / (heads * ((nk + 15) / 16));
    int64_t pf_unit = 0;
    const char *pf_k = nullptr, *pf_v = nullptr;  // the current 16 keys' head pf_h0 rows
    auto prefetch_units = [&](int64_t count) {
      for (; count > 0 && pf_unit < pf_units; --count, ++pf_unit) {
        const int64_t hb = pf_unit % pf_heads;
        if (hb == 0) {
          const auto [blk, off] = pf.next();
          for (int64_t i = 1; i < kTileRows; ++i) pf.next();
          pf_k = reinterpret_cast<const char*>(a.k_cache + blk * a.k_stride_block + pf_h0 * head_elems + off * D);
          pf_v = reinterpret_cast<const char*>(a.v_cache + blk * a.v_stride_block + pf_h0 * head_elems + off * D);
        }
        for (int64_t o = 0; o < kTileRows * head_bytes; o += 64) {
          _mm_prefetch(pf_k + hb * head_elems * 2 + o, _MM_HINT_T0);
          _mm_prefetch(pf_v + hb * head_elems * 2 + o, _MM_HINT_T0);
        }
      }
    };
    auto prefetch_some = [&](int64_t count) {
      if (packed) return prefetch_units(pf_units);
      for (; count > 0 && pf_left > 0; --count, --pf_left) {
        const auto [blk, off] = pf.next();
        const char* kr = reinterpret_cast<const char*>(a.k_cache + blk * a.k_stride_block + off * a.k_stride_token +
                                                       pf_h0 * a.k_stride_head);
        const char* vr = reinterpret_cast<const char*>(a.v_cache + blk * a.v_stride_block + off * a.v_stride_token +
                                                       pf_h0 * a.v_stride_head);
        for (int64_t hb = 0; hb < pf_heads; ++hb)
          for (int64_t o = 0; o < head_bytes; o += 64) {
            _mm_prefetch(kr + hb * a.k_stride_head * 2 + o, _MM_HINT_T1);
            _mm_prefetch(vr + hb * a.v_stride_head * 2 + o, _MM_HINT_T1);
          }
      }
    };

    for (int64_t hb = 0; hb < heads; ++hb) {
      const int64_t h = h0 + hb;
      const c10::BFloat16* k_h = a.k_cache + h * (packed ? head_elems : a.k_stride_head);
      bool v_tail_ready = false;  // packed: v_tail_ holds this head's last V tile of this chunk
      const c10::BFloat16* v_h = a.v_cache + h * (packed ? head_elems : a.v_stride_head);
      // The chunk's K^T of this head: per 16 keys (one block's consecutive rows) and 32-dim slice, the 16 x 16
      // matrix [key][dim pair] transposed to [dim pair][key] (tile B's pair layout); keys past nk are zero.
      for (int64_t k16 = 0; !transposed && !packed && k16 < nk; k16 += kTileRows) {
        const int64_t key = c0 + k16, nkeys = std::min(kTileRows, nk - k16);
        const c10::BFloat16* kp =
            k_h + table[key / a.block_size] * a.k_stride_block + (key % a.block_size) * a.k_stride_token;
        for (int64_t sl = 0; sl < slices; ++sl) {
          __m512i r[16];
          for (int64_t i = 0; i < kTileRows; ++i)
            r[i] = i < nkeys ? _mm512_loadu_si512(kp + i * a.k_stride_token + 32 * sl) : _mm512_setzero_si512();
          transpose16x16_epi32(r);
          uint32_t* dst = k_pack_.data() + ((k16 / kTileRows) * slices + sl) * kTileRows * kTileRows;
          for (int64_t i = 0; i < kTileRows; ++i) _mm512_storeu_si512(dst + i * kTileRows, r[i]);
        }
      }
      // The chunk's V rows of this head, two keys interleaved per dimension; keys past nk are zero.
      RowWalker vw;
      vw.start(table, a.block_size, c0);
      for (int64_t kp = 0; !packed && kp < nk32 / 2; ++kp) {
        const c10::BFloat16* vr[2] = {nullptr, nullptr};
        for (int e = 0; e < 2; ++e)
          if (2 * kp + e < nk) {
            const auto [blk, off] = vw.next();
            vr[e] = v_h + blk * a.v_stride_block + off * a.v_stride_token;
          }
        if (hb == 0) prefetch_some(2 * pf_per_row);
        uint16_t* dst = v_pack_.data() + ((kp / 16) * dtiles * kTileRows + kp % 16) * 32;
        for (int64_t sl = 0; sl < slices; ++sl) {
          const __m512i x0 = vr[0] ? _mm512_loadu_si512(vr[0] + 32 * sl) : _mm512_setzero_si512();
          const __m512i x1 = vr[1] ? _mm512_loadu_si512(vr[1] + 32 * sl) : _mm512_setzero_si512();
          __m512i lo, hi;
          interleave_pairs_epi16(x0, x1, &lo, &hi);
          _mm512_storeu_si512(dst + (2 * sl) * kTileRows * 32, lo);
          _mm512_storeu_si512(dst + (2 * sl + 1) * kTileRows * 32, hi);
        }
      }
      // O += P . V of a row group whose probabilities are in p_ (see the loop below for when it runs).
      struct PendingPV {
        int64_t r0, n, ng, ng32;
        float alpha[kTileRows];
      };
      auto run_pv = [&](const PendingPV& pv) {
        const int64_t r0 = pv.r0, n = pv.n, ng = pv.ng, ng32 = pv.ng32;
        const float* alpha = pv.alpha;
        // O += P . V, 64 dims (four accumulator tiles) per pass, or 32 (two) when D is not a multiple of 64: P is
        // loaded once per 32 keys for four products, and four independent accumulators keep the tile unit busy
        // (a product's latency is longer than its issue interval). The chunk's sum is added to the fp32
        // accumulators with alpha.
        // tmm0 and tmm2 (or tmm7): see the config
        const int64_t dims_per_pass = D % 64 == 0 && !transposed && layout != kPacked16Layout ? 64 : 32;
        for (int64_t d0 = 0; d0 < D; d0 += dims_per_pass) {
          const int64_t dt0 = d0 / 16;
          KVS_TILE_ZERO(5);
          KVS_TILE_ZERO(6);
          if (packed) {
            // V tiles straight from the cache: v_keys / 2 key pairs of 16 dims, 4 * D bytes apart; the sequence's
            // last tile, which reaches past its last key, from v_tail_ (zero there: never-written or stale slots
            // must not reach the product, where 0 x NaN would be NaN).
            if (dims_per_pass == 64) {
              KVS_TILE_ZERO(7);
              KVS_TILE_ZERO(0);
            }
            for (int64_t kk = 0; kk < ng; kk += v_keys) {
              const int64_t key = c0 + kk;
              const uint16_t* vb =
                  key + v_keys > ctx ? v_tail_.data() + 32 * dt0
                                     : reinterpret_cast<const uint16_t*>(v_h + table[key / bs] * a.v_stride_block +
                                                                         (key % bs) * D) + 32 * dt0;
              if (key + v_keys > ctx && !v_tail_ready) {
                fill_v_tail(v_h + table[key / bs] * a.v_stride_block + (key % bs) * D, ctx - key);
                v_tail_ready = true;
              }
              KVS_TILE_LOAD(3, p_.data() + kk, kChunkKeys * 2);
              KVS_TILE_LOAD(4, vb, 4 * D);
              KVS_TILE_DP_BF16(5, 3, 4);
              // A second V register (tmm2, 16 x 64 bytes as K^T; tmm7 with 16-key blocks) alternates with tmm4: a
              // load into the register a product still reads would wait for it.
              if (v_keys == 32) {
                KVS_TILE_LOAD(2, vb + 32, 4 * D);
                KVS_TILE_DP_BF16(6, 3, 2);
              } else {
                KVS_TILE_LOAD(7, vb + 32, 4 * D);
                KVS_TILE_DP_BF16(6, 3, 7);
              }
              if (dims_per_pass == 64) {
                KVS_TILE_LOAD(4, vb + 64, 4 * D);
                KVS_TILE_DP_BF16(7, 3, 4);
                KVS_TILE_LOAD(2, vb + 96, 4 * D);
                KVS_TILE_DP_BF16(0, 3, 2);
              }
            }
            if (dims_per_pass == 64) {
              KVS_TILE_STORE(7, o + 32, 256);
              KVS_TILE_STORE(0, o + 48, 256);
            }
          } else if (dims_per_pass == 64) {
            KVS_TILE_ZERO(7);
            KVS_TILE_ZERO(0);
            for (int64_t k32 = 0; k32 < ng32; k32 += 32) {
              const uint16_t* vb = v_pack_.data() + ((k32 / 32) * dtiles + dt0) * kTileRows * 32;
              KVS_TILE_LOAD(3, p_.data() + k32, kChunkKeys * 2);
              KVS_TILE_LOAD(4, vb, 64);
              KVS_TILE_DP_BF16(5, 3, 4);
              KVS_TILE_LOAD(2, vb + kTileRows * 32, 64);  // tmm2 (K^T's, 16 x 64 bytes too) alternates with tmm4
              KVS_TILE_DP_BF16(6, 3, 2);
              KVS_TILE_LOAD(4, vb + 2 * kTileRows * 32, 64);
              KVS_TILE_DP_BF16(7, 3, 4);
              KVS_TILE_LOAD(2, vb + 3 * kTileRows * 32, 64);
              KVS_TILE_DP_BF16(0, 3, 2);
            }
            KVS_TILE_STORE(7, o + 32, 256);
            KVS_TILE_STORE(0, o + 48, 256);
          } else {
            for (int64_t k32 = 0; k32 < ng32; k32 += 32) {
              const uint16_t* vb = v_pack_.data() + ((k32 / 32) * dtiles + dt0) * kTileRows * 32;
              KVS_TILE_LOAD(3, p_.data() + k32, kChunkKeys * 2);
              KVS_TILE_LOAD(4, vb, 64);
              KVS_TILE_DP_BF16(5, 3, 4);
              if (transposed) {
                KVS_TILE_LOAD(1, vb + kTileRows * 32, 64);
                KVS_TILE_DP_BF16(6, 3, 1);
              } else {
                KVS_TILE_LOAD(2, vb + kTileRows * 32, 64);
                KVS_TILE_DP_BF16(6, 3, 2);
              }
            }
          }
          KVS_TILE_STORE(5, o, 256);
          KVS_TILE_STORE(6, o + 16, 256);
          for (int64_t j = 0; j < n; ++j) {
            float* acc = acc_.data() + (hb * rows + r0 + j) * D + d0;
            const __m512 va = _mm512_set1_ps(alpha[j]);
            for (int64_t d = 0; d < dims_per_pass; d += 16)
              _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), va, _mm512_loadu_ps(o + 64 * j + d)));
          }
        }
      };
      // Per row group: scores, then the previous group's P . V, then this group's softmax. A tile load of data that
      // vector stores just wrote waits for them to drain, as do vector loads of a tile store: run in order, S's
      // tile store fed the softmax's loads at once and the softmax's stores P's tile load (perf put a fifth of a
      // prefill's time on those two waits); one group's P . V between them hides both.
      PendingPV pending{};
      bool has_pending = false;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * kTileRows, n = std::min(kTileRows, rows - r0);
        const int64_t group_end = start + t0 + (r0 + n - 1) / G + 1;  // the group's last row's causal limit
        if (c0 >= group_end) continue;
        const int64_t ng = std::min(nk, group_end - c0), ng32 = (ng + 31) / 32 * 32;
        const int64_t config = 4 * n + layout;
        if (config != configured_) {
          if (has_pending) run_pv(pending), has_pending = false;  // in the configuration it was computed in
          load_tile_config(n, layout), configured_ = config;
        }
        if (transposed) {
          // Scores: S^T per 16 keys (K rows straight from the cache), transposed back into the rows' score lines.
          const uint32_t* qt = q_t_.data() + hb * slices * kTileRows * n;
          alignas(64) float s_t[kTileRows * kTileRows];  // [16 keys][16 lanes, n of them rows]
          for (int64_t k16 = 0; k16 < ng; k16 += kTileRows) {
            const int64_t key = c0 + k16;
            const c10::BFloat16* kp =
                k_h + table[key / a.block_size] * a.k_stride_block + (key % a.block_size) * a.k_stride_token;
            KVS_TILE_ZERO(0);
            for (int64_t sl = 0; sl < slices; ++sl) {
              KVS_TILE_LOAD(1, kp + 32 * sl, a.k_stride_token * 2);
              KVS_TILE_LOAD(2, qt + sl * kTileRows * n, 4 * n);
              KVS_TILE_DP_BF16(0, 1, 2);
            }
            KVS_TILE_STORE(0, s_t, 64);
            __m512i r[16];
            for (int64_t i = 0; i < kTileRows; ++i) r[i] = _mm512_load_si512(s_t + i * kTileRows);
            transpose16x16_epi32(r);  // r[j] = query row j's scores of the 16 keys
            for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(s_.data() + j * kChunkKeys + k16, r[j]);
          }
        } else if (packed) {
          // Scores: S per 16 keys, K^T tiles straight from the cache (16 dim pairs of 64 bytes, one after another).
          // (Two 16-key groups at a time into two accumulators measured 3-15% slower.)
          const uint16_t* qg = q_rows_.data() + (hb * rows + r0) * D;
          for (int64_t k16 = 0; k16 < ng; k16 += kTileRows) {
            const int64_t key = c0 + k16;
            const c10::BFloat16* kt = k_h + table[key / bs] * a.k_stride_block + (key % bs) * D;
            KVS_TILE_ZERO(0);
            for (int64_t sl = 0; sl < slices; ++sl) {
              KVS_TILE_LOAD(1, qg + 32 * sl, head_bytes);
              KVS_TILE_LOAD(2, kt + sl * 32 * kTileRows, 64);
              KVS_TILE_DP_BF16(0, 1, 2);
            }
            KVS_TILE_STORE(0, s_.data() + k16, kChunkKeys * 4);
            if (g == 0) prefetch_units(pf_units_per_step);
          }
        } else {
          // Scores: S per 16 keys, stored straight into the rows' score lines.
          const uint16_t* qg = q_rows_.data() + (hb * rows + r0) * D;
          for (int64_t k16 = 0; k16 < ng; k16 += kTileRows) {
            KVS_TILE_ZERO(0);
            for (int64_t sl = 0; sl < slices; ++sl) {
              KVS_TILE_LOAD(1, qg + 32 * sl, head_bytes);
              KVS_TILE_LOAD(2, k_pack_.data() + ((k16 / kTileRows) * slices + sl) * kTileRows * kTileRows, 64);
              KVS_TILE_DP_BF16(0, 1, 2);
            }
            KVS_TILE_STORE(0, s_.data() + k16, kChunkKeys * 4);
          }
        }
        if (has_pending) run_pv(pending), has_pending = false;
        // Online softmax per row over its visible keys of this chunk; P in bf16, zero past them.
        float* alpha = pending.alpha;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t r = r0 + j, hr = hb * rows + r;
          const int64_t visible = std::clamp<int64_t>(start + t0 + r / G + 1 - c0, 0, ng);
          float* sr = s_.data() + j * kChunkKeys;
          uint16_t* pr = p_.data() + j * kChunkKeys;
          if (visible == 0) {
            alpha[j] = 1.f;
            std::fill(pr, pr + ng32, uint16_t(0));
            continue;
          }
          // The scale is folded into the exponent, exp(s * scale - max * scale) as one fused multiply-add: the
          // max of the raw scores times a positive scale is the max of the scaled ones, and the scores are read
          // twice instead of scaled, stored and read again.
          __m512 vmax = _mm512_set1_ps(kNegInf);
          for (int64_t i = 0; i < visible; i += 16) {
            const __mmask16 mk = tail_mask(visible - i);
            vmax = _mm512_mask_max_ps(vmax, mk, vmax, _mm512_maskz_loadu_ps(mk, sr + i));
          }
          const float m_new = std::max(m_[hr], _mm512_reduce_max_ps(vmax) * a.scale);
          alpha[j] = m_[hr] == kNegInf ? 0.f : std::exp(m_[hr] - m_new);
          const __m512 vscale = _mm512_set1_ps(a.scale), vneg_m = _mm512_set1_ps(-m_new);
          __m512 vsum = _mm512_setzero_ps();
          int64_t i = 0;
          for (; i < visible; i += 16) {
            const __mmask16 mk = tail_mask(visible - i);
            const __m512 x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, sr + i), vscale, vneg_m);
            const __m512 e = _mm512_maskz_mov_ps(mk, exp_ps(x));  // zeros past `visible`
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + i), (__m256i)_mm512_cvtneps_pbh(e));
          }
          for (; i < ng32; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + i), _mm256_setzero_si256());
          l_[hr] = l_[hr] * alpha[j] + _mm512_reduce_add_ps(vsum);
          m_[hr] = m_new;
        }
        pending.r0 = r0, pending.n = n, pending.ng = ng, pending.ng32 = ng32, has_pending = true;
      }
      if (has_pending) run_pv(pending);
    }
    prefetch_some(pf_left);  // what the packing loop did not reach (a next chunk longer than this one)
  }
  for (int64_t hb = 0; hb < heads; ++hb)
    for (int64_t r = 0; r < rows; ++r) {
      float* acc = acc_.data() + (hb * rows + r) * D;
      const float inv = 1.f / l_[hb * rows + r];
      for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
      store_row<c10::BFloat16>(
          acc, a.out + (tok0 + t0 + r / G) * a.out_stride0 + ((h0 + hb) * G + r % G) * a.out_stride1, D);
    }
}

#else  // no AMX in this build: amx_attention_usable says so and the worker is never built

bool amx_attention_usable(int64_t, int64_t) { return false; }
AmxAttentionWorker::AmxAttentionWorker(const AmxAttnArgs& args) : a_(args) {}
AmxAttentionWorker::~AmxAttentionWorker() = default;
void AmxAttentionWorker::run(const AttnItem&, const AttnItem*) {}

#endif

}  // namespace kvserve_cpu
