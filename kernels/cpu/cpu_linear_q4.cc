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
// With AVX2 but not AVX-512, 4-bit weights at up to 4 rows take cpu_linear_q4_i8.h: x
// rounded to int16 per 32 inputs and held as two int8 parts, vpmaddubsw. Otherwise up to
// kIntRows rows (decode at batch 1, or 1-2 without AVX-512) take an int16 path
// (row_int below): x rounded to int16 per row, weights widened to int16, vpmaddwd. Past
// them, with AVX-512, cpu_linear_q4_512.h's float32 paths: dot_rows up to kDotRows rows,
// block_z past them; with AVX512-VNNI, decode steps of 6-32 rows take
// cpu_linear_q4_lanes.h's int16 path instead (x rounded per group, vpdpwssd). Without
// AVX-512 a work item (row block, kTn outputs) dequantizes kTo
// outputs' weights at a time into a float32 buffer that every row tile reads (tile_t below),
// so each weight streams from memory once per row block of kMc rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_fused.h"
#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "cpu_linear_q4_512.h"  // after cpu_simd.h, which defines JAXPAGED_AVX512
#include "cpu_linear_q4_lanes.h"
#include "cpu_linear_q4_i8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMc = 96;   // rows per work item (float path)
constexpr int64_t kNb = 16;   // outputs per work item (int16 path)
constexpr int64_t kChunk = 16;  // inputs unpacked at once

#ifdef JAXPAGED_AVX2
struct Pair {
  __m256 lo, hi;  // inputs [k, k + 8) and [k + 8, k + 16)
};

// Inputs [k, k + 16) of one output, in k order.
template <int BITS>
inline Pair unpack16(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 4) {
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
  if (bits == 4) return static_cast<float>((row[k / 2] >> (4 * (k & 1))) & 0x0F);
  return static_cast<float>(static_cast<int8_t>(row[k]));
}

// The float path (more than kIntRows rows): a work item dequantizes kTo outputs' weights at
// a time into a float32 buffer [kTo, K] (their natural row-major order, no transpose) and
// every register tile of its rows reads it. A tile holds kTo outputs x 16 rows: it
// broadcasts one weight per output and multiplies it into two 8-row vectors of x, which is
// stored transposed ([K, rows], xt), so per k it costs 2 loads, 6 broadcasts and 12 FMAs,
// the float32 panel kernel's mix (cpu_linear.cc). Its sums stay in registers over the whole
// K and are stored transposed once. The dot-product tile it replaced (per 16 k: 2 loads per
// output and per row, 8-lane sums reduced at the end) was load-bound: at 32 rows, 1.35-1.5x
// float32's time per SmolLM2 layer shape (measured, 30 cold layers a call).
constexpr int64_t kTo = 6;   // outputs per register tile (broadcast weights)
constexpr int64_t kTv = 2;   // 8-row vectors of x per register tile (tile_t has 1 or 2)
constexpr int64_t kTm = 8 * kTv;  // rows per register tile
constexpr int64_t kTn = 4 * kTo;  // outputs per work item

// out[j][r] = sum over k of wt[j * K + k] * xt[k * ldx + r], for j < NR and r < 8 NV.
template <int NR, int NV>
inline void tile_t(const float* xt, int64_t ldx, const float* wt, int64_t K,
                   float (*out)[kTm]) {
#ifdef JAXPAGED_AVX2
  // GCC keeps the sums in registers only if every loop over them is unrolled: otherwise it
  // stored all twelve to the stack at every k
  __m256 lo[NR], hi[NR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m256 x0 = _mm256_loadu_ps(xt + k * ldx);
    const __m256 x1 = NV > 1 ? _mm256_loadu_ps(xt + k * ldx + 8) : x0;
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m256 wb = _mm256_broadcast_ss(wt + j * K + k);
      lo[j] = _mm256_fmadd_ps(wb, x0, lo[j]);
      if constexpr (NV > 1) hi[j] = _mm256_fmadd_ps(wb, x1, hi[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    _mm256_storeu_ps(out[j], lo[j]);
    if constexpr (NV > 1) _mm256_storeu_ps(out[j] + 8, hi[j]);
  }
#else
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < 8 * NV; ++r) {
      float total = 0.0f;
      for (int64_t k = 0; k < K; ++k) total += wt[j * K + k] * xt[k * ldx + r];
      out[j][r] = total;
    }
#endif
}

// A tile of 1 .. kTo outputs and 1 .. kTv vectors of rows.
inline void tile_t_any(int64_t cols, int64_t vectors, const float* xt, int64_t ldx,
                       const float* wt, int64_t K, float (*out)[kTm]) {
#define JP_TILE(NR)                                          \
  return vectors > 1 ? tile_t<NR, 2>(xt, ldx, wt, K, out) \
                     : tile_t<NR, 1>(xt, ldx, wt, K, out)
  switch (cols) {
    case 1: JP_TILE(1);
    case 2: JP_TILE(2);
    case 3: JP_TILE(3);
    case 4: JP_TILE(4);
    case 5: JP_TILE(5);
    default: JP_TILE(6);
  }
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

// Rows [m0, m0 + rows) of y over outputs [n0, n1); xt: x transposed, [K, ldx], its rows
// padded with zeros to a multiple of 8.
template <int BITS>
void block_t(const float* xt, int64_t ldx, const uint8_t* w, const float* scales,
             const float* mins, const float* residual, float* y, int64_t K, int64_t G,
             int64_t N, int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(kTo * K)) buf.resize(kTo * K);
  float out[kTo][kTm];
  for (int64_t n = n0; n < n1; n += kTo) {
    const int64_t cols = std::min(kTo, n1 - n);
    dequantize_rows<BITS>(w, scales, mins, K, G, n, n + cols, buf.data());
    for (int64_t t = 0; t < rows; t += kTm) {
      const int64_t rt = std::min(kTm, rows - t);
      tile_t_any(cols, (rt + 7) / 8, xt + m0 + t, ldx, buf.data(), K, out);
      for (int64_t r = 0; r < rt; ++r) {
        const int64_t at = (m0 + t + r) * N + n;
        for (int64_t j = 0; j < cols; ++j)
          y[at + j] = out[j][r] + (residual != nullptr ? residual[at + j] : 0.0f);
      }
    }
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

#ifdef JAXPAGED_AVX512
// With AVX-512 two rows take dot_rows (cpu_linear_q4_512.h): measured faster than the int16
// path there (CPU time, 30 layers of SmolLM2's MLP shapes: 12.1 against 14.0-23.1 ms), and
// exact in float32
constexpr int64_t kIntRows = 1;
#else
constexpr int64_t kIntRows = 2;  // up to this many rows take the int16 path (AVX2)
#endif

#ifdef JAXPAGED_Q4_LANES
// Many rows with AVX512-VNNI (cpu_linear_q4_lanes.h). LanesX::row(r) rounds row r of x to
// int16 per group (called in the pass that prepares the rows, so no pass of its own), then run()
// stores the pairs transposed on the calling thread (a few microseconds: cheaper than
// waking the pool once more) and runs work items of (row block, outputs) in block_lanes.
struct LanesX {
  LanesX(int64_t M, int64_t K, int64_t G)
      : M(M), K(K), G(G), groups(K / G), mp((M + 15) / 16 * 16) {
    if (xq.size() < static_cast<size_t>(M * K)) xq.resize(M * K);
    if (xs.size() < static_cast<size_t>(M * groups)) xs.resize(M * groups);
    if (xsc.size() < static_cast<size_t>(mp * groups)) xsc.resize(mp * groups);
    if (sums.size() < static_cast<size_t>(M * groups)) sums.resize(M * groups);
    if (xsum.size() < static_cast<size_t>(mp * groups)) xsum.resize(mp * groups);
    if (xp.size() < static_cast<size_t>(mp * K / 2)) xp.resize(mp * K / 2);
    // the calling thread's buffers: row() runs on pool threads too
    xqp = xq.data(), xsp = xs.data(), sump = sums.data(), xsump = xsum.data(), xpp = xp.data();
    xscp = xsc.data();
  }

  void row(const float* x, int64_t r) {  // x: row r, [K]
    jaxpaged::q4::quantize_groups16_z(x, K, G, xqp + r * K, xsp + r * groups, sump + r * groups);
  }

  void run(ffi::ThreadPool& pool, int64_t bits, int64_t N, const uint8_t* wl, const float* sl,
           const float* ml, const float* residual, float* yp) {
    // pairs transposed: xp[p, m] = row m's pair p (its int16 row read as 32-bit words)
    const int64_t half = K / 2;
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* row = xqp + m * K;
      for (int64_t p = 0; p < half; ++p) std::memcpy(xpp + p * mp + m, row + 2 * p, 4);
    }
    for (int64_t p = 0; p < half; ++p)
      for (int64_t m = M; m < mp; ++m) xpp[p * mp + m] = 0;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t m = 0; m < M; ++m) {
        xsump[g * mp + m] = sump[m * groups + g];
        xscp[g * mp + m] = xsp[m * groups + g];
      }
      for (int64_t m = M; m < mp; ++m) xsump[g * mp + m] = xscp[g * mp + m] = 0.0f;
    }
    constexpr int64_t kRows = 96;  // rows per work item
    constexpr int64_t kOut = 2 * jaxpaged::q4::kLo;  // outputs per work item
    const int64_t row_blocks = (M + kRows - 1) / kRows, out_blocks = (N + kOut - 1) / kOut;
    jaxpaged::parallel_for_runs(pool, row_blocks * out_blocks, [&](int64_t i) {
      const int64_t m0 = (i / out_blocks) * kRows, n0 = (i % out_blocks) * kOut;
      const int64_t rows = std::min(kRows, M - m0), n1 = std::min(N, n0 + kOut);
      if (bits == 4)
        jaxpaged::q4::block_lanes<4>(xpp, xscp, xsump, mp, wl, sl, ml, residual, yp, K, G, N,
                                     m0, rows, n0, n1);
      else
        jaxpaged::q4::block_lanes<8>(xpp, xscp, xsump, mp, wl, sl, nullptr, residual, yp, K, G,
                                     N, m0, rows, n0, n1);
    });
  }

  const int64_t M, K, G, groups, mp;  // mp: rows padded to whole vectors
  int16_t* xqp;
  float *xsp, *sump, *xsump, *xscp;
  int32_t* xpp;
  static thread_local std::vector<int16_t> xq;  // [M, K]
  static thread_local std::vector<float> xs, sums;  // x's group scales and sums [M, K / G]
  static thread_local std::vector<float> xsc, xsum;  // the same, transposed: [K / G, mp]
  static thread_local std::vector<int32_t> xp;  // [K / 2, mp]
};
thread_local std::vector<int16_t> LanesX::xq;
thread_local std::vector<float> LanesX::xs, LanesX::sums, LanesX::xsc, LanesX::xsum;
thread_local std::vector<int32_t> LanesX::xp;
#endif

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
#ifdef JAXPAGED_Q4_LANES
  const bool lanes = M >= jaxpaged::q4::kLanesMin && M <= jaxpaged::q4::kLanesMax;
  std::optional<LanesX> lx;
  if (lanes) lx.emplace(M, K, G);
#endif
#ifdef JAXPAGED_Q4_I8
  namespace i8 = jaxpaged::q4i8;
  const bool chunk_x = M >= 1 && M <= i8::kMaxRows && G % i8::kChunk == 0 && nibbles;
  const int64_t chunks = K / i8::kChunk;
  thread_local std::vector<int8_t> xq8;
  thread_local std::vector<float> xd8, xsum8;
  if (chunk_x && xq8.size() < static_cast<size_t>(2 * M * K)) xq8.resize(2 * M * K);
  if (chunk_x && xd8.size() < static_cast<size_t>(M * chunks)) xd8.resize(M * chunks);
  if (chunk_x && xsum8.size() < static_cast<size_t>(M * groups)) xsum8.resize(M * groups);
  // the calling thread's buffers (rows are rounded on pool threads): x's hi parts, then lo
  int8_t *xhp = xq8.data(), *xlp = xq8.data() + M * K;
  float *xd8p = xd8.data(), *xsum8p = xsum8.data();
#endif
  jaxpaged::parallel_for(pool, M, [&](int64_t r) {
    const float* gate = fused.gate ? fused.gate + r * K : nullptr;
    jaxpaged::PrepareRow(xp + r * K, gate, fused.norm_w, norm_eps, K, xfp + r * K);
#ifdef JAXPAGED_Q4_LANES
    if (lanes) lx->row(xfp + r * K, r);
#endif
#ifdef JAXPAGED_Q4_I8
    if (chunk_x)
      i8::quantize_row(xfp + r * K, K, G, xhp + r * K, xlp + r * K, xd8p + r * chunks,
                       xsum8p + r * groups);
#endif
  });
  const int64_t row_bytes = nibbles ? K / 2 : K;
  const uint8_t* wl = static_cast<const uint8_t*>(values.untyped_data()) + layer * N * row_bytes;
  const float* sl = scales.typed_data() + layer * N * groups;
  const float* ml = nibbles ? mins.typed_data() + layer * N * groups : nullptr;
  const int64_t out_blocks = (N + kNb - 1) / kNb;
#ifdef JAXPAGED_Q4_I8
  if (chunk_x) {
    jaxpaged::parallel_for_runs(pool, (N + i8::kOut - 1) / i8::kOut, [&](int64_t i) {
      const int64_t n0 = i * i8::kOut, n1 = std::min(N, n0 + i8::kOut);
      i8::block(M, xhp, xlp, xd8p, xsum8p, K, G, wl, sl, ml, fused.residual, yp, N, n0, n1);
    });
    return ffi::Error::Success();
  }
#endif
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
#ifdef JAXPAGED_Q4_VNNI
    if (jaxpaged::q4::vnni_fits(bits, K, G)) {
      thread_local std::vector<int16_t> xs2;  // x in the order tile_vnni reads
      thread_local std::vector<float> xsum;  // the group sums, as float
      if (xs2.size() < static_cast<size_t>(M * K)) xs2.resize(M * K);
      if (xsum.size() < static_cast<size_t>(M * groups)) xsum.resize(M * groups);
      for (int64_t r = 0; r < M; ++r) {
        if (nibbles)
          jaxpaged::q4::split_even_odd(xqp + r * K, K, xs2.data() + r * K);
        else
          std::copy(xqp + r * K, xqp + (r + 1) * K, xs2.data() + r * K);
        for (int64_t g = 0; g < groups; ++g) xsum[r * groups + g] = static_cast<float>(sp[r * groups + g]);
      }
      const int16_t* x2 = xs2.data();
      const float* xsp = xsum.data();
      jaxpaged::parallel_for_runs(pool, M * out_blocks, [&](int64_t i) {
        const int64_t m = i / out_blocks, n0 = (i % out_blocks) * kNb;
        const int64_t n1 = std::min(N, n0 + kNb);
        const float* res = fused.residual != nullptr ? fused.residual + m * N : nullptr;
        if (nibbles)
          jaxpaged::q4::row_vnni<4>(x2 + m * K, xs[m], xsp + m * groups, wl, sl, ml, res,
                                    yp + m * N, K, G, n0, n1);
        else
          jaxpaged::q4::row_vnni<8>(x2 + m * K, xs[m], xsp + m * groups, wl, sl, nullptr, res,
                                    yp + m * N, K, G, n0, n1);
      });
      return ffi::Error::Success();
    }
#endif
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
#ifdef JAXPAGED_Q4_LANES
  if (lanes) {
    lx->run(pool, bits, N, wl, sl, ml, fused.residual, yp);
    return ffi::Error::Success();
  }
#endif
#ifdef JAXPAGED_AVX512
  if (M <= jaxpaged::q4::kDotRows) {
    constexpr int64_t kDotNb = jaxpaged::q4::kDotNb;
    jaxpaged::parallel_for_runs(pool, (N + kDotNb - 1) / kDotNb, [&](int64_t i) {
      const int64_t n0 = i * kDotNb, n1 = std::min(N, n0 + kDotNb);
      if (nibbles)
        jaxpaged::q4::dot_rows<4>(M, xfp, wl, sl, ml, fused.residual, yp, K, G, N, n0, n1);
      else
        jaxpaged::q4::dot_rows<8>(M, xfp, wl, sl, nullptr, fused.residual, yp, K, G, N, n0, n1);
    });
    return ffi::Error::Success();
  }
  constexpr int64_t kPad = 16;  // block_z reads x's rows 16 at a time
#else
  constexpr int64_t kPad = 8;
#endif
  // x transposed, [K, Mp], its rows padded with zeros to Mp, a multiple of kPad
  const int64_t mp = (M + kPad - 1) / kPad * kPad;
  thread_local std::vector<float> xt;
  if (xt.size() < static_cast<size_t>(K * mp)) xt.resize(K * mp);
  float* xtp = xt.data();
  jaxpaged::parallel_for(pool, (K + 63) / 64, [&](int64_t i) {
    for (int64_t k = i * 64; k < std::min(K, i * 64 + 64); ++k) {
      for (int64_t m = 0; m < M; ++m) xtp[k * mp + m] = xfp[m * K + k];
      for (int64_t m = M; m < mp; ++m) xtp[k * mp + m] = 0.0f;
    }
  });
  const int64_t row_blocks = (M + kMc - 1) / kMc;
#ifdef JAXPAGED_AVX512
  constexpr int64_t kZn = 4 * jaxpaged::q4::kZo;  // outputs per work item
  const int64_t z_blocks = (N + kZn - 1) / kZn;
  jaxpaged::parallel_for_runs(pool, row_blocks * z_blocks, [&](int64_t i) {
    const int64_t m0 = (i / z_blocks) * kMc, n0 = (i % z_blocks) * kZn;
    const int64_t rows = std::min(kMc, M - m0), n1 = std::min(N, n0 + kZn);
    jaxpaged::q4::block_z(xtp, mp, fused.residual, yp, K, N, m0, rows, n0, n1,
                          [&](int64_t a, int64_t b, float* buf) {
                            if (nibbles)
                              jaxpaged::q4::dequantize_z<4>(wl, sl, ml, K, G, a, b, buf);
                            else
                              jaxpaged::q4::dequantize_z<8>(wl, sl, nullptr, K, G, a, b, buf);
                          });
  });
  return ffi::Error::Success();
#endif
  const int64_t col_blocks = (N + kTn - 1) / kTn;
  jaxpaged::parallel_for_runs(pool, row_blocks * col_blocks, [&](int64_t i) {
    const int64_t m0 = (i / col_blocks) * kMc, n0 = (i % col_blocks) * kTn;
    const int64_t rows = std::min(kMc, M - m0), n1 = std::min(N, n0 + kTn);
    if (nibbles)
      block_t<4>(xtp, mp, wl, sl, ml, fused.residual, yp, K, G, N, m0, rows, n0, n1);
    else
      block_t<8>(xtp, mp, wl, sl, nullptr, fused.residual, yp, K, G, N, m0, rows, n0, n1);
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
