// One Python extension for the CPU kernels (built by cpu_extension.py).
#include <torch/extension.h>

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor sw, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa);
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t past,
                             c10::optional<torch::Tensor> visible, double scale, int64_t isa);
torch::Tensor rope_tree_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                                  torch::Tensor vc, int64_t past, c10::optional<torch::Tensor> visible,
                                  int64_t n_heads, int64_t n_kv, double scale, c10::optional<torch::Tensor> q_norm,
                                  c10::optional<torch::Tensor> k_norm, double norm_eps, int64_t isa);
torch::Tensor rope_tree_attention_batched(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                          const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs,
                                          const std::vector<int64_t>& pasts,
                                          const std::vector<c10::optional<torch::Tensor>>& visibles,
                                          const std::vector<int64_t>& row_ends, int64_t n_heads, int64_t n_kv,
                                          double scale, c10::optional<torch::Tensor> q_norm,
                                          c10::optional<torch::Tensor> k_norm, double norm_eps, int64_t isa);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                        c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa);
int64_t amx_mode(int64_t mode);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, int64_t isa);
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t isa);
std::vector<torch::Tensor> decoder_stack(torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& layers,
                                         const std::vector<int64_t>& meta, torch::Tensor cos, torch::Tensor sin,
                                         torch::Tensor k_cache, torch::Tensor v_cache, int64_t past,
                                         c10::optional<torch::Tensor> visible, int64_t n_heads, int64_t n_kv,
                                         double scale, double norm_eps, double qk_norm_eps,
                                         const std::vector<int64_t>& capture, int64_t isa);
std::vector<torch::Tensor> decoder_stack_batched(torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& layers,
                                                 const std::vector<int64_t>& meta, torch::Tensor cos, torch::Tensor sin,
                                                 const std::vector<torch::Tensor>& k_caches,
                                                 const std::vector<torch::Tensor>& v_caches,
                                                 const std::vector<int64_t>& pasts,
                                                 const std::vector<c10::optional<torch::Tensor>>& visibles,
                                                 const std::vector<int64_t>& row_ends, int64_t n_heads, int64_t n_kv,
                                                 double scale, double norm_eps, double qk_norm_eps,
                                                 const std::vector<int64_t>& capture, int64_t isa);

std::vector<torch::Tensor> gdn_tree_verify(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                           torch::Tensor beta, torch::Tensor S0, torch::Tensor tree, int64_t isa);
std::vector<torch::Tensor> gdn_step(torch::Tensor proj, torch::Tensor conv_wt, torch::Tensor conv_ctx,
                                    torch::Tensor A_log, torch::Tensor dt_bias, torch::Tensor norm_w, torch::Tensor S0,
                                    int64_t Hk, double norm_eps, int64_t isa);

// Every kernel runs without the GIL (arguments are converted before, results after): a decoder stack call is a
// whole forward (≈ 15 ms a token on a 2-vCPU Zen 3), and `drafttree serve`'s HTTP thread, woken by each round's
// text, would otherwise wait for it to end, then make the model thread wait while it writes the chunk.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("int8_linear", &int8_linear, "int8 x int8 linear with per-row scales on packed weights (ops/int8)", no_gil);
  m.def("tree_attention", &tree_attention, "row-by-row attention against a KV cache (ops/attention)", no_gil);
  m.def("rope_tree_attention", &rope_tree_attention, "RoPE + KV-cache write + tree_attention (ops/attention)", no_gil);
  m.def("rope_tree_attention_batched", &rope_tree_attention_batched,
        "rope_tree_attention for several requests' rows, each against its own cache (ops/attention)", no_gil);
  m.def("q4_linear", &q4_linear, "GGUF Q4_1 blocks x per-row int8 activations (ops/q4)", no_gil);
  m.def("amx_mode", &amx_mode, "int8_linear's AMX tiles: -1 asks, 0 off, 1 on where the CPU has them (ops/int8)");
  m.def("rms_norm", &rms_norm, "row-wise RMSNorm (ops/pointwise)", no_gil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up (ops/pointwise)", no_gil);
  m.def("gdn_tree_verify", &gdn_tree_verify, "Gated DeltaNet tree verification over ancestor lists (ops/gdn)", no_gil);
  m.def("gdn_step", &gdn_step, "one Gated DeltaNet decode step: conv, gates, state update, gated norm (ops/gdn)", no_gil);
  m.def("decoder_stack", &decoder_stack, "a llama/qwen3 decoder stack in one call (ops/decoder)", no_gil);
  m.def("decoder_stack_batched", &decoder_stack_batched,
        "the decoder stack over several requests' rows, attention each against its own cache (ops/decoder)", no_gil);
}
