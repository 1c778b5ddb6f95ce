// One Python extension for the CPU kernels (built by cpu_extension.py).
#include <torch/extension.h>

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor sw, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa);
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t past,
                             c10::optional<torch::Tensor> visible, double scale, int64_t isa);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "int8 x int8 linear with per-row scales on packed weights (ops/int8)");
  m.def("tree_attention", &tree_attention, "row-by-row attention against a KV cache (ops/attention)");
}
