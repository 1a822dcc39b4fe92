// Decode steps (up to kMaxRows rows) over 4-bit group-wise weights on AVX2 without AVX-512:
// x rounded to int16 per chunk of 32 inputs (X, scale max |x| / (254 * 127)) and held as two
// int8 parts, X = 254 hi + lo, so 32 weights multiply into each part in one vpmaddubsw
// (unsigned nibble x signed int8, pairs summed to int16; the pairs then to int32 with
// vpmaddwd, the hi part's times 254). Two int8 parts, not one: int8 x alone (llama.cpp's q8
// activations) moved the bundled SmolLM2's greedy tokens off transformers' float32 ones.
// The int16 path this replaces widened every 16 weights to int16 for one vpmaddwd; the
// dequantized float tiles past two rows (block_t) lost to the float32 expansion at 4 rows. 8-bit weights (a GGUF's Q8_0 vocabulary
// projection) keep the int16 path: it was faster at one row (2.1 against 3.2 ms, 576 x 49152).
//
// Per chunk c of 32 inputs in group g (G a multiple of 32), row r and output j:
//   y[r, j] += scale[j, g] * d[r, c] * sum_i q_w[j, i] X[r, i]
// and y[r, j] += sum_g min[j, g] * xsum[r, g], with xsum the group's sum of d X. 4-bit rows
// store input 2i in the low nibble of byte i and 2i + 1 in the high one.
#pragma once

#if defined(JAXPAGED_AVX2) && !defined(JAXPAGED_AVX512)
#define JAXPAGED_Q4_I8 1

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace jaxpaged::q4i8 {

constexpr int64_t kChunk = 32;    // inputs per x scale and per vpmaddubsw
// Past 4 rows the float32 tiles (block_t) win: 120 matmuls of SmolLM2's shapes at 8 rows
// took 32-37 ms here against 22-33 (at 1 row 9.0-9.3 against 11.9-14.0, at 4 rows 18-20
// against 25-34; alternated processes). Rows in the vector lanes lost too (16 rows: 40-47
// against 29-38 ms).
constexpr int64_t kMaxRows = 4;
constexpr int64_t kOut = 16;      // outputs per work item
constexpr float kLevels = 254.0f * 127.0f;  // |X| <= this: X's two int8 parts fit

// Chunk of 32 int32 values (v[0]: inputs 0-7, ... v[3]: 24-31), each in [-127, 127], as 32
// int8 in the order the 4-bit weights unpack in: the even inputs, then the odd ones.
inline __m256i pack_chunk(const __m256i v[4]) {
  // packs leave input 8q + t (t < 4) at byte 4q + t of lane 0, 8q + 4 + t at lane 1's
  const __m256i b =
      _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i natural =
      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i lanes = _mm256_shuffle_epi8(natural, _mm256_set_m128i(split, split));
  return _mm256_permute4x64_epi64(lanes, 0xD8);  // evens of both lanes, then odds
}

// Row x [K] -> X [K], x rounded to int16 per chunk of 32 inputs (scale d = max |x| / kLevels)
// and stored as two int8 parts, X = 254 hi + lo (|lo| <= 127): hi [K] and lo [K], each chunk
// as its even inputs, then its odd ones (the order the 4-bit weights unpack in); d [K / 32]
// and xsum [K / G], each group's sum of d X. Vectorized: it runs once per row on the calling
// thread before the matmul's threads start, so at one row it is serial time.
inline void quantize_row(const float* x, int64_t K, int64_t G, int8_t* hi, int8_t* lo,
                         float* d, float* xsum) {
  const int64_t per_group = G / kChunk;
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  const __m256 levels = _mm256_set1_ps(kLevels), base = _mm256_set1_ps(254.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t c = 0; c < K / kChunk; ++c) {
    __m256 v[4];
    __m256 absmax = zero, finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int q = 0; q < 4; ++q) {
      v[q] = _mm256_loadu_ps(x + c * kChunk + 8 * q);
      absmax = _mm256_max_ps(absmax, _mm256_andnot_ps(sign, v[q]));
      // x - x is 0 for a finite x, NaN for an infinite or NaN one
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(v[q], v[q]), zero, _CMP_EQ_OQ));
    }
    // a NaN or infinite x makes the chunk's scale NaN, so its outputs are NaN, as in float32
    const float dc = _mm256_movemask_ps(finite) == 0xFF ? hmax(absmax) / kLevels
                                                         : std::numeric_limits<float>::quiet_NaN();
    const __m256 dv = _mm256_set1_ps(dc);
    const __m256 use = dc > 0.0f ? _mm256_castsi256_ps(_mm256_set1_epi32(-1)) : zero;
    __m256i h[4], l[4], total = _mm256_setzero_si256();
    for (int q = 0; q < 4; ++q) {
      __m256 X = _mm256_round_ps(_mm256_div_ps(v[q], dv), kRound);
      X = _mm256_max_ps(_mm256_min_ps(X, levels), _mm256_set1_ps(-kLevels));
      X = _mm256_and_ps(use, X);  // dc 0 or NaN: 0
      const __m256 hq = _mm256_round_ps(_mm256_div_ps(X, base), kRound);  // |X - 254 h| <= 127
      h[q] = _mm256_cvtps_epi32(hq);
      l[q] = _mm256_cvtps_epi32(_mm256_fnmadd_ps(hq, base, X));  // exact: integers below 2^24
      total = _mm256_add_epi32(total, _mm256_cvtps_epi32(X));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + c * kChunk), pack_chunk(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + c * kChunk), pack_chunk(l));
    __m128i t =
        _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    d[c] = dc;
    if (c % per_group == 0) xsum[c / per_group] = 0.0f;
    xsum[c / per_group] += dc * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

// The products of 32 unsigned weights (w) and one chunk of X's parts as 8 int32 lanes:
// 254 * (w . hi) + (w . lo), each pair of products summed in vpmaddubsw (|sum| <= 2 * 15 * 127).
inline __m256i dot_parts(__m256i w, __m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w, hi), _mm256_set1_epi16(254)),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(w, lo), _mm256_set1_epi16(1)));
}

// Chunk c of one 4-bit weight row as 32 unsigned bytes 0..15 in x's order.
inline __m256i load_chunk(const uint8_t* row, int64_t c) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// Rows [0, R) of x (hi and lo [R, K], d [R, K / 32], xsum [R, K / G]) times outputs [0, NR)
// of w: y[r * ldy + j] = the sum (+ residual[r * ldy + j]).
template <int R, int NR>
inline void tile(const int8_t* hi, const int8_t* lo, const float* d, const float* xsum,
                 int64_t K, int64_t G, const uint8_t* w, int64_t row_bytes, const float* scales,
                 const float* mins, const float* residual, float* y, int64_t ldy) {
  const int64_t chunks = K / kChunk, groups = K / G, per_group = G / kChunk;
  __m256 acc[R][NR];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t g = c / per_group;
    __m256i wv[NR];
    __m256 sv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      wv[j] = load_chunk(w + j * row_bytes, c);
      sv[j] = _mm256_set1_ps(scales[j * groups + g]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + r * K + c * kChunk));
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + r * K + c * kChunk));
      const __m256 dv = _mm256_set1_ps(d[r * chunks + c]);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m256 f = _mm256_cvtepi32_ps(dot_parts(wv[j], xh, xl));
        acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(f, sv[j]), dv, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) {
      float v = hsum(acc[r][j]);
      if (mins != nullptr)
        for (int64_t g = 0; g < groups; ++g) v += mins[j * groups + g] * xsum[r * groups + g];
      y[r * ldy + j] = v + (residual != nullptr ? residual[r * ldy + j] : 0.0f);
    }
}

// Rows [0, R) of y over outputs [n0, n1): tiles of NR outputs, then single outputs.
template <int R, int NR>
inline void row_tile(const int8_t* hi, const int8_t* lo, const float* d, const float* xsum,
                     int64_t K, int64_t G, const uint8_t* w, const float* scales,
                     const float* mins, const float* residual, float* y, int64_t N, int64_t n0,
                     int64_t n1) {
  const int64_t row_bytes = K / 2, groups = K / G;
  for (int64_t n = n0; n < n1;) {
    const uint8_t* wn = w + n * row_bytes;
    const float* sn = scales + n * groups;
    const float* mn = mins != nullptr ? mins + n * groups : nullptr;
    const float* rn = residual != nullptr ? residual + n : nullptr;
    if (n + NR <= n1) {
      tile<R, NR>(hi, lo, d, xsum, K, G, wn, row_bytes, sn, mn, rn, y + n, N);
      n += NR;
    } else {
      tile<R, 1>(hi, lo, d, xsum, K, G, wn, row_bytes, sn, mn, rn, y + n, N);
      n += 1;
    }
  }
}

// Rows [0, M) of y over outputs [n0, n1), M <= 4 in one row tile (one row: 4 outputs a tile,
// more: 2).
inline void block(int64_t M, const int8_t* hi, const int8_t* lo, const float* d,
                  const float* xsum, int64_t K, int64_t G, const uint8_t* w, const float* scales,
                  const float* mins, const float* residual, float* y, int64_t N, int64_t n0,
                  int64_t n1) {
  switch (M) {
    case 1: return row_tile<1, 4>(hi, lo, d, xsum, K, G, w, scales, mins, residual, y, N, n0, n1);
    case 2: return row_tile<2, 2>(hi, lo, d, xsum, K, G, w, scales, mins, residual, y, N, n0, n1);
    case 3: return row_tile<3, 2>(hi, lo, d, xsum, K, G, w, scales, mins, residual, y, N, n0, n1);
    case 4: return row_tile<4, 2>(hi, lo, d, xsum, K, G, w, scales, mins, residual, y, N, n0, n1);
    default: return;  // no rows: nothing to write
  }
}

}  // namespace jaxpaged::q4i8

#endif  // JAXPAGED_AVX2 && !JAXPAGED_AVX512
