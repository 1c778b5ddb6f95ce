// Gated DeltaNet tree verification in one pass per (batch, key head): the fused form of ops/gdn/tree.py.
// Only ancestor pairs (j in anc(i)) carry weight in X, Y and the triangular solve, so each row walks its
// ancestor list: O(n * depth) instead of the composed op's dense O(n^2) Gram products and solve.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

// ---- vector helpers: AVX2+FMA and scalar, same structure ----
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

float dot_scalar(const float* a, const float* b, int64_t n) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y += s * x
__attribute__((target("avx2,fma"))) void axpy_avx2(float* y, float s, const float* x, int64_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += s * x[i];
}

void axpy_scalar(float* y, float s, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += s * x[i];
}

// kS[i] = k̂ᵢᵀS₀ and qS[i] = q̂ᵢᵀS₀ for all n rows (S₀ [dk, dv]): the op's one dense product. 32 columns of
// both outputs stay in 8 registers while S₀'s rows stream past, instead of an axpy per (row, a) through memory.
__attribute__((target("avx2,fma"))) void rows_times_state_avx2(const float* k, const float* q, const float* S,
                                                               float* kS, float* qS, int64_t n, int64_t dk,
                                                               int64_t dv) {
  int64_t c0 = 0;
  for (; c0 + 32 <= dv; c0 += 32) {
    for (int64_t i = 0; i < n; ++i) {
      __m256 ak[4], aq[4];
      for (int t = 0; t < 4; ++t) ak[t] = aq[t] = _mm256_setzero_ps();
      for (int64_t a = 0; a < dk; ++a) {
        const __m256 kb = _mm256_set1_ps(k[i * dk + a]), qb = _mm256_set1_ps(q[i * dk + a]);
        const float* Sa = S + a * dv + c0;
        for (int t = 0; t < 4; ++t) {
          const __m256 s = _mm256_loadu_ps(Sa + 8 * t);
          ak[t] = _mm256_fmadd_ps(kb, s, ak[t]);
          aq[t] = _mm256_fmadd_ps(qb, s, aq[t]);
        }
      }
      for (int t = 0; t < 4; ++t) {
        _mm256_storeu_ps(kS + i * dv + c0 + 8 * t, ak[t]);
        _mm256_storeu_ps(qS + i * dv + c0 + 8 * t, aq[t]);
      }
    }
  }
  for (int64_t i = 0; i < n; ++i)  // leftover columns (dv not a multiple of 32)
    for (int64_t c = c0; c < dv; ++c) {
      float sk = 0.f, sq = 0.f;
      for (int64_t a = 0; a < dk; ++a) {
        sk += k[i * dk + a] * S[a * dv + c];
        sq += q[i * dk + a] * S[a * dv + c];
      }
      kS[i * dv + c] = sk;
      qS[i * dv + c] = sq;
    }
}

void rows_times_state_scalar(const float* k, const float* q, const float* S, float* kS, float* qS, int64_t n,
                             int64_t dk, int64_t dv) {
  std::fill(kS, kS + n * dv, 0.f);
  std::fill(qS, qS + n * dv, 0.f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t a = 0; a < dk; ++a) {
      axpy_scalar(kS + i * dv, k[i * dk + a], S + a * dv, dv);
      axpy_scalar(qS + i * dv, q[i * dk + a], S + a * dv, dv);
    }
}

struct Vec {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float*, float, const float*, int64_t);
  void (*rows_times_state)(const float*, const float*, const float*, float*, float*, int64_t, int64_t, int64_t);
};

// The tree's ancestor lists, root first, flattened: anc[off[i] .. off[i]+depth[i]) are i's strict ancestors.
struct Ancestors {
  std::vector<int64_t> off, depth, anc;
};

Ancestors ancestor_lists(const int64_t* parents, int64_t n) {
  Ancestors a;
  a.off.resize(n);
  a.depth.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = parents[i];
    TORCH_CHECK(p < i, "gdn_tree_verify: nodes must be in topological order (parents[", i, "] = ", p, ")");
    a.off[i] = (int64_t)a.anc.size();
    if (p >= 0) {
      for (int64_t t = 0; t < a.depth[p]; ++t) a.anc.push_back(a.anc[a.off[p] + t]);
      a.anc.push_back(p);
    }
    a.depth[i] = (int64_t)a.anc.size() - a.off[i];
  }
  return a;
}

// One (batch, key head): Gram products over ancestor pairs once, then each of its r value heads.
void verify_key_head(const float* q, const float* k, const float* v, const float* g, const float* beta,
                     const float* S0, float* o, float* u, float* gamma, const Ancestors& A, int64_t n,
                     int64_t dk, int64_t dv, int64_t r, const Vec& V) {
  const int64_t pairs = (int64_t)A.anc.size();
  std::vector<float> kk(pairs), qk(pairs), qk_self(n), kS(n * dv), qS(n * dv);
  for (int64_t i = 0; i < n; ++i) {
    const float* ki = k + i * dk;
    const float* qi = q + i * dk;
    for (int64_t t = 0; t < A.depth[i]; ++t) {
      const float* kj = k + A.anc[A.off[i] + t] * dk;
      kk[A.off[i] + t] = V.dot(ki, kj, dk);
      qk[A.off[i] + t] = V.dot(qi, kj, dk);
    }
    qk_self[i] = V.dot(qi, ki, dk);
  }
  for (int64_t h = 0; h < r; ++h) {
    const float* vh = v + h * n * dv;
    const float* gh = g + h * n;
    const float* bh = beta + h * n;
    const float* Sh = S0 + h * dk * dv;
    float* oh = o + h * n * dv;
    float* uh = u + h * n * dv;
    float* gam = gamma + h * n;
    V.rows_times_state(k, q, Sh, kS.data(), qS.data(), n, dk, dv);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* anc = A.anc.data() + A.off[i];
      const int64_t d = A.depth[i];
      const int64_t p = d ? anc[d - 1] : -1;
      const float gi = (p >= 0 ? gam[p] : 0.f) + gh[i];  // Γ = path sum, not a cumsum over node order
      gam[i] = gi;
      const float egi = std::exp(gi), bi = bh[i];
      float* ui = uh + i * dv;
      float* oi = oh + i * dv;
      // forward substitution: Uᵢ = βᵢ(vᵢ − e^Γᵢ k̂ᵢS₀) − Σ_{j∈anc(i)} βᵢ e^{Γᵢ−Γⱼ} (k̂ᵢ·k̂ⱼ) Uⱼ
      for (int64_t c = 0; c < dv; ++c) ui[c] = bi * (vh[i * dv + c] - egi * kS[i * dv + c]);
      for (int64_t c = 0; c < dv; ++c) oi[c] = egi * qS[i * dv + c];
      for (int64_t t = 0; t < d; ++t) {
        const int64_t j = anc[t];
        const float dij = std::exp(gi - gam[j]);  // ancestors only: the exponent stays ≤ 0 for g ≤ 0
        V.axpy(ui, -bi * dij * kk[A.off[i] + t], uh + j * dv, dv);
        V.axpy(oi, dij * qk[A.off[i] + t], uh + j * dv, dv);
      }
      V.axpy(oi, qk_self[i], ui, dv);  // Y's diagonal: D[i,i] = 1
    }
  }
}

}  // namespace

// q, k [B, Hk, n, dk]; v [B, Hv, n, dv]; g, beta [B, Hv, n]; S0 [B, Hv, dk, dv]; parents [n] int64.
// Returns {O [B, Hv, n, dv], U [B, Hv, n, dv], Γ [B, Hv, n]}, all float32.
std::vector<torch::Tensor> gdn_tree_verify(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                           torch::Tensor beta, torch::Tensor S0, torch::Tensor parents,
                                           int64_t isa) {
  for (const auto& t : {q, k, v, g, beta, S0})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
                "gdn_tree_verify: inputs must be contiguous float32 CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && g.dim() == 3 && beta.sizes() == g.sizes()
                  && S0.dim() == 4, "gdn_tree_verify: q, k [B,Hk,n,dk], v [B,Hv,n,dv], g, beta [B,Hv,n], S0 [B,Hv,dk,dv]");
  const int64_t B = q.size(0), Hk = q.size(1), n = q.size(2), dk = q.size(3), Hv = v.size(1), dv = v.size(3);
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "gdn_tree_verify: value heads must be a multiple of key heads");
  TORCH_CHECK(v.size(0) == B && v.size(2) == n && g.size(0) == B && g.size(1) == Hv && g.size(2) == n
                  && S0.size(0) == B && S0.size(1) == Hv && S0.size(2) == dk && S0.size(3) == dv,
              "gdn_tree_verify: shapes disagree");
  TORCH_CHECK(parents.scalar_type() == torch::kInt64 && parents.is_contiguous() && parents.numel() == n,
              "gdn_tree_verify: parents must be contiguous int64 [n]");
  const Ancestors A = ancestor_lists(parents.data_ptr<int64_t>(), n);
  const Vec V = isa >= 1 ? Vec{dot_avx2, axpy_avx2, rows_times_state_avx2}
                         : Vec{dot_scalar, axpy_scalar, rows_times_state_scalar};
  const int64_t r = Hv / Hk;
  auto o = torch::empty({B, Hv, n, dv}, v.options());
  auto u = torch::empty({B, Hv, n, dv}, v.options());
  auto gamma = torch::empty({B, Hv, n}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *sp = S0.data_ptr<float>();
  float *op = o.data_ptr<float>(), *up = u.data_ptr<float>(), *gam = gamma.data_ptr<float>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t hv0 = (bh / Hk) * Hv + (bh % Hk) * r;  // first value head of this key head
      verify_key_head(qp + bh * n * dk, kp + bh * n * dk, vp + hv0 * n * dv, gp + hv0 * n, bp + hv0 * n,
                      sp + hv0 * dk * dv, op + hv0 * n * dv, up + hv0 * n * dv, gam + hv0 * n, A, n, dk, dv, r, V);
    }
  });
  return {o, u, gamma};
}
