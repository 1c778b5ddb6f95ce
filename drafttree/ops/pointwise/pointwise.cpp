// Row-wise RMSNorm and SwiGLU's silu(gate) * up in one call each (on a decode step the op count, not
// the arithmetic, is what costs). Reference: naive.py. Every row is computed alone, so results do not
// depend on how many rows share the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "../vec_math.h"

namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// y = w * (x * rsqrt(mean(x^2) + eps)), as layers.RMSNorm computes it in float32.
void rms_row_scalar(const float* x, const float* w, int64_t H, float eps, float* y) {
  const float r = 1.f / std::sqrt(drafttree::sumsq_scalar(x, H) / static_cast<float>(H) + eps);
  for (int64_t c = 0; c < H; ++c) y[c] = w[c] * (x[c] * r);
}

__attribute__((target("avx512f"))) void rms_row_avx512(const float* x, const float* w, int64_t H, float eps, float* y) {
  const float r = 1.f / std::sqrt(drafttree::sumsq_avx512(x, H) / static_cast<float>(H) + eps);
  const __m512 vr = _mm512_set1_ps(r);
  int64_t c = 0;
  for (; c + 16 <= H; c += 16)
    _mm512_storeu_ps(y + c, _mm512_mul_ps(_mm512_loadu_ps(w + c), _mm512_mul_ps(_mm512_loadu_ps(x + c), vr)));
  for (; c < H; ++c) y[c] = w[c] * (x[c] * r);
}

__attribute__((target("avx2,fma"))) void rms_row_avx2(const float* x, const float* w, int64_t H, float eps, float* y) {
  const float r = 1.f / std::sqrt(drafttree::sumsq_avx2(x, H) / static_cast<float>(H) + eps);
  const __m256 vr = _mm256_set1_ps(r);
  int64_t c = 0;
  for (; c + 8 <= H; c += 8)
    _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_loadu_ps(w + c), _mm256_mul_ps(_mm256_loadu_ps(x + c), vr)));
  for (; c < H; ++c) y[c] = w[c] * (x[c] * r);
}

// y = g / (1 + exp(-g)) * u for the halves [g | u] of one row.
void silu_row_scalar(const float* g, const float* u, int64_t n, float* y) {
  for (int64_t c = 0; c < n; ++c) y[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
}

__attribute__((target("avx512f"))) void silu_row_avx512(const float* g, const float* u, int64_t n, float* y) {
  int64_t c = 0;
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (; c + 16 <= n; c += 16) {
    const __m512 v = _mm512_loadu_ps(g + c);
    const __m512 s = _mm512_div_ps(v, _mm512_add_ps(one, drafttree::exp512(_mm512_sub_ps(zero, v))));
    _mm512_storeu_ps(y + c, _mm512_mul_ps(s, _mm512_loadu_ps(u + c)));
  }
  for (; c < n; ++c) y[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
}

__attribute__((target("avx2,fma"))) void silu_row_avx2(const float* g, const float* u, int64_t n, float* y) {
  int64_t c = 0;
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; c + 8 <= n; c += 8) {
    const __m256 v = _mm256_loadu_ps(g + c);
    const __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, drafttree::exp256(_mm256_sub_ps(zero, v))));
    _mm256_storeu_ps(y + c, _mm256_mul_ps(s, _mm256_loadu_ps(u + c)));
  }
  for (; c < n; ++c) y[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
}

}  // namespace

// x [..., H] float32, w [H] -> [..., H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "rms_norm: float32 only");
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.numel() == H, "rms_norm: weight size differs from the last dimension");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty_like(x);
  const int64_t rows = H ? x.numel() / H : 0;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (isa == kAvx512) rms_row_avx512(xp + r * H, wp, H, e, yp + r * H);
      else if (isa == kAvx2) rms_row_avx2(xp + r * H, wp, H, e, yp + r * H);
      else rms_row_scalar(xp + r * H, wp, H, e, yp + r * H);
    }
  });
  return y;
}

// gate_up [T, 2n] (gate first) -> [T, n]
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t isa) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_mul: float32 [T, 2n] only");
  gate_up = gate_up.contiguous();
  const int64_t T = gate_up.size(0), n = gate_up.size(1) / 2;
  auto y = torch::empty({T, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = gp + t * 2 * n, *u = g + n;
      if (isa == kAvx512) silu_row_avx512(g, u, n, yp + t * n);
      else if (isa == kAvx2) silu_row_avx2(g, u, n, yp + t * n);
      else silu_row_scalar(g, u, n, yp + t * n);
    }
  });
  return y;
}
