// Gated DeltaNet tree verification in one pass per (batch, key head): the fused form of ops/gdn/tree.py.
// Only ancestor pairs (j in anc(i)) carry weight in X, Y and the triangular solve, so each row walks its
// ancestor list: O(n * depth) instead of the composed op's dense O(n^2) Gram products and solve.
//
// The one dense part, [k̂; q̂]·S₀ (2·n·d_k·d_v per value head), is most of the work at 64 nodes. On the SIMD
// paths it is one batched ATen matmul for all heads before the pass (MKL/oneDNN), and the pass reads its rows. Each row of the pass then
// keeps its Uᵢ and Oᵢ columns in registers while its ancestors' U rows stream past, with the row's decays
// e^{Γᵢ−Γⱼ} taken as one vector exp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cfloat>
#include <cmath>
#include <vector>

#include "../vec_math.h"

namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// ---- scalar path: plain loops, the structure the SIMD paths vectorise ----
float dot_scalar(const float* a, const float* b, int64_t n) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y += s * x
void axpy_scalar(float* y, float s, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += s * x[i];
}

// kS[i] = k̂ᵢᵀS₀ and qS[i] = q̂ᵢᵀS₀ for all n rows (S₀ [dk, dv]); the SIMD paths get these from one matmul.
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

// One row's Gram products: kk[t] = k̂ᵢ·k̂_{anc t}, qk[t] = q̂ᵢ·k̂_{anc t}; returns q̂ᵢ·k̂ᵢ.
float gram_row_scalar(const float* ki, const float* qi, const float* k, const int64_t* anc, int64_t d, float* kk,
                      float* qk, int64_t dk) {
  for (int64_t t = 0; t < d; ++t) {
    kk[t] = dot_scalar(ki, k + anc[t] * dk, dk);
    qk[t] = dot_scalar(qi, k + anc[t] * dk, dk);
  }
  return dot_scalar(qi, ki, dk);
}

// Weights below FLT_MIN become 0: deep ancestors' decays underflow (the vector exp stops at e^-87 instead), and
// a subnormal weight makes every multiply-add of its U row take a microcode assist (measured: the 256-node
// bench 4x slower). What is dropped is < 1e-38 of a U row.
inline float flush_tiny(float x) { return std::fabs(x) < FLT_MIN ? 0.f : x; }

// The row's substitution weights: cu[t] = −βᵢ e^{Γᵢ−Γⱼ} (k̂ᵢ·k̂ⱼ), co[t] = e^{Γᵢ−Γⱼ} (q̂ᵢ·k̂ⱼ), j = anc[t].
// Ancestors only: the exponent stays ≤ 0 for g ≤ 0.
void weights_scalar(float gi, float bi, const float* gam, const int64_t* anc, int64_t d, const float* kk,
                    const float* qk, float* cu, float* co) {
  for (int64_t t = 0; t < d; ++t) {
    const float dij = std::exp(gi - gam[anc[t]]);
    cu[t] = flush_tiny(-bi * dij * kk[t]);
    co[t] = flush_tiny(dij * qk[t]);
  }
}

// What one row of one value head computes, given its weights (U's rows [n, dv]; uᵢ, oᵢ are row i's outputs):
//   uᵢ = βᵢ(vᵢ − e^Γᵢ k̂ᵢS₀) + Σ_t cu[t] u_{anc t}       (forward substitution)
//   oᵢ = e^Γᵢ q̂ᵢS₀ + Σ_t co[t] u_{anc t} + (q̂ᵢ·k̂ᵢ) uᵢ     (Y's diagonal: D[i,i] = 1)
struct Row {
  const float *v, *kS, *qS;
  float b, eg, qk_self;
  const float *cu, *co;
  const int64_t* anc;
  int64_t d;
  const float* U;
  float *u, *o;
};

void row_scalar(const Row& R, int64_t dv) {
  for (int64_t c = 0; c < dv; ++c) R.u[c] = R.b * (R.v[c] - R.eg * R.kS[c]);
  for (int64_t c = 0; c < dv; ++c) R.o[c] = R.eg * R.qS[c];
  for (int64_t t = 0; t < R.d; ++t) {
    axpy_scalar(R.u, R.cu[t], R.U + R.anc[t] * dv, dv);
    axpy_scalar(R.o, R.co[t], R.U + R.anc[t] * dv, dv);
  }
  axpy_scalar(R.o, R.qk_self, R.u, dv);
}

// ---- AVX2 + FMA ----
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// lanes [0, m) of a ymm (AVX2 has no mask registers: maskload/maskstore take a vector of sign bits)
__attribute__((target("avx2,fma"))) inline __m256i tail_mask256(int64_t m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// k̂ᵢ·k̂ⱼ and q̂ᵢ·k̂ⱼ together: both share k̂ⱼ's loads.
__attribute__((target("avx2,fma"))) inline void dot2_avx2(const float* ki, const float* qi, const float* kj,
                                                           int64_t dk, float* out_k, float* out_q) {
  const int64_t full = dk - dk % 8;
  __m256 ak = _mm256_setzero_ps(), aq = _mm256_setzero_ps();
  for (int64_t a = 0; a < full; a += 8) {
    const __m256 x = _mm256_loadu_ps(kj + a);
    ak = _mm256_fmadd_ps(_mm256_loadu_ps(ki + a), x, ak);
    aq = _mm256_fmadd_ps(_mm256_loadu_ps(qi + a), x, aq);
  }
  if (full < dk) {
    const __m256i tail = tail_mask256(dk - full);
    const __m256 x = _mm256_maskload_ps(kj + full, tail);
    ak = _mm256_fmadd_ps(_mm256_maskload_ps(ki + full, tail), x, ak);
    aq = _mm256_fmadd_ps(_mm256_maskload_ps(qi + full, tail), x, aq);
  }
  *out_k = hsum256(ak);
  *out_q = hsum256(aq);
}

// Eight row sums at once: lanes [y0 .. y7] of the result are the sums of y0 .. y7.
__attribute__((target("avx2,fma"))) inline __m256 sum8_avx2(__m256 y0, __m256 y1, __m256 y2, __m256 y3, __m256 y4,
                                                             __m256 y5, __m256 y6, __m256 y7) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(y0, y1), _mm256_hadd_ps(y2, y3));  // y0..y3, per 128-bit half
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(y4, y5), _mm256_hadd_ps(y6, y7));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Four ancestors at a time: k̂ᵢ and q̂ᵢ are loaded once per four k̂ⱼ rows, and the eight sums share one
// reduction (one dot at a time spent most of its time reducing single vectors).
__attribute__((target("avx2,fma"))) float gram_row_avx2(const float* ki, const float* qi, const float* k,
                                                         const int64_t* anc, int64_t d, float* kk, float* qk,
                                                         int64_t dk) {
  const int64_t full = dk - dk % 8;
  const __m256i tail = tail_mask256(dk - full);
  int64_t t = 0;
  for (; t + 4 <= d; t += 4) {
    const float* kj[4] = {k + anc[t] * dk, k + anc[t + 1] * dk, k + anc[t + 2] * dk, k + anc[t + 3] * dk};
    __m256 ak[4], aq[4];
    for (int s = 0; s < 4; ++s) ak[s] = aq[s] = _mm256_setzero_ps();
    for (int64_t a = 0; a < full; a += 8) {
      const __m256 x = _mm256_loadu_ps(ki + a), y = _mm256_loadu_ps(qi + a);
      for (int s = 0; s < 4; ++s) {
        const __m256 z = _mm256_loadu_ps(kj[s] + a);
        ak[s] = _mm256_fmadd_ps(x, z, ak[s]);
        aq[s] = _mm256_fmadd_ps(y, z, aq[s]);
      }
    }
    if (full < dk) {
      const __m256 x = _mm256_maskload_ps(ki + full, tail), y = _mm256_maskload_ps(qi + full, tail);
      for (int s = 0; s < 4; ++s) {
        const __m256 z = _mm256_maskload_ps(kj[s] + full, tail);
        ak[s] = _mm256_fmadd_ps(x, z, ak[s]);
        aq[s] = _mm256_fmadd_ps(y, z, aq[s]);
      }
    }
    const __m256 sums = sum8_avx2(ak[0], ak[1], ak[2], ak[3], aq[0], aq[1], aq[2], aq[3]);
    _mm_storeu_ps(kk + t, _mm256_castps256_ps128(sums));
    _mm_storeu_ps(qk + t, _mm256_extractf128_ps(sums, 1));
  }
  for (; t < d; ++t) dot2_avx2(ki, qi, k + anc[t] * dk, dk, kk + t, qk + t);
  float self_k, self_q;
  dot2_avx2(ki, qi, ki, dk, &self_k, &self_q);
  return self_q;
}

__attribute__((target("avx2,fma"))) void weights_avx2(float gi, float bi, const float* gam, const int64_t* anc,
                                                      int64_t d, const float* kk, const float* qk, float* cu,
                                                      float* co) {
  const __m256 vg = _mm256_set1_ps(gi), vnb = _mm256_set1_ps(-bi), sign = _mm256_set1_ps(-0.f),
               tiny = _mm256_set1_ps(FLT_MIN);
  int64_t t = 0;
  for (; t + 8 <= d; t += 8) {
    alignas(32) float gj[8];
    for (int l = 0; l < 8; ++l) gj[l] = gam[anc[t + l]];
    const __m256 dij = drafttree::exp256(_mm256_sub_ps(vg, _mm256_load_ps(gj)));
    const __m256 wu = _mm256_mul_ps(_mm256_mul_ps(vnb, dij), _mm256_loadu_ps(kk + t));
    const __m256 wo = _mm256_mul_ps(dij, _mm256_loadu_ps(qk + t));
    // flush_tiny: keep lanes with |w| ≥ FLT_MIN
    _mm256_storeu_ps(cu + t, _mm256_and_ps(wu, _mm256_cmp_ps(_mm256_andnot_ps(sign, wu), tiny, _CMP_GE_OQ)));
    _mm256_storeu_ps(co + t, _mm256_and_ps(wo, _mm256_cmp_ps(_mm256_andnot_ps(sign, wo), tiny, _CMP_GE_OQ)));
  }
  weights_scalar(gi, bi, gam, anc + t, d - t, kk + t, qk + t, cu + t, co + t);
}

// NV vectors of columns from c0; the last one holds `last` lanes (AVX2 has 16 registers: 2·4 accumulators,
// the two weights and one U vector at a time).
template <int NV>
__attribute__((target("avx2,fma"))) inline void row_block_avx2(const Row& R, int64_t dv, int64_t c0, int64_t last) {
  const __m256i full = _mm256_set1_epi32(-1), tail = tail_mask256(last);
  const __m256 b = _mm256_set1_ps(R.b), eg = _mm256_set1_ps(R.eg);
  __m256 u[NV], o[NV];
  for (int s = 0; s < NV; ++s) {
    const __m256i m = s == NV - 1 ? tail : full;
    const int64_t c = c0 + 8 * s;
    u[s] = _mm256_mul_ps(b, _mm256_fnmadd_ps(eg, _mm256_maskload_ps(R.kS + c, m), _mm256_maskload_ps(R.v + c, m)));
    o[s] = _mm256_mul_ps(eg, _mm256_maskload_ps(R.qS + c, m));
  }
  for (int64_t t = 0; t < R.d; ++t) {
    const float* Uj = R.U + R.anc[t] * dv + c0;
    const __m256 wu = _mm256_broadcast_ss(R.cu + t), wo = _mm256_broadcast_ss(R.co + t);
    for (int s = 0; s < NV; ++s) {
      const __m256 x = _mm256_maskload_ps(Uj + 8 * s, s == NV - 1 ? tail : full);
      u[s] = _mm256_fmadd_ps(wu, x, u[s]);
      o[s] = _mm256_fmadd_ps(wo, x, o[s]);
    }
  }
  const __m256 qs = _mm256_set1_ps(R.qk_self);
  for (int s = 0; s < NV; ++s) {
    const __m256i m = s == NV - 1 ? tail : full;
    _mm256_maskstore_ps(R.u + c0 + 8 * s, m, u[s]);
    _mm256_maskstore_ps(R.o + c0 + 8 * s, m, _mm256_fmadd_ps(qs, u[s], o[s]));
  }
}

__attribute__((target("avx2,fma"))) void row_avx2(const Row& R, int64_t dv) {
  int64_t c0 = 0;
  for (; c0 + 32 <= dv; c0 += 32) row_block_avx2<4>(R, dv, c0, 8);
  const int64_t rest = dv - c0, nv = (rest + 7) / 8, last = rest - 8 * (nv - 1);
  if (nv == 1) row_block_avx2<1>(R, dv, c0, last);
  if (nv == 2) row_block_avx2<2>(R, dv, c0, last);
  if (nv == 3) row_block_avx2<3>(R, dv, c0, last);
}

// ---- AVX-512F: the AVX2 structure at 16 lanes, tails through mask registers ----
__attribute__((target("avx512f"))) inline __mmask16 tail_mask512(int64_t m) {
  return (__mmask16)((1u << m) - 1u);
}

__attribute__((target("avx512f"))) inline void dot2_avx512(const float* ki, const float* qi, const float* kj,
                                                            int64_t dk, float* out_k, float* out_q) {
  const int64_t full = dk - dk % 16;
  __m512 ak = _mm512_setzero_ps(), aq = _mm512_setzero_ps();
  for (int64_t a = 0; a < full; a += 16) {
    const __m512 x = _mm512_loadu_ps(kj + a);
    ak = _mm512_fmadd_ps(_mm512_loadu_ps(ki + a), x, ak);
    aq = _mm512_fmadd_ps(_mm512_loadu_ps(qi + a), x, aq);
  }
  if (full < dk) {
    const __mmask16 tail = tail_mask512(dk - full);
    const __m512 x = _mm512_maskz_loadu_ps(tail, kj + full);
    ak = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, ki + full), x, ak);
    aq = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, qi + full), x, aq);
  }
  *out_k = _mm512_reduce_add_ps(ak);
  *out_q = _mm512_reduce_add_ps(aq);
}

__attribute__((target("avx512f"))) inline __m256 half_sum512(__m512 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

// The AVX2 structure: four ancestors at a time, one reduction for the eight sums.
__attribute__((target("avx512f"))) float gram_row_avx512(const float* ki, const float* qi, const float* k,
                                                         const int64_t* anc, int64_t d, float* kk, float* qk,
                                                         int64_t dk) {
  const int64_t full = dk - dk % 16;
  const __mmask16 tail = tail_mask512(dk - full);
  int64_t t = 0;
  for (; t + 4 <= d; t += 4) {
    const float* kj[4] = {k + anc[t] * dk, k + anc[t + 1] * dk, k + anc[t + 2] * dk, k + anc[t + 3] * dk};
    __m512 ak[4], aq[4];
    for (int s = 0; s < 4; ++s) ak[s] = aq[s] = _mm512_setzero_ps();
    for (int64_t a = 0; a < full; a += 16) {
      const __m512 x = _mm512_loadu_ps(ki + a), y = _mm512_loadu_ps(qi + a);
      for (int s = 0; s < 4; ++s) {
        const __m512 z = _mm512_loadu_ps(kj[s] + a);
        ak[s] = _mm512_fmadd_ps(x, z, ak[s]);
        aq[s] = _mm512_fmadd_ps(y, z, aq[s]);
      }
    }
    if (full < dk) {
      const __m512 x = _mm512_maskz_loadu_ps(tail, ki + full), y = _mm512_maskz_loadu_ps(tail, qi + full);
      for (int s = 0; s < 4; ++s) {
        const __m512 z = _mm512_maskz_loadu_ps(tail, kj[s] + full);
        ak[s] = _mm512_fmadd_ps(x, z, ak[s]);
        aq[s] = _mm512_fmadd_ps(y, z, aq[s]);
      }
    }
    const __m256 sums = sum8_avx2(half_sum512(ak[0]), half_sum512(ak[1]), half_sum512(ak[2]), half_sum512(ak[3]),
                                  half_sum512(aq[0]), half_sum512(aq[1]), half_sum512(aq[2]), half_sum512(aq[3]));
    _mm_storeu_ps(kk + t, _mm256_castps256_ps128(sums));
    _mm_storeu_ps(qk + t, _mm256_extractf128_ps(sums, 1));
  }
  for (; t < d; ++t) dot2_avx512(ki, qi, k + anc[t] * dk, dk, kk + t, qk + t);
  float self_k, self_q;
  dot2_avx512(ki, qi, ki, dk, &self_k, &self_q);
  return self_q;
}

__attribute__((target("avx512f"))) void weights_avx512(float gi, float bi, const float* gam, const int64_t* anc,
                                                       int64_t d, const float* kk, const float* qk, float* cu,
                                                       float* co) {
  const __m512 vg = _mm512_set1_ps(gi), vnb = _mm512_set1_ps(-bi), tiny = _mm512_set1_ps(FLT_MIN);
  for (int64_t t = 0; t < d; t += 16) {
    const int64_t m = d - t < 16 ? d - t : 16;
    const __mmask16 mask = tail_mask512(m);
    alignas(64) float gj[16] = {0.f};
    for (int64_t l = 0; l < m; ++l) gj[l] = gam[anc[t + l]];
    const __m512 dij = drafttree::exp512(_mm512_sub_ps(vg, _mm512_load_ps(gj)));
    const __m512 wu = _mm512_mul_ps(_mm512_mul_ps(vnb, dij), _mm512_maskz_loadu_ps(mask, kk + t));
    const __m512 wo = _mm512_mul_ps(dij, _mm512_maskz_loadu_ps(mask, qk + t));
    // flush_tiny: keep lanes with |w| ≥ FLT_MIN
    _mm512_mask_storeu_ps(cu + t, mask, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(wu), tiny, _CMP_GE_OQ), wu));
    _mm512_mask_storeu_ps(co + t, mask, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(wo), tiny, _CMP_GE_OQ), wo));
  }
}

// NV vectors of columns from c0, the last holding `last` lanes: 2·NV accumulators of 32, U rows stream past.
template <int NV>
__attribute__((target("avx512f"))) inline void row_block_avx512(const Row& R, int64_t dv, int64_t c0, int64_t last) {
  const __mmask16 tail = tail_mask512(last);
  const __m512 b = _mm512_set1_ps(R.b), eg = _mm512_set1_ps(R.eg);
  __m512 u[NV], o[NV];
  for (int s = 0; s < NV; ++s) {
    const __mmask16 m = s == NV - 1 ? tail : (__mmask16)0xFFFF;
    const int64_t c = c0 + 16 * s;
    u[s] = _mm512_mul_ps(b, _mm512_fnmadd_ps(eg, _mm512_maskz_loadu_ps(m, R.kS + c), _mm512_maskz_loadu_ps(m, R.v + c)));
    o[s] = _mm512_mul_ps(eg, _mm512_maskz_loadu_ps(m, R.qS + c));
  }
  for (int64_t t = 0; t < R.d; ++t) {
    const float* Uj = R.U + R.anc[t] * dv + c0;
    const __m512 wu = _mm512_set1_ps(R.cu[t]), wo = _mm512_set1_ps(R.co[t]);
    for (int s = 0; s < NV; ++s) {
      const __m512 x = _mm512_maskz_loadu_ps(s == NV - 1 ? tail : (__mmask16)0xFFFF, Uj + 16 * s);
      u[s] = _mm512_fmadd_ps(wu, x, u[s]);
      o[s] = _mm512_fmadd_ps(wo, x, o[s]);
    }
  }
  const __m512 qs = _mm512_set1_ps(R.qk_self);
  for (int s = 0; s < NV; ++s) {
    const __mmask16 m = s == NV - 1 ? tail : (__mmask16)0xFFFF;
    _mm512_mask_storeu_ps(R.u + c0 + 16 * s, m, u[s]);
    _mm512_mask_storeu_ps(R.o + c0 + 16 * s, m, _mm512_fmadd_ps(qs, u[s], o[s]));
  }
}

__attribute__((target("avx512f"))) void row_avx512(const Row& R, int64_t dv) {
  int64_t c0 = 0;
  for (; c0 + 128 <= dv; c0 += 128) row_block_avx512<8>(R, dv, c0, 16);
  const int64_t rest = dv - c0, nv = (rest + 15) / 16, last = rest - 16 * (nv - 1);
  switch (nv) {
    case 1: row_block_avx512<1>(R, dv, c0, last); break;
    case 2: row_block_avx512<2>(R, dv, c0, last); break;
    case 3: row_block_avx512<3>(R, dv, c0, last); break;
    case 4: row_block_avx512<4>(R, dv, c0, last); break;
    case 5: row_block_avx512<5>(R, dv, c0, last); break;
    case 6: row_block_avx512<6>(R, dv, c0, last); break;
    case 7: row_block_avx512<7>(R, dv, c0, last); break;
    default: break;
  }
}

struct Kernels {
  float (*gram_row)(const float*, const float*, const float*, const int64_t*, int64_t, float*, float*, int64_t);
  void (*weights)(float, float, const float*, const int64_t*, int64_t, const float*, const float*, float*, float*);
  void (*row)(const Row&, int64_t);
};

Kernels kernels_for(int64_t isa) {
  if (isa >= kAvx512) return {gram_row_avx512, weights_avx512, row_avx512};
  if (isa == kAvx2) return {gram_row_avx2, weights_avx2, row_avx2};
  return {gram_row_scalar, weights_scalar, row_scalar};
}

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

// Parent of each node from an ancestor-or-self mask [n, n] (bool): the proper ancestor with the largest index,
// as ops/gdn/tree.py's parents_from_mask (here: its half-dozen small torch ops cost as much as a head's pass).
std::vector<int64_t> parents_from_mask(const torch::Tensor& mask, int64_t n) {
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == n
                  && mask.size(1) == n, "gdn_tree_verify: the mask must be a contiguous bool [n, n] tensor");
  const bool* m = mask.data_ptr<bool>();
  std::vector<int64_t> parents(n, -1);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = n - 1; j >= 0; --j)
      if (j != i && m[i * n + j]) {
        parents[i] = j;
        break;
      }
  return parents;
}

// One (batch, key head): Gram products over ancestor pairs once, then each of its r value heads. kS0, qS0 hold
// its value heads' k̂S₀ and q̂S₀ rows ([r, n, dv] each); the scalar path computes them here (have_kqS false).
void verify_key_head(const float* q, const float* k, const float* v, const float* g, const float* beta,
                     const float* S0, float* kS0, float* qS0, bool have_kqS, float* o, float* u, float* gamma,
                     const Ancestors& A, int64_t n, int64_t dk, int64_t dv, int64_t r, const Kernels& K) {
  const int64_t pairs = (int64_t)A.anc.size();
  std::vector<float> kk(pairs), qk(pairs), qk_self(n), cu(n), co(n);
  for (int64_t i = 0; i < n; ++i)
    qk_self[i] = K.gram_row(k + i * dk, q + i * dk, k, A.anc.data() + A.off[i], A.depth[i], kk.data() + A.off[i],
                            qk.data() + A.off[i], dk);
  for (int64_t h = 0; h < r; ++h) {
    const float* vh = v + h * n * dv;
    const float* gh = g + h * n;
    const float* bh = beta + h * n;
    float* kS = kS0 + h * n * dv;
    float* qS = qS0 + h * n * dv;
    float* uh = u + h * n * dv;
    float* gam = gamma + h * n;
    if (!have_kqS) rows_times_state_scalar(k, q, S0 + h * dk * dv, kS, qS, n, dk, dv);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* anc = A.anc.data() + A.off[i];
      const int64_t d = A.depth[i];
      const int64_t p = d ? anc[d - 1] : -1;
      const float gi = (p >= 0 ? gam[p] : 0.f) + gh[i];  // Γ = path sum, not a cumsum over node order
      gam[i] = gi;
      K.weights(gi, bh[i], gam, anc, d, kk.data() + A.off[i], qk.data() + A.off[i], cu.data(), co.data());
      const Row R{vh + i * dv, kS + i * dv, qS + i * dv, bh[i], flush_tiny(std::exp(gi)), qk_self[i], cu.data(), co.data(),
                  anc, d, uh, uh + i * dv, o + h * n * dv + i * dv};
      K.row(R, dv);
    }
  }
}

}  // namespace

// q, k [B, Hk, n, dk]; v [B, Hv, n, dv]; g, beta [B, Hv, n]; S0 [B, Hv, dk, dv]; tree: parents [n] int64, or the
// bool ancestor-or-self mask [n, n]. Returns {O [B, Hv, n, dv], U [B, Hv, n, dv], Γ [B, Hv, n]}, all float32.
std::vector<torch::Tensor> gdn_tree_verify(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                           torch::Tensor beta, torch::Tensor S0, torch::Tensor tree, int64_t isa) {
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
  std::vector<int64_t> parents;
  if (tree.scalar_type() == torch::kBool) {
    parents = parents_from_mask(tree, n);
  } else {
    TORCH_CHECK(tree.scalar_type() == torch::kInt64 && tree.is_contiguous() && tree.numel() == n,
                "gdn_tree_verify: parents must be contiguous int64 [n] (or pass the bool mask [n, n])");
    parents.assign(tree.data_ptr<int64_t>(), tree.data_ptr<int64_t>() + n);
  }
  const Ancestors A = ancestor_lists(parents.data(), n);
  const Kernels K = kernels_for(isa);
  const int64_t r = Hv / Hk;
  auto o = torch::empty({B, Hv, n, dv}, v.options());
  auto u = torch::empty({B, Hv, n, dv}, v.options());
  auto gamma = torch::empty({B, Hv, n}, v.options());
  // k̂S₀ and q̂S₀ per value head: [2, B·Hv, n, dv]. On the SIMD paths two batched GEMMs (ATen's bmm: MKL/oneDNN)
  // fill it for all heads before the pass; a key head's k̂, q̂ are repeated for its r value heads (n·dk each,
  // small beside the dk·dv state). bmm on 3-D contiguous operands: torch::matmul's 5-D broadcast form
  // measured 1.6x slower.
  auto kqS = torch::empty({2, B * Hv, n, dv}, v.options());
  const bool have_kqS = isa != kScalar && n > 0;
  if (have_kqS) {
    auto per_value_head = [&](const torch::Tensor& x) {
      return r == 1 ? x.view({B * Hv, n, dk}) : x.unsqueeze(2).expand({B, Hk, r, n, dk}).reshape({B * Hv, n, dk});
    };
    const auto S = S0.view({B * Hv, dk, dv});
    auto kS = kqS.select(0, 0), qS = kqS.select(0, 1);
    torch::bmm_out(kS, per_value_head(k), S);
    torch::bmm_out(qS, per_value_head(q), S);
  }
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *sp = S0.data_ptr<float>();
  float *op = o.data_ptr<float>(), *up = u.data_ptr<float>(), *gam = gamma.data_ptr<float>(), *kqp = kqS.data_ptr<float>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t hv0 = (bh / Hk) * Hv + (bh % Hk) * r;  // first value head of this key head
      verify_key_head(qp + bh * n * dk, kp + bh * n * dk, vp + hv0 * n * dv, gp + hv0 * n, bp + hv0 * n,
                      sp + hv0 * dk * dv, kqp + hv0 * n * dv, kqp + (B * Hv + hv0) * n * dv, have_kqS, op + hv0 * n * dv, up + hv0 * n * dv,
                      gam + hv0 * n, A, n, dk, dv, r, K);
    }
  });
  return {o, u, gamma};
}
