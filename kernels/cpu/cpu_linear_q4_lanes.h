// cpu_linear_q4.cc's path for many rows with AVX512-VNNI: the rows in the vector lanes, the
// weights in int16 pairs, vpdpwssd.
//
// x is rounded to int16 per group of inputs (max |x| / 32767 of the group) and stored as
// pairs (x[k], x[k+1]) in one 32-bit lane per row, transposed: [K/2, rows]. A work item
// widens NR outputs' weights once to int16 pairs (32-bit words), then every tile of 8
// (256-bit vectors), 16 or 32 rows broadcasts one word per output and k pair into one
// vpdpwssd per vector of rows: 32 multiply-adds per 512 bits where the float32 kernels
// (block_z here, the panel kernel for float weights) do 16, and the weights need no
// conversion to float. The int32 sums of a group are converted and scaled once per group (a
// conversion, a multiply and an FMA per vector of rows and output), the mins' term added
// from the sums of x's rounded groups. Measured against the float32 panel kernel in
// bench/q4_vs_float.py (bench/RESULTS.md).
#pragma once

#include "cpu_simd.h"

#if defined(JAXPAGED_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define JAXPAGED_Q4_LANES 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace jaxpaged::q4 {

constexpr int64_t kLanesMin = 6;  // rows from which the lane path runs (fewer: dot_rows)
// rows up to which it runs: decode steps. More (prefill chunks) take block_z in float32: x
// rounded to int16 moved the bundled SmolLM2's logits over 64 prompt tokens by up to 0.014
// from the float expansion's (float32 kernels: < 1e-3)
constexpr int64_t kLanesMax = 32;

// Row x [K] rounded to int16 per group of G inputs (scale: the group's max |x| / 32767;
// round to nearest even, as lrintf): xq [K], scales [K / G], and the sums of the rounded
// groups, sums [K / G] (the mins' term then sees the x the products see: with x's own sums
// the rounding error met 4-bit weights' q * scale, all of one sign, not the weights
// themselves, and grew ~10x). A scale per group, not per row: a row's few outlier inputs
// (hundreds of times the rest) would leave the others a handful of int16 steps.
inline void quantize_groups16_z(const float* x, int64_t K, int64_t G, int16_t* xq,
                                float* scales, float* sums) {
  const __m512i lo = _mm512_set1_epi32(-32767), hi = _mm512_set1_epi32(32767);
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    __m512i total = _mm512_setzero_si512();
    const float absmax = _mm512_reduce_max_ps(mx);
    // a NaN in x makes its group's scale NaN, so it reaches y as in float32
    const float s = nan ? std::nanf("") : absmax > 0.0f ? absmax / 32767.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
      q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
      total = _mm512_add_epi32(total, q);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + k), _mm512_cvtepi32_epi16(q));
    }
    scales[g] = s;
    sums[g] = s * static_cast<float>(_mm512_reduce_add_epi32(total));
  }
}

// Inputs [k, k + 16) of one output as 8 int16 pairs (k order, the low half the even input).
template <int BITS>
inline __m256i pairs8(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 4) {
    // byte b holds inputs k (low nibble) and k + 1 (high): (b | b << 12) & 0x000F000F
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2)));
    return _mm256_ternarylogic_epi32(v, _mm256_slli_epi32(v, 12),
                                     _mm256_set1_epi32(0x000F000F), 0xA8);
  } else {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
  }
}

// dpwssd_bcast on 8 lanes (AVX512-VL): a step of up to 8 rows fills one 256-bit vector,
// which runs at twice the 512-bit rate, so it costs half a 16-row tile.
inline __m256i dpwssd_bcast8(__m256i acc, __m256i x, const int32_t* w) {
  asm("vpdpwssd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*w));
  return acc;
}

constexpr int64_t kLo1 = 12;  // outputs per tile of 16 rows: 12 int32 and 12 float sums
constexpr int64_t kLo2 = 6;   // outputs per tile of 32 rows
constexpr int64_t kLo = 12;   // outputs per work item's widened block (a multiple of both)

// acc + the pairwise products of x with *w's two int16 broadcast to every lane, the
// broadcast folded into vpdpwssd's memory operand (GCC emits a separate vpbroadcastd for
// the intrinsics: one more instruction per multiply)
inline __m512i dpwssd_bcast(__m512i acc, __m512i x, const int32_t* w) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*w));
  return acc;
}

// Outputs [n, n + cols) (cols <= kLo) as int16 pairs, in blocks of 8 pairs: out[c, j, i] is
// output j's pair 8c + i, out [K / 16, kLo, 8] 32-bit words, so a tile finds every output's
// pair at a constant offset from one pointer.
template <int BITS>
inline void widen_pairs(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n, int64_t cols,
                        int32_t* out) {
  for (int64_t j = 0; j < cols; ++j) {
    const uint8_t* row = w + (n + j) * row_bytes;
    for (int64_t k = 0; k < K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (k / 16) * kLo * 8 + j * 8),
                          pairs8<BITS>(row, k));
  }
}

// out[j][r] = sum over groups g of scale[j, g] * xsc[g, r] * (sum over the group's k pairs
// p of wp[j, p] . xp[p, r]) + min[j, g] * xsum[g, r], for j < NR and r < 16 NV.
// xp: [K / 2, ldx] pairs; wp: widen_pairs' blocks from the tile's first output; xsc, xsum:
// x's group scales and sums, [K / G, ldx].
template <int NR, int NV>
inline void tile_lanes(const int32_t* xp, const float* xsc, const float* xsum, int64_t ldx,
                       const int32_t* wp,
                       int64_t K, int64_t G, const float* scales, const float* mins,
                       float (*out)[32]) {
  const int64_t groups = K / G, gp = G / 2;
  __m512 acc[NR][NV];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i part[NR][NV];
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) part[j][v] = _mm512_setzero_si512();
    // 8 pairs at a time, unrolled: a loop over single pairs had GCC copy every sum to
    // another register each step
    for (int64_t c = g * gp; c < (g + 1) * gp; c += 8) {
      const int32_t* wc = wp + (c / 8) * kLo * 8;
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const int64_t p = c + q;
        __m512i xv[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) xv[v] = _mm512_loadu_si512(xp + p * ldx + 16 * v);
#pragma GCC unroll 12
        for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) part[j][v] = dpwssd_bcast(part[j][v], xv[v], wc + j * 8 + q);
      }
    }
    __m512 xv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) xv[v] = _mm512_loadu_ps(xsc + g * ldx + 16 * v);
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) {
      const __m512 sv = _mm512_set1_ps(scales[j * groups + g]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v)
        acc[j][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[j][v]), _mm512_mul_ps(sv, xv[v]),
                                    acc[j][v]);
      if (mins != nullptr) {
        const __m512 mv = _mm512_set1_ps(mins[j * groups + g]);
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v)
          acc[j][v] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xsum + g * ldx + 16 * v), acc[j][v]);
      }
    }
  }
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[j] + 16 * v, acc[j][v]);
}

// tile_lanes for up to 8 rows (the first 8 lanes of xp, xsc and xsum), in 256-bit vectors.
template <int NR>
inline void tile_lanes8(const int32_t* xp, const float* xsc, const float* xsum, int64_t ldx,
                        const int32_t* wp, int64_t K, int64_t G, const float* scales,
                        const float* mins, float (*out)[32]) {
  const int64_t groups = K / G, gp = G / 2;
  __m256 acc[NR];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i part[NR];
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) part[j] = _mm256_setzero_si256();
    for (int64_t c = g * gp; c < (g + 1) * gp; c += 8) {
      const int32_t* wc = wp + (c / 8) * kLo * 8;
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + (c + q) * ldx));
#pragma GCC unroll 12
        for (int j = 0; j < NR; ++j) part[j] = dpwssd_bcast8(part[j], xv, wc + j * 8 + q);
      }
    }
    const __m256 xs = _mm256_loadu_ps(xsc + g * ldx);
    const __m256 xm = _mm256_loadu_ps(xsum + g * ldx);
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) {
      const __m256 sv = _mm256_set1_ps(scales[j * groups + g]);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[j]), _mm256_mul_ps(sv, xs), acc[j]);
      if (mins != nullptr)
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(mins[j * groups + g]), xm, acc[j]);
    }
  }
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j) _mm256_storeu_ps(out[j], acc[j]);
}

// tile_lanes over `cols` (1 .. kLo) outputs of one tile of 16 NV rows.
template <int NV>
inline void tile_lanes_cols(int64_t cols, const int32_t* xp, const float* xsc,
                            const float* xsum, int64_t ldx,
                            const int32_t* wp, int64_t K, int64_t G, const float* scales,
                            const float* mins, float (*out)[32]) {
  constexpr int64_t step = NV > 1 ? kLo2 : kLo1;
  const int64_t groups = K / G;
  int64_t j = 0;
  if constexpr (NV == 0) {  // up to 8 rows
    for (; j + kLo1 <= cols; j += kLo1)
      tile_lanes8<kLo1>(xp, xsc, xsum, ldx, wp + j * 8, K, G, scales + j * groups,
                        mins != nullptr ? mins + j * groups : nullptr, out + j);
    for (; j < cols; ++j)
      tile_lanes8<1>(xp, xsc, xsum, ldx, wp + j * 8, K, G, scales + j * groups,
                     mins != nullptr ? mins + j * groups : nullptr, out + j);
  } else {
  for (; j + step <= cols; j += step)
    tile_lanes<step, NV>(xp, xsc, xsum, ldx, wp + j * 8, K, G, scales + j * groups,
                         mins != nullptr ? mins + j * groups : nullptr, out + j);
  for (; j < cols; ++j)
    tile_lanes<1, NV>(xp, xsc, xsum, ldx, wp + j * 8, K, G, scales + j * groups,
                      mins != nullptr ? mins + j * groups : nullptr, out + j);
  }
}

// Rows [m0, m0 + rows) of y over outputs [n0, n1). xp: x's int16 pairs [K / 2, ldx]; xsc,
// xsum: its group scales and sums [K / G, ldx]; ldx a multiple of 16 (padding rows zero).
template <int BITS>
void block_lanes(const int32_t* xp, const float* xsc, const float* xsum, int64_t ldx,
                 const uint8_t* w, const float* scales, const float* mins,
                 const float* residual, float* y, int64_t K, int64_t G, int64_t N, int64_t m0,
                 int64_t rows, int64_t n0, int64_t n1) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int64_t groups = K / G;
  thread_local std::vector<int32_t> wp;
  if (wp.size() < static_cast<size_t>(kLo * K / 2)) wp.resize(kLo * K / 2);
  alignas(64) float out[kLo][32];
  for (int64_t n = n0; n < n1; n += kLo) {
    const int64_t cols = std::min(kLo, n1 - n);
    widen_pairs<BITS>(w, row_bytes, K, n, cols, wp.data());
    const float* sn = scales + n * groups;
    const float* mn = mins != nullptr ? mins + n * groups : nullptr;
    // the next outputs' weights, scales and mins into L2 while these tiles run (widen_pairs
    // waited on memory: a third of this function's time, perf)
    const int64_t next = std::min(kLo, N - (n + kLo));
    if (next > 0) {
      const char* wn = reinterpret_cast<const char*>(w + (n + kLo) * row_bytes);
      for (int64_t b = 0; b < next * row_bytes; b += 64) _mm_prefetch(wn + b, _MM_HINT_T1);
      const char* sx = reinterpret_cast<const char*>(scales + (n + kLo) * groups);
      for (int64_t b = 0; b < next * groups * 4; b += 64) _mm_prefetch(sx + b, _MM_HINT_T1);
      if (mins != nullptr) {
        const char* mx = reinterpret_cast<const char*>(mins + (n + kLo) * groups);
        for (int64_t b = 0; b < next * groups * 4; b += 64) _mm_prefetch(mx + b, _MM_HINT_T1);
      }
    }
    for (int64_t t = 0; t < rows; t += 32) {
      const int64_t rt = std::min<int64_t>(32, rows - t);
      const int64_t r0 = m0 + t;
      if (rt > 16)
        tile_lanes_cols<2>(cols, xp + r0, xsc + r0, xsum + r0, ldx, wp.data(), K, G, sn, mn, out);
      else if (rt > 8)
        tile_lanes_cols<1>(cols, xp + r0, xsc + r0, xsum + r0, ldx, wp.data(), K, G, sn, mn, out);
      else
        tile_lanes_cols<0>(cols, xp + r0, xsc + r0, xsum + r0, ldx, wp.data(), K, G, sn, mn, out);
      for (int64_t r = 0; r < rt; ++r) {
        const int64_t at = (r0 + r) * N + n;
        for (int64_t j = 0; j < cols; ++j)
          y[at + j] = out[j][r] + (residual != nullptr ? residual[at + j] : 0.0f);
      }
    }
  }
}

}  // namespace jaxpaged::q4

#endif  // JAXPAGED_AVX512 && __AVX512VNNI__ && __AVX512VL__
