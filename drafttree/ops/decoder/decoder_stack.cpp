// A llama/qwen3 decoder stack in one call: the same kernels, in the same order, as the Python modules
// (model/transformer.py: DecoderLayer, which is this op's reference), without ~10 Python module calls per
// layer. Those calls cost 4-6 ms of a 14-20 ms one-token step on a 2-vCPU Zen 3 (measured with the kernels
// stubbed out), as much as the KV-cache attention itself. The bits are the modules' (tests/ops).
#include <torch/extension.h>

#include <vector>

#include "../kernels.h"

namespace {

enum LinearKind : int64_t { kInt8 = 0, kQ4 = 1, kQ8 = 2 };

// Per layer, the tensors in this order (an empty tensor where a layer has none):
//   0 input norm, 1 post-attention norm, 2 q_norm, 3 k_norm, then 4 tensors for each of qkv, o, gate_up, down:
//   int8 (packed, scale, row sums, bias), Q4_1 or 8-bit blocks (q, d, m, bias).
// meta, per layer: (kind, n_out) of qkv, o, gate_up, down.
constexpr int kNorms = 4, kPerLinear = 4, kLinears = 4, kTensors = kNorms + kPerLinear * kLinears;

c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& p, const int64_t* meta, int which,
                     int64_t isa) {
  const int base = kNorms + kPerLinear * which;
  const int64_t kind = meta[2 * which], n_out = meta[2 * which + 1];
  const auto bias = present(p[base + 3]);
  if (kind == kQ4) return q4_linear(x, p[base], p[base + 1], p[base + 2], bias, n_out, isa);
  if (kind == kQ8) return q8_linear(x, p[base], p[base + 1], p[base + 2], bias, n_out, isa);
  return int8_linear(x, p[base], p[base + 1], p[base + 2], bias, n_out, isa);
}

}  // namespace

// x [R, hidden] float32 (the embedded tokens of several requests, request s's rows ending at row_ends[s]);
// layers as above; per request its caches [L, Hkv, Lmax, d], its new rows' K/V written at [past, past + T_s), its
// tree mask (or none). The linears run once over all rows, attention per request against its own cache (each row
// gets the bits it gets alone: the kernels are row-wise). Returns the hidden state after the last layer, then the
// hidden states after each layer in `capture` (ascending).
std::vector<torch::Tensor> decoder_stack_batched(torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& layers,
                                                 const std::vector<int64_t>& meta, torch::Tensor cos, torch::Tensor sin,
                                                 const std::vector<torch::Tensor>& k_caches,
                                                 const std::vector<torch::Tensor>& v_caches,
                                                 const std::vector<int64_t>& pasts,
                                                 const std::vector<c10::optional<torch::Tensor>>& visibles,
                                                 const std::vector<int64_t>& row_ends, int64_t n_heads, int64_t n_kv,
                                                 double scale, double norm_eps, double qk_norm_eps,
                                                 const std::vector<int64_t>& capture, int64_t isa) {
  const int64_t L = static_cast<int64_t>(layers.size());
  const size_t S = row_ends.size();
  TORCH_CHECK(static_cast<int64_t>(meta.size()) == 2 * kLinears * L, "decoder_stack: meta must hold 8 values a layer");
  TORCH_CHECK(S > 0 && k_caches.size() == S && v_caches.size() == S, "decoder_stack: one cache per request");
  for (size_t s = 0; s < S; ++s)
    TORCH_CHECK(k_caches[s].dim() == 4 && k_caches[s].size(0) >= L && v_caches[s].sizes() == k_caches[s].sizes(),
                "decoder_stack: caches must be [layers, Hkv, Lmax, d]");
  std::vector<torch::Tensor> out{torch::Tensor()};
  size_t next_capture = 0;
  for (int64_t i = 0; i < L; ++i) {
    const auto& p = layers[i];
    TORCH_CHECK(static_cast<int>(p.size()) == kTensors, "decoder_stack: layer ", i, " must hold ", kTensors, " tensors");
    const int64_t* m = meta.data() + 2 * kLinears * i;
    const auto qkv = linear(rms_norm(x, p[0], norm_eps, isa), p, m, 0, isa);
    const auto attn = rope_tree_attention_layer(qkv, cos, sin, k_caches, v_caches, i, pasts, visibles, row_ends,
                                                n_heads, n_kv, scale, present(p[2]), present(p[3]), qk_norm_eps, isa);
    x = x + linear(attn, p, m, 1, isa);
    x = x + linear(silu_mul(linear(rms_norm(x, p[1], norm_eps, isa), p, m, 2, isa), isa), p, m, 3, isa);
    if (next_capture < capture.size() && capture[next_capture] == i) {
      out.push_back(x);
      ++next_capture;
    }
  }
  out[0] = x;
  return out;
}

// One request's rows: decoder_stack_batched of one (k_cache/v_cache [L, Hkv, Lmax, d], new rows at [past, past + T)).
std::vector<torch::Tensor> decoder_stack(torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& layers,
                                         const std::vector<int64_t>& meta, torch::Tensor cos, torch::Tensor sin,
                                         torch::Tensor k_cache, torch::Tensor v_cache, int64_t past,
                                         c10::optional<torch::Tensor> visible, int64_t n_heads, int64_t n_kv,
                                         double scale, double norm_eps, double qk_norm_eps,
                                         const std::vector<int64_t>& capture, int64_t isa) {
  return decoder_stack_batched(x, layers, meta, cos, sin, {k_cache}, {v_cache}, {past}, {visible}, {x.size(0)},
                               n_heads, n_kv, scale, norm_eps, qk_norm_eps, capture, isa);
}
