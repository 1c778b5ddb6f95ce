// The kernels' entry points, for the binding and for kernels that call other kernels (ops/decoder): one declaration
// each, defined in their own sources (ops/int8, ops/attention, ops/q4, ops/pointwise, ops/decoder, ops/gdn).
#pragma once
#include <torch/extension.h>

#include <atomic>
#include <vector>

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
// rope_tree_attention_batched on layer `layer` of per-request caches [L, Hkv, Lmax, d] (addressed in place)
torch::Tensor rope_tree_attention_layer(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                        const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs,
                                        int64_t layer, const std::vector<int64_t>& pasts,
                                        const std::vector<c10::optional<torch::Tensor>>& visibles,
                                        const std::vector<int64_t>& row_ends, int64_t n_heads, int64_t n_kv,
                                        double scale, c10::optional<torch::Tensor> q_norm,
                                        c10::optional<torch::Tensor> k_norm, double norm_eps, int64_t isa);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                        c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                        c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa);
int64_t amx_mode(int64_t mode);
int64_t weight_prefetch(int64_t bytes);
extern std::atomic<int64_t> weight_prefetch_bytes;  // the weight kernels' software prefetch distance (bytes; 0 none)

// How far ahead a call of `rows` input rows prefetches its weights (int8_linear, q4_linear): several rows' arithmetic
// per weight byte keeps fewer loads in flight than the hardware prefetchers need (Emerald Rapids AVX-512 VNNI, 2
// threads, 3-9 rows: the forward 3-12 % faster at 4 KiB ahead), while a one-row step measured 2-6 % slower with it.
inline int64_t weight_prefetch_for(int64_t rows) {
  return rows >= 2 ? weight_prefetch_bytes.load(std::memory_order_relaxed) : 0;
}
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
