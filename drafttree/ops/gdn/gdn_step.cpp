// One Gated DeltaNet decode step (one token, one layer) in one call: what model/gdn_layer.py's one-token forward
// computes between its two projections. From the in-projection's row [mixed (q|k|v) | z | b | a]:
//   conv:    x_c = silu(Σ_m W[c, m] E[m, c]), E = [conv context (K-1 rows); mixed]; new context = E[1:]
//   q̂, k̂:   l2-normalised per key head (eps 1e-6 inside the root), q̂ scaled by dk^-½
//   gates:   β = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (≤ 0), per value head
//   state:   kS = k̂ᵀS₀, qS = q̂ᵀS₀ (one pass over S₀);  u = β (v − e^g kS);
//            o = e^g qS + (q̂·k̂) u;  S₁ = e^g S₀ + k̂ uᵀ (a second pass, S₀'s head still in cache)
//   norm:    y = w ⊙ rmsnorm(o) ⊙ silu(z), per value head
// The new conv context and S₁ are fresh tensors: the committed state is only read (the commit swaps them in).
// Reference: ops/gdn/step.py (the layer's composed PyTorch ops; an fp64 recurrence as the oracle).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../vec_math.h"

namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline float silu1(float x) { return x / (1.f + std::exp(-x)); }
inline float softplus1(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold

// ---- conv + silu over the C channels of one token (wt [K, C]: the conv weight transposed once) ----
void conv_silu_scalar(const float* ctx, const float* x, const float* wt, int64_t K, int64_t C, float* y) {
  for (int64_t c = 0; c < C; ++c) {
    float acc = 0.f;
    for (int64_t m = 0; m + 1 < K; ++m) acc += wt[m * C + c] * ctx[m * C + c];
    acc += wt[(K - 1) * C + c] * x[c];
    y[c] = silu1(acc);
  }
}

__attribute__((target("avx2,fma"))) void conv_silu_avx2(const float* ctx, const float* x, const float* wt, int64_t K,
                                                        int64_t C, float* y) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t m = 0; m + 1 < K; ++m)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt + m * C + c), _mm256_loadu_ps(ctx + m * C + c), acc);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt + (K - 1) * C + c), _mm256_loadu_ps(x + c), acc);
    _mm256_storeu_ps(y + c, _mm256_div_ps(acc, _mm256_add_ps(one, drafttree::exp256(_mm256_sub_ps(zero, acc)))));
  }
  for (; c < C; ++c) {
    float acc = 0.f;
    for (int64_t m = 0; m + 1 < K; ++m) acc += wt[m * C + c] * ctx[m * C + c];
    acc += wt[(K - 1) * C + c] * x[c];
    y[c] = silu1(acc);
  }
}

__attribute__((target("avx512f"))) void conv_silu_avx512(const float* ctx, const float* x, const float* wt,
                                                         int64_t K, int64_t C, float* y) {
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 mk = C - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c)) - 1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t m = 0; m + 1 < K; ++m)
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, wt + m * C + c), _mm512_maskz_loadu_ps(mk, ctx + m * C + c), acc);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, wt + (K - 1) * C + c), _mm512_maskz_loadu_ps(mk, x + c), acc);
    _mm512_mask_storeu_ps(y + c, mk, _mm512_div_ps(acc, _mm512_add_ps(one, drafttree::exp512(_mm512_sub_ps(zero, acc)))));
  }
}

// ---- one value head's state update: pass 1 (kS, qS), u and o, pass 2 (S₁) ----
// S0, S1 [dk, dv]; q, k [dk] prepared; v, o [dv]; tmp [2 dv] scratch.
void head_scalar(const float* S0, const float* q, const float* k, const float* v, float eg, float beta, float qk,
                 float* S1, float* o, float* tmp, int64_t dk, int64_t dv) {
  float *kS = tmp, *qS = tmp + dv;
  for (int64_t c = 0; c < dv; ++c) kS[c] = qS[c] = 0.f;
  for (int64_t a = 0; a < dk; ++a) {
    const float* Sa = S0 + a * dv;
    for (int64_t c = 0; c < dv; ++c) {
      kS[c] += k[a] * Sa[c];
      qS[c] += q[a] * Sa[c];
    }
  }
  float* u = kS;  // u overwrites kS
  for (int64_t c = 0; c < dv; ++c) {
    u[c] = beta * (v[c] - eg * kS[c]);
    o[c] = eg * qS[c] + qk * u[c];
  }
  for (int64_t a = 0; a < dk; ++a)
    for (int64_t c = 0; c < dv; ++c) S1[a * dv + c] = eg * S0[a * dv + c] + k[a] * u[c];
}

__attribute__((target("avx2,fma"))) void head_avx2(const float* S0, const float* q, const float* k, const float* v,
                                                   float eg, float beta, float qk, float* S1, float* o, float* tmp,
                                                   int64_t dk, int64_t dv) {
  float *kS = tmp, *qS = tmp + dv;
  int64_t c0 = 0;
  for (; c0 + 32 <= dv; c0 += 32) {  // 32 columns of both products in 8 registers while S₀'s rows stream past
    __m256 ak[4], aq[4];
    for (int t = 0; t < 4; ++t) ak[t] = aq[t] = _mm256_setzero_ps();
    for (int64_t a = 0; a < dk; ++a) {
      const __m256 kb = _mm256_set1_ps(k[a]), qb = _mm256_set1_ps(q[a]);
      const float* Sa = S0 + a * dv + c0;
      for (int t = 0; t < 4; ++t) {
        const __m256 s = _mm256_loadu_ps(Sa + 8 * t);
        ak[t] = _mm256_fmadd_ps(kb, s, ak[t]);
        aq[t] = _mm256_fmadd_ps(qb, s, aq[t]);
      }
    }
    for (int t = 0; t < 4; ++t) {
      _mm256_storeu_ps(kS + c0 + 8 * t, ak[t]);
      _mm256_storeu_ps(qS + c0 + 8 * t, aq[t]);
    }
  }
  for (; c0 + 8 <= dv; c0 += 8) {
    __m256 ak = _mm256_setzero_ps(), aq = _mm256_setzero_ps();
    for (int64_t a = 0; a < dk; ++a) {
      const __m256 s = _mm256_loadu_ps(S0 + a * dv + c0);
      ak = _mm256_fmadd_ps(_mm256_set1_ps(k[a]), s, ak);
      aq = _mm256_fmadd_ps(_mm256_set1_ps(q[a]), s, aq);
    }
    _mm256_storeu_ps(kS + c0, ak);
    _mm256_storeu_ps(qS + c0, aq);
  }
  for (; c0 < dv; ++c0) {
    float sk = 0.f, sq = 0.f;
    for (int64_t a = 0; a < dk; ++a) {
      sk += k[a] * S0[a * dv + c0];
      sq += q[a] * S0[a * dv + c0];
    }
    kS[c0] = sk;
    qS[c0] = sq;
  }
  float* u = kS;
  const __m256 veg = _mm256_set1_ps(eg), vb = _mm256_set1_ps(beta), vqk = _mm256_set1_ps(qk);
  int64_t c = 0;
  for (; c + 8 <= dv; c += 8) {
    const __m256 uc = _mm256_mul_ps(vb, _mm256_sub_ps(_mm256_loadu_ps(v + c), _mm256_mul_ps(veg, _mm256_loadu_ps(kS + c))));
    _mm256_storeu_ps(u + c, uc);
    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(vqk, uc, _mm256_mul_ps(veg, _mm256_loadu_ps(qS + c))));
  }
  for (; c < dv; ++c) {
    u[c] = beta * (v[c] - eg * kS[c]);
    o[c] = eg * qS[c] + qk * u[c];
  }
  // S₁ is not read again before the next token (the weights of a whole forward stream past in between): streaming
  // stores skip reading its lines into the cache first, a third of this head's memory traffic
  const bool stream = dv % 8 == 0 && reinterpret_cast<uintptr_t>(S1) % 32 == 0;
  for (int64_t a = 0; a < dk; ++a) {
    const __m256 ka = _mm256_set1_ps(k[a]);
    const float* Sa = S0 + a * dv;
    float* Ta = S1 + a * dv;
    if (stream) {
      for (c = 0; c < dv; c += 8)
        _mm256_stream_ps(Ta + c, _mm256_fmadd_ps(ka, _mm256_loadu_ps(u + c), _mm256_mul_ps(veg, _mm256_loadu_ps(Sa + c))));
      continue;
    }
    for (c = 0; c + 8 <= dv; c += 8)
      _mm256_storeu_ps(Ta + c, _mm256_fmadd_ps(ka, _mm256_loadu_ps(u + c), _mm256_mul_ps(veg, _mm256_loadu_ps(Sa + c))));
    for (; c < dv; ++c) Ta[c] = eg * Sa[c] + k[a] * u[c];
  }
  if (stream) _mm_sfence();
}

__attribute__((target("avx512f"))) void head_avx512(const float* S0, const float* q, const float* k, const float* v,
                                                    float eg, float beta, float qk, float* S1, float* o, float* tmp,
                                                    int64_t dk, int64_t dv) {
  float *kS = tmp, *qS = tmp + dv;
  int64_t c0 = 0;
  for (; c0 + 128 <= dv; c0 += 128) {  // 128 columns of both products in 16 of the 32 registers
    __m512 ak[8], aq[8];
    for (int t = 0; t < 8; ++t) ak[t] = aq[t] = _mm512_setzero_ps();
    for (int64_t a = 0; a < dk; ++a) {
      const __m512 kb = _mm512_set1_ps(k[a]), qb = _mm512_set1_ps(q[a]);
      const float* Sa = S0 + a * dv + c0;
      for (int t = 0; t < 8; ++t) {
        const __m512 s = _mm512_loadu_ps(Sa + 16 * t);
        ak[t] = _mm512_fmadd_ps(kb, s, ak[t]);
        aq[t] = _mm512_fmadd_ps(qb, s, aq[t]);
      }
    }
    for (int t = 0; t < 8; ++t) {
      _mm512_storeu_ps(kS + c0 + 16 * t, ak[t]);
      _mm512_storeu_ps(qS + c0 + 16 * t, aq[t]);
    }
  }
  for (; c0 < dv; c0 += 16) {  // 16 columns at a time, the last ones masked
    const __mmask16 mk = dv - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv - c0)) - 1);
    __m512 ak = _mm512_setzero_ps(), aq = _mm512_setzero_ps();
    for (int64_t a = 0; a < dk; ++a) {
      const __m512 s = _mm512_maskz_loadu_ps(mk, S0 + a * dv + c0);
      ak = _mm512_fmadd_ps(_mm512_set1_ps(k[a]), s, ak);
      aq = _mm512_fmadd_ps(_mm512_set1_ps(q[a]), s, aq);
    }
    _mm512_mask_storeu_ps(kS + c0, mk, ak);
    _mm512_mask_storeu_ps(qS + c0, mk, aq);
  }
  float* u = kS;
  const __m512 veg = _mm512_set1_ps(eg), vb = _mm512_set1_ps(beta), vqk = _mm512_set1_ps(qk);
  for (int64_t c = 0; c < dv; c += 16) {
    const __mmask16 mk = dv - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv - c)) - 1);
    const __m512 uc = _mm512_mul_ps(vb, _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, v + c),
                                                      _mm512_mul_ps(veg, _mm512_maskz_loadu_ps(mk, kS + c))));
    _mm512_mask_storeu_ps(u + c, mk, uc);
    _mm512_mask_storeu_ps(o + c, mk, _mm512_fmadd_ps(vqk, uc, _mm512_mul_ps(veg, _mm512_maskz_loadu_ps(mk, qS + c))));
  }
  const bool stream = dv % 16 == 0 && reinterpret_cast<uintptr_t>(S1) % 64 == 0;  // as in head_avx2
  for (int64_t a = 0; a < dk; ++a) {
    const __m512 ka = _mm512_set1_ps(k[a]);
    const float* Sa = S0 + a * dv;
    float* Ta = S1 + a * dv;
    if (stream) {
      for (int64_t c = 0; c < dv; c += 16)
        _mm512_stream_ps(Ta + c, _mm512_fmadd_ps(ka, _mm512_loadu_ps(u + c), _mm512_mul_ps(veg, _mm512_loadu_ps(Sa + c))));
      continue;
    }
    for (int64_t c = 0; c < dv; c += 16) {
      const __mmask16 mk = dv - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv - c)) - 1);
      _mm512_mask_storeu_ps(Ta + c, mk, _mm512_fmadd_ps(ka, _mm512_maskz_loadu_ps(mk, u + c),
                                                        _mm512_mul_ps(veg, _mm512_maskz_loadu_ps(mk, Sa + c))));
    }
  }
  if (stream) _mm_sfence();
}

// ---- y = w ⊙ (o · rsqrt(mean o² + eps)) ⊙ silu(z) over one value head ----
void gated_norm_scalar(const float* o, const float* z, const float* w, float r, float* y, int64_t dv) {
  for (int64_t c = 0; c < dv; ++c) y[c] = (w[c] * (o[c] * r)) * silu1(z[c]);
}

__attribute__((target("avx2,fma"))) void gated_norm_avx2(const float* o, const float* z, const float* w, float r,
                                                         float* y, int64_t dv) {
  const __m256 vr = _mm256_set1_ps(r), one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= dv; c += 8) {
    const __m256 zc = _mm256_loadu_ps(z + c);
    const __m256 s = _mm256_div_ps(zc, _mm256_add_ps(one, drafttree::exp256(_mm256_sub_ps(zero, zc))));
    _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(w + c), _mm256_mul_ps(_mm256_loadu_ps(o + c), vr)), s));
  }
  for (; c < dv; ++c) y[c] = (w[c] * (o[c] * r)) * silu1(z[c]);
}

__attribute__((target("avx512f"))) void gated_norm_avx512(const float* o, const float* z, const float* w, float r,
                                                          float* y, int64_t dv) {
  const __m512 vr = _mm512_set1_ps(r), one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int64_t c = 0; c < dv; c += 16) {
    const __mmask16 mk = dv - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv - c)) - 1);
    const __m512 zc = _mm512_maskz_loadu_ps(mk, z + c);
    const __m512 s = _mm512_div_ps(zc, _mm512_add_ps(one, drafttree::exp512(_mm512_sub_ps(zero, zc))));
    _mm512_mask_storeu_ps(y + c, mk, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, w + c),
                                                                 _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, o + c), vr)), s));
  }
}

struct Ops {
  void (*conv_silu)(const float*, const float*, const float*, int64_t, int64_t, float*);
  float (*sumsq)(const float*, int64_t);
  void (*head)(const float*, const float*, const float*, const float*, float, float, float, float*, float*, float*,
               int64_t, int64_t);
  void (*gated_norm)(const float*, const float*, const float*, float, float*, int64_t);
};

Ops ops_for(int64_t isa) {
  if (isa >= kAvx512) return {conv_silu_avx512, drafttree::sumsq_avx512, head_avx512, gated_norm_avx512};
  if (isa == kAvx2) return {conv_silu_avx2, drafttree::sumsq_avx2, head_avx2, gated_norm_avx2};
  return {conv_silu_scalar, drafttree::sumsq_scalar, head_scalar, gated_norm_scalar};
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), "gdn_step: ", name,
              " must be a contiguous float32 CPU tensor");
}

}  // namespace

// proj [conv_dim + Hv·dv + 2Hv]: the in-projection's row [q | k | v | z | b | a] (q, k [Hk·dk], v, z [Hv·dv]);
// conv_wt [K, conv_dim] (the conv weight transposed); conv_ctx [K-1, conv_dim]; A_log, dt_bias [Hv]; norm_w [dv];
// S0 [Hv, dk, dv]. Returns {y [1, Hv·dv] (the out-projection's input), new conv context [K-1, conv_dim], S₁}.
std::vector<torch::Tensor> gdn_step(torch::Tensor proj, torch::Tensor conv_wt, torch::Tensor conv_ctx,
                                    torch::Tensor A_log, torch::Tensor dt_bias, torch::Tensor norm_w, torch::Tensor S0,
                                    int64_t Hk, double norm_eps, int64_t isa) {
  check_f32(proj, "proj");
  check_f32(conv_wt, "conv_wt");
  check_f32(conv_ctx, "conv_ctx");
  check_f32(A_log, "A_log");
  check_f32(dt_bias, "dt_bias");
  check_f32(norm_w, "norm_w");
  check_f32(S0, "S0");
  TORCH_CHECK(S0.dim() == 3 && conv_wt.dim() == 2 && conv_ctx.dim() == 2, "gdn_step: S0 [Hv,dk,dv], conv_wt [K,C], conv_ctx [K-1,C]");
  const int64_t Hv = S0.size(0), dk = S0.size(1), dv = S0.size(2), K = conv_wt.size(0), C = conv_wt.size(1);
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "gdn_step: value heads must be a multiple of key heads");
  const int64_t key_dim = Hk * dk, value_dim = Hv * dv;
  TORCH_CHECK(C == 2 * key_dim + value_dim, "gdn_step: conv channels ", C, " != 2·Hk·dk + Hv·dv = ", 2 * key_dim + value_dim);
  TORCH_CHECK(K >= 1 && conv_ctx.size(0) == K - 1 && conv_ctx.size(1) == C, "gdn_step: conv_ctx must be [K-1, C]");
  TORCH_CHECK(proj.numel() == C + value_dim + 2 * Hv, "gdn_step: proj must hold C + Hv·dv + 2·Hv = ",
              C + value_dim + 2 * Hv, " values, got ", proj.numel());
  TORCH_CHECK(A_log.numel() == Hv && dt_bias.numel() == Hv && norm_w.numel() == dv,
              "gdn_step: A_log, dt_bias [Hv] and norm_w [dv]");
  const Ops P = ops_for(isa);
  const int64_t r = Hv / Hk;
  const float* x = proj.data_ptr<float>();
  const float* z = x + C;
  const float* b = z + value_dim;
  const float* a = b + Hv;
  const float* ctx = conv_ctx.data_ptr<float>();

  auto y = torch::empty({1, value_dim}, proj.options());
  auto new_ctx = torch::empty({K - 1, C}, proj.options());
  auto S1 = torch::empty({Hv, dk, dv}, proj.options());
  float* ctx_out = new_ctx.data_ptr<float>();
  if (K > 1) {
    std::memcpy(ctx_out, ctx + C, sizeof(float) * (K - 2) * C);
    std::memcpy(ctx_out + (K - 2) * C, x, sizeof(float) * C);
  }

  std::vector<float> mixed(C), qk_dot(Hk);
  P.conv_silu(ctx, x, conv_wt.data_ptr<float>(), K, C, mixed.data());
  float* q = mixed.data();
  float* k = q + key_dim;
  const float* v = k + key_dim;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int64_t h = 0; h < Hk; ++h) {  // l2norm (eps inside the root) as naive.prepare_qk: q̂ = l2norm(q)·dk^-½
    float* qh = q + h * dk;
    float* kh = k + h * dk;
    const float rq = 1.f / std::sqrt(P.sumsq(qh, dk) + 1e-6f), rk = 1.f / std::sqrt(P.sumsq(kh, dk) + 1e-6f);
    for (int64_t i = 0; i < dk; ++i) {
      qh[i] = (qh[i] * rq) * q_scale;
      kh[i] = kh[i] * rk;
    }
    float s = 0.f;
    for (int64_t i = 0; i < dk; ++i) s += qh[i] * kh[i];
    qk_dot[h] = s;
  }

  const float* Ap = A_log.data_ptr<float>();
  const float* dtp = dt_bias.data_ptr<float>();
  const float* wn = norm_w.data_ptr<float>();
  const float* s0 = S0.data_ptr<float>();
  float* s1 = S1.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float eps = static_cast<float>(norm_eps);
  at::parallel_for(0, Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(2 * dv), o(dv);
    for (int64_t h = begin; h < end; ++h) {
      const int64_t kh = h / r;
      const float beta = 1.f / (1.f + std::exp(-b[h]));
      const float g = -std::exp(Ap[h]) * softplus1(a[h] + dtp[h]);
      P.head(s0 + h * dk * dv, q + kh * dk, k + kh * dk, v + h * dv, std::exp(g), beta, qk_dot[kh], s1 + h * dk * dv,
             o.data(), tmp.data(), dk, dv);
      const float rn = 1.f / std::sqrt(P.sumsq(o.data(), dv) / static_cast<float>(dv) + eps);
      P.gated_norm(o.data(), z + h * dv, wn, rn, yp + h * dv, dv);
    }
  });
  return {y, new_ctx, S1};
}
