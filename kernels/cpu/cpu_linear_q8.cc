// y = x @ (q[layer] * s[layer]).T for an int8 weight q with one float32 scale per output
// (weight-only quantization, models/quant), as an XLA FFI custom call, with the same fused
// silu gate, RMSNorm and residual as cpu_linear.cc.
//
// Two paths. Up to two rows (decode at batch 1-2, memory-bound: the int8 bytes are the
// gain), each row of x is rounded to int16 with a per-row scale (max |x| / 32767: finer than
// bfloat16's 8-bit mantissa for every value within 1/256 of the row's largest) and vpmaddwd
// multiplies 16 int16 pairs into 8 int32 sums per instruction. From kFloatRows rows on (a
// batch step, compute-bound), slices of the weight are widened to float32 once into L1 and
// multiplied in FMAs, as the float32 kernel does (see block_float for why).
//
// Layout (cpu.pack_panels of an int8 weight): an [N, K] matrix, N % 16 == 0 and K even, is
// stored as [N/16, K/2, 16, 2]: panel p, k pair kk holds (q[16p + j, 2kk], q[16p + j,
// 2kk + 1]) for its 16 outputs j, so one 32-byte row per pair widens into the two vpmaddwd
// operands of 8 outputs each.
//
// A slice of kKc = 128 k (64 pairs) bounds the int32 sums: 64 * 2 * 32767 * 127 < 2^31.
// After each slice a tile's sums go to y in float32, times the row's and the outputs'
// scales. A panel slice (2 KB) is widened once into L1 (to int16, or to float32 on the float
// path) and read by every row tile of the work item's rows; a work item is (row block, group
// of panels), so each weight streams from memory once per row block.

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

constexpr int64_t kNr = 16;    // outputs per panel
constexpr int64_t kMr = 4;     // rows per register tile: 8 int32 accumulators
constexpr int64_t kKc = 128;   // k per slice (64 pairs): the int32 sums cannot overflow
constexpr int64_t kMc = 96;    // rows per work item
constexpr int64_t kPanelsPerItem = 3;

inline int32_t pair(int16_t lo, int16_t hi) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                              static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
}

// A prepared row of x as int16 pairs, lo half first: xq[kk] = (x[2kk], x[2kk+1]) rounded to
// x / scale, scale = max |x| / 32767 (written to *scale; 1 for a zero row).
void quantize_row(const float* x, int64_t K, int32_t* xq, float* scale) {
  float absmax = 0.0f;
  for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::fabs(x[k]));
  const float s = absmax > 0.0f ? absmax / 32767.0f : 1.0f;
  const float inv_s = 1.0f / s;
  auto q = [&](int64_t k) {
    return static_cast<int16_t>(std::lrintf(std::clamp(x[k] * inv_s, -32767.0f, 32767.0f)));
  };
  for (int64_t kk = 0; kk < K / 2; ++kk) xq[kk] = pair(q(2 * kk), q(2 * kk + 1));
  *scale = s;
}

// y[0:MR, 0:16] = base + (sum over the slice's pairs of x pair . w pair) * xs[m] * ws[j].
// x: the tile's rows as int16 pairs, row stride K/2 pairs; wp: the widened slice [pairs][16][2].
template <int MR>
inline void tile(const int32_t* x, int64_t x_stride, const int16_t* wp, int64_t pairs,
                 const float* xs, const float* ws, float* y, int64_t ldy, const float* base) {
#ifdef JAXPAGED_AVX2
  __m256i lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + kk * 32));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + kk * 32 + 16));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256i xb = _mm256_set1_epi32(x[m * x_stride + kk]);
      lo[m] = _mm256_add_epi32(lo[m], _mm256_madd_epi16(xb, w0));
      hi[m] = _mm256_add_epi32(hi[m], _mm256_madd_epi16(xb, w1));
    }
  }
  const __m256 ws0 = _mm256_loadu_ps(ws), ws1 = _mm256_loadu_ps(ws + 8);
  for (int m = 0; m < MR; ++m) {
    const __m256 sx = _mm256_set1_ps(xs[m]);
    __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(lo[m]), _mm256_mul_ps(sx, ws0));
    __m256 b = _mm256_mul_ps(_mm256_cvtepi32_ps(hi[m]), _mm256_mul_ps(sx, ws1));
    if (base != nullptr) {
      a = _mm256_add_ps(a, _mm256_loadu_ps(base + m * ldy));
      b = _mm256_add_ps(b, _mm256_loadu_ps(base + m * ldy + 8));
    }
    _mm256_storeu_ps(y + m * ldy, a);
    _mm256_storeu_ps(y + m * ldy + 8, b);
  }
#else
  for (int m = 0; m < MR; ++m) {
    int32_t acc[kNr] = {};
    for (int64_t kk = 0; kk < pairs; ++kk) {
      const uint32_t v = static_cast<uint32_t>(x[m * x_stride + kk]);
      const int32_t lo = static_cast<int16_t>(v & 0xffff), hi = static_cast<int16_t>(v >> 16);
      for (int64_t j = 0; j < kNr; ++j)
        acc[j] += lo * wp[kk * 32 + 2 * j] + hi * wp[kk * 32 + 2 * j + 1];
    }
    for (int64_t j = 0; j < kNr; ++j)
      y[m * ldy + j] = acc[j] * xs[m] * ws[j] + (base ? base[m * ldy + j] : 0.0f);
  }
#endif
}

template <int MR>
inline void tile_upto(int64_t rows, const int32_t* x, int64_t x_stride, const int16_t* wp,
                      int64_t pairs, const float* xs, const float* ws, float* y, int64_t ldy,
                      const float* base) {
  if constexpr (MR > 1)
    if (rows < MR) return tile_upto<MR - 1>(rows, x, x_stride, wp, pairs, xs, ws, y, ldy, base);
  tile<MR>(x, x_stride, wp, pairs, xs, ws, y, ldy, base);
}

// n int8 weights widened to int16 into dst (a panel slice, for all the row tiles).
inline void widen(const int8_t* src, int16_t* dst, int64_t n) {
  int64_t i = 0;
#ifdef JAXPAGED_AVX2
  for (; i + 16 <= n; i += 16)
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i),
                       _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

// Rows [m0, m0 + rows) of y over panels [p0, p1).
void block(const int32_t* x32, const float* xs, const int8_t* w, const float* ws,
           const float* residual, float* y, int64_t K, int64_t N, int64_t m0, int64_t rows,
           int64_t p0, int64_t p1) {
  alignas(64) int16_t wide[kKc * kNr];
  const int64_t stride = K / 2;  // pairs per row
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      widen(w + p * K * kNr + k0 * kNr, wide, kc * kNr);
      for (int64_t t = 0; t < rows; t += kMr) {
        const int64_t m = m0 + t;
        const int64_t at = m * N + p * kNr;
        const float* base = k0 > 0 ? y + at : residual != nullptr ? residual + at : nullptr;
        tile_upto<kMr>(std::min(kMr, rows - t), x32 + m * stride + k0 / 2, stride, wide, kc / 2,
                       xs + m, ws + p * kNr, y + at, N, base);
      }
    }
}

#ifdef JAXPAGED_AVX2
// The float path, from kFloatRows rows on. vpmaddwd multiplies 16 int16 pairs per
// instruction but issues at half the rate of an 8-lane FMA on this AVX2 EPYC, so it does no
// more multiply-accumulates per cycle (measured: 0.84-1.08x of FMA's), and its 4-row tile
// (a 6-row one spills: vpmaddwd has no accumulating form, so each product needs a register)
// runs at 0.83-0.87x of the FMA peak from L1 where the float32 6 x 16 tile runs at 0.9-1.0x.
// So a slice of a panel is widened once to float32 into L1, in panel order [kc, 16], and
// every 6-row tile of the item's rows multiplies it in FMAs over x in float32, unrounded;
// the outputs' scales are applied as a tile's sums are added to y.
constexpr int64_t kFloatRows = 3;  // rows from which the float path is taken
constexpr int64_t kFr = 6;         // rows per float register tile: 12 accumulators

// A panel slice of `pairs` k pairs ([pairs][16][2] int8) as float32 [2 pairs][16].
inline void widen_float(const int8_t* src, float* dst, int64_t pairs) {
  // per 128-bit lane (8 outputs x 2 k): the 8 first k's bytes, then the 8 second k's
  const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  auto to_float = [](__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); };
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const __m256i v = _mm256_shuffle_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kk * 32)), order);
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    float* d = dst + kk * 32;
    _mm256_store_ps(d, to_float(lo));                             // k even, outputs 0-7
    _mm256_store_ps(d + 8, to_float(hi));                         // k even, outputs 8-15
    _mm256_store_ps(d + 16, to_float(_mm_srli_si128(lo, 8)));     // k odd, outputs 0-7
    _mm256_store_ps(d + 24, to_float(_mm_srli_si128(hi, 8)));     // k odd, outputs 8-15
  }
}

// y[0:MR, 0:16] = base + (x[0:MR, 0:kc] @ wp[0:kc, 0:16]) * ws[0:16]; x row-major with row
// stride ldx, wp a widened slice.
template <int MR>
inline void tile_float(const float* x, int64_t ldx, const float* wp, int64_t kc,
                       const float* ws, float* y, int64_t ldy, const float* base) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(wp + k * kNr), w1 = _mm256_load_ps(wp + k * kNr + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      lo[m] = _mm256_fmadd_ps(xb, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xb, w1, hi[m]);
    }
  }
  const __m256 ws0 = _mm256_loadu_ps(ws), ws1 = _mm256_loadu_ps(ws + 8);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    __m256 a = _mm256_mul_ps(lo[m], ws0), b = _mm256_mul_ps(hi[m], ws1);
    if (base != nullptr) {
      a = _mm256_add_ps(a, _mm256_loadu_ps(base + m * ldy));
      b = _mm256_add_ps(b, _mm256_loadu_ps(base + m * ldy + 8));
    }
    _mm256_storeu_ps(y + m * ldy, a);
    _mm256_storeu_ps(y + m * ldy + 8, b);
  }
}

template <int MR>
inline void tile_float_upto(int64_t rows, const float* x, int64_t ldx, const float* wp,
                            int64_t kc, const float* ws, float* y, int64_t ldy,
                            const float* base) {
  if constexpr (MR > 1)
    if (rows < MR) return tile_float_upto<MR - 1>(rows, x, ldx, wp, kc, ws, y, ldy, base);
  tile_float<MR>(x, ldx, wp, kc, ws, y, ldy, base);
}

// Rows [m0, m0 + rows) of y over panels [p0, p1), from x in float32 (xf [M, K]).
void block_float(const float* xf, const int8_t* w, const float* ws, const float* residual,
                 float* y, int64_t K, int64_t N, int64_t m0, int64_t rows, int64_t p0,
                 int64_t p1) {
  alignas(64) float wide[kKc * kNr];
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      widen_float(w + p * K * kNr + k0 * kNr, wide, kc / 2);
      // tiles of as equal a size as kFr allows (32 rows: 6, 6, 5, 5, 5, 5, not 5 x 6 and a
      // load-bound 2)
      const int64_t tiles = (rows + kFr - 1) / kFr;
      for (int64_t i = 0, t = 0; i < tiles; ++i) {
        const int64_t size = rows / tiles + (i < rows % tiles ? 1 : 0);
        const int64_t at = (m0 + t) * N + p * kNr;
        const float* base = k0 > 0 ? y + at : residual != nullptr ? residual + at : nullptr;
        tile_float_upto<kFr>(size, xf + (m0 + t) * K + k0, K, wide, kc, ws + p * kNr, y + at,
                             N, base);
        t += size;
      }
    }
}
#endif

ffi::Error LinearQ8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                        ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> layer_buf,
                        ffi::Buffer<ffi::S32> num_rows, ffi::Buffer<ffi::F32> gate_buf,
                        ffi::Buffer<ffi::F32> norm_weight, ffi::Buffer<ffi::F32> residual_buf,
                        float norm_eps, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1] || wd[1] % kNr != 0 || xd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("need x [M, K] and w [L, N, K], N % 16 == 0, K even");
  const int64_t K = xd[1], L = wd[0], N = wd[1];
  if (scales.element_count() != L * N)
    return ffi::Error::InvalidArgument("scales must hold L * N values");
  const int64_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("layer index out of range");
  float* yp = y->typed_data();
  jaxpaged::FusedOperands fused;
  if (auto err = jaxpaged::ReadFusedOperands(xd[0], K, N, num_rows, gate_buf, norm_weight,
                                             residual_buf, yp, &fused);
      err.failure())
    return err;
  const float* gate = fused.gate;
  const float* norm_w = fused.norm_w;
  const float* residual = fused.residual;
  // Rows past num_rows are a step's padding: they cost nothing.
  const int64_t M = fused.rows;
  const float* xp = x.typed_data();
  const int8_t* wl = w.typed_data() + layer * N * K;
  const float* sl = scales.typed_data() + layer * N;
  const int64_t panels = N / kNr;
  const int64_t row_blocks = (M + kMc - 1) / kMc;
  const int64_t groups = (panels + kPanelsPerItem - 1) / kPanelsPerItem;
  // x's rows after the gate and the norm, in a buffer the calling thread keeps across calls
  thread_local std::vector<float> xf;
  if (xf.size() < static_cast<size_t>(M * K)) xf.resize(M * K);
  float* xfp = xf.data();
  jaxpaged::parallel_for(pool, M, [&](int64_t r) {
    jaxpaged::PrepareRow(xp + r * K, gate ? gate + r * K : nullptr, norm_w, norm_eps, K,
                         xfp + r * K);
  });
#ifdef JAXPAGED_AVX2
  if (M >= kFloatRows) {
    jaxpaged::parallel_for_runs(pool, row_blocks * groups, [&](int64_t i) {
      const int64_t m0 = (i / groups) * kMc, p0 = (i % groups) * kPanelsPerItem;
      block_float(xfp, wl, sl, residual, yp, K, N, m0, std::min(kMc, M - m0), p0,
                  std::min(panels, p0 + kPanelsPerItem));
    });
    return ffi::Error::Success();
  }
#endif
  // x's rows as int16 with their scales
  thread_local std::vector<int32_t> xq;
  thread_local std::vector<float> xs;
  if (xq.size() < static_cast<size_t>(M * K / 2)) xq.resize(M * K / 2);
  if (xs.size() < static_cast<size_t>(M)) xs.resize(M);
  int32_t* xqp = xq.data();
  float* xsp = xs.data();
  jaxpaged::parallel_for(pool, M,
                         [&](int64_t r) { quantize_row(xfp + r * K, K, xqp + r * (K / 2), xsp + r); });
  jaxpaged::parallel_for_runs(pool, row_blocks * groups, [&](int64_t i) {
    const int64_t m0 = (i / groups) * kMc, p0 = (i % groups) * kPanelsPerItem;
    block(xqp, xsp, wl, sl, residual, yp, K, N, m0, std::min(kMc, M - m0), p0,
          std::min(panels, p0 + kPanelsPerItem));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedLinearQ8, LinearQ8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [L, N, K] int8, q8 panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [L, N, 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_rows [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [M, K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm weight [K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [M, N] or [0]
                                  .Attr<float>("norm_eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);
