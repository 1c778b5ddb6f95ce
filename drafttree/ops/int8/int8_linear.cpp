// int8 x int8 linear for small batches of rows (1..64 tree tokens; prefill too), with AVX-512 VNNI,
// AVX2 and scalar paths chosen by the caller. Reference: naive.py (bit-identical results).
//
// y[t, n] = float(sum_k xq[t, k] * wq[n, k]) * (sx[t] * sw[n]) + bias[n]
// xq/sx: each input row quantized symmetrically to -127..127 here; wq/sw: prepared once (pack.py layout).
//
// Packed weights: panels of 16 output columns, [P = Np/16][Kp/4][16][4] bytes, so one 64-byte load holds
// 4 consecutive k of 16 columns. Each input row's 4 bytes at k are broadcast and one dot-product
// instruction updates 16 column sums: no horizontal reductions, and a weight panel is read from memory
// once per call while the input rows (small, in L1/L2) pass over it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "../kernels.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int kQMax = 127;
constexpr int kPanel = 16;  // output columns per panel

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

// Row-wise quantization exactly as naive.quantize_rows: scale = amax / 127 (1 for a zero row),
// q = round-half-even(x / scale), clamped. `offset` 128 gives the unsigned bytes VNNI multiplies.
template <typename scalar_t>
void quantize_rows(const scalar_t* x, int64_t T, int64_t K, int64_t Kp, int offset, int8_t* q, float* scale) {
  for (int64_t t = 0; t < T; ++t) {
    const scalar_t* row = x + t * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(static_cast<float>(row[k])));
    const float s = amax > 0.f ? amax / static_cast<float>(kQMax) : 1.f;
    scale[t] = s;
    int8_t* out = q + t * Kp;
    for (int64_t k = 0; k < K; ++k) {
      float v = std::nearbyint(static_cast<float>(row[k]) / s);
      v = std::fmin(std::fmax(v, -static_cast<float>(kQMax)), static_cast<float>(kQMax));
      out[k] = static_cast<int8_t>(static_cast<int>(v) + offset);  // offset 128: the uint8 bit pattern
    }
    for (int64_t k = K; k < Kp; ++k) out[k] = static_cast<int8_t>(offset);  // zero after the offset
  }
}

// The same quantization, 16 or 8 floats at a time (division, round-half-even and clamping are exact
// IEEE operations, so the result equals the scalar loop's).
__attribute__((target("avx512f,avx512bw"))) void quantize_row_avx512(const float* row, int64_t K, int64_t Kp,
                                                                     int offset, int8_t* out, float* scale) {
      int64_t k = 0;
      __m512 vmax = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
      float amax = _mm512_reduce_max_ps(vmax);
      for (; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
      const float s = amax > 0.f ? amax / static_cast<float>(kQMax) : 1.f;
      *scale = s;
      const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-kQMax), hi = _mm512_set1_ps(kQMax);
      const __m512i voff = _mm512_set1_epi32(offset);
      for (k = 0; k + 16 <= K; k += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), voff)));
      }
      for (; k < K; ++k) {
        float v = std::fmin(std::fmax(std::nearbyint(row[k] / s), -static_cast<float>(kQMax)), static_cast<float>(kQMax));
        out[k] = static_cast<int8_t>(static_cast<int>(v) + offset);
      }
      for (k = K; k < Kp; ++k) out[k] = static_cast<int8_t>(offset);
}

// AVX2 rows are signed (offset 0): the kernel multiplies |x| by sign(x)*w.
__attribute__((target("avx2"))) void quantize_row_avx2(const float* row, int64_t K, int64_t Kp, int offset,
                                                         int8_t* out, float* scale) {
  int64_t k = 0;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(row + k), absmask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.f;
  for (float v : lanes) amax = std::fmax(amax, v);
  for (; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
  const float s = amax > 0.f ? amax / static_cast<float>(kQMax) : 1.f;
  *scale = s;
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-kQMax), hi = _mm256_set1_ps(kQMax);
  for (k = 0; offset == 0 && k + 8 <= K; k += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(i16, i16));
  }
  for (; k < K; ++k) {
    float v = std::fmin(std::fmax(std::nearbyint(row[k] / s), -static_cast<float>(kQMax)), static_cast<float>(kQMax));
    out[k] = static_cast<int8_t>(static_cast<int>(v) + offset);
  }
  for (k = K; k < Kp; ++k) out[k] = static_cast<int8_t>(offset);
}

void quantize_rows_fast(const float* x, int64_t T, int64_t K, int64_t Kp, int offset, bool avx512, int8_t* q,
                        float* scale) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (avx512)
        quantize_row_avx512(x + t * K, K, Kp, offset, q + t * Kp, scale + t);
      else
        quantize_row_avx2(x + t * K, K, Kp, offset, q + t * Kp, scale + t);
    }
  });
}

// A tile computes acc[i][c] for TT input rows and NP panels (NP*16 columns), c = column in the tile.
struct TileArgs {
  const int8_t* x;   // first input row of the tile, rows Kp bytes apart
  const int8_t* w;   // first panel of the tile, panels panel_stride bytes apart
  int64_t Kp, panel_stride;
  int32_t* acc;      // [TT][NP*16]
  int64_t prefetch;  // bytes ahead of its weights the tile prefetches (0: none; the panels' first row tile only)
};

template <int NP, int TT>
void tile_scalar(const TileArgs& a) {
  for (int i = 0; i < TT; ++i)
    for (int p = 0; p < NP; ++p)
      for (int c = 0; c < kPanel; ++c) {
        int32_t s = 0;
        const int8_t* wp = a.w + p * a.panel_stride + c * 4;
        for (int64_t k = 0; k < a.Kp; k += 4)
          for (int j = 0; j < 4; ++j) s += int32_t(a.x[i * a.Kp + k + j]) * int32_t(wp[k * kPanel + j]);
        a.acc[i * NP * kPanel + p * kPanel + c] = s;
      }
}

// AVX2 has no byte dot product into 32 bits: maddubs multiplies unsigned by signed bytes into
// saturating 16-bit pairs. |x| times sign(x)*w keeps each pair within 2*127*127 < 32767.
template <int NP, int TT>
__attribute__((target("avx2"))) void tile_avx2(const TileArgs& a) {
  constexpr int V = NP * 2;  // 8 columns per ymm
  __m256i acc[TT][V];
  for (int i = 0; i < TT; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t pf = a.prefetch;
  for (int64_t k = 0; k < a.Kp; k += 4) {
    __m256i wv[V];
    for (int p = 0; p < NP; ++p)
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(a.w + p * a.panel_stride + k * kPanel) + pf, _MM_HINT_T0);
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h)
        wv[p * 2 + h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + p * a.panel_stride + k * kPanel + h * 32));
    for (int i = 0; i < TT; ++i) {
      int32_t four;
      std::memcpy(&four, a.x + i * a.Kp + k, 4);
      const __m256i xb = _mm256_set1_epi32(four);
      const __m256i ax = _mm256_sign_epi8(xb, xb);
      for (int v = 0; v < V; ++v) {
        const __m256i prod = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[v], xb));
        acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(prod, ones));
      }
    }
  }
  for (int i = 0; i < TT; ++i)
    for (int v = 0; v < V; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.acc + i * V * 8 + v * 8), acc[i][v]);
}

// AVX-512 VNNI: vpdpbusd multiplies the unsigned x+128 by signed w into 32-bit sums; the 128*sum(w) it
// adds is taken off in the epilogue with the weight column sums.
template <int NP, int TT>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const TileArgs& a) {
  __m512i acc[TT][NP];
  for (int i = 0; i < TT; ++i)
    for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_si512();
  const int64_t pf = a.prefetch;
  for (int64_t k = 0; k < a.Kp; k += 4) {
    __m512i wv[NP];
    for (int p = 0; p < NP; ++p) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(a.w + p * a.panel_stride + k * kPanel) + pf, _MM_HINT_T0);
      wv[p] = _mm512_loadu_si512(a.w + p * a.panel_stride + k * kPanel);
    }
    for (int i = 0; i < TT; ++i) {
      int32_t four;
      std::memcpy(&four, a.x + i * a.Kp + k, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], xb, wv[p]);
    }
  }
  for (int i = 0; i < TT; ++i)
    for (int p = 0; p < NP; ++p) _mm512_storeu_si512(a.acc + (i * NP + p) * kPanel, acc[i][p]);
}

// AMX (Sapphire Rapids and later): tdpbusd multiplies up to 16 rows of 64 unsigned inputs (x+128, as VNNI
// reads them) by a 64 x 16 block of signed weights, which the packed layout already holds as one 1 KiB
// tile (16 lines of [16 columns][4 k]): no repacking. The sums accumulate over all of K in the tile and are
// the exact integers the VNNI loop makes, so the shared epilogue gives the same bits: a row still does not
// depend on the batch, and AMX on or off leaves every output unchanged.
constexpr int kAmxRows = 16, kAmxPanels = 4, kAmxK = 64;
constexpr int64_t kAmxMinRows = 2;  // from 2 rows on AMX is faster than the VNNI loops (bench/amx_ab.py)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the 8 KiB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_permitted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool has_amx = (d >> 24 & 1) && (d >> 25 & 1);  // AMX-TILE, AMX-INT8
    return has_amx && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
}

// -1 until first asked: on where the CPU has AMX unless DRAFTTREE_AMX=0; tests and benches switch it.
std::atomic<int> amx_state{-1};

bool amx_on() {
  int mode = amx_state.load(std::memory_order_relaxed);
  if (mode < 0) {
    const char* env = std::getenv("DRAFTTREE_AMX");
    mode = (env && std::strcmp(env, "0") == 0) ? 0 : int(amx_permitted());
    amx_state.store(mode, std::memory_order_relaxed);
  }
  return mode == 1;
}

// C in tmm0-3 (rows x 16 int32), A in tmm4 (rows x 64 bytes), B in tmm5 (16 x 64); a K tail of `tail`
// bytes (Kp % 64) in tmm6 (A) and tmm7 (B).
__attribute__((target("amx-tile,amx-int8"))) void amx_configure(int rows, int tail) {
  TileConfig cfg;
  for (int t = 0; t < kAmxPanels; ++t) cfg.colsb[t] = 64, cfg.rows[t] = rows;
  cfg.colsb[4] = kAmxK, cfg.rows[4] = rows;
  cfg.colsb[5] = 64, cfg.rows[5] = kAmxK / 4;
  if (tail) cfg.colsb[6] = tail, cfg.rows[6] = rows, cfg.colsb[7] = 64, cfg.rows[7] = tail / 4;
  // GCC 12's ldtilecfg asm declares a read of 8 bytes only: without this the stores past them can be dropped.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Another library in the process may keep its own tile configuration on these (shared OpenMP) threads and load it
// once per thread: llama.cpp's AMX backend does, and a `tilerelease` here made its next tile instruction fault
// (SIGILL in `drafttree bench-peers`). So a call saves the thread's configuration and puts it back when done.
__attribute__((target("amx-tile"))) void amx_save(TileConfig* saved) {
  _tile_storeconfig(saved);
  __asm__ volatile("" : : "r"(saved) : "memory");  // GCC's asm declares 8 of the 64 bytes written
}

__attribute__((target("amx-tile"))) void amx_restore(const TileConfig& saved) {
  if (saved.palette == 0) {
    _tile_release();
    return;
  }
  __asm__ volatile("" : : "r"(&saved) : "memory");
  _tile_loadconfig(&saved);
}

// One K step at byte k: the inputs into tile A, each panel's weights into tile B, C0..C(np-1) += A x B. Tile
// numbers are immediates spelled into the instruction (the intrinsics stringify them), so a macro, not a template.
#define DRAFTTREE_AMX_STEP(A, B, k)                                                              \
  do {                                                                                           \
    const int8_t* w_ = a.w + (k) * kPanel;                                                       \
    _tile_loadd(A, a.x + (k), a.Kp);                                                             \
    _tile_loadd(B, w_, 64); _tile_dpbusd(0, A, B);                                               \
    if (np > 1) { _tile_loadd(B, w_ + a.panel_stride, 64); _tile_dpbusd(1, A, B); }             \
    if (np > 2) { _tile_loadd(B, w_ + 2 * a.panel_stride, 64); _tile_dpbusd(2, A, B); }         \
    if (np > 3) { _tile_loadd(B, w_ + 3 * a.panel_stride, 64); _tile_dpbusd(3, A, B); }         \
  } while (0)

// acc[i][p*16 + c] for `rows` rows and np <= 4 panels (np*16 columns, the epilogue's layout).
__attribute__((target("amx-tile,amx-int8"))) void tile_amx(const TileArgs& a, int rows, int np) {
  const int64_t cols = np * kPanel, full = a.Kp / kAmxK * kAmxK;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < full; k += kAmxK) DRAFTTREE_AMX_STEP(4, 5, k);
  if (full < a.Kp) DRAFTTREE_AMX_STEP(6, 7, full);  // the K tail (Kp % 64 bytes) has tiles of its own shape
  _tile_stored(0, a.acc, cols * 4);
  if (np > 1) _tile_stored(1, a.acc + kPanel, cols * 4);
  if (np > 2) _tile_stored(2, a.acc + 2 * kPanel, cols * 4);
  if (np > 3) _tile_stored(3, a.acc + 3 * kPanel, cols * 4);
}
#undef DRAFTTREE_AMX_STEP

using TileFn = void (*)(const TileArgs&);

// Kernels by [panels - 1][rows - 1] for partial tiles at the right and bottom edges.
#define DRAFTTREE_TILE_TABLE(NAME, FN)                                                  \
  struct NAME {                                                                         \
    static constexpr int kNP = 4, kTT = 4;                                              \
    static TileFn get(int np, int tt) {                                                 \
      static const TileFn t[4][4] = {                                                   \
          {FN<1, 1>, FN<1, 2>, FN<1, 3>, FN<1, 4>}, {FN<2, 1>, FN<2, 2>, FN<2, 3>, FN<2, 4>}, \
          {FN<3, 1>, FN<3, 2>, FN<3, 3>, FN<3, 4>}, {FN<4, 1>, FN<4, 2>, FN<4, 3>, FN<4, 4>}}; \
      return t[np - 1][tt - 1];                                                         \
    }                                                                                   \
  };
DRAFTTREE_TILE_TABLE(VnniTiles, tile_vnni)
DRAFTTREE_TILE_TABLE(ScalarTiles, tile_scalar)
#undef DRAFTTREE_TILE_TABLE

// VNNI for a weight too big for L2 (an LM head): one panel by up to 16 rows, so each 64-byte weight load
// feeds every row and the weight is read as one sequential stream, once. Measured on Zen 4 (1 thread,
// 36,864 x 576): 1.5-1.6x faster than 4 x 4 tiles at 4-8 rows, 1.3x at 16; for a small weight that
// stays in cache the 4 x 4 tiles' register reuse wins, and at one row the single accumulator chain is
// latency-bound, so those keep VnniTiles.
struct VnniStreamTiles {
  static constexpr int kNP = 1, kTT = 16;
  static constexpr int64_t kMinBytes = int64_t(1) << 21;  // weights from this size up are streamed
  template <int... TT>
  static constexpr std::array<TileFn, sizeof...(TT)> table(std::integer_sequence<int, TT...>) {
    return {tile_vnni<1, TT + 1>...};
  }
  static TileFn get(int tt) {
    static constexpr auto t = table(std::make_integer_sequence<int, kTT>{});
    return t[tt - 1];
  }
};

// AVX2 has 16 vector registers: one panel (2 ymm) by 4 rows keeps 8 accumulators live.
TileFn avx2_tile(int tt) {
  static const TileFn t[4] = {tile_avx2<1, 1>, tile_avx2<1, 2>, tile_avx2<1, 3>, tile_avx2<1, 4>};
  return t[tt - 1];
}

// Epilogue: y[t, n] = float(acc - 128*wsum[n] if compensating) * (sx[t] * sw[n]) + bias[n], in the
// reference's order (the file is compiled without fused multiply-add).
struct Epilogue {
  const float *sx, *sw, *bias;
  const int32_t* wsum;
  bool compensate;
  int64_t N;
};

template <typename out_t>
void epilogue_scalar(const Epilogue& e, const int32_t* acc, int tt, int cols, int64_t t0, int64_t n0, out_t* y) {
  for (int i = 0; i < tt; ++i) {
    const int64_t t = t0 + i;
    for (int c = 0; c < cols && n0 + c < e.N; ++c) {
      const int64_t n = n0 + c;
      int32_t s = acc[i * cols + c];
      if (e.compensate) s -= 128 * e.wsum[n];
      float v = static_cast<float>(s) * (e.sx[t] * e.sw[n]);
      if (e.bias) v = v + e.bias[n];
      y[t * e.N + n] = static_cast<out_t>(v);
    }
  }
}

__attribute__((target("avx512f"))) void epilogue_avx512(const Epilogue& e, const int32_t* acc, int tt, int cols,
                                                         int64_t t0, int64_t n0, float* y) {
  for (int c = 0; c < cols && n0 + c < e.N; c += 16) {
    const int64_t n = n0 + c;
    const __mmask16 m = n + 16 <= e.N ? __mmask16(0xFFFF) : __mmask16((1u << (e.N - n)) - 1);
    const __m512 sw = _mm512_maskz_loadu_ps(m, e.sw + n);
    const __m512i comp = e.compensate ? _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, e.wsum + n), 7) : _mm512_setzero_si512();
    const __m512 bias = e.bias ? _mm512_maskz_loadu_ps(m, e.bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < tt; ++i) {
      const __m512i s = _mm512_sub_epi32(_mm512_loadu_si512(acc + i * cols + c), comp);
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_set1_ps(e.sx[t0 + i]), sw));
      if (e.bias) v = _mm512_add_ps(v, bias);
      _mm512_mask_storeu_ps(y + (t0 + i) * e.N + n, m, v);
    }
  }
}

__attribute__((target("avx2"))) void epilogue_avx2(const Epilogue& e, const int32_t* acc, int tt, int cols,
                                                     int64_t t0, int64_t n0, float* y) {
  const int full = static_cast<int>(std::min<int64_t>(cols, e.N - n0)) / 8 * 8;
  for (int c = 0; c < full; c += 8) {
    const int64_t n = n0 + c;
    const __m256 sw = _mm256_loadu_ps(e.sw + n);
    const __m256 bias = e.bias ? _mm256_loadu_ps(e.bias + n) : _mm256_setzero_ps();
    for (int i = 0; i < tt; ++i) {
      const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + i * cols + c));
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(_mm256_set1_ps(e.sx[t0 + i]), sw));
      if (e.bias) v = _mm256_add_ps(v, bias);
      _mm256_storeu_ps(y + (t0 + i) * e.N + n, v);
    }
  }
  if (n0 + full < e.N && full < cols) {  // the columns past the last full vector
    alignas(64) int32_t rest[4 * 4 * kPanel];
    const int rc = cols - full;
    for (int i = 0; i < tt; ++i)
      for (int c = 0; c < rc; ++c) rest[i * rc + c] = acc[i * cols + full + c];
    epilogue_scalar(e, rest, tt, rc, t0, n0 + full, y);
  }
}

// Rows in groups of 16 (one tile configuration a group), groups of 4 panels shared out between threads.
void gemm_amx(const int8_t* xq, int64_t T, const int8_t* wp, int64_t P, int64_t Kp, const Epilogue& epi, float* y) {
  const int64_t panel_stride = Kp * kPanel, groups = (P + kAmxPanels - 1) / kAmxPanels;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (panel_stride * kAmxPanels));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[kAmxRows * kAmxPanels * kPanel];
    TileConfig saved;
    amx_save(&saved);
    for (int64_t t0 = 0; t0 < T; t0 += kAmxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, T - t0));
      amx_configure(rows, static_cast<int>(Kp % kAmxK));
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * kAmxPanels;
        const int np = static_cast<int>(std::min<int64_t>(kAmxPanels, P - p0));
        tile_amx(TileArgs{xq + t0 * Kp, wp + p0 * panel_stride, Kp, panel_stride, acc}, rows, np);
        epilogue_avx512(epi, acc, rows, np * kPanel, t0, p0 * kPanel, y);
      }
    }
    amx_restore(saved);
  });
}

template <typename out_t>
void gemm(const int8_t* xq, const float* sx, int64_t T, const int8_t* wp, const float* sw, const int32_t* wsum,
          const float* bias, int64_t N, int64_t Kp, int64_t isa, out_t* y) {
  const int64_t P = (N + kPanel - 1) / kPanel, panel_stride = Kp * kPanel;
  const Epilogue epi{sx, sw, bias, wsum, isa == kAvx512Vnni, N};
  if constexpr (std::is_same_v<out_t, float>) {
    if (isa == kAvx512Vnni && T >= kAmxMinRows && amx_on()) {
      gemm_amx(xq, T, wp, P, Kp, epi, y);
      return;
    }
  }
  const bool stream = isa == kAvx512Vnni && T >= 2 && N * Kp >= VnniStreamTiles::kMinBytes;
  const int max_np = isa == kAvx2 ? 1 : stream ? VnniStreamTiles::kNP : 4;
  const int max_tt = stream ? VnniStreamTiles::kTT : 4;
  // Enough weight bytes per task that waking a second thread pays (~64 KiB).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / panel_stride);
  const int64_t prefetch = weight_prefetch_for(T);
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[16 * kPanel];  // the largest tile: 16 rows x 1 panel, or 4 x 4
    for (int64_t p0 = begin; p0 < end; p0 += max_np) {
      const int np = static_cast<int>(std::min<int64_t>(max_np, end - p0));
      for (int64_t t0 = 0; t0 < T; t0 += max_tt) {
        const int tt = static_cast<int>(std::min<int64_t>(max_tt, T - t0));
        const TileArgs args{xq + t0 * Kp, wp + p0 * panel_stride, Kp, panel_stride, acc, t0 == 0 ? prefetch : 0};
        TileFn fn = isa == kAvx2 ? avx2_tile(tt)
                    : stream ? VnniStreamTiles::get(tt)
                    : isa == kAvx512Vnni ? VnniTiles::get(np, tt) : ScalarTiles::get(np, tt);
        fn(args);
        if constexpr (std::is_same_v<out_t, float>) {
          if (isa == kAvx512Vnni) {
            epilogue_avx512(epi, acc, tt, np * kPanel, t0, p0 * kPanel, y);
            continue;
          }
          if (isa == kAvx2) {
            epilogue_avx2(epi, acc, tt, np * kPanel, t0, p0 * kPanel, y);
            continue;
          }
        }
        epilogue_scalar(epi, acc, tt, np * kPanel, t0, p0 * kPanel, y);
      }
    }
  });
}

}  // namespace

// Signed per-row quantization of float32 rows (offset 0), shared with the Q4 kernel.
void quantize_rows_signed(const torch::Tensor& x, int64_t Kp, int64_t isa, int8_t* q, float* scale) {
  const int64_t T = x.size(0), K = x.size(1);
  if (isa != kScalar)
    quantize_rows_fast(x.data_ptr<float>(), T, K, Kp, 0, isa == kAvx512Vnni, q, scale);
  else
    quantize_rows(x.data_ptr<float>(), T, K, Kp, 0, q, scale);
}

// x [T, K] float32/bfloat16; wp int8 packed [P, Kp/4, 16, 4]; sw float32 [>=N]; wsum int32 [>=N];
// bias float32 [N] or None; n_out = N. Returns [T, N] in x's dtype.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor sw, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias, int64_t n_out, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be [T, K]");
  TORCH_CHECK(wp.dim() == 4 && wp.scalar_type() == torch::kInt8 && wp.size(2) == kPanel && wp.size(3) == 4,
              "int8_linear: weights must be packed int8 [P, Kp/4, 16, 4]");
  TORCH_CHECK(wp.is_contiguous(), "int8_linear: packed weights must be contiguous");
  TORCH_CHECK(sw.scalar_type() == torch::kFloat32 && wsum.scalar_type() == torch::kInt32, "int8_linear: bad scales");
  const int64_t T = x.size(0), K = x.size(1), N = n_out, Kp = wp.size(1) * 4;
  TORCH_CHECK(Kp >= K && Kp - K < 4 && wp.size(0) * kPanel >= N && sw.numel() >= N && wsum.numel() >= N,
              "int8_linear: packed weights do not match x's K or n_out");
  x = x.contiguous();
  auto xq = torch::empty({T, Kp}, torch::kInt8);
  auto sx = torch::empty({T}, torch::kFloat32);
  const int offset = isa == kAvx512Vnni ? 128 : 0;
  if (x.scalar_type() == torch::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), T, K, Kp, offset, xq.data_ptr<int8_t>(), sx.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "int8_linear: x must be float32 or bfloat16");
    if (isa != kScalar)
      quantize_rows_fast(x.data_ptr<float>(), T, K, Kp, offset, isa == kAvx512Vnni, xq.data_ptr<int8_t>(),
                         sx.data_ptr<float>());
    else
      quantize_rows(x.data_ptr<float>(), T, K, Kp, offset, xq.data_ptr<int8_t>(), sx.data_ptr<float>());
  }
  const float* b = nullptr;
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias_f.numel() >= N, "int8_linear: bias shorter than n_out");
    b = bias_f.data_ptr<float>();
  }
  auto y = torch::empty({T, N}, x.options());
  if (x.scalar_type() == torch::kBFloat16)
    gemm(xq.data_ptr<int8_t>(), sx.data_ptr<float>(), T, wp.data_ptr<int8_t>(), sw.data_ptr<float>(),
         wsum.data_ptr<int32_t>(), b, N, Kp, isa, y.data_ptr<at::BFloat16>());
  else
    gemm(xq.data_ptr<int8_t>(), sx.data_ptr<float>(), T, wp.data_ptr<int8_t>(), sw.data_ptr<float>(),
         wsum.data_ptr<int32_t>(), b, N, Kp, isa, y.data_ptr<float>());
  return y;
}

std::atomic<int64_t> weight_prefetch_bytes{4096};

int64_t weight_prefetch(int64_t bytes) {
  if (bytes >= 0) weight_prefetch_bytes.store(bytes);
  return weight_prefetch_bytes.load();
}

// Tests and benches: -1 asks, 0 turns AMX off, 1 on where the CPU allows it; returns the mode now.
int64_t amx_mode(int64_t mode) {
  amx_on();  // the default is decided first
  if (mode >= 0) amx_state.store(mode == 1 ? int(amx_permitted()) : 0);
  return amx_state.load();
}
