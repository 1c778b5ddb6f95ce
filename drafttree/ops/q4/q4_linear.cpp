// GGUF Q4_1 weights (w = d*q + m per block of 32, q in 0..15, d and m fp16) times int8 activations
// quantized per block of 32 (as llama.cpp's Q8_1), for small batches of rows. Reference: naive.py.
//
// y[t, n] = sum_b sx[t,b] * ( d[n,b] * sum_{k in b} q[n,k] * xq[t,k]  +  m[n,b] * sum_{k in b} xq[t,k] )
//
// The weights are used as the GGUF stores them (no re-quantization): 20 bytes per 32 weights, 0.625
// bytes a weight. Each block's integer dot product is exact; the float sum over blocks runs in block
// order with the same instructions whatever the number of rows, so a row's result does not depend on
// the batch (tree verify == one-token step, bit for bit).
//
// Packed layout (naive.pack_q4): panels of 16 output columns; q as [P][K/8][16][4] bytes whose low nibble
// holds k = 8j..8j+3 and high nibble k = 8j+4..8j+7 of column c; d and m as fp16 [P][K/32][16].
//
// The same kernel runs 8-bit values (q8_linear; w = d*q + m, q in 0..255): GGUF's Q8_0, Q5_0 and Q5_1 as stored
// (Q8_0: q = stored + 128, m = -128*d; Q5_0: m = -16*d), other types requantized per block of 32 (naive.pack_q8).
// Its layout: q as [P][K/4][16][4] bytes, group 2j holding k = 8j..8j+3 and group 2j+1 k = 8j+4..8j+7 of column c,
// so one 64-byte line of each group takes the place of the 4-bit layout's low and high nibbles.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "../kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kPanel = 16, kBlock = 32;
constexpr int kStreamRows = 8;  // VNNI row counts that use the one-panel tiles
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

struct Args {
  const int8_t* x;      // quantized input rows, K bytes apart
  const float* xsum;    // per row, per block: sum of the quantized inputs (an integer), K/32 apart
  const float* xscale;  // per row, per block: the inputs' scale, K/32 apart
  const uint8_t* q;     // first panel of the tile; panels q_stride bytes apart (4-bit: 64 bytes per 8 k, 8-bit: 128)
  const uint16_t* d;    // fp16 block scales / mins of the first panel; panels dm_stride halves apart
  const uint16_t* m;
  int64_t K, q_stride, dm_stride;
  float* acc;           // [TT][NP*16] block-summed floats (before the row scale)
  int64_t prefetch;     // bytes ahead of its weights the tile prefetches (0: none; the panel's first row tile only)
};

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// The values of k = 8j+e (lo) and 8j+4+e (hi) of column c, for e = 0..3.
template <int Bits>
inline int32_t lo_value(const uint8_t* panel, int64_t j, int c, int e) {
  return Bits == 4 ? panel[j * 64 + c * 4 + e] & 15 : panel[j * 128 + c * 4 + e];
}
template <int Bits>
inline int32_t hi_value(const uint8_t* panel, int64_t j, int c, int e) {
  return Bits == 4 ? panel[j * 64 + c * 4 + e] >> 4 : panel[j * 128 + 64 + c * 4 + e];
}

template <int Bits, int NP, int TT>
void tile_scalar(const Args& a) {
  const int64_t nb = a.K / kBlock;
  for (int i = 0; i < TT; ++i)
    for (int p = 0; p < NP; ++p)
      for (int c = 0; c < kPanel; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          int32_t s = 0;
          for (int64_t j = 4 * b; j < 4 * b + 4; ++j) {
            const uint8_t* panel = a.q + p * a.q_stride;
            for (int e = 0; e < 4; ++e) {
              s += lo_value<Bits>(panel, j, c, e) * a.x[i * a.K + 8 * j + e];
              s += hi_value<Bits>(panel, j, c, e) * a.x[i * a.K + 8 * j + 4 + e];
            }
          }
          const float dv = half_to_float(a.d[p * a.dm_stride + b * kPanel + c]);
          const float mv = half_to_float(a.m[p * a.dm_stride + b * kPanel + c]);
          const float v = std::fma(dv, static_cast<float>(s), mv * a.xsum[i * nb + b]);
          acc = std::fma(a.xscale[i * nb + b], v, acc);
        }
        a.acc[i * NP * kPanel + p * kPanel + c] = acc;
      }
}

// Software prefetch of panel p's block b, `pf` bytes ahead (kernels.h: weight_prefetch_bytes): its values and, every
// other block (a 64-byte line holds two blocks' 16 fp16 scales), its d and m as far ahead in their own streams. Panels
// are contiguous, so near a panel's end this fetches the next one's start, which the next tile reads.
template <int Bits>
inline void prefetch_block(const Args& a, int p, int64_t b, int64_t pf) {
  constexpr int64_t block_bytes = Bits == 4 ? 256 : 512;
  const char* ahead = reinterpret_cast<const char*>(a.q + p * a.q_stride + b * block_bytes) + pf;
  for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  if ((b & 1) == 0) {
    const int64_t off = p * a.dm_stride + b * kPanel + pf * 32 / block_bytes / 2;  // in halves: 32 bytes a block
    _mm_prefetch(reinterpret_cast<const char*>(a.d + off), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a.m + off), _MM_HINT_T0);
  }
}

// VNNI: vpdpbusd multiplies the unsigned values (nibbles or bytes) by the signed inputs directly (no offset needed).
template <int Bits, int NP, int TT>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const Args& a) {
  const int64_t nb = a.K / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t pf = a.prefetch;
  __m512 facc[TT][NP];
  for (int i = 0; i < TT; ++i)
    for (int p = 0; p < NP; ++p) facc[i][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (pf)
      for (int p = 0; p < NP; ++p) prefetch_block<Bits>(a, p, b, pf);
    __m512i iacc[TT][NP];
    for (int i = 0; i < TT; ++i)
      for (int p = 0; p < NP; ++p) iacc[i][p] = _mm512_setzero_si512();
    for (int64_t j = 4 * b; j < 4 * b + 4; ++j) {
      __m512i lo[NP], hi[NP];
      for (int p = 0; p < NP; ++p) {
        if (Bits == 4) {
          const __m512i v = _mm512_loadu_si512(a.q + p * a.q_stride + j * 64);
          lo[p] = _mm512_and_si512(v, low);
          hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else {
          lo[p] = _mm512_loadu_si512(a.q + p * a.q_stride + j * 128);
          hi[p] = _mm512_loadu_si512(a.q + p * a.q_stride + j * 128 + 64);
        }
      }
      for (int i = 0; i < TT; ++i) {
        int32_t xa, xb;
        std::memcpy(&xa, a.x + i * a.K + 8 * j, 4);
        std::memcpy(&xb, a.x + i * a.K + 8 * j + 4, 4);
        const __m512i va = _mm512_set1_epi32(xa), vb = _mm512_set1_epi32(xb);
        for (int p = 0; p < NP; ++p) {
          iacc[i][p] = _mm512_dpbusd_epi32(iacc[i][p], lo[p], va);
          iacc[i][p] = _mm512_dpbusd_epi32(iacc[i][p], hi[p], vb);
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      const int64_t off = p * a.dm_stride + b * kPanel;
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.d + off)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.m + off)));
      for (int i = 0; i < TT; ++i) {
        const __m512 v = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(iacc[i][p]),
                                         _mm512_mul_ps(mv, _mm512_set1_ps(a.xsum[i * nb + b])));
        facc[i][p] = _mm512_fmadd_ps(_mm512_set1_ps(a.xscale[i * nb + b]), v, facc[i][p]);
      }
    }
  }
  for (int i = 0; i < TT; ++i)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(a.acc + (i * NP + p) * kPanel, facc[i][p]);
}

// AVX2, one half panel (8 columns) by TT rows: maddubs multiplies unsigned nibbles (<= 15) by signed
// inputs (|x| <= 127) into 16-bit pairs; a block's 16 products per lane stay within 16 * 15 * 127 < 32767,
// so a block is summed in 16 bits and widened once (one madd per block instead of one per 8 inputs). The
// integers are exact, so the result is the same bits as widening every step. 8-bit values are split into their
// nibbles (v = 16 * high + low), each summed so, the high sums widened times 16.
template <int Bits>
__attribute__((target("avx2,fma,f16c"))) inline void nibbles_avx2(const Args& a, int64_t j, int h, int part,
                                                                   __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* line = Bits == 4 ? a.q + j * 64 + h * 32 : a.q + j * 128 + part * 64 + h * 32;
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  lo = _mm256_and_si256(v, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

template <int Bits, int TT>
__attribute__((target("avx2,fma,f16c"))) void half_avx2(const Args& a, int h) {
  const int64_t nb = a.K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  const int64_t pf = h == 0 ? a.prefetch : 0;  // the second half reads the panel from L1
  __m256 facc[TT];
  for (int i = 0; i < TT; ++i) facc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (pf) prefetch_block<Bits>(a, 0, b, pf);
    __m256i s16[TT], t16[TT];  // 4-bit: the block's sums; 8-bit: those of the values' low and high nibbles
    for (int i = 0; i < TT; ++i) s16[i] = t16[i] = _mm256_setzero_si256();
    for (int64_t j = 4 * b; j < 4 * b + 4; ++j) {
      __m256i lo, hi, lo2, hi2;
      nibbles_avx2<Bits>(a, j, h, 0, lo, hi);  // 4-bit: k = 8j..8j+3 and 8j+4..; 8-bit: k = 8j..8j+3, split
      if (Bits == 8) nibbles_avx2<Bits>(a, j, h, 1, lo2, hi2);  // 8-bit: k = 8j+4..8j+7, split
      for (int i = 0; i < TT; ++i) {
        int32_t xa, xb;
        std::memcpy(&xa, a.x + i * a.K + 8 * j, 4);
        std::memcpy(&xb, a.x + i * a.K + 8 * j + 4, 4);
        const __m256i va = _mm256_set1_epi32(xa), vb = _mm256_set1_epi32(xb);
        if (Bits == 4) {
          s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, va), _mm256_maddubs_epi16(hi, vb)));
        } else {
          s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, va), _mm256_maddubs_epi16(lo2, vb)));
          t16[i] = _mm256_add_epi16(t16[i], _mm256_add_epi16(_mm256_maddubs_epi16(hi, va), _mm256_maddubs_epi16(hi2, vb)));
        }
      }
    }
    const int64_t off = b * kPanel + h * 8;
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.d + off)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.m + off)));
    for (int i = 0; i < TT; ++i) {
      __m256i wide = _mm256_madd_epi16(s16[i], ones);
      if (Bits == 8) wide = _mm256_add_epi32(wide, _mm256_madd_epi16(t16[i], sixteens));
      const __m256 isum = _mm256_cvtepi32_ps(wide);
      const __m256 v = _mm256_fmadd_ps(dv, isum, _mm256_mul_ps(mv, _mm256_set1_ps(a.xsum[i * nb + b])));
      facc[i] = _mm256_fmadd_ps(_mm256_set1_ps(a.xscale[i * nb + b]), v, facc[i]);
    }
  }
  for (int i = 0; i < TT; ++i) _mm256_storeu_ps(a.acc + i * kPanel + h * 8, facc[i]);
}

// A panel is two halves: 4 rows x 8 columns keep 4 float and 4 16-bit accumulators live (AVX2 has 16
// registers), and the panel's weights are read again from L1 for the second half.
template <int Bits, int TT>
void tile_avx2(const Args& a) {
  half_avx2<Bits, TT>(a, 0);
  half_avx2<Bits, TT>(a, 1);
}

using TileFn = void (*)(const Args&);

template <int B>
TileFn pick(int64_t isa, bool stream, int np, int tt) {
  static const TileFn vnni[2][4] = {{tile_vnni<B, 1, 1>, tile_vnni<B, 1, 2>, tile_vnni<B, 1, 3>, tile_vnni<B, 1, 4>},
                                    {tile_vnni<B, 2, 1>, tile_vnni<B, 2, 2>, tile_vnni<B, 2, 3>, tile_vnni<B, 2, 4>}};
  static const TileFn avx2[4] = {tile_avx2<B, 1>, tile_avx2<B, 2>, tile_avx2<B, 3>, tile_avx2<B, 4>};
  static const TileFn scalar[2][4] = {
      {tile_scalar<B, 1, 1>, tile_scalar<B, 1, 2>, tile_scalar<B, 1, 3>, tile_scalar<B, 1, 4>},
      {tile_scalar<B, 2, 1>, tile_scalar<B, 2, 2>, tile_scalar<B, 2, 3>, tile_scalar<B, 2, 4>}};
  static const TileFn vnni_rows[kStreamRows] = {tile_vnni<B, 1, 1>, tile_vnni<B, 1, 2>, tile_vnni<B, 1, 3>,
                                                tile_vnni<B, 1, 4>, tile_vnni<B, 1, 5>, tile_vnni<B, 1, 6>,
                                                tile_vnni<B, 1, 7>, tile_vnni<B, 1, 8>};
  if (isa == kAvx512Vnni) return stream ? vnni_rows[tt - 1] : vnni[np - 1][tt - 1];
  if (isa == kAvx2) return avx2[tt - 1];
  return scalar[np - 1][tt - 1];
}

}  // namespace

// Signed int8 quantization of rows of floats (int8_linear.cpp); here each block of 32 is one "row".
void quantize_rows_signed(const torch::Tensor& x, int64_t Kp, int64_t isa, int8_t* q, float* scale);

namespace {

// x [T, K] float32; q uint8 [P, K/8, 16, 4] (4-bit) or [P, K/4, 16, 4] (8-bit); d, m fp16 (as int16) [P, K/32, 16];
// bias float32 [N] or None.
template <int Bits>
torch::Tensor blocks_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                            c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa) {
  const char* name = Bits == 4 ? "q4_linear" : "q8_linear";
  const int64_t k_per_group = Bits == 4 ? 8 : 4;  // the k one group of 4 bytes per column holds
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, name, ": x must be float32 [T, K]");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kUInt8 && q.size(2) == kPanel && q.size(3) == 4 && q.is_contiguous(),
              name, ": q must be packed uint8 [P, K/", k_per_group, ", 16, 4]");
  const int64_t T = x.size(0), K = x.size(1), P = q.size(0), N = n_out, nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && q.size(1) * k_per_group == K && P * kPanel >= N, name,
              ": packed weights do not match x");
  TORCH_CHECK(d.is_contiguous() && m.is_contiguous() && d.numel() == P * nb * kPanel && m.numel() == d.numel(),
              name, ": d/m must be [P, K/32, 16]");
  x = x.contiguous();
  auto xq = torch::empty({T, K}, torch::kInt8);
  auto sx = torch::empty({T, nb}, torch::kFloat32);
  quantize_rows_signed(x.view({T * nb, kBlock}), kBlock, isa, xq.data_ptr<int8_t>(), sx.data_ptr<float>());
  auto xsum = torch::empty({T, nb}, torch::kFloat32);
  {
    const int8_t* xp = xq.data_ptr<int8_t>();
    float* sp = xsum.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int64_t k = 0; k < kBlock; ++k) s += xp[t * K + b * kBlock + k];
        sp[t * nb + b] = static_cast<float>(s);
      }
  }
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  auto y = torch::empty({T, N}, x.options());
  const int8_t* xp = xq.data_ptr<int8_t>();
  const float* sump = xsum.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr());
  const float* sxp = sx.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t q_stride = K / k_per_group * 64, dm_stride = nb * kPanel;
  // VNNI up to 8 rows: one panel by all the rows, so each weight load feeds every row and the panel is
  // read as one sequential stream (the verify of a small tree). Measured on Zen 4, whole target verify:
  // 10-17 % faster at 1-8 rows on 1 thread, 1-7 % on 2; from 9 rows on, 2 x 4 tiles are faster.
  const bool stream = isa == kAvx512Vnni && T <= kStreamRows;
  const int max_np = isa == kAvx2 || stream ? 1 : 2, max_tt = stream ? kStreamRows : 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / q_stride);
  const int64_t prefetch = weight_prefetch_for(T);
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[4 * 2 * kPanel];
    for (int64_t p0 = begin; p0 < end; p0 += max_np) {
      const int np = static_cast<int>(std::min<int64_t>(max_np, end - p0));
      for (int64_t t0 = 0; t0 < T; t0 += max_tt) {
        const int tt = static_cast<int>(std::min<int64_t>(max_tt, T - t0));
        const Args args{xp + t0 * K, sump + t0 * nb, sxp + t0 * nb, qp + p0 * q_stride, dp + p0 * dm_stride,
                        mp + p0 * dm_stride, K, q_stride, dm_stride, acc, t0 == 0 ? prefetch : 0};
        pick<Bits>(isa, stream, np, tt)(args);
        // Whole rows of the tile at once (an element loop with its bounds and bias tests cost 7 % of a
        // 9-token verify on a Zen 3); the same float adds, so the same bits.
        const int cols = np * kPanel;
        const int64_t n0 = p0 * kPanel, width = std::min<int64_t>(cols, N - n0);
        for (int i = 0; i < tt; ++i) {
          const float* src = acc + i * cols;
          float* dst = yp + (t0 + i) * N + n0;
          if (bp)
            for (int64_t c = 0; c < width; ++c) dst[c] = src[c] + bp[n0 + c];
          else
            std::memcpy(dst, src, width * sizeof(float));
        }
      }
    }
  });
  return y;
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                        c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa) {
  return blocks_linear<4>(x, q, d, m, bias, n_out, isa);
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                        c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa) {
  return blocks_linear<8>(x, q, d, m, bias, n_out, isa);
}
