// The AVX-512 paths of cpu_linear_q4.cc for more than its int16 rows: 16-lane float32
// vectors, where the AVX2 float path (tile_t) ran 8 lanes and lost to the float32 panel
// kernel (cpu_linear.cc, AVX-512) by 1.15-1.7x from 2 rows up.
//
// - dot_rows (a few rows, up to kDotRows: decode at a small batch): each output's 16 weights
//   of a chunk are dequantized in registers (unpack, convert, one FMA with the group's scale
//   and min) and multiplied into every row's 16 inputs, which the FMA reads from L1. A
//   weight costs its dequantization once per call, and nothing is stored: the sums stay in
//   MR x NR registers and are reduced once per output.
// - block_z (more rows): a work item dequantizes kZo outputs' weights into a float32 buffer
//   [kZo, K] once, and every register tile of its rows reads it: per k one broadcast of each
//   output's weight into 16 or 32 rows of x (transposed, [K, rows]), so a weight's
//   dequantization is shared by all the rows of the step, and with 32 rows a broadcast feeds
//   two FMAs (the float32 panel kernel: one).
#pragma once

#include "cpu_simd.h"

#ifdef JAXPAGED_AVX512

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace jaxpaged::q4 {

// The 16 quantized values of inputs [k, k + 16) of one output, as float32, in k order.
template <int BITS>
inline __m512 unpack16_z(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_unpacklo_epi8(_mm_and_si128(b, mask),
                                        _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  }
}

constexpr int64_t kDotRows = 8;  // up to this many rows take dot_rows

constexpr int64_t kDotNb = 24;  // outputs per work item of dot_rows

// Outputs per dot tile of MR rows: MR x NR accumulators, MR vectors of x and one of weights
// within the 32 registers.
constexpr int dot_nr(int64_t mr) {
  return mr <= 2 ? 8 : mr == 3 ? 6 : mr <= 5 ? 4 : mr <= 7 ? 3 : 2;  // each divides kDotNb
}

// y[m, j] (+ base[m, j]) for MR rows of x ([MR, K], row stride K) and NR outputs.
template <int MR, int NR, int BITS>
inline void tile_dot(const float* x, int64_t K, int64_t G, const uint8_t* w, int64_t row_bytes,
                     const float* scales, const float* mins, float* y, int64_t ldy,
                     const float* base) {
  const int64_t groups = K / G;
  __m512 acc[NR][MR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    int64_t k = g * G;
    if constexpr (BITS == 4 && MR <= 4) {
      // 32 inputs a step: one 16-byte load holds both halves' nibbles (with more rows their
      // two vectors of x each would not fit the registers beside the sums)
      for (; k + 32 <= (g + 1) * G; k += 32) {
        __m512 x0[MR], x1[MR];
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          x0[m] = _mm512_loadu_ps(x + m * K + k);
          x1[m] = _mm512_loadu_ps(x + m * K + k + 16);
        }
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
          const __m512 sv = _mm512_set1_ps(scales[j * groups + g]);
          const __m512 mv = _mm512_set1_ps(mins != nullptr ? mins[j * groups + g] : 0.0f);
          const __m128i b =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * row_bytes + k / 2));
          const __m128i even = _mm_and_si128(b, mask);
          const __m128i odd = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          const __m512 w0 = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd))), sv, mv);
          const __m512 w1 = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(even, odd))), sv, mv);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m)
            acc[j][m] = _mm512_fmadd_ps(w1, x1[m], _mm512_fmadd_ps(w0, x0[m], acc[j][m]));
        }
      }
    }
    for (; k < (g + 1) * G; k += 16) {
      __m512 xv[MR];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const float mn = mins != nullptr ? mins[j * groups + g] : 0.0f;
        const __m512 wv = _mm512_fmadd_ps(unpack16_z<BITS>(w + j * row_bytes, k),
                                          _mm512_set1_ps(scales[j * groups + g]),
                                          _mm512_set1_ps(mn));
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_fmadd_ps(wv, xv[m], acc[j][m]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j)
      y[m * ldy + j] = _mm512_reduce_add_ps(acc[j][m]) + (base ? base[m * ldy + j] : 0.0f);
}

// Outputs [n0, n1) of MR rows (x [MR, K] prepared, y and residual at those rows' starts).
template <int MR, int BITS>
void dot_rows_mr(const float* x, const uint8_t* w, const float* scales, const float* mins,
                 const float* residual, float* y, int64_t K, int64_t G, int64_t N, int64_t n0,
                 int64_t n1) {
  constexpr int NR = dot_nr(MR);
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1;) {
    const float* base = residual != nullptr ? residual + n : nullptr;
    const uint8_t* wr = w + n * row_bytes;
    const float* sr = scales + n * groups;
    const float* mr = mins != nullptr ? mins + n * groups : nullptr;
    if (n + NR <= n1) {
      tile_dot<MR, NR, BITS>(x, K, G, wr, row_bytes, sr, mr, y + n, N, base);
      n += NR;
    } else {
      tile_dot<MR, 1, BITS>(x, K, G, wr, row_bytes, sr, mr, y + n, N, base);
      n += 1;
    }
  }
}

// dot_rows_mr for any number of rows, 8 at a time.
template <int BITS>
void dot_rows(int64_t rows, const float* x, const uint8_t* w, const float* scales,
              const float* mins, const float* residual, float* y, int64_t K, int64_t G,
              int64_t N, int64_t n0, int64_t n1) {
  // tiles of at most 6 rows, as even as can be (each weight is dequantized once per tile)
  const int64_t tiles = (rows + 5) / 6;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t mr = (rows - r) / (tiles - t);
    const float* xr = x + r * K;
    float* yr = y + r * N;
    const float* rr = residual != nullptr ? residual + r * N : nullptr;
    r += mr;
    switch (mr) {
#define JP_DOT(MR) \
  case MR: dot_rows_mr<MR, BITS>(xr, w, scales, mins, rr, yr, K, G, N, n0, n1); break
      JP_DOT(1);
      JP_DOT(2);
      JP_DOT(3);
      JP_DOT(4);
      JP_DOT(5);
      JP_DOT(6);
      JP_DOT(7);
      default: JP_DOT(8);
#undef JP_DOT
    }
  }
}

// Outputs [n0, n1) of a weight dequantized to float32 into out [n1 - n0, K]: 32 inputs per
// unpack (one 16-byte load of 4-bit values, both nibbles, two 16-lane conversions).
template <int BITS>
void dequantize_z(const uint8_t* w, const float* scales, const float* mins, int64_t K,
                  int64_t G, int64_t n0, int64_t n1, float* out) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int64_t groups = K / G;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* o = out + (n - n0) * K;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 sv = _mm512_set1_ps(scales[n * groups + g]);
      const __m512 mv = _mm512_set1_ps(mins != nullptr ? mins[n * groups + g] : 0.0f);
      int64_t k = g * G;
      if constexpr (BITS == 4) {
        for (; k + 32 <= (g + 1) * G; k += 32) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
          const __m128i even = _mm_and_si128(b, mask);
          const __m128i odd = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          const __m128i q0 = _mm_unpacklo_epi8(even, odd), q1 = _mm_unpackhi_epi8(even, odd);
          _mm512_storeu_ps(o + k, _mm512_fmadd_ps(
                                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)), sv, mv));
          _mm512_storeu_ps(o + k + 16, _mm512_fmadd_ps(
                                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)), sv, mv));
        }
      }
      for (; k < (g + 1) * G; k += 16)
        _mm512_storeu_ps(o + k, _mm512_fmadd_ps(unpack16_z<BITS>(row, k), sv, mv));
    }
  }
}

constexpr int64_t kZo = 12;  // outputs per broadcast tile: 24 accumulators with 32 rows
constexpr int64_t kZm = 32;  // rows per broadcast tile

// out[j][r] = sum over k of wt[j * K + k] * xt[k * ldx + r], for j < NR and r < 16 NV.
template <int NR, int NV>
inline void tile_z(const float* xt, int64_t ldx, const float* wt, int64_t K,
                   float (*out)[kZm]) {
  __m512 lo[NR], hi[NR];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const __m512 x0 = _mm512_loadu_ps(xt + k * ldx);
    const __m512 x1 = NV > 1 ? _mm512_loadu_ps(xt + k * ldx + 16) : x0;
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) {
      const __m512 wb = _mm512_set1_ps(wt[j * K + k]);
      lo[j] = _mm512_fmadd_ps(wb, x0, lo[j]);
      if constexpr (NV > 1) hi[j] = _mm512_fmadd_ps(wb, x1, hi[j]);
    }
  }
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j) {
    _mm512_storeu_ps(out[j], lo[j]);
    if constexpr (NV > 1) _mm512_storeu_ps(out[j] + 16, hi[j]);
  }
}

// tile_z over `cols` (1 .. kZo) outputs: 12, 4 and 1 at a time.
template <int NV>
inline void tile_z_cols(int64_t cols, const float* xt, int64_t ldx, const float* wt, int64_t K,
                        float (*out)[kZm]) {
  int64_t j = 0;
  if (cols == kZo) return tile_z<kZo, NV>(xt, ldx, wt, K, out);
  for (; j + 4 <= cols; j += 4) tile_z<4, NV>(xt, ldx, wt + j * K, K, out + j);
  for (; j < cols; ++j) tile_z<1, NV>(xt, ldx, wt + j * K, K, out + j);
}

// Rows [m0, m0 + rows) of y over outputs [n0, n1); xt: x transposed, [K, ldx], its rows
// padded with zeros to a multiple of 16. dequantize(n, n + cols, buf) writes those outputs'
// float32 weights, [cols, K].
template <typename Dequantize>
void block_z(const float* xt, int64_t ldx, const float* residual, float* y, int64_t K,
             int64_t N, int64_t m0, int64_t rows, int64_t n0, int64_t n1,
             Dequantize&& dequantize) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(kZo * K)) buf.resize(kZo * K);
  alignas(64) float out[kZo][kZm];
  for (int64_t n = n0; n < n1; n += kZo) {
    const int64_t cols = std::min(kZo, n1 - n);
    dequantize(n, n + cols, buf.data());
    for (int64_t t = 0; t < rows; t += kZm) {
      const int64_t rt = std::min(kZm, rows - t);
      if (rt > 16)
        tile_z_cols<2>(cols, xt + m0 + t, ldx, buf.data(), K, out);
      else
        tile_z_cols<1>(cols, xt + m0 + t, ldx, buf.data(), K, out);
      for (int64_t r = 0; r < rt; ++r) {
        const int64_t at = (m0 + t + r) * N + n;
        for (int64_t j = 0; j < cols; ++j)
          y[at + j] = out[j][r] + (residual != nullptr ? residual[at + j] : 0.0f);
      }
    }
  }
}


#if defined(__AVX512VNNI__)
#define JAXPAGED_Q4_VNNI 1
// One row in int16 (cpu_linear_q4.cc's row_int: x rounded to int16 with a per-row scale,
// int32 sums per group, scaled once per group) with AVX512-VNNI: vpdpwssd multiplies and
// adds 32 int16 pairs in one instruction, where row_int spends vpmaddwd and vpaddd on 16.
// 4-bit weights are not put back in k order: 32 bytes (64 inputs) widen to 32 int16 lanes,
// the low nibbles (the even inputs) are one mask and the high ones (the odd inputs) one shift
// away, and x is stored split the same way (split_even_odd), so the whole unpack is 3
// instructions per 64 weights (row_int: 5 per 16).
inline bool vnni_fits(int64_t bits, int64_t K, int64_t G) {
  return bits == 4 ? K % 64 == 0 && (G == 32 || G % 64 == 0) : G % 32 == 0;
}

// xq [K] int16 -> out [K]: per 64-input block, its 32 even inputs, then its 32 odd ones.
inline void split_even_odd(const int16_t* xq, int64_t K, int16_t* out) {
  for (int64_t b = 0; b < K; b += 64)
    for (int64_t i = 0; i < 32; ++i) {
      out[b + i] = xq[b + 2 * i];
      out[b + 32 + i] = xq[b + 2 * i + 1];
    }
}

// y[j] = xs * (sum over groups of scale * (q . xq) + min * sum(xq)) + base[j] for NR outputs.
// x: split_even_odd's order (4-bit) or k order (8-bit); xsum: the group sums of xq, float.
template <int NR, int BITS>
inline void tile_vnni(const int16_t* x, float xs, const float* xsum, int64_t K, int64_t G,
                      const uint8_t* w, int64_t row_bytes, const float* scales,
                      const float* mins, float* y, const float* base) {
  const int64_t groups = K / G;
  __m512 acc[NR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi16(0x0F);
    for (int64_t b = 0; b < K; b += 64) {
      const __m512i xe = _mm512_loadu_si512(x + b), xo = _mm512_loadu_si512(x + b + 32);
      const int64_t g0 = b / G, g1 = (b + 32) / G;  // int32 lanes 0-7: g0, 8-15: g1
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m512i v = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + b / 2)));
        __m512i part = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, low), xe);
        part = _mm512_dpwssd_epi32(part, _mm512_srli_epi16(v, 4), xo);
        const float* sr = scales + j * groups;
        const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(sr[g0]), _mm256_set1_ps(sr[g1]), 1);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part), sv, acc[j]);
      }
    }
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      __m512i part[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) part[j] = _mm512_setzero_si512();
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        const __m512i xv = _mm512_loadu_si512(x + k);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j)
          part[j] = _mm512_dpwssd_epi32(
              part[j],
              _mm512_cvtepi8_epi16(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + k))),
              xv);
      }
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[j]),
                                 _mm512_set1_ps(scales[j * groups + g]), acc[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    float v = _mm512_reduce_add_ps(acc[j]);
    if (mins != nullptr) {
      const float* mr = mins + j * groups;
      __m512 mv = _mm512_setzero_ps();
      int64_t g = 0;
      for (; g + 16 <= groups; g += 16)
        mv = _mm512_fmadd_ps(_mm512_loadu_ps(mr + g), _mm512_loadu_ps(xsum + g), mv);
      v += _mm512_reduce_add_ps(mv);
      for (; g < groups; ++g) v += mr[g] * xsum[g];
    }
    y[j] = v * xs + (base != nullptr ? base[j] : 0.0f);
  }
}

// Outputs [n0, n1) of one row (y, residual: that row's), 4 outputs a tile.
template <int BITS>
void row_vnni(const int16_t* x, float xs, const float* xsum, const uint8_t* w,
              const float* scales, const float* mins, const float* residual, float* y,
              int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1;) {
    const float* base = residual != nullptr ? residual + n : nullptr;
    const uint8_t* wr = w + n * row_bytes;
    const float* sr = scales + n * groups;
    const float* mr = mins != nullptr ? mins + n * groups : nullptr;
    if (n + 4 <= n1) {
      tile_vnni<4, BITS>(x, xs, xsum, K, G, wr, row_bytes, sr, mr, y + n, base);
      n += 4;
    } else {
      tile_vnni<1, BITS>(x, xs, xsum, K, G, wr, row_bytes, sr, mr, y + n, base);
      n += 1;
    }
  }
}
#endif  // __AVX512VNNI__

}  // namespace jaxpaged::q4

#endif  // JAXPAGED_AVX512
