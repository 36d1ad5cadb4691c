// Registers the kvserve CPU ops as torch.ops.kvserve_cpu.* (schema + CPU kernels). The extension is a plain
// shared library loaded with torch.ops.load_library semantics (no pybind), see kvkernels/cpu_ops.py.
#include "ops.h"

#include <torch/library.h>

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor cu_seqlens_q, float scale, int max_q_len, int max_fresh_q_len=-1, "
        "bool allow_amx=True, bool packed_kv=False) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "bool packed_kv=False) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  m.def("screened_greedy_argmax(Tensor hidden, Tensor approx, Tensor weight, Tensor weight_norms) -> Tensor");
  m.def("packed_kv_usable(int head_dim, int block_size) -> bool");
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  m.def("panel_linear_native() -> bool");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_attention", &kvserve_cpu::paged_attention);
  m.impl("store_kv", &kvserve_cpu::store_kv);
  m.impl("rms_norm", &kvserve_cpu::rms_norm);
  m.impl("add_rms_norm", &kvserve_cpu::add_rms_norm);
  m.impl("rotary_embedding", &kvserve_cpu::rotary_embedding);
  m.impl("silu_and_mul", &kvserve_cpu::silu_and_mul);
  m.impl("greedy_argmax", &kvserve_cpu::greedy_argmax);
  m.impl("screened_greedy_argmax", &kvserve_cpu::screened_greedy_argmax);
  m.impl("panel_linear", &kvserve_cpu::panel_linear);
}

// No tensor arguments: registered for every dispatch key (CompositeExplicitAutograd would need a tensor to route by).
TORCH_LIBRARY_IMPL(kvserve_cpu, CatchAll, m) {
  m.impl("packed_kv_usable", &kvserve_cpu::packed_kv_usable);
  m.impl("panel_linear_native", &kvserve_cpu::panel_linear_native);
}
