// y = x @ w[layer].T for a group-wise quantized weight (models/quant/grouped.py: GGUF's
// Q4_0/Q4_1/Q4_K/Q8_0/Q6_K, AWQ, GPTQ) as an XLA FFI custom call, with the same fused silu
// gate, RMSNorm and residual as cpu_linear.cc:
//
//   w[n, k] = q[n, k] * scale[n, k / G] + min[n, k / G]
//
// The weight stays in the format's own layout, [L, N, K/2] bytes (4-bit: the even k in the
// low nibble) or [L, N, K] int8, with float32 scales and mins [L, N, K/G]: a decode step
// streams 4.5-6 bits per weight where float32 streams 32.
//
// Each 16 inputs of an output are unpacked in registers (the low and high nibbles of 8 bytes
// interleaved back into k order, widened to two 8-float vectors), dequantized with two FMAs,
// and multiplied into every row of a register tile of x (FMA, float32 throughout). Past a
// register tile of rows, a work item (row block, 16 outputs) dequantizes its weights once into
// a float32 buffer that every row tile reads, so each weight streams from memory once per row
// block of kMc rows. Up to kIntRows rows (decode at batch 1-2) take an int16 path instead
// (row_int below): x rounded to int16 per row, weights widened to int16, vpmaddwd.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_fused.h"
#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMr = 4;    // rows per register tile
constexpr int64_t kMc = 96;   // rows per work item
constexpr int64_t kNb = 16;   // outputs per work item
constexpr int64_t kChunk = 16;  // inputs unpacked at once

// A row of x after the gate and the norm (float32).
void prepare_row(const float* x, const float* gate, const float* norm_w, float eps, int64_t K,
                 float* out) {
  for (int64_t k = 0; k < K; ++k)
    out[k] = gate ? gate[k] / (1.0f + std::exp(-gate[k])) * x[k] : x[k];
  if (norm_w != nullptr) {
    float squares = 0.0f;
    for (int64_t k = 0; k < K; ++k) squares += out[k] * out[k];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k) out[k] = norm_w[k] * (out[k] * inv);
  }
}

#ifdef JAXPAGED_AVX2
struct Pair {
  __m256 lo, hi;  // inputs [k, k + 8) and [k + 8, k + 16)
};

// Inputs [k, k + 16) of one output, in k order.
template <int BITS>
inline Pair unpack16(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 32) {  // already dequantized (dequantize_rows)
    const float* f = reinterpret_cast<const float*>(row) + k;
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  } else if constexpr (BITS == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_and_si128(b, mask);
    const __m128i odd = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i q = _mm_unpacklo_epi8(even, odd);  // 16 values in k order
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
  }
}
#endif

inline float q_at(const uint8_t* row, int64_t k, int bits) {
  if (bits == 32) return reinterpret_cast<const float*>(row)[k];
  if (bits == 4) return static_cast<float>((row[k / 2] >> (4 * (k & 1))) & 0x0F);
  return static_cast<float>(static_cast<int8_t>(row[k]));
}

// y[m, n0 + j] for the tile's MR rows and NR outputs (weight rows w + j * row_bytes). Each
// 16 inputs of an output are unpacked and dequantized (q * scale + min: two FMAs) once, then
// multiplied into all MR rows: MR * NR independent accumulators hide the FMA latency.
template <int MR, int NR, int BITS>
inline void tile(const float* x, int64_t K, int64_t G, const uint8_t* w, int64_t row_bytes,
                 const float* scales, const float* mins, float* y, int64_t ldy,
                 const float* base) {
  const int64_t groups = K / G;
  float out[MR][NR];
#ifdef JAXPAGED_AVX2
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s[NR], mn[NR];
    if constexpr (BITS != 32)
      for (int j = 0; j < NR; ++j) {
        s[j] = _mm256_set1_ps(scales[j * groups + g]);
        mn[j] = _mm256_set1_ps(mins != nullptr ? mins[j * groups + g] : 0.0f);
      }
    for (int64_t k = g * G; k < (g + 1) * G; k += kChunk) {
      Pair wv[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const Pair q = unpack16<BITS>(w + j * row_bytes, k);
        if constexpr (BITS == 32)
          wv[j] = q;
        else
          wv[j] = {_mm256_fmadd_ps(q.lo, s[j], mn[j]), _mm256_fmadd_ps(q.hi, s[j], mn[j])};
      }
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m256 x0 = _mm256_loadu_ps(x + m * K + k), x1 = _mm256_loadu_ps(x + m * K + k + 8);
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          acc[m][j] = _mm256_fmadd_ps(wv[j].lo, x0, acc[m][j]);
          acc[m][j] = _mm256_fmadd_ps(wv[j].hi, x1, acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) out[m][j] = jaxpaged::hsum(acc[m][j]);
#else
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) {
      float total = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = j * groups + k / G;
        const float q = q_at(w + j * row_bytes, k, BITS);
        const float wk = BITS == 32 ? q : q * scales[g] + (mins ? mins[g] : 0.0f);
        total += wk * x[m * K + k];
      }
      out[m][j] = total;
    }
#endif
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) y[m * ldy + j] = out[m][j] + (base ? base[m * ldy + j] : 0.0f);
}

// A tile of `rows` (<= kMr) rows and `cols` (1, 2 or 4) outputs.
template <int BITS>
void tile_any(int64_t rows, int64_t cols, const float* x, int64_t K, int64_t G,
              const uint8_t* w, int64_t row_bytes, const float* scales, const float* mins,
              float* y, int64_t ldy, const float* base) {
#define JP_TILE(MR, NR) \
  return tile<MR, NR, BITS>(x, K, G, w, row_bytes, scales, mins, y, ldy, base)
#define JP_ROWS(NR)                 \
  switch (rows) {                   \
    case 1: JP_TILE(1, NR);         \
    case 2: JP_TILE(2, NR);         \
    case 3: JP_TILE(3, NR);         \
    default: JP_TILE(4, NR);        \
  }
  if (cols == 4) JP_ROWS(4);
  if (cols == 2) JP_ROWS(2);
  JP_ROWS(1);
#undef JP_ROWS
#undef JP_TILE
}

// Rows of weights [n0, n1) dequantized to float32 into out [n1 - n0, K].
template <int BITS>
void dequantize_rows(const uint8_t* w, const float* scales, const float* mins, int64_t K,
                     int64_t G, int64_t n0, int64_t n1, float* out) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* o = out + (n - n0) * K;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[n * groups + g];
      const float mn = mins != nullptr ? mins[n * groups + g] : 0.0f;
#ifdef JAXPAGED_AVX2
      const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(mn);
      for (int64_t k = g * G; k < (g + 1) * G; k += kChunk) {
        const Pair q = unpack16<BITS>(row, k);
        _mm256_storeu_ps(o + k, _mm256_fmadd_ps(q.lo, sv, mv));
        _mm256_storeu_ps(o + k + 8, _mm256_fmadd_ps(q.hi, sv, mv));
      }
#else
      for (int64_t k = g * G; k < (g + 1) * G; ++k) o[k] = q_at(row, k, BITS) * s + mn;
#endif
    }
  }
}

// Rows [m0, m0 + rows) of y over outputs [n0, n1). Past a register tile of rows, the item's
// weights are dequantized once into a float32 buffer that every row tile then reads.
template <int BITS>
void block(const float* xf, const uint8_t* w, const float* scales, const float* mins,
           const float* residual, float* y, int64_t K, int64_t G, int64_t N, int64_t m0,
           int64_t rows, int64_t n0, int64_t n1, int64_t w_first = 0) {  // w's first row
  if constexpr (BITS != 32) {
    if (rows > kMr) {
      thread_local std::vector<float> buf;
      if (buf.size() < static_cast<size_t>(kNb * K)) buf.resize(kNb * K);
      dequantize_rows<BITS>(w, scales, mins, K, G, n0, n1, buf.data());
      const uint8_t* wf = reinterpret_cast<const uint8_t*>(buf.data());
      return block<32>(xf, wf, nullptr, nullptr, residual, y, K, G, N, m0, rows, n0, n1, n0);
    }
  }
  const int64_t row_bytes = BITS == 4 ? K / 2 : BITS == 8 ? K : K * 4;
  const int64_t groups = K / G;
  const int64_t wide = rows <= 2 ? 4 : 2;  // outputs per tile
  for (int64_t n = n0; n < n1;) {
    const int64_t cols = n + wide <= n1 ? wide : 1;
    for (int64_t t = 0; t < rows; t += kMr) {
      const int64_t m = m0 + t;
      const float* base = residual != nullptr ? residual + m * N + n : nullptr;
      tile_any<BITS>(std::min(kMr, rows - t), cols, xf + m * K, K, G, w + (n - w_first) * row_bytes,
                     row_bytes, scales ? scales + n * groups : nullptr,
                     mins != nullptr ? mins + n * groups : nullptr,
                     y + m * N + n, N, base);
    }
    n += cols;
  }
}

#ifdef JAXPAGED_AVX2
// Few rows (a decode step's): x is rounded to int16 per row (max |x| / 32767, as
// cpu_linear_q8.cc) so that 16 weights widen to int16 in one instruction and multiply in one
// vpmaddwd, where the float path spends four conversions and two FMAs on dequantizing them:
// a batch-1 step was compute-bound on those. The group's int32 sums are scaled once.
void quantize_row16(const float* x, int64_t K, int64_t G, int16_t* xq, float* scale,
                    int32_t* sums) {
  float absmax = 0.0f;
  for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::fabs(x[k]));
  const float s = absmax > 0.0f ? absmax / 32767.0f : 1.0f;
  const float inv = 1.0f / s;
  for (int64_t g = 0; g < K / G; ++g) {
    int32_t total = 0;
    for (int64_t k = g * G; k < (g + 1) * G; ++k) {
      xq[k] = static_cast<int16_t>(std::lrintf(std::clamp(x[k] * inv, -32767.0f, 32767.0f)));
      total += xq[k];
    }
    sums[g] = total;
  }
  *scale = s;
}

template <int BITS>
inline __m256i unpack16_i16(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_unpacklo_epi8(_mm_and_si128(b, mask),
                                        _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    return _mm256_cvtepu8_epi16(q);
  } else {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
  }
}

// y[j] for one row (int16 xq, its scale and group sums) and NR outputs.
template <int NR, int BITS>
inline void tile_int(const int16_t* xq, float xs, const int32_t* sums, int64_t K, int64_t G,
                     const uint8_t* w, int64_t row_bytes, const float* scales,
                     const float* mins, float* y, const float* base) {
  const int64_t groups = K / G;
  __m256 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i part[NR];
    for (int j = 0; j < NR; ++j) part[j] = _mm256_setzero_si256();
    for (int64_t k = g * G; k < (g + 1) * G; k += kChunk) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
        part[j] = _mm256_add_epi32(
            part[j], _mm256_madd_epi16(unpack16_i16<BITS>(w + j * row_bytes, k), xv));
    }
    for (int j = 0; j < NR; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[j]),
                               _mm256_set1_ps(scales[j * groups + g]), acc[j]);
  }
  for (int j = 0; j < NR; ++j) {
    float v = jaxpaged::hsum(acc[j]);
    if (mins != nullptr)
      for (int64_t g = 0; g < groups; ++g) v += mins[j * groups + g] * static_cast<float>(sums[g]);
    y[j] = v * xs + (base ? base[j] : 0.0f);
  }
}

// Row m of y over outputs [n0, n1), from int16 x.
template <int BITS>
void row_int(const int16_t* xq, float xs, const int32_t* sums, const uint8_t* w,
             const float* scales, const float* mins, const float* residual, float* y,
             int64_t K, int64_t G, int64_t N, int64_t m, int64_t n0, int64_t n1) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1;) {
    const float* base = residual != nullptr ? residual + m * N + n : nullptr;
    const uint8_t* wr = w + n * row_bytes;
    const float* sr = scales + n * groups;
    const float* mr = mins != nullptr ? mins + n * groups : nullptr;
    if (n + 4 <= n1) {
      tile_int<4, BITS>(xq, xs, sums, K, G, wr, row_bytes, sr, mr, y + m * N + n, base);
      n += 4;
    } else {
      tile_int<1, BITS>(xq, xs, sums, K, G, wr, row_bytes, sr, mr, y + m * N + n, base);
      n += 1;
    }
  }
}
#endif

constexpr int64_t kIntRows = 2;  // up to this many rows take the int16 path (AVX2)

ffi::Error LinearQ4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                        ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                        ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> num_rows,
                        ffi::Buffer<ffi::F32> gate_buf, ffi::Buffer<ffi::F32> norm_weight,
                        ffi::Buffer<ffi::F32> residual_buf, float norm_eps, int64_t bits,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto vd = values.dimensions();
  auto sd = scales.dimensions();
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("bits must be 4 or 8");
  const bool nibbles = bits == 4;
  if (values.element_type() != (nibbles ? ffi::DataType::U8 : ffi::DataType::S8))
    return ffi::Error::InvalidArgument("values must be uint8 (4-bit) or int8 (8-bit)");
  if (xd.size() != 2 || vd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("need x [M, K], values [L, N, Kb], scales [L, N, K/G]");
  const int64_t K = xd[1], L = vd[0], N = vd[1];
  if (vd[2] * (nibbles ? 2 : 1) != K || sd[0] != L || sd[1] != N || sd[2] <= 0 || K % sd[2])
    return ffi::Error::InvalidArgument("values and scales do not match x's K");
  const int64_t G = K / sd[2];
  if (G % kChunk != 0) return ffi::Error::InvalidArgument("group size must be a multiple of 16");
  if (mins.element_count() != (nibbles ? L * N * (K / G) : 0))
    return ffi::Error::InvalidArgument("4-bit weights need mins like scales; 8-bit ones none");
  const int64_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("layer index out of range");
  float* yp = y->typed_data();
  jaxpaged::FusedOperands fused;
  if (auto err = jaxpaged::ReadFusedOperands(xd[0], K, N, num_rows, gate_buf, norm_weight,
                                             residual_buf, yp, &fused);
      err.failure())
    return err;
  const int64_t M = fused.rows;  // rows past num_rows are padding: they cost nothing
  const int64_t groups = K / G;
  thread_local std::vector<float> xf;
  if (xf.size() < static_cast<size_t>(M * K)) xf.resize(M * K);
  float* xfp = xf.data();
  const float* xp = x.typed_data();
  jaxpaged::parallel_for(pool, M, [&](int64_t r) {
    prepare_row(xp + r * K, fused.gate ? fused.gate + r * K : nullptr, fused.norm_w, norm_eps,
                K, xfp + r * K);
  });
  const int64_t row_bytes = nibbles ? K / 2 : K;
  const uint8_t* wl = static_cast<const uint8_t*>(values.untyped_data()) + layer * N * row_bytes;
  const float* sl = scales.typed_data() + layer * N * groups;
  const float* ml = nibbles ? mins.typed_data() + layer * N * groups : nullptr;
  const int64_t out_blocks = (N + kNb - 1) / kNb;
#ifdef JAXPAGED_AVX2
  if (M <= kIntRows) {
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<int32_t> sums;
    float xs[kIntRows];
    if (xq.size() < static_cast<size_t>(M * K)) xq.resize(M * K);
    if (sums.size() < static_cast<size_t>(M * groups)) sums.resize(M * groups);
    for (int64_t r = 0; r < M; ++r)
      quantize_row16(xfp + r * K, K, G, xq.data() + r * K, xs + r, sums.data() + r * groups);
    const int16_t* xqp = xq.data();
    const int32_t* sp = sums.data();
    jaxpaged::parallel_for_runs(pool, M * out_blocks, [&](int64_t i) {
      const int64_t m = i / out_blocks, n0 = (i % out_blocks) * kNb;
      const int64_t n1 = std::min(N, n0 + kNb);
      const int16_t* xr = xqp + m * K;
      const int32_t* sr = sp + m * groups;
      if (nibbles)
        row_int<4>(xr, xs[m], sr, wl, sl, ml, fused.residual, yp, K, G, N, m, n0, n1);
      else
        row_int<8>(xr, xs[m], sr, wl, sl, nullptr, fused.residual, yp, K, G, N, m, n0, n1);
    });
    return ffi::Error::Success();
  }
#endif
  const int64_t row_blocks = (M + kMc - 1) / kMc;
  jaxpaged::parallel_for_runs(pool, row_blocks * out_blocks, [&](int64_t i) {
    const int64_t m0 = (i / out_blocks) * kMc, n0 = (i % out_blocks) * kNb;
    const int64_t rows = std::min(kMc, M - m0), n1 = std::min(N, n0 + kNb);
    if (nibbles)
      block<4>(xfp, wl, sl, ml, fused.residual, yp, K, G, N, m0, rows, n0, n1);
    else
      block<8>(xfp, wl, sl, nullptr, fused.residual, yp, K, G, N, m0, rows, n0, n1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedLinearQ4, LinearQ4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // values [L, N, K/2] u8 or [L, N, K] s8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [L, N, K/G]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mins [L, N, K/G] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_rows [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [M, K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm weight [K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [M, N] or [0]
                                  .Attr<float>("norm_eps")
                                  .Attr<int64_t>("bits")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);
