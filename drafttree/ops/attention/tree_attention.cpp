// Softmax attention of a few new rows (a decode step or a draft tree) against a KV cache, one query row
// at a time (with AVX2 or AVX-512, the query heads sharing a kv head side by side). Reference: naive.py.
//
// Why a kernel: a batched matmul may sum in a different order for different batch shapes, so a tree
// verify and a one-token step could round differently and, on a quantized path, cross an int8 rounding
// boundary. Here each row's scores, softmax and weighted sum run over exactly its visible keys, in key
// order, with the same instructions whatever the number of rows: a tree node's output is bit-identical
// to the one-token step at the same position on the same path.
//
// Row r of q (stacked as [kv_heads, group * T, d], r = g * T + t) sees every cached key before `past`
// and, among the T new keys, key i when visible[t, i] (causal when no mask is given).
//
// Keys and values are float32 or float16 (the kernel paths' KV caches: a decode step reads every cached row, and on
// a small CPU that is memory-bound, so half the bytes); float16 rows are widened exactly to float32 as they load,
// and everything after runs as for float32 rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../vec_math.h"

namespace {

using drafttree::exp256;
using drafttree::exp512;

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// ---- K/V rows as stored: float32, or float16 bits (uint16_t) widened on load -------------------------------
inline float kv_at(const float* p) { return *p; }
inline float kv_at(const uint16_t* p) { return c10::detail::fp16_ieee_to_fp32_value(*p); }
__attribute__((target("avx512f"))) inline __m512 kv16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 kv16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 kv8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 kv8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ---- one query row ---------------------------------------------------------------------------------
// keys/values: rows `d` elements apart; `idx` lists the visible key rows in order; `w` is n floats of scratch.
template <typename KV>
struct Row {
  const float* q;
  const KV* keys;
  const KV* values;
  const int32_t* idx;
  int64_t n, d;
  float scale;
  float* w;
  float* out;
};

template <typename KV>
void row_scalar(const Row<KV>& a) {
  float m = -INFINITY;
  for (int64_t j = 0; j < a.n; ++j) {
    const KV* k = a.keys + a.idx[j] * a.d;
    float s = 0.f;
    for (int64_t c = 0; c < a.d; ++c) s += a.q[c] * kv_at(k + c);
    a.w[j] = s * a.scale;
    m = std::fmax(m, a.w[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < a.n; ++j) sum += (a.w[j] = std::exp(a.w[j] - m));
  for (int64_t c = 0; c < a.d; ++c) a.out[c] = 0.f;
  for (int64_t j = 0; j < a.n; ++j) {
    const KV* v = a.values + a.idx[j] * a.d;
    for (int64_t c = 0; c < a.d; ++c) a.out[c] += a.w[j] * kv_at(v + c);
  }
  const float inv = 1.f / sum;
  for (int64_t c = 0; c < a.d; ++c) a.out[c] *= inv;
}

// d must be a multiple of 16 (the caller falls back to the scalar row otherwise).
template <typename KV>
__attribute__((target("avx512f"))) void row_avx512(const Row<KV>& a) {
  const int64_t nv = a.d / 16;
  __m512 q[8];  // head_dim <= 128
  for (int64_t c = 0; c < nv; ++c) q[c] = _mm512_loadu_ps(a.q + 16 * c);
  float m = -INFINITY;
  for (int64_t j = 0; j < a.n; ++j) {
    const KV* k = a.keys + a.idx[j] * a.d;
    __m512 acc = _mm512_mul_ps(q[0], kv16(k));
    for (int64_t c = 1; c < nv; ++c) acc = _mm512_fmadd_ps(q[c], kv16(k + 16 * c), acc);
    a.w[j] = _mm512_reduce_add_ps(acc) * a.scale;
    m = std::fmax(m, a.w[j]);
  }
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= a.n; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(a.w + j), vm));
    _mm512_storeu_ps(a.w + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (j < a.n) {
    const __mmask16 mk = __mmask16((1u << (a.n - j)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, a.w + j), vm));
    _mm512_mask_storeu_ps(a.w + j, mk, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mk, e));
  }
  const float sum = _mm512_reduce_add_ps(vsum);
  __m512 o[8];
  for (int64_t c = 0; c < nv; ++c) o[c] = _mm512_setzero_ps();
  for (j = 0; j < a.n; ++j) {
    const KV* v = a.values + a.idx[j] * a.d;
    const __m512 p = _mm512_set1_ps(a.w[j]);
    for (int64_t c = 0; c < nv; ++c) o[c] = _mm512_fmadd_ps(p, kv16(v + 16 * c), o[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(a.out + 16 * c, _mm512_mul_ps(o[c], inv));
}

// The 16 horizontal sums of v[0..15] as one vector (lane j = sum of v[j]'s lanes): a fixed network of
// 128-bit shuffles and adds, in _mm512_reduce_add_ps's pairwise order (so the same bits as 16 of those).
__attribute__((target("avx512f"))) inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // [x0 x1 y0 y1] + [x2 x3 y2 y3]: 8 partials of x = v[2i], y = v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: 4 partials of one key (keys 4i .. 4i+3 in lane order)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane L: 2 partials each of b[2i]'s and b[2i+1]'s key L
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  // r's lane 4a + b holds the sum of key a + (0, 8, 4, 12)[b]
  const __m512 r = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  // output lane j takes r's lane holding key j
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// The scores of one query (NV vectors) against 16 key rows of a chunk (kn live, the rest zero), each key's
// products summed in the same order wherever its row comes from.
template <int NV, typename K, typename KeyRow>
__attribute__((target("avx512f"))) inline __m512 chunk_scores(const __m512* q, int kn, KeyRow key_row) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    if (j >= kn) {
      acc[j] = _mm512_setzero_ps();
      continue;
    }
    const K* k = key_row(j);
    acc[j] = _mm512_mul_ps(q[0], kv16(k));
    for (int c = 1; c < NV; ++c) acc[j] = _mm512_fmadd_ps(q[c], kv16(k + 16 * c), acc[j]);
  }
  return hsum16(acc);
}

// G query rows that see the same keys (the query heads of one kv head at one position), NV = d / 16. The
// scores come 16 keys at a time (a partial last chunk as if padded with zero keys), so a row's result is a
// function of its query and its visible keys alone: the same bits in a one-token step and in a tree, and
// whatever G (tests/ops). Each value row is loaded once for all G rows; a key row once per row (16 keys x G
// rows of accumulators would not fit the 32 vector registers), the repeats from L1. float16 keys are widened
// once per chunk into a float32 copy the G rows read (widening costs two vector uops a vector, on the ports the
// multiply-adds use: done per row it was as dear as the products); the same floats, so the same bits.
template <typename KV, int G, int NV>
__attribute__((target("avx512f"))) void rows_avx512(const Row<KV>* r) {
  const Row<KV>& a = r[0];  // keys, values, idx, n, d, scale: shared by the G rows
  constexpr bool kWiden = std::is_same<KV, uint16_t>::value && G > 1;
  alignas(64) float widened[kWiden ? 16 * 16 * NV : 1];
  __m512 q[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) q[g][c] = _mm512_loadu_ps(r[g].q + 16 * c);
  __m512 vmax[G];
  for (int g = 0; g < G; ++g) vmax[g] = _mm512_set1_ps(-INFINITY);
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < a.n; j0 += 16) {
    const int kn = static_cast<int>(std::min<int64_t>(16, a.n - j0));
    const __mmask16 mk = __mmask16((1u << kn) - 1);  // kn <= 16: all 16 bits at most
    if constexpr (kWiden)
      for (int j = 0; j < kn; ++j)
        for (int c = 0; c < NV; ++c)
          _mm512_store_ps(widened + (j * NV + c) * 16, kv16(a.keys + a.idx[j0 + j] * a.d + 16 * c));
    for (int g = 0; g < G; ++g) {
      __m512 scores;
      if constexpr (kWiden)
        scores = chunk_scores<NV, float>(q[g], kn, [&](int j) { return widened + j * NV * 16; });
      else
        scores = chunk_scores<NV, KV>(q[g], kn, [&](int j) { return a.keys + a.idx[j0 + j] * a.d; });
      const __m512 sc = _mm512_mul_ps(scores, scale);
      _mm512_mask_storeu_ps(r[g].w + j0, mk, sc);
      vmax[g] = _mm512_mask_max_ps(vmax[g], mk, vmax[g], sc);
    }
  }
  float sum[G];
  for (int g = 0; g < G; ++g) {
    const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[g]));
    float* w = r[g].w;
    __m512 vsum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= a.n; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(w + j), vm));
      _mm512_storeu_ps(w + j, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (j < a.n) {
      const __mmask16 mk = __mmask16((1u << (a.n - j)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, w + j), vm));
      _mm512_mask_storeu_ps(w + j, mk, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mk, e));
    }
    sum[g] = _mm512_reduce_add_ps(vsum);
  }
  __m512 o[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < a.n; ++j) {
    const KV* v = a.values + a.idx[j] * a.d;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = kv16(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(r[g].w[j]);
      for (int c = 0; c < NV; ++c) o[g][c] = _mm512_fmadd_ps(p, vv[c], o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(r[g].out + 16 * c, _mm512_mul_ps(o[g][c], inv));
  }
}

template <typename KV>
using GroupFn = void (*)(const Row<KV>*);

// The grouped kernel for head_dim d: (kernel by group size - 1, the largest group), or {nullptr, 0} (then
// one row at a time). Query heads beyond the largest group run in further groups, with the same bits.
template <typename KV>
struct Grouped {
  const GroupFn<KV>* fns;
  int64_t max_group;
};
template <typename KV>
Grouped<KV> grouped_avx512(int64_t d) {
  static const GroupFn<KV> d64[4] = {rows_avx512<KV, 1, 4>, rows_avx512<KV, 2, 4>, rows_avx512<KV, 3, 4>,
                                     rows_avx512<KV, 4, 4>};
  static const GroupFn<KV> d128[2] = {rows_avx512<KV, 1, 8>, rows_avx512<KV, 2, 8>};
  if (d == 64) return {d64, 4};
  if (d == 128) return {d128, 2};
  return {nullptr, 0};
}

__attribute__((target("avx2,fma,f16c"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(w[j] - m) in place over n scores, 8 at a time, the tail one lane at a time through the same
// polynomial; returns their sum (the vector part reduced by hsum256, then the tail in order).
__attribute__((target("avx2,fma,f16c"))) float softmax_numerators_avx2(float* w, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(w + j), vm));
    _mm256_storeu_ps(w + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum256(vsum);
  for (; j < n; ++j) {
    alignas(32) float lane[8] = {w[j] - m, 0, 0, 0, 0, 0, 0, 0};
    _mm256_store_ps(lane, exp256(_mm256_load_ps(lane)));
    sum += (w[j] = lane[0]);
  }
  return sum;
}

// d must be a multiple of 8.
template <typename KV>
__attribute__((target("avx2,fma,f16c"))) void row_avx2(const Row<KV>& a) {
  const int64_t nv = a.d / 8;
  float m = -INFINITY;
  for (int64_t j = 0; j < a.n; ++j) {
    const KV* k = a.keys + a.idx[j] * a.d;
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a.q), kv8(k));
    for (int64_t c = 1; c < nv; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.q + 8 * c), kv8(k + 8 * c), acc);
    a.w[j] = hsum256(acc) * a.scale;
    m = std::fmax(m, a.w[j]);
  }
  const float sum = softmax_numerators_avx2(a.w, a.n, m);
  for (int64_t c0 = 0; c0 < nv; c0 += 4) {  // 4 output vectors at a time: 16 registers
    const int64_t cn = std::min<int64_t>(4, nv - c0);
    __m256 o[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t j = 0; j < a.n; ++j) {
      const KV* v = a.values + a.idx[j] * a.d + 8 * c0;
      const __m256 p = _mm256_set1_ps(a.w[j]);
      for (int64_t c = 0; c < cn; ++c) o[c] = _mm256_fmadd_ps(p, kv8(v + 8 * c), o[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int64_t c = 0; c < cn; ++c) _mm256_storeu_ps(a.out + 8 * (c0 + c), _mm256_mul_ps(o[c], inv));
  }
}

// The 8 horizontal sums of v[0..7] as one vector (lane j = hsum256(v[j]), the same bits): hsum256's three
// pairwise steps (128-bit halves, then lanes 2 apart, then neighbours) for 8 keys at once.
__attribute__((target("avx2,fma,f16c"))) inline __m256 hsum8(const __m256* v) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // 128-bit lane 0: v[2i]'s low + high half; lane 1: v[2i+1]'s
    a[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20), _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // each 128-bit lane: [x0+x2, x1+x3] of two keys
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  // lanes hold the sums of keys 0 2 4 6 | 1 3 5 7
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// G query rows that see the same keys, NV = d / 8: row_avx2's bits (tests/ops), with the scores of 8 keys
// at a time (8 independent accumulator chains, one shuffle network instead of 8 horizontal sums) and each
// value row loaded once for all G rows.
template <typename KV, int G, int NV>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Row<KV>* r) {
  const Row<KV>& a = r[0];  // keys, values, idx, n, d, scale: shared by the G rows
  const __m256 scale = _mm256_set1_ps(a.scale);
  float m[G];
  for (int g = 0; g < G; ++g) {
    __m256 q[NV];
    for (int c = 0; c < NV; ++c) q[c] = _mm256_loadu_ps(r[g].q + 8 * c);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < a.n; j0 += 8) {
      const int kn = static_cast<int>(std::min<int64_t>(8, a.n - j0));
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) {
        if (j >= kn) {
          acc[j] = _mm256_setzero_ps();
          continue;
        }
        const KV* k = a.keys + a.idx[j0 + j] * a.d;
        acc[j] = _mm256_mul_ps(q[0], kv8(k));
        for (int c = 1; c < NV; ++c) acc[j] = _mm256_fmadd_ps(q[c], kv8(k + 8 * c), acc[j]);
      }
      const __m256 sc = _mm256_mul_ps(hsum8(acc), scale);
      if (kn == 8) {
        _mm256_storeu_ps(r[g].w + j0, sc);
        vmax = _mm256_max_ps(vmax, sc);
      } else {  // the missing keys' lanes are neither stored nor part of the max
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(kn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(r[g].w + j0, live, sc);
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, sc, _mm256_castsi256_ps(live)));
      }
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    m[g] = *std::max_element(lanes, lanes + 8);
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = 1.f / softmax_numerators_avx2(r[g].w, a.n, m[g]);
  constexpr int CW = std::min(4, 12 / G);  // output vectors per pass: G * CW accumulators
  for (int c0 = 0; c0 < NV; c0 += CW) {
    const int cn = std::min(CW, NV - c0);
    __m256 o[G][CW];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CW; ++c) o[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < a.n; ++j) {
      const KV* v = a.values + a.idx[j] * a.d + 8 * c0;
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_set1_ps(r[g].w[j]);
        for (int c = 0; c < cn; ++c) o[g][c] = _mm256_fmadd_ps(p, kv8(v + 8 * c), o[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 s = _mm256_set1_ps(inv[g]);
      for (int c = 0; c < cn; ++c) _mm256_storeu_ps(r[g].out + 8 * (c0 + c), _mm256_mul_ps(o[g][c], s));
    }
  }
}

template <typename KV>
Grouped<KV> grouped_avx2(int64_t d) {
  static const GroupFn<KV> d64[4] = {rows_avx2<KV, 1, 8>, rows_avx2<KV, 2, 8>, rows_avx2<KV, 3, 8>, rows_avx2<KV, 4, 8>};
  static const GroupFn<KV> d128[4] = {rows_avx2<KV, 1, 16>, rows_avx2<KV, 2, 16>, rows_avx2<KV, 3, 16>,
                                      rows_avx2<KV, 4, 16>};
  if (d == 64) return {d64, 4};
  if (d == 128) return {d128, 4};
  return {nullptr, 0};
}

// Every (kv head, group member, new row) item: its query, its output, and the keys it sees.
struct Problem {
  int64_t H, G, T, past, d;
  const bool* visible;  // [T, T] or nullptr (causal)
  const void *keys, *values;  // float, or float16 bits (uint16_t) when `half`
  bool half;
  int64_t key_head_stride, value_head_stride;
  float scale;
  int64_t isa;
};

// The visible keys of new row t, in order: every cached key, then the new ones its mask shows.
int64_t visible_idx(const Problem& pb, int64_t t, int32_t* idx) {
  int64_t n = 0;
  for (int64_t j = 0; j < pb.past; ++j) idx[n++] = static_cast<int32_t>(j);
  for (int64_t i = 0; i < pb.T; ++i)
    if (pb.visible ? pb.visible[t * pb.T + i] : i <= t) idx[n++] = static_cast<int32_t>(pb.past + i);
  return n;
}

// Every item of several problems (one per request of a batch) in one parallel loop; q_and_out(p, h, g, t)
// gives problem p's query and output rows. An item runs the same instructions whatever else is in the
// loop, so a request's rows get the same bits alone or batched.
template <typename KV, typename QOut>
void run_rows_of(const std::vector<Problem>& pbs, QOut q_and_out) {
  const Problem& first = pbs.front();  // d and isa are the same for every problem
  int64_t fast = first.isa;
  if ((fast == kAvx512 && (first.d % 16 || first.d > 128)) || (fast == kAvx2 && first.d % 8)) fast = kScalar;
  const Grouped<KV> grouped = fast == kAvx512 ? grouped_avx512<KV>(first.d)
                              : fast == kAvx2 ? grouped_avx2<KV>(first.d) : Grouped<KV>{nullptr, 0};
  // one item per (kv head, new row, group of its query heads) when grouped: they see the same keys
  const int64_t gs = grouped.fns ? std::min(first.G, grouped.max_group) : 1, groups = (first.G + gs - 1) / gs;
  std::vector<int64_t> ends(pbs.size());
  int64_t total = 0, widest = 0;
  for (size_t p = 0; p < pbs.size(); ++p) {
    total += pbs[p].H * pbs[p].T * (grouped.fns ? groups : pbs[p].G);
    ends[p] = total;
    widest = std::max(widest, pbs[p].past + pbs[p].T);
  }
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> idx(widest);
    std::vector<float> w(gs * widest);
    Row<KV> rows[4];
    int64_t p = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (int64_t it = begin; it < end; ++it) {
      while (it >= ends[p]) ++p;
      const Problem& pb = pbs[p];
      const int64_t local = it - (p ? ends[p - 1] : 0);
      if (grouped.fns) {
        const int64_t h = local / (pb.T * groups), t = local / groups % pb.T, g0 = local % groups * gs;
        const int64_t n = visible_idx(pb, t, idx.data()), gn = std::min(gs, pb.G - g0);
        for (int64_t g = 0; g < gn; ++g) {
          const auto [q, out] = q_and_out(p, h, g0 + g, t);
          rows[g] = Row<KV>{q, static_cast<const KV*>(pb.keys) + h * pb.key_head_stride,
                            static_cast<const KV*>(pb.values) + h * pb.value_head_stride, idx.data(), n, pb.d,
                            pb.scale, w.data() + g * widest, out};
        }
        grouped.fns[gn - 1](rows);
        continue;
      }
      const int64_t h = local / (pb.G * pb.T), g = local / pb.T % pb.G, t = local % pb.T;
      const int64_t n = visible_idx(pb, t, idx.data());
      const auto [q, out] = q_and_out(p, h, g, t);
      const Row<KV> row{q, static_cast<const KV*>(pb.keys) + h * pb.key_head_stride,
                        static_cast<const KV*>(pb.values) + h * pb.value_head_stride, idx.data(), n, pb.d, pb.scale,
                        w.data(), out};
      if (fast == kAvx512)
        row_avx512(row);
      else if (fast == kAvx2)
        row_avx2(row);
      else
        row_scalar(row);
    }
  });
}

// run_rows_of for the problems' K/V storage (one kind per call: a model's caches share it).
template <typename QOut>
void run_rows(const std::vector<Problem>& pbs, QOut q_and_out) {
  if (pbs.empty()) return;
  for (const Problem& pb : pbs) TORCH_CHECK(pb.half == pbs.front().half, "tree_attention: K/V dtypes differ");
  if (pbs.front().half)
    run_rows_of<uint16_t>(pbs, q_and_out);
  else
    run_rows_of<float>(pbs, q_and_out);
}

// The rotation below, 8 lanes at a time: per element the same two rounded products and one add (the sources are built
// with -ffp-contract=off, so the scalar loop does not fuse them either), hence the same bits. AVX2 serves the AVX-512
// path too: a head is 4-8 vectors, too few for wider ones to matter.
__attribute__((target("avx2"))) void rotate_avx2(const float* x, const float* cos, const float* sin, int64_t half,
                                                 float* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t c = 0; c < half; c += 8) {
    const __m256 lo = _mm256_loadu_ps(x + c), hi = _mm256_loadu_ps(x + half + c);
    _mm256_storeu_ps(out + c, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + c)),
                                            _mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_loadu_ps(sin + c))));
    _mm256_storeu_ps(out + half + c, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + c)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + c))));
  }
}

// Optional per-head RMSNorm (qwen3-style q_norm / k_norm) then rotate-half RoPE of one head, as
// layers.RMSNorm and layers.apply_rotary compute them: x*cos + rotated*sin, each product rounded.
void rope(const float* src, const float* cos, const float* sin, int64_t d, const float* norm_w, float eps, float* out,
          int64_t isa) {
  float normed[256];
  const float* x = src;
  if (norm_w) {
    float ss = 0.f;
    for (int64_t c = 0; c < d; ++c) ss += src[c] * src[c];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t c = 0; c < d; ++c) normed[c] = norm_w[c] * (src[c] * r);
    x = normed;
  }
  const int64_t half = d / 2;
  if (isa != kScalar && half % 8 == 0) return rotate_avx2(x, cos, sin, half, out);
  for (int64_t c = 0; c < d; ++c) {
    const float rotated = c < half ? -x[c + half] : x[c - half];
    out[c] = x[c] * cos[c] + rotated * sin[c];
  }
}

// float32 -> float16 bits rounded to nearest even, as c10's fp16_ieee_from_fp32_value and torch's float -> half copy
// round them, with F16C (every AVX2 and AVX-512 CPU has it): a decode step writes 2 x heads x d of them a row and layer.
__attribute__((target("avx2,f16c"))) void to_half_avx2(const float* x, uint16_t* out, int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; c < n; ++c) out[c] = c10::detail::fp16_ieee_from_fp32_value(x[c]);
}
void to_half(const float* x, uint16_t* out, int64_t n, int64_t isa) {
  if (isa != kScalar) return to_half_avx2(x, out, n);
  for (int64_t c = 0; c < n; ++c) out[c] = c10::detail::fp16_ieee_from_fp32_value(x[c]);
}

const bool* mask_ptr(const c10::optional<torch::Tensor>& visible, torch::Tensor& holder, int64_t& T) {
  if (!visible.has_value() || !visible->defined()) return nullptr;
  holder = visible->to(torch::kBool).contiguous();
  TORCH_CHECK(holder.dim() == 2 && holder.size(0) == holder.size(1), "tree_attention: visible must be [T, T]");
  T = holder.size(0);
  return holder.data_ptr<bool>();
}

}  // namespace

// q [Hkv, G*T, d]; keys/values [Hkv, >= past+T, d] with unit stride in d and rows d apart (a KV-cache
// slice); visible: bool [T, T] or None (causal). Returns [Hkv, G*T, d] float32.
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t past,
                             c10::optional<torch::Tensor> visible, double scale, int64_t isa) {
  const bool half = keys.scalar_type() == torch::kHalf;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && (half || keys.scalar_type() == torch::kFloat32) &&
                  values.scalar_type() == keys.scalar_type(),
              "tree_attention: q float32; keys and values float32 or float16, both alike");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "tree_attention: q, keys, values must be 3-D");
  const int64_t H = q.size(0), R = q.size(1), d = q.size(2);
  TORCH_CHECK(keys.size(0) == H && values.size(0) == H && keys.size(2) == d && values.size(2) == d,
              "tree_attention: head counts or head_dim differ");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == d && values.stride(2) == 1 && values.stride(1) == d,
              "tree_attention: keys/values rows must be contiguous");
  // T new rows: the mask's size, or (causal) the keys after `past`.
  torch::Tensor vis_c;
  int64_t T = keys.size(1) - past;
  const bool* vis = mask_ptr(visible, vis_c, T);
  TORCH_CHECK(past >= 0 && T > 0 && past + T <= keys.size(1), "tree_attention: keys must hold past + T rows");
  TORCH_CHECK(R % T == 0, "tree_attention: q rows must be group * T");
  q = q.contiguous();
  auto out = torch::empty({H, R, d}, q.options());
  float* op = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const Problem pb{H, R / T, T, past, d, vis, keys.data_ptr(), values.data_ptr(), half, keys.stride(0),
                   values.stride(0), static_cast<float>(scale), isa};
  run_rows({pb}, [&](int64_t, int64_t h, int64_t g, int64_t t) {
    const int64_t r = (h * pb.G + g) * T + t;
    return std::pair<const float*, float*>{qp + r * d, op + r * d};
  });
  return out;
}

namespace {

// What rope_tree_attention and its batched form share: the checks, the norms, and one request's rows.
struct RopeArgs {
  int64_t n_heads, n_kv, d, width;
  const float *qn, *kn;
  float eps, scale;
  int64_t isa;
};

RopeArgs rope_args(const torch::Tensor& qkv, int64_t d, int64_t n_heads, int64_t n_kv, double scale,
                   const torch::Tensor& qn, const torch::Tensor& kn, double norm_eps, int64_t isa) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32, "rope_tree_attention: float32 tensors only");
  TORCH_CHECK(n_heads % n_kv == 0 && qkv.size(1) == (n_heads + 2 * n_kv) * d,
              "rope_tree_attention: qkv width does not match the heads");
  TORCH_CHECK(d <= 256, "rope_tree_attention: head_dim above 256");
  return RopeArgs{n_heads, n_kv, d, qkv.size(1), qn.defined() ? qn.data_ptr<float>() : nullptr,
                  kn.defined() ? kn.data_ptr<float>() : nullptr, static_cast<float>(norm_eps),
                  static_cast<float>(scale), isa};
}

torch::Tensor norm_weight(const c10::optional<torch::Tensor>& w) {
  return w.has_value() && w->defined() ? w->to(torch::kFloat32).contiguous() : torch::Tensor();
}

// One request's T rows (qkv rows `src`, cos/sin rows `cp`/`sp`): q rotated into qp [n_heads, T, d], k
// rotated and v copied into the cache rows [past, past + T) of kc/vc — [Hkv, Lmax, d], or layer `layer` of
// [L, Hkv, Lmax, d] (addressed in place: a decoder stack's layer loop makes no tensor per layer and request).
// Returns its Problem.
Problem rope_rows(const RopeArgs& a, const float* src, const float* cp, const float* sp, int64_t T,
                  const torch::Tensor& kc, const torch::Tensor& vc, int64_t layer, int64_t past, const bool* vis,
                  float* qp) {
  const bool half = kc.scalar_type() == torch::kHalf;
  TORCH_CHECK((half || kc.scalar_type() == torch::kFloat32) && vc.scalar_type() == kc.scalar_type(),
              "rope_tree_attention: the caches must be float32 or float16, both alike");
  const int64_t lead = kc.dim() - 3;  // 1 for [L, Hkv, Lmax, d]
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && (lead == 0 || lead == 1) && kc.sizes() == vc.sizes() &&
                  kc.size(lead) == a.n_kv && kc.size(lead + 2) == a.d && 0 <= layer &&
                  layer < (lead ? kc.size(0) : 1),
              "rope_tree_attention: kc/vc must be contiguous [Hkv, Lmax, d] or [L, Hkv, Lmax, d] with the layer");
  const int64_t d = a.d, Lmax = kc.size(lead + 1), offset = lead ? layer * kc.stride(0) * kc.element_size() : 0;
  TORCH_CHECK(past >= 0 && past + T <= Lmax, "rope_tree_attention: the cache has no room for T new rows");
  void *kp = static_cast<char*>(kc.data_ptr()) + offset, *vp = static_cast<char*>(vc.data_ptr()) + offset;
  float krot[256];
  for (int64_t t = 0; t < T; ++t) {
    const float* row = src + t * a.width;
    for (int64_t h = 0; h < a.n_heads; ++h)
      rope(row + h * d, cp + t * d, sp + t * d, d, a.qn, a.eps, qp + (h * T + t) * d, a.isa);
    for (int64_t h = 0; h < a.n_kv; ++h) {
      const int64_t at = (h * Lmax + past + t) * d;
      const float* v = row + (a.n_heads + a.n_kv + h) * d;
      if (!half) {
        rope(row + (a.n_heads + h) * d, cp + t * d, sp + t * d, d, a.kn, a.eps, static_cast<float*>(kp) + at, a.isa);
        std::memcpy(static_cast<float*>(vp) + at, v, d * sizeof(float));
        continue;
      }
      // float16 rows rounded to nearest even, as torch's float -> half copy rounds them
      rope(row + (a.n_heads + h) * d, cp + t * d, sp + t * d, d, a.kn, a.eps, krot, a.isa);
      to_half(krot, static_cast<uint16_t*>(kp) + at, d, a.isa);
      to_half(v, static_cast<uint16_t*>(vp) + at, d, a.isa);
    }
  }
  return Problem{a.n_kv, a.n_heads / a.n_kv, T, past, d, vis, kp, vp, half, Lmax * d, Lmax * d, a.scale, a.isa};
}

}  // namespace

// rope_tree_attention for the rows of several requests (row_ends: where each one's rows end in qkv),
// each against its own cache with its own mask, in one call: every request's rows get the bits they get
// alone, without one call (and one thread fork) per request and layer.
// kcs/vcs: per request [Hkv, Lmax, d], or (layer_caches) [L, Hkv, Lmax, d] with `layer` the one to use.
torch::Tensor rope_tree_attention_layer(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                        const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs,
                                        int64_t layer, const std::vector<int64_t>& pasts,
                                        const std::vector<c10::optional<torch::Tensor>>& visibles,
                                        const std::vector<int64_t>& row_ends, int64_t n_heads, int64_t n_kv,
                                        double scale, c10::optional<torch::Tensor> q_norm,
                                        c10::optional<torch::Tensor> k_norm, double norm_eps, int64_t isa) {
  const size_t S = row_ends.size();
  TORCH_CHECK(S > 0 && kcs.size() == S && vcs.size() == S && pasts.size() == S && visibles.size() == S,
              "rope_tree_attention: one cache, past and mask per request");
  TORCH_CHECK(row_ends.back() == qkv.size(0), "rope_tree_attention: row_ends must end at qkv's rows");
  const torch::Tensor qn = norm_weight(q_norm), kn = norm_weight(k_norm);
  const RopeArgs a = rope_args(qkv, kcs[0].size(-1), n_heads, n_kv, scale, qn, kn, norm_eps, isa);
  qkv = qkv.contiguous();
  cos = cos.to(torch::kFloat32).contiguous();
  sin = sin.to(torch::kFloat32).contiguous();
  const int64_t R = qkv.size(0), d = a.d;
  auto qrot = torch::empty({R * n_heads * d}, qkv.options());  // request s: [n_heads, T_s, d] from row_start * n_heads * d
  auto out = torch::empty({R, n_heads * d}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = qrot.data_ptr<float>(), *op = out.data_ptr<float>();
  std::vector<torch::Tensor> masks(S);
  std::vector<Problem> pbs;
  std::vector<int64_t> starts;
  int64_t a0 = 0;
  for (size_t s = 0; s < S; a0 = row_ends[s++]) {
    const int64_t T = row_ends[s] - a0;
    TORCH_CHECK(T > 0, "rope_tree_attention: every request needs a row");
    int64_t Tm = T;
    const bool* vis = mask_ptr(visibles[s], masks[s], Tm);
    TORCH_CHECK(Tm == T, "rope_tree_attention: visible must be [T, T]");
    pbs.push_back(rope_rows(a, src + a0 * a.width, cp + a0 * d, sp + a0 * d, T, kcs[s], vcs[s], layer, pasts[s], vis,
                            qp + a0 * n_heads * d));
    starts.push_back(a0);
  }
  run_rows(pbs, [&](int64_t p, int64_t h, int64_t g, int64_t t) {
    const int64_t head = h * pbs[p].G + g, first = starts[p];
    return std::pair<const float*, float*>{qp + first * n_heads * d + (head * pbs[p].T + t) * d,
                                           op + (first + t) * n_heads * d + head * d};
  });
  return out;
}

// rope_tree_attention for the rows of several requests, each against its own cache [Hkv, Lmax, d].
torch::Tensor rope_tree_attention_batched(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                          const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs,
                                          const std::vector<int64_t>& pasts,
                                          const std::vector<c10::optional<torch::Tensor>>& visibles,
                                          const std::vector<int64_t>& row_ends, int64_t n_heads, int64_t n_kv,
                                          double scale, c10::optional<torch::Tensor> q_norm,
                                          c10::optional<torch::Tensor> k_norm, double norm_eps, int64_t isa) {
  return rope_tree_attention_layer(qkv, cos, sin, kcs, vcs, 0, pasts, visibles, row_ends, n_heads, n_kv, scale,
                                   q_norm, k_norm, norm_eps, isa);
}

// The attention half of a decoder layer in one call: RoPE on q and k of the fused projection qkv
// [T, (Hq + 2 Hkv) d], the new k/v written to the cache rows [past, past + T) of kc/vc [Hkv, Lmax, d],
// then tree_attention. Returns [T, Hq * d] (heads side by side, as the output projection reads them).
torch::Tensor rope_tree_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                                  torch::Tensor vc, int64_t past, c10::optional<torch::Tensor> visible,
                                  int64_t n_heads, int64_t n_kv, double scale, c10::optional<torch::Tensor> q_norm,
                                  c10::optional<torch::Tensor> k_norm, double norm_eps, int64_t isa) {
  return rope_tree_attention_batched(qkv, cos, sin, {kc}, {vc}, {past}, {visible}, {qkv.size(0)}, n_heads, n_kv,
                                     scale, q_norm, k_norm, norm_eps, isa);
}
