// y = x @ w[layer].T with w in panel layout, as an XLA FFI custom call (kernels/cpu/__init__.py), with
// a decoder layer's element-wise work folded in: optionally x -> silu(gate) * x and an RMSNorm
// of x's rows as x is packed, and a residual added as y is stored.
//
// Panel layout (cpu.pack_panels): an [N, K] weight, N % 16 == 0, is stored as [N/16, K, 16]:
// panel p holds outputs 16p .. 16p+15, one contiguous row of 16 floats per k. A 6 x 16 tile
// of y then costs, per k, two weight loads and six broadcasts of x for 12 FMAs, so the FMA
// units set the pace; the dot form over [out, in] rows needed 15 loads per 12 FMAs and a
// horizontal sum per output, and ran at about half of this (measured side by side).
// With AVX-512 a panel row is one 16-lane vector and the tile is 8 x 16: one weight load and
// eight broadcasts for 8 FMAs of 16 lanes.
//
// Weights are float32 or bfloat16 (read as the top half of a float32: a shift, no rounding);
// x, the accumulators and y are float32 either way, so a bfloat16 model streams half the
// weight bytes, which is what bounds its decode steps.
//
// Blocking: x is first packed tile by tile ([K][tile rows], so a tile's broadcasts per k are
// adjacent), then a kKc-deep slice of a panel (8 KB) stays in L1 while every row tile of a
// kMc-row block of x passes over it; each tile prefetches its share of the slice kAhead
// slices on into L2. Only the first num_rows rows are computed (the rest of a padded step's
// bucket is zero-filled, or gets the residual's rows). The residual is added in the first
// slice's store. A work item is (row block, group of panels), so each weight streams from
// memory once per row block: once per call in decode. Each thread owns a contiguous run of
// items (taking from the others' ends once its own is done), so the prefetches that run past
// an item's last slice land in the same thread's next item. The stacked weight is indexed in
// place, so a decoder's lax.scan never copies a layer out.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_fused.h"
#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNr = 16;  // outputs per panel (two AVX2 vectors, one AVX-512 vector)
#ifdef JAXPAGED_AVX512
constexpr int64_t kMr = 8;  // rows of x per register tile: 8 accumulators (of 32 registers)
#else
constexpr int64_t kMr = 6;  // rows of x per register tile: 12 accumulators + 2 + 1 registers
#endif
constexpr int64_t kKc = 128;  // depth of a panel slice (8 KB): it and the x tiles stay in L1
constexpr int64_t kAhead = 2;  // slices between the one read and the one prefetched into L2
constexpr int64_t kMc = 96;   // rows of x per work item (x block in L2)

// The row tiles of a block of `rows` rows: kMr-row tiles (6 with AVX2, 8 with AVX-512), and
// a remainder of 1 or 2 rows shares the last kMr as two tiles of about half as many (a 1- or
// 2-row tile is load-bound). Writes (first row, row count) pairs; returns how many.
inline int64_t split_rows(int64_t rows, int64_t (*out)[2]) {
  int64_t full = rows / kMr;
  if (full > 0 && rows % kMr > 0 && rows % kMr < 3) --full;
  int64_t n = 0, m = 0;
  for (; m < full * kMr; m += kMr) out[n][0] = m, out[n++][1] = kMr;
  int64_t left = rows - m;
  if (left > kMr) {
    const int64_t first = left - left / 2;
    out[n][0] = m, out[n++][1] = first;
    m += first;
    left -= first;
  }
  if (left > 0) out[n][0] = m, out[n++][1] = left;
  return n;
}
constexpr int64_t kMaxTiles = kMc / kMr + 2;

// A weight element: float, or bfloat16 bits.
using bf16_t = uint16_t;
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line

#if defined(JAXPAGED_AVX512) || defined(JAXPAGED_AVX2)
// A tile's k loop over one slice: the first pf_count steps each also prefetch one line (of
// the slice kAhead on) into L2, then the rest. Two loops, each unrolled by 4: a prefetch
// test inside one loop cost a third of the 32-row throughput (bench: 46-51 -> 69-71
// GFLOP/s per core, standalone harness).
template <typename Step>
__attribute__((always_inline)) inline void slice_loop(int64_t kc, const char* prefetch,
                                                      int64_t pf_count, Step&& step) {
  const int64_t with_pf = std::min(pf_count, kc);
  int64_t k = 0;
#pragma GCC unroll 4
  for (; k < with_pf; ++k) {
    _mm_prefetch(prefetch + k * 64, _MM_HINT_T1);
    step(k);
  }
#pragma GCC unroll 4
  for (; k < kc; ++k) step(k);
}
#endif

#ifdef JAXPAGED_AVX512
// AVX-512: a panel's 16 weights at one k are one vector, so a tile of kMr = 8 rows keeps 8
// accumulators and each broadcast of x feeds one FMA of 16 lanes. Against the AVX2 tile
// (two vectors per panel row, 6 rows) on a 2-core Zen 4 VM, a batch-32 decode step's 30
// layers of matmuls plus the lm_head went from 59-66 to 49.5-53 ms (C++ harness over this
// source, weights cold).
inline __m512 load_panel_row(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_panel_row(const bf16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

template <int MR, typename W>
inline void tile(const float* x, const W* panel, float* y, int64_t ldy, int64_t kc,
                 const float* base, const char* prefetch, int64_t pf_count) {
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    const __m512 w = load_panel_row(panel + k * kNr);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[k * MR + m]), w, acc[m]);
  };
  slice_loop(kc, prefetch, pf_count, step);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    if (base != nullptr) acc[m] = _mm512_add_ps(acc[m], _mm512_loadu_ps(base + m * ldy));
    _mm512_storeu_ps(y + m * ldy, acc[m]);
  }
}
#elif defined(JAXPAGED_AVX2)
// The 16 weights of a panel at one k, as two float32 vectors.
inline void load_panel_row(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}
inline void load_panel_row(const bf16_t* p, __m256& w0, __m256& w1) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
}

// y[0:MR, 0:16] = base[0:MR, 0:16] + x[0:MR, 0:kc] @ panel[0:kc, 0:16], base (row stride
// ldy like y) being y itself after the first slice, the residual or nothing (null) before.
// x is packed: x[k * MR + m].
template <int MR, typename W>
inline void tile(const float* x, const W* panel, float* y, int64_t ldy, int64_t kc,
                 const float* base, const char* prefetch, int64_t pf_count) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    __m256 w0, w1;
    load_panel_row(panel + k * kNr, w0, w1);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xm = _mm256_broadcast_ss(x + k * MR + m);
      lo[m] = _mm256_fmadd_ps(xm, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xm, w1, hi[m]);
    }
  };
  slice_loop(kc, prefetch, pf_count, step);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float* row = y + m * ldy;
    if (base != nullptr) {
      lo[m] = _mm256_add_ps(lo[m], _mm256_loadu_ps(base + m * ldy));
      hi[m] = _mm256_add_ps(hi[m], _mm256_loadu_ps(base + m * ldy + 8));
    }
    _mm256_storeu_ps(row, lo[m]);
    _mm256_storeu_ps(row + 8, hi[m]);
  }
}


// The AVX2 tile over bfloat16 weights, widened in registers with two cheap ALU ops: one
// 32-byte load holds a panel row's 16 weights, 32-bit lane i being outputs 2i (low half)
// and 2i+1 (high half), so a shift by 16 makes the even outputs float32 and a mask the odd
// ones. The accumulators hold even and odd outputs; they are put back in order once per
// slice, at the store (four shuffles a row). Against the float32 tile's two loads a k, this
// is one load and two ALU ops beside the 12 FMAs (the zero-extending widening it replaces
// cost two loads, two shuffle-port extensions and two shifts a k).
//
// Across a panel's slices y stays in that even/odd order ("pair order"): a slice adds the
// previous slices' sums (pair_base: y itself, or null on the first) in pair order, and only
// the last slice puts the outputs back in order and adds the residual (null: none). The
// shuffles then run once per tile and panel, not once per slice.
template <int MR>
inline void tile_bf16(const float* x, const bf16_t* panel, float* y, int64_t ldy, int64_t kc,
                      const float* pair_base, const float* residual, bool last,
                      const char* prefetch, int64_t pf_count) {
  __m256 ev[MR], od[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) ev[m] = od[m] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kNr));
    const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xm = _mm256_broadcast_ss(x + k * MR + m);
      ev[m] = _mm256_fmadd_ps(xm, w_even, ev[m]);
      od[m] = _mm256_fmadd_ps(xm, w_odd, od[m]);
    }
  };
  slice_loop(kc, prefetch, pf_count, step);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float* row = y + m * ldy;
    if (pair_base != nullptr) {
      ev[m] = _mm256_add_ps(ev[m], _mm256_loadu_ps(pair_base + m * ldy));
      od[m] = _mm256_add_ps(od[m], _mm256_loadu_ps(pair_base + m * ldy + 8));
    }
    if (!last) {
      _mm256_storeu_ps(row, ev[m]);
      _mm256_storeu_ps(row + 8, od[m]);
      continue;
    }
    // ev = [o0 o2 o4 o6 | o8 o10 o12 o14], od = [o1 o3 o5 o7 | o9 o11 o13 o15]
    const __m256 a = _mm256_unpacklo_ps(ev[m], od[m]);  // [o0..o3 | o8..o11]
    const __m256 b = _mm256_unpackhi_ps(ev[m], od[m]);  // [o4..o7 | o12..o15]
    __m256 lo = _mm256_permute2f128_ps(a, b, 0x20);    // o0..o7
    __m256 hi = _mm256_permute2f128_ps(a, b, 0x31);    // o8..o15
    if (residual != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(residual + m * ldy));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(residual + m * ldy + 8));
    }
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
  }
}
#endif

#if defined(JAXPAGED_AVX512) || defined(JAXPAGED_AVX2)
// A tile of 1 .. kMr rows.
template <int MR, typename W>
inline void tile_rows_upto(int64_t rows, const float* x, const W* panel, float* y, int64_t ldy,
                           int64_t kc, const float* base, const char* prefetch, int64_t pf_count) {
  if constexpr (MR > 1)
    if (rows < MR)
      return tile_rows_upto<MR - 1>(rows, x, panel, y, ldy, kc, base, prefetch, pf_count);
  tile<MR>(x, panel, y, ldy, kc, base, prefetch, pf_count);
}

template <typename W>
inline void tile_rows(int64_t rows, const float* x, const W* panel, float* y, int64_t ldy,
                      int64_t kc, const float* base, const char* prefetch, int64_t pf_count) {
  tile_rows_upto<kMr>(rows, x, panel, y, ldy, kc, base, prefetch, pf_count);
}
#endif

#if defined(JAXPAGED_AVX2) && !defined(JAXPAGED_AVX512)
// tile_bf16 for a tile of 1 .. kMr rows.
template <int MR = kMr>
inline void tile_rows_bf16(int64_t rows, const float* x, const bf16_t* panel, float* y,
                           int64_t ldy, int64_t kc, const float* pair_base,
                           const float* residual, bool last, const char* prefetch,
                           int64_t pf_count) {
  if constexpr (MR > 1)
    if (rows < MR)
      return tile_rows_bf16<MR - 1>(rows, x, panel, y, ldy, kc, pair_base, residual, last,
                                    prefetch, pf_count);
  tile_bf16<MR>(x, panel, y, ldy, kc, pair_base, residual, last, prefetch, pf_count);
}
#endif

#if !defined(JAXPAGED_AVX512) && !defined(JAXPAGED_AVX2)
template <typename W>
inline void tile_rows(int64_t rows, const float* x, const W* panel, float* y, int64_t ldy,
                      int64_t kc, const float* base, const char*, int64_t) {
  for (int64_t m = 0; m < rows; ++m) {
    float acc[kNr] = {};
    for (int64_t k = 0; k < kc; ++k) {
      const float xv = x[k * rows + m];
#pragma omp simd
      for (int64_t j = 0; j < kNr; ++j) acc[j] += xv * jaxpaged::to_float(panel[k * kNr + j]);
    }
    for (int64_t j = 0; j < kNr; ++j) y[m * ldy + j] = acc[j] + (base ? base[m * ldy + j] : 0.0f);
  }
}
#endif

// Whether every bfloat16 tile widens its weights in registers (tile_bf16, AVX2 without
// AVX-512); elsewhere a slice read by several row tiles is widened once into L1 (widen).
#if defined(JAXPAGED_AVX2) && !defined(JAXPAGED_AVX512)
constexpr bool kWidenInRegisters = true;
#else
constexpr bool kWidenInRegisters = false;
#endif

// n bfloat16 weights (bits) widened to float32 into dst: a panel slice converted once for
// all the row tiles that read it.
inline void widen(const bf16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef JAXPAGED_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i w =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = jaxpaged::to_float(src[i]);
}

#ifndef JAXPAGED_KC_BF16
#define JAXPAGED_KC_BF16 384
#endif
// The most depth of a slice of bfloat16 weights widened in registers: the same 8 KB as
// float32's kKc.
constexpr int64_t kKcBf16 = JAXPAGED_KC_BF16;

// The depth of a panel's slices for K. bfloat16 weights widened in registers take slices of
// the same bytes as float32's (twice the depth) with K split evenly between them: each slice
// costs a tile its accumulators' store and reload, a short last slice (576 = 4 x 128 + 64)
// as much as a full one.
template <typename W>
inline int64_t slice_depth(int64_t K) {
  if constexpr (std::is_same_v<W, bf16_t> && kWidenInRegisters) {
    const int64_t slices = (K + kKcBf16 - 1) / kKcBf16;
    return std::min(kKcBf16, ((K + slices - 1) / slices + 7) / 8 * 8);
  }
  return kKc;
}

// Rows [m0, m0 + rows) of y, panels [p0, p1); xp: that row block packed by pack_tile.
// residual ([M, N] like y, or null) is added in the first slice's store (bfloat16 widened in
// registers: the last's).
//
// bfloat16 weights, where AVX-512 is there, read by more than one row tile are widened once
// per slice into an L1 buffer that every tile then reads as float32; a lone tile (a few rows:
// decode at a small batch) widens in registers. With AVX2 alone every tile widens in
// registers (tile_bf16). One thread's 32-row matmuls over SmolLM2's 30 layers and its
// lm_head, against float32's CPU time (C++ harness over this file, medians of 9-15
// alternated rounds, load ~10): widened once per slice (a zero extension, a shift and a
// store per 8 weights, then float32 loads) 1.09-1.11x; in registers with 128-deep slices,
// each put back in order, 1.02-1.03x; in pair order across slices up to 384 deep, 0.98-0.99x.
template <typename W>
void linear_block(const float* xp, const W* w, const float* residual, float* y, int64_t K,
                  int64_t N, int64_t m0, int64_t rows, int64_t p0, int64_t p1) {
  int64_t tiles[kMaxTiles][2];
  const int64_t nt = split_rows(rows, tiles);
  const int64_t depth = slice_depth<W>(K);
  const int64_t slice_lines = depth * kNr / kLine<W>;
  const int64_t per_tile = (slice_lines + nt - 1) / nt;  // lines of the slice per tile
  constexpr bool kNarrow = !std::is_same_v<W, float>;
  alignas(64) float widened[kNarrow && !kWidenInRegisters ? kKc * kNr : 1];
  // panel by panel, slice by slice: the item reads its weights as one sequential stream
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t kc = std::min(depth, K - k0);
      const W* panel = w + p * K * kNr + k0 * kNr;
      const W* pf_base = panel + kAhead * depth * kNr;  // the stream is contiguous
      const int64_t lines = kc * kNr / kLine<W>;
      bool wide = false;
      if constexpr (kNarrow && !kWidenInRegisters) {
        if (nt > 1) {
          widen(panel, widened, kc * kNr);
          wide = true;
        }
      }
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t pf_first = std::min(t * per_tile, lines);
        const int64_t pf_count = std::min(per_tile, lines - pf_first);
        const int64_t at = (m0 + tiles[t][0]) * N + p * kNr;
        const float* xt = xp + tiles[t][0] * K + k0 * tiles[t][1];
        const char* pf = reinterpret_cast<const char*>(pf_base + pf_first * kLine<W>);
#if defined(JAXPAGED_AVX2) && !defined(JAXPAGED_AVX512)
        if constexpr (kNarrow) {
          const bool last = k0 + kc >= K;
          tile_rows_bf16(tiles[t][1], xt, panel, y + at, N, kc, k0 > 0 ? y + at : nullptr,
                         last && residual != nullptr ? residual + at : nullptr, last, pf,
                         pf_count);
          continue;
        }
#endif
        const float* base = k0 > 0 ? y + at : residual != nullptr ? residual + at : nullptr;
        if (wide)
          tile_rows(tiles[t][1], xt, widened, y + at, N, kc, base, pf, pf_count);
        else
          tile_rows(tiles[t][1], xt, panel, y + at, N, kc, base, pf, pf_count);
      }
    }
}

// out[i] = silu(gate[i]) * x[i] = gate / (1 + e^-gate) * x: a SwiGLU MLP's activation.
void silu_gate(const float* gate, const float* x, float* out, int64_t n) {
  int64_t i = 0;
#ifdef JAXPAGED_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256 act = jaxpaged::silu8(_mm256_loadu_ps(gate + i));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(x + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * x[i];
}

// Rows [r0, r0 + r) of x [M, K] as one packed tile [K][r] at dst. With a gate ([M, K]) x is
// silu(gate) * x first; with a norm weight ([K]) each row is then RMS-normalized on the way:
// norm_w * (x / rms(x)).
void pack_tile(const float* x, float* dst, int64_t K, int64_t r0, int64_t r, const float* gate,
               const float* norm_w, float eps) {
  const float* src = x + r0 * K;
  thread_local std::vector<float> gated;  // the gated rows, contiguous
  if (gate != nullptr) {
    if (gated.size() < static_cast<size_t>(r * K)) gated.resize(r * K);
    silu_gate(gate + r0 * K, src, gated.data(), r * K);
    src = gated.data();
  }
  // k outer: the writes run contiguously and the r row streams are read in step (m outer
  // wrote with a stride of r floats: 16.4 vs 5.5 us for 32 x 576 floats, alone)
  if (norm_w == nullptr) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < r; ++m) dst[k * r + m] = src[m * K + k];
    return;
  }
  float inv[kMr];
  for (int64_t m = 0; m < r; ++m) {
    const float* row = src + m * K;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t k = 0; k < K; ++k) squares += row[k] * row[k];
    inv[m] = 1.0f / std::sqrt(squares / static_cast<float>(K) + eps);
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < r; ++m) dst[k * r + m] = norm_w[k] * (src[m * K + k] * inv[m]);
}

// Panels per work item: 4, or 3 or 2 where that makes the items a multiple of the threads.
// SmolLM2's o and down projections have 36 panels: 9 items of 4 left one of two threads idle
// through the last item (a tenth of the call), 12 items of 3 do not. A decode step went
// 1.2-1.6 ms faster (paired runs of one compiled step, 26 of 38 pairs faster, twice).
inline int64_t panels_per_item(int64_t panels, int64_t row_blocks, int64_t threads) {
  for (int64_t c = 4; c >= 2; --c)
    if (row_blocks * ((panels + c - 1) / c) % std::max<int64_t>(1, threads) == 0) return c;
  return 4;
}

template <typename W>
void linear(ffi::ThreadPool& pool, const float* xp, const W* wp, const float* gate,
            const float* norm_w, float eps, const float* residual, float* yp, int64_t M, int64_t K,
            int64_t N) {
  const int64_t panels = N / kNr;
  const int64_t row_blocks = (M + kMc - 1) / kMc;
  const int64_t per_item = panels_per_item(panels, row_blocks, pool.num_threads());
  const int64_t panel_groups = (panels + per_item - 1) / per_item;
  // The packed copy of x lives in a buffer kept by the calling thread across calls: a fresh
  // multi-MB allocation per call (prefill) costs page faults and zeroing.
  thread_local std::vector<float> packed;
  if (packed.size() < static_cast<size_t>(M * K)) packed.resize(M * K);
  float* xpk = packed.data();
  // Packed tile by tile over both threads: with a gate or a norm a decode step's 32 rows
  // (one row block) are work enough for two.
  jaxpaged::parallel_for(pool, row_blocks * kMaxTiles, [&](int64_t i) {
    const int64_t m0 = (i / kMaxTiles) * kMc, t = i % kMaxTiles;
    int64_t tiles[kMaxTiles][2];
    if (t >= split_rows(std::min(kMc, M - m0), tiles)) return;
    const int64_t r0 = m0 + tiles[t][0];
    pack_tile(xp, xpk + r0 * K, K, r0, tiles[t][1], gate, norm_w, eps);
  });
  // Each thread takes a contiguous run of items, so its weights are one stream whose
  // prefetches run on into its next item (parallel_for_runs); a decode step went ~2 ms faster.
  jaxpaged::parallel_for_runs(pool, row_blocks * panel_groups, [&](int64_t i) {
    const int64_t m0 = (i / panel_groups) * kMc, p0 = (i % panel_groups) * per_item;
    linear_block(xpk + m0 * K, wp, residual, yp, K, N, m0, std::min(kMc, M - m0), p0,
                 std::min(panels, p0 + per_item));
  });
}

// y = residual + norm(silu(gate) * x) @ w[layer].T for the first num_rows rows of x [M, K];
// the rest of y is the residual's rows, or zero. The gate ([M, K]), the norm (an RMSNorm of
// the rows, scaled by a [K] weight) and the residual ([M, N]) are optional: a zero-size
// buffer leaves each out. They fuse a decoder layer's activation, norms and skip connections
// into its matmuls, which saves an XLA pass over the rows for each (and reading back lines
// the other core wrote).
ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> num_rows,
                      ffi::Buffer<ffi::F32> gate_buf, ffi::Buffer<ffi::F32> norm_weight,
                      ffi::Buffer<ffi::F32> residual_buf, float norm_eps,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1] || wd[1] % kNr != 0)
    return ffi::Error::InvalidArgument("need x [M, K] and w [L, N, K] with N % 16 == 0");
  const auto dtype = w.element_type();
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("w must be float32 or bfloat16");
  const int64_t K = xd[1], L = wd[0], N = wd[1];
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
  if (dtype == ffi::DataType::BF16)
    linear(pool, xp, static_cast<const bf16_t*>(w.untyped_data()) + layer * N * K, gate, norm_w,
           norm_eps, residual, yp, M, K, N);
  else
    linear(pool, xp, static_cast<const float*>(w.untyped_data()) + layer * N * K, gate, norm_w,
           norm_eps, residual, yp, M, K, N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [L, N, K] f32/bf16, panels
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_rows [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [M, K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm weight [K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [M, N] or [0]
                                  .Attr<float>("norm_eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);
