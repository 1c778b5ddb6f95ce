// One Python extension for the CPU kernels (built by cpu_extension.py).
#include <torch/extension.h>

#include "kernels.h"

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
  m.def("q8_linear", &q8_linear, "8-bit blocks of 32 (w = d*q + m) x per-block int8 activations (ops/q4)", no_gil);
  m.def("weight_prefetch", &weight_prefetch, "bytes ahead the int8 / q4 kernels prefetch weights (0 none; -1 asks)");
  m.def("amx_mode", &amx_mode, "int8_linear's AMX tiles: -1 asks, 0 off, 1 on where the CPU has them (ops/int8)");
  m.def("rms_norm", &rms_norm, "row-wise RMSNorm (ops/pointwise)", no_gil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up (ops/pointwise)", no_gil);
  m.def("gdn_tree_verify", &gdn_tree_verify, "Gated DeltaNet tree verification over ancestor lists (ops/gdn)", no_gil);
  m.def("gdn_step", &gdn_step, "one Gated DeltaNet decode step: conv, gates, state update, gated norm (ops/gdn)", no_gil);
  m.def("decoder_stack", &decoder_stack, "a llama/qwen3 decoder stack in one call (ops/decoder)", no_gil);
  m.def("decoder_stack_batched", &decoder_stack_batched,
        "the decoder stack over several requests' rows, attention each against its own cache (ops/decoder)", no_gil);
}
