// Declarations of the kvserve CPU ops; ops.cpp registers them as torch.ops.kvserve_cpu.*.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvserve_cpu {

// out[tokens, heads, head_dim] = causal attention of q over the paged cache. Skipped, their rows of out left
// untouched: sequences with q_len > max_q_len, and fresh prefills (q_len == seq_len) with q_len > max_fresh_q_len
// when that is >= 0 (the caller runs those through SDPA). allow_amx: bf16 may run on AMX tiles where the CPU and
// the shapes allow it (paged_attention_amx.h); false keeps the AVX-512 kernel (A/B runs, KVSERVE_CPU_ATTENTION_AMX).
// packed_kv: the caches are in the AMX block layout (paged_attention_amx.h; needs bf16 and allow_amx).
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                     double scale, int64_t max_q_len, int64_t max_fresh_q_len, bool allow_amx, bool packed_kv);

// k_cache.view(-1, kv_heads, head_dim)[slot_mapping[t]] = k[t] (and v); slot -1 is skipped. packed_kv: into the AMX
// block layout instead (paged_attention_amx.h).
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping, bool packed_kv);

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), computed in fp32 (Llama's RMSNorm order).
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);

// residual = residual + x (rounded to the dtype, as torch's add), then out = rms_norm(residual).
void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps);

// In place, neox / rotate_half style: x = x * cos[pos] + rotate_half(x) * sin[pos], each product rounded to the
// dtype as torch's eager ops do. q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim].
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin);

// out[:, :I] = silu(x[:, :I]) * x[:, I:], rounding to the dtype after the silu and after the product.
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

// Whether paged_attention / store_kv take packed_kv for these shapes on this CPU and build (bf16 caches).
bool packed_kv_usable(int64_t head_dim, int64_t block_size);

// int64 [rows]: torch.argmax(logits, dim=-1) for float32 / bfloat16 / float16 [rows, vocab] (first maximum; first
// NaN if any).
at::Tensor greedy_argmax(const at::Tensor& logits);
// int64 [rows]: the fp32 LM head's greedy tokens, argmax(hidden . weight^T), from approx = the same product on bf16
// operands (bfloat16 [rows, vocab]) and weight_norms (float32 [vocab], the rows' L2 norms rounded up): only the
// vocab rows the screen cannot rule out are computed in fp32 (screened_argmax.cpp); -1 for a row that needs full
// logits (a non-finite value).
at::Tensor screened_greedy_argmax(const at::Tensor& hidden, const at::Tensor& approx, const at::Tensor& weight,
                                  const at::Tensor& weight_norms);

// out[M, N] = x[M, K] . W^T (+ bias), float32, with W in panels of 32 columns: panels[ceil(N / 32), K, 32], zero
// past N (panel_linear.cpp). Each output is one sequential FMA chain over k, whatever M or the thread count.
void panel_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias);

// Whether this build runs panel_linear vectorised (AVX-512); elsewhere it runs a scalar loop, right but slow.
bool panel_linear_native();

}  // namespace kvserve_cpu

#include <ATen/Dispatch.h>

// float32 / bfloat16 / float16 only (double would silently run through fp32 scratch).
#define KVS_DISPATCH(TYPE, NAME, ...)                          \
  AT_DISPATCH_SWITCH(TYPE, NAME,                               \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
