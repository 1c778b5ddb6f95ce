// Softmax attention of a few new rows (a decode step or a draft tree) against a KV cache, one query row
// at a time. Reference: naive.py.
//
// Why a kernel: a batched matmul may sum in a different order for different batch shapes, so a tree
// verify and a one-token step could round differently and, on a quantized path, cross an int8 rounding
// boundary. Here each row's scores, softmax and weighted sum run over exactly its visible keys, in key
// order, with the same instructions whatever the number of rows: a tree node's output is bit-identical
// to the one-token step at the same position on the same path.
//
// Row r of q (stacked as [kv_heads, group * T, d], r = g * T + t) sees every cached key before `past`
// and, among the T new keys, key i when visible[t, i] (causal when no mask is given).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// ---- exp on a vector of values <= 0 (Cephes' single-precision polynomial, ~1 ulp) --------------------
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

// ---- one query row ---------------------------------------------------------------------------------
// keys/values: rows `d` floats apart; `idx` lists the visible key rows in order; `w` is n floats of scratch.
struct Row {
  const float* q;
  const float* keys;
  const float* values;
  const int32_t* idx;
  int64_t n, d;
  float scale;
  float* w;
  float* out;
};

void row_scalar(const Row& a) {
  float m = -INFINITY;
  for (int64_t j = 0; j < a.n; ++j) {
    const float* k = a.keys + a.idx[j] * a.d;
    float s = 0.f;
    for (int64_t c = 0; c < a.d; ++c) s += a.q[c] * k[c];
    a.w[j] = s * a.scale;
    m = std::fmax(m, a.w[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < a.n; ++j) sum += (a.w[j] = std::exp(a.w[j] - m));
  for (int64_t c = 0; c < a.d; ++c) a.out[c] = 0.f;
  for (int64_t j = 0; j < a.n; ++j) {
    const float* v = a.values + a.idx[j] * a.d;
    for (int64_t c = 0; c < a.d; ++c) a.out[c] += a.w[j] * v[c];
  }
  const float inv = 1.f / sum;
  for (int64_t c = 0; c < a.d; ++c) a.out[c] *= inv;
}

// d must be a multiple of 16 (the caller falls back to the scalar row otherwise).
__attribute__((target("avx512f"))) void row_avx512(const Row& a) {
  const int64_t nv = a.d / 16;
  __m512 q[8];  // head_dim <= 128
  for (int64_t c = 0; c < nv; ++c) q[c] = _mm512_loadu_ps(a.q + 16 * c);
  float m = -INFINITY;
  for (int64_t j = 0; j < a.n; ++j) {
    const float* k = a.keys + a.idx[j] * a.d;
    __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
    for (int64_t c = 1; c < nv; ++c) acc = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), acc);
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
    const float* v = a.values + a.idx[j] * a.d;
    const __m512 p = _mm512_set1_ps(a.w[j]);
    for (int64_t c = 0; c < nv; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), o[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(a.out + 16 * c, _mm512_mul_ps(o[c], inv));
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// d must be a multiple of 8.
__attribute__((target("avx2,fma"))) void row_avx2(const Row& a) {
  const int64_t nv = a.d / 8;
  float m = -INFINITY;
  for (int64_t j = 0; j < a.n; ++j) {
    const float* k = a.keys + a.idx[j] * a.d;
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a.q), _mm256_loadu_ps(k));
    for (int64_t c = 1; c < nv; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.q + 8 * c), _mm256_loadu_ps(k + 8 * c), acc);
    a.w[j] = hsum256(acc) * a.scale;
    m = std::fmax(m, a.w[j]);
  }
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= a.n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(a.w + j), vm));
    _mm256_storeu_ps(a.w + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum256(vsum);
  for (; j < a.n; ++j) {  // the tail through the same polynomial, one lane at a time
    alignas(32) float lane[8] = {a.w[j] - m, 0, 0, 0, 0, 0, 0, 0};
    _mm256_store_ps(lane, exp256(_mm256_load_ps(lane)));
    sum += (a.w[j] = lane[0]);
  }
  for (int64_t c0 = 0; c0 < nv; c0 += 4) {  // 4 output vectors at a time: 16 registers
    const int64_t cn = std::min<int64_t>(4, nv - c0);
    __m256 o[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (j = 0; j < a.n; ++j) {
      const float* v = a.values + a.idx[j] * a.d + 8 * c0;
      const __m256 p = _mm256_set1_ps(a.w[j]);
      for (int64_t c = 0; c < cn; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), o[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int64_t c = 0; c < cn; ++c) _mm256_storeu_ps(a.out + 8 * (c0 + c), _mm256_mul_ps(o[c], inv));
  }
}

}  // namespace

// q [Hkv, G*T, d]; keys/values [Hkv, >= past+T, d] with unit stride in d and rows d apart (a KV-cache
// slice); visible: bool [T, T] or None (causal). Returns [Hkv, G*T, d] float32.
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t past,
                             c10::optional<torch::Tensor> visible, double scale, int64_t isa) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
                  values.scalar_type() == torch::kFloat32, "tree_attention: float32 tensors only");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "tree_attention: q, keys, values must be 3-D");
  const int64_t H = q.size(0), R = q.size(1), d = q.size(2);
  TORCH_CHECK(keys.size(0) == H && values.size(0) == H && keys.size(2) == d && values.size(2) == d,
              "tree_attention: head counts or head_dim differ");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == d && values.stride(2) == 1 && values.stride(1) == d,
              "tree_attention: keys/values rows must be contiguous");
  // T new rows: the mask's size, or (causal) the keys after `past`.
  const bool* vis = nullptr;
  torch::Tensor vis_c;
  int64_t T = keys.size(1) - past;
  if (visible.has_value() && visible->defined()) {
    vis_c = visible->to(torch::kBool).contiguous();
    TORCH_CHECK(vis_c.dim() == 2 && vis_c.size(0) == vis_c.size(1), "tree_attention: visible must be [T, T]");
    T = vis_c.size(0);
    vis = vis_c.data_ptr<bool>();
  }
  TORCH_CHECK(past >= 0 && T > 0 && past + T <= keys.size(1), "tree_attention: keys must hold past + T rows");
  TORCH_CHECK(R % T == 0, "tree_attention: q rows must be group * T");
  q = q.contiguous();
  auto out = torch::empty({H, R, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t ks = keys.stride(0), vs = values.stride(0);
  float* op = out.data_ptr<float>();
  int64_t fast = isa;
  if ((isa == kAvx512 && (d % 16 || d > 128)) || (isa == kAvx2 && d % 8)) fast = kScalar;
  at::parallel_for(0, H * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> idx(past + T);
    std::vector<float> w(past + T);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / R, r = it % R, t = r % T;
      int64_t n = 0;
      for (int64_t j = 0; j < past; ++j) idx[n++] = static_cast<int32_t>(j);
      for (int64_t i = 0; i < T; ++i)
        if (vis ? vis[t * T + i] : i <= t) idx[n++] = static_cast<int32_t>(past + i);
      const Row row{qp + (h * R + r) * d, kp + h * ks, vp + h * vs, idx.data(), n, d, static_cast<float>(scale),
                    w.data(), op + (h * R + r) * d};
      if (fast == kAvx512)
        row_avx512(row);
      else if (fast == kAvx2)
        row_avx2(row);
      else
        row_scalar(row);
    }
  });
  return out;
}
