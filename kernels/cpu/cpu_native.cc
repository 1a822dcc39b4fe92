// Ragged paged attention for CPUs, as an XLA FFI custom call (see kernels/cpu/__init__.py).
//
// Why native: XLA:CPU cannot fuse the block-table gather into its dots, so the XLA path
// copies every K/V chunk before reading it and runs many tiny batched dots; decode
// attention costs ~10x its KV read. Here each work item (a decode row with all KV heads,
// or a tile of a prefill's rows with one KV head) walks its blocks in place. With AVX2
// (attend_rows), each row's G queries of a head share every K/V row read: scores four
// keys at a time, a vectorized exp, P.V with accumulators in registers; a prefill tile's
// rows take turns on a block while it is in L1. Without AVX2, or for head_dim % 8 or
// G > 8, `attend` does the same work with scalar loops. Work items are spread over XLA's
// intra-op thread pool (cpu_parallel.h).
//
// Semantics are those of kernels/reference.py: row t of sequence s (cu_q_lens[s] <= t <
// cu_q_lens[s + 1]) sits at position kv_lens[s] - q_len + (t - cu_q_lens[s]) and sees
// positions 0..position (the last `sliding_window` only, if > 0); logits sm_scale * q.k,
// then soft_cap * tanh(logits / soft_cap) if soft_cap > 0, then (ALiBi, with a slopes
// buffer [Hq] as an extra operand) + slopes[h] * (key_pos - pos). Padding rows come out zero.
// With a causal-limits buffer (int32 [T], another extra operand) row t sees keys up to
// clamp(limits[t], pos, kv_len - 1) instead of up to pos (an image's tokens see the whole
// image); the window's lower bound stays relative to pos.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 64;
constexpr int kRowTile = 32;  // query rows of one sequence per work item (prefill)

using jaxpaged::to_float;
#ifdef JAXPAGED_AVX2
using jaxpaged::exp8;
#endif

// A K/V row as float: the pool's own memory for float32, converted into `buf` otherwise.
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const uint16_t* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
  return buf;
}

// 8-bit KV pools (kernels/kv_quant.py): int8 or float8_e4m3fn values, one float32 scale per
// (token, KV head) row, row value = value * scale. A row is dequantized into `buf` as it is
// read, so the kernels below see float rows as they do for bfloat16.
struct Fp8E4M3 {
  uint8_t bits;
};

// float8_e4m3fn -> float for all 256 codes: 4 exponent bits (bias 7), 3 mantissa bits,
// subnormals at exponent 0, NaN at 0x7f/0xff, no infinities.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                       : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = NAN;
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
const Fp8Table kFp8;

// The row `row` of `pages` as float; `scales` (one per row of D values) only for 8-bit pools.
template <typename KV>
inline const float* load_row(const KV* row, const KV*, const float*, float* buf, int64_t D) {
  return as_float(row, buf, D);
}
inline const float* load_row(const int8_t* row, const int8_t* pages, const float* scales,
                             float* buf, int64_t D) {
  const float s = scales[(row - pages) / D];
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) buf[i] = s * static_cast<float>(row[i]);
  return buf;
}
inline const float* load_row(const Fp8E4M3* row, const Fp8E4M3* pages, const float* scales,
                             float* buf, int64_t D) {
  const float s = scales[(row - pages) / D];
  for (int64_t i = 0; i < D; ++i) buf[i] = s * kFp8.v[row[i].bits];
  return buf;
}

// q.k over n floats. Kept out of line so the compiler vectorizes along n (it would
// otherwise vectorize the caller's loop over keys with slow gathers).
__attribute__((noinline)) float dot(const float* __restrict a, const float* __restrict b,
                                    int64_t n) {
#ifdef JAXPAGED_AVX2
  if (n % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return jaxpaged::hsum(_mm256_add_ps(s0, s1));
  }
#endif
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += p * x over n floats.
__attribute__((noinline)) void axpy(float p, const float* __restrict x, float* __restrict y,
                                    int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

constexpr int kMaxGroup = 8;  // queries sharing one K/V read in the decode path

// Decode prefetch: a K block and its V block (two contiguous byte ranges), kAheadBlocks on,
// are prefetched a few lines per call through the compute of the blocks before them:
// kTrickleScores lines per four keys scored, kTricklePV per key in the P.V pass, so a block's
// 2 x 192 lines (SmolLM2: 16 tokens x 3 heads x 64) are out by its turn. Read in the
// kernel's head-major order without prefetch, the hardware prefetchers reach ~half the
// bandwidth of a contiguous read (5 vs 10 GB/s on one core); one burst of a whole block's
// lines fills the core's miss queue and stalls the loads the compute waits on. Measured on
// 2 cores, 32 sequences x ~190 tokens x 30 layers: 37-45 ms before, 24-30 ms after;
// distances 1-3 and 4-8 lines per call were within the noise of each other. The lines go
// to L2 (prefetcht1), not L1: on the 2-core AVX-512 machine that took the
// same 30 layers from 16-18 ms to 12-14 ms, as a core can keep more misses in flight to L2;
// with the hint to L1 or non-temporal, a faster or slower trickle, or more blocks ahead,
// none did better.
constexpr int64_t kAheadBlocks = 2;
constexpr int kTrickleScores = 8, kTricklePV = 1;

struct Trickle {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t next = 0, end = 0;
  void start(const void* k_block, const void* v_block, int64_t bytes) {
    flush();
    k = static_cast<const char*>(k_block);
    v = static_cast<const char*>(v_block);
    next = 0;
    end = bytes;
  }
  void step(int lines) {
    for (; lines > 0 && next < end; --lines, next += 64) {
      __builtin_prefetch(k + next, 0, 2);  // read, into L2
      __builtin_prefetch(v + next, 0, 2);
    }
  }
  void flush() { step(static_cast<int>((end - next + 63) / 64)); }
};

#ifdef JAXPAGED_AVX2

// The 4 sums of a0..a3's lanes, in order.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Scores of NQ queries (q: [NQ][D], scaled) against n keys (krows[j]: [D]); out:
// [NQ][kMaxBlockSize]. Four keys at a time, so the lane sums are shared (hsum4).
template <int NQ>
void row_scores(const float* q, const float* const* krows, int64_t n, int64_t D,
                   float* out, Trickle* pf) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    pf->step(kTrickleScores);
    __m256 acc[NQ][4];
    for (int g = 0; g < NQ; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 k[4];
      for (int c = 0; c < 4; ++c) k[c] = _mm256_loadu_ps(krows[j + c] + d);
      for (int g = 0; g < NQ; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + d);
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_fmadd_ps(qv, k[c], acc[g][c]);
      }
    }
    for (int g = 0; g < NQ; ++g)
      _mm_storeu_ps(out + g * kMaxBlockSize + j, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (; j < n; ++j) {
    __m256 acc[NQ];
    for (int g = 0; g < NQ; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(krows[j] + d);
      for (int g = 0; g < NQ; ++g)
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);
    }
    for (int g = 0; g < NQ; ++g) out[g * kMaxBlockSize + j] = jaxpaged::hsum(acc[g]);
  }
}

// bfloat16 K/V rows read straight from the pool, widened in registers: one 32-byte load
// holds 16 values, 32-bit lane i being values 2i (low half) and 2i+1 (high half), so a shift
// by 16 gives the even ones as float32 and a mask the odd ones. The queries and P.V
// accumulators of a bfloat16 pool are kept in that order ("pair order": each 16 values as
// their 8 even, then their 8 odd; pair_order), so the kernels never reorder a row; the
// output is put back in order once per item. Against widening each block's rows into a
// float32 buffer first (an extra store and load of every value), this reads half the bytes
// of float32 and adds two ALU ops per 16 values beside the FMAs: write_kv + decode attention
// over 30 layers at 32 sequences x 201 tokens (SmolLM2's heads) took 1.14-1.22x float32's
// CPU time buffered, 0.84-0.87x in place (measured: quartiles of 15 alternated pairs, AVX2-only
// Zen 4 VM at load ~10).
inline void load_pair(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// row_scores over bfloat16 keys; q in pair order, D % 16 == 0.
template <int NQ>
void row_scores_bf16(const float* q, const uint16_t* const* krows, int64_t n, int64_t D,
                     float* out, Trickle* pf) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    pf->step(kTrickleScores);
    __m256 acc[NQ][4];
    for (int g = 0; g < NQ; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      for (int c = 0; c < 4; ++c) {
        __m256 ke, ko;
        load_pair(krows[j + c] + d, ke, ko);
        for (int g = 0; g < NQ; ++g) {
          acc[g][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), ke, acc[g][c]);
          acc[g][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d + 8), ko, acc[g][c]);
        }
      }
    }
    for (int g = 0; g < NQ; ++g)
      _mm_storeu_ps(out + g * kMaxBlockSize + j, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (; j < n; ++j) {
    __m256 acc[NQ];
    for (int g = 0; g < NQ; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m256 ke, ko;
      load_pair(krows[j] + d, ke, ko);
      for (int g = 0; g < NQ; ++g) {
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), ke, acc[g]);
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d + 8), ko, acc[g]);
      }
    }
    for (int g = 0; g < NQ; ++g) out[g * kMaxBlockSize + j] = jaxpaged::hsum(acc[g]);
  }
}

// Float vectors of 8 lanes (AVX2) and, where the CPU has AVX-512, 16, for row_pv.
struct Vec8 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};
#ifdef JAXPAGED_AVX512
struct Vec16 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

// acc[g] = acc[g] * alpha[g] + sum_j p[g][j] * vrows[j] for NQ queries, D in tiles of CH
// vectors held in registers across the n keys. acc: [NQ][D]; p: [NQ][kMaxBlockSize].
// In 16-lane vectors SmolLM2's head of 64 is one tile: one pass over the block's V rows
// instead of two. On the 2-core AVX-512 machine 30 layers of decode attention (32 x 204
// tokens) took 12.0-15.8 ms with them against 15.2-16.8 with 8 lanes (runs
// alternated). The trickle issues kTricklePV lines per key per 8 lanes of a tile.
// Over bfloat16 rows (R = uint16_t: 8 lanes, CH even, acc in pair order) each 16 values are
// one load_pair.
template <typename Vec, int NQ, int CH, typename R = float>
void row_pv(const float* p, const float* alpha, const R* const* vrows, int64_t n,
            int64_t D, float* acc, Trickle* pf) {
  using V = typename Vec::V;
  constexpr int kW = Vec::kLanes;
  for (int64_t d0 = 0; d0 < D; d0 += kW * CH) {
    V a[NQ][CH];
    for (int g = 0; g < NQ; ++g) {
      const V al = Vec::set1(alpha[g]);
      for (int c = 0; c < CH; ++c) a[g][c] = Vec::mul(al, Vec::load(acc + g * D + d0 + kW * c));
    }
    for (int64_t j = 0; j < n; ++j) {
      pf->step(kTricklePV * kW / 8);
      V v[CH];
      if constexpr (std::is_same_v<R, float>) {
        for (int c = 0; c < CH; ++c) v[c] = Vec::load(vrows[j] + d0 + kW * c);
      } else {
        static_assert(kW == 8 && CH % 2 == 0, "bfloat16 rows: pairs of 8-lane vectors");
        for (int c = 0; c < CH; c += 2) load_pair(vrows[j] + d0 + kW * c, v[c], v[c + 1]);
      }
      for (int g = 0; g < NQ; ++g) {
        const V pg = Vec::set1(p[g * kMaxBlockSize + j]);
        for (int c = 0; c < CH; ++c) a[g][c] = Vec::fmadd(pg, v[c], a[g][c]);
      }
    }
    for (int g = 0; g < NQ; ++g)
      for (int c = 0; c < CH; ++c) Vec::store(acc + g * D + d0 + kW * c, a[g][c]);
  }
}

// The online-softmax step of NQ queries over n keys of one block: s [NQ][kMaxBlockSize]
// holds their scores (lanes n .. the next multiple of 8 are set to -inf here); on return
// it holds the probabilities, m/l are updated and alpha is what acc must be scaled by.
template <int NQ>
void row_softmax(float* s, int64_t n, float* m, float* l, float* alpha) {
  const int64_t nv = (n + 7) / 8;
  for (int g = 0; g < NQ; ++g) {
    float* sg = s + g * kMaxBlockSize;
    for (int64_t j = n; j < nv * 8; ++j) sg[j] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t v = 0; v < nv; ++v) mx = _mm256_max_ps(mx, _mm256_load_ps(sg + 8 * v));
    const float m_new = std::max(m[g], jaxpaged::hmax(mx));
    alpha[g] = m_new == -INFINITY ? 1.0f : std::exp(m[g] - m_new);
    const __m256 mn = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t v = 0; v < nv; ++v) {
      const __m256 pv = m_new == -INFINITY ? _mm256_setzero_ps()
                                           : exp8(_mm256_sub_ps(_mm256_load_ps(sg + 8 * v), mn));
      _mm256_store_ps(sg + 8 * v, pv);
      sum = _mm256_add_ps(sum, pv);
    }
    l[g] = l[g] * alpha[g] + jaxpaged::hsum(sum);
    m[g] = m_new;
  }
}

// The decode-row kernels over K/V rows of element R: float (a float32 pool, or rows widened
// into a buffer), or uint16_t (a bfloat16 pool's own rows, widened in registers).
template <typename R>
struct RowKernelsOf {
  void (*scores)(const float*, const R* const*, int64_t, int64_t, float*, Trickle*) = nullptr;
  void (*softmax)(float*, int64_t, float*, float*, float*) = nullptr;
  void (*pv)(const float*, const float*, const R* const*, int64_t, int64_t, float*,
             Trickle*) = nullptr;
};
using RowKernels = RowKernelsOf<float>;

// The P.V kernel for NQ queries in Vec's lanes: the widest tile of CH <= kMaxCH vectors
// per query that divides D and keeps the NQ x CH accumulators within `regs` registers.
template <typename Vec, int NQ, int kMaxCH>
decltype(RowKernels::pv) pv_kernel(int64_t D, int regs) {
  const int64_t vecs = D / Vec::kLanes;
  const int cap = std::max(1, regs / NQ);
  if constexpr (kMaxCH >= 8)
    if (cap >= 8 && vecs % 8 == 0) return &row_pv<Vec, NQ, 8>;
  if (cap >= 4 && vecs % 4 == 0) return &row_pv<Vec, NQ, 4>;
  if (cap >= 2 && vecs % 2 == 0) return &row_pv<Vec, NQ, 2>;
  return &row_pv<Vec, NQ, 1>;
}

template <int NQ>
RowKernels row_kernels_for(int64_t D) {
  RowKernels k{&row_scores<NQ>, &row_softmax<NQ>, nullptr};
#ifdef JAXPAGED_AVX512
  if (D % 16 == 0) {  // 16 lanes: up to 24 accumulators of the 32 registers
    k.pv = pv_kernel<Vec16, NQ, 4>(D, 24);
    return k;
  }
#endif
  k.pv = pv_kernel<Vec8, NQ, 8>(D, 12);  // 8 lanes: 12 accumulators of the 16 registers
  return k;
}

// The kernels for one decode row's NQ = group queries, or none (no AVX2, D % 8, NQ > 8).
RowKernels row_kernels(int64_t nq, int64_t D) {
  if (D % 8 != 0) return {};
  switch (nq) {
    case 1: return row_kernels_for<1>(D);
    case 2: return row_kernels_for<2>(D);
    case 3: return row_kernels_for<3>(D);
    case 4: return row_kernels_for<4>(D);
    case 5: return row_kernels_for<5>(D);
    case 6: return row_kernels_for<6>(D);
    case 7: return row_kernels_for<7>(D);
    case 8: return row_kernels_for<8>(D);
    default: return {};
  }
}

// The kernels over a bfloat16 pool's own rows for NQ queries: AVX2 builds (AVX-512 ones widen
// into a buffer for their 16-lane P.V), D % 16 == 0; P.V holds up to 12 accumulators.
template <int NQ>
RowKernelsOf<uint16_t> row_kernels_bf16_for(int64_t D) {
  RowKernelsOf<uint16_t> k{&row_scores_bf16<NQ>, &row_softmax<NQ>, nullptr};
  const int64_t pairs = D / 16, cap = std::max(1, 12 / NQ) / 2;  // pairs of vectors held
  if (cap >= 4 && pairs % 4 == 0) k.pv = &row_pv<Vec8, NQ, 8, uint16_t>;
  else if (cap >= 2 && pairs % 2 == 0) k.pv = &row_pv<Vec8, NQ, 4, uint16_t>;
  else k.pv = &row_pv<Vec8, NQ, 2, uint16_t>;
  return k;
}

RowKernelsOf<uint16_t> row_kernels_bf16(int64_t nq, int64_t D) {
#ifdef JAXPAGED_AVX512
  const bool widen_in_registers = false;
#else
  const bool widen_in_registers = true;
#endif
  if (!widen_in_registers || D % 16 != 0) return {};
  switch (nq) {
    case 1: return row_kernels_bf16_for<1>(D);
    case 2: return row_kernels_bf16_for<2>(D);
    case 3: return row_kernels_bf16_for<3>(D);
    case 4: return row_kernels_bf16_for<4>(D);
    case 5: return row_kernels_bf16_for<5>(D);
    case 6: return row_kernels_bf16_for<6>(D);
    case 7: return row_kernels_bf16_for<7>(D);
    case 8: return row_kernels_bf16_for<8>(D);
    default: return {};
  }
}
#else
struct RowKernels {
  void* scores = nullptr;
};
RowKernels row_kernels(int64_t, int64_t) { return {}; }
#endif

struct Shapes {
  int64_t num_tokens, num_q_heads, head_dim;
  int64_t block_size, num_kv_heads, group;
  int64_t num_pool_blocks, max_seqs, max_blocks;
  float sm_scale, soft_cap;
  int64_t sliding_window;
  const float* k_scales = nullptr;  // [NB, B, Hkv]: 8-bit pools only (load_row)
  const float* v_scales = nullptr;
  const float* alibi = nullptr;  // [Hq] ALiBi slopes, or null: no bias
  const int32_t* limits = nullptr;  // [T] last key position per row, or null: causal
};

struct WorkItem {
  int32_t seq, head_begin, head_end, row_begin, row_end;  // KV heads [begin, end), rows
};

// Where an item's rows sit (row r at pos0 + r; a sequence's last row at kv_len - 1) and the
// blocks they can see.
struct ItemSpan {
  int64_t pos0, last_pos, first_blk, last_blk;
};
// The first key position a query at `pos` sees (the last `sliding_window` only, if > 0).
inline int64_t first_visible(const Shapes& sh, int64_t pos) {
  return sh.sliding_window > 0 ? std::max<int64_t>(0, pos - sh.sliding_window + 1) : 0;
}

// The last key position row `row` (at `pos`, of a sequence of kv_len tokens) sees.
inline int64_t last_visible(const Shapes& sh, int64_t row, int64_t pos, int64_t kv_len) {
  if (sh.limits == nullptr) return pos;
  return std::max<int64_t>(pos, std::min<int64_t>(sh.limits[row], kv_len - 1));
}

ItemSpan item_span(const Shapes& sh, const WorkItem& w, const int32_t* kv_lens,
                   const int32_t* cu_q_lens) {
  const int64_t pos0 = kv_lens[w.seq] - (cu_q_lens[w.seq + 1] - w.row_begin);
  int64_t last_pos = pos0 + (w.row_end - w.row_begin) - 1;
  for (int64_t r = w.row_begin; sh.limits != nullptr && r < w.row_end; ++r)
    last_pos = std::max(last_pos, last_visible(sh, r, pos0 + r - w.row_begin, kv_lens[w.seq]));
  return {pos0, last_pos, first_visible(sh, pos0) / sh.block_size,
          std::min<int64_t>(last_pos / sh.block_size, sh.max_blocks - 1)};
}

// A block's K and its V: what a decode item prefetches.
struct BlockPair {
  const void* k;
  const void* v;
};

// One (sequence, KV heads, rows) item: online softmax over the visible blocks, block by
// block, every head of the item per block (a decode item takes all heads, so each block's
// contiguous K/V is read front to back once).
template <typename KV>
void attend(const Shapes& sh, const WorkItem& w, const float* q, const KV* k_pages,
            const KV* v_pages, const int32_t* kv_lens, const int32_t* tables,
            const int32_t* cu_q_lens, float* out) {
  const int64_t D = sh.head_dim, B = sh.block_size, G = sh.group, Hkv = sh.num_kv_heads;
  const int64_t rows = w.row_end - w.row_begin;
  const int64_t M = rows * G;  // query vectors per KV head
  const int64_t H = w.head_end - w.head_begin;
  const ItemSpan span = item_span(sh, w, kv_lens, cu_q_lens);
  const int64_t pos0 = span.pos0, last_pos = span.last_pos;

  // State of query vector mi of head h (relative to head_begin) is at index h * M + mi.
  std::vector<float> qs(H * M * D), acc(H * M * D, 0.0f), m_run(H * M, -INFINITY),
      l_run(H * M, 0.0f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (w.head_begin + h) * G + g;
        const float* src = q + ((w.row_begin + r) * sh.num_q_heads + head) * D;
        float* dst = &qs[(h * M + r * G + g) * D];
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * sh.sm_scale;
      }

  const int32_t* table = tables + static_cast<int64_t>(w.seq) * sh.max_blocks;
  const int64_t row_stride = Hkv * D;  // between consecutive tokens of a block
  alignas(64) float s[kMaxBlockSize];
  alignas(64) float sm[kMaxGroup * kMaxBlockSize];  // scores of a decode row's queries

  // Online-softmax update of state i with the scores s[lo..hi) of the block whose first key
  // is at kpos0; s becomes p.
  auto softmax_step = [&](int64_t i, int64_t lo, int64_t hi, float* s, int64_t kpos0) {
    const int64_t mi = i % M;
    const float slope = sh.alibi ? sh.alibi[(w.head_begin + i / M) * G + mi % G] : 0.0f;
    const int64_t rel0 = kpos0 - (pos0 + mi / G);  // key minus query position at j = 0
    float bmax = -INFINITY;
    for (int64_t j = lo; j < hi; ++j) {
      if (sh.soft_cap > 0) s[j] = sh.soft_cap * std::tanh(s[j] / sh.soft_cap);
      if (sh.alibi) s[j] += slope * static_cast<float>(rel0 + j);
      bmax = std::max(bmax, s[j]);
    }
    const float m_new = std::max(m_run[i], bmax);
    const float alpha = std::exp(m_run[i] - m_new);  // 0 on the first visible block
    float psum = 0.0f;
    for (int64_t j = lo; j < hi; ++j) {
      s[j] = std::exp(s[j] - m_new);
      psum += s[j];
    }
    l_run[i] = l_run[i] * alpha + psum;
    m_run[i] = m_new;
    float* a = &acc[i * D];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
  };
  // Keys of block `kpos0` query mi may see: [lo, hi) of the block's first n_keys.
  auto visible = [&](int64_t mi, int64_t kpos0, int64_t n_keys, int64_t& lo, int64_t& hi) {
    const int64_t pos = pos0 + mi / G;
    const int64_t last = last_visible(sh, w.row_begin + mi / G, pos, kv_lens[w.seq]);
    lo = std::max<int64_t>(0, first_visible(sh, pos) - kpos0);
    hi = std::min<int64_t>(n_keys, last - kpos0 + 1);
    return hi > lo;
  };
  // Rows of heads [head_begin, head_end) of token j of pool block `phys`.
  auto row_of = [&](const KV* pages, int64_t phys, int64_t j, int64_t h) {
    return pages + ((phys * B + j) * Hkv + w.head_begin + h) * D;
  };

  const bool few_queries = M <= 8;  // decode: score key by key, straight from the pool
  alignas(64) float kt[kMaxHeadDim * kMaxBlockSize];  // K block transposed, [D][B]
  alignas(64) float kbuf[kMaxBlockSize * kMaxHeadDim];  // K/V rows as float, [B][D]
  alignas(64) float vbuf[kMaxBlockSize * kMaxHeadDim];

  for (int64_t blk = span.first_blk; blk <= span.last_blk; ++blk) {
    const int64_t phys = table[blk];
    if (phys < 0 || phys >= sh.num_pool_blocks) continue;  // never read outside the pool
    const int64_t kpos0 = blk * B;
    const int64_t n_keys = std::min<int64_t>(B, last_pos - kpos0 + 1);
    if (blk + 1 <= span.last_blk) {  // next block's rows, early
      const int64_t next = table[blk + 1];
      if (next >= 0 && next < sh.num_pool_blocks) {
        const int64_t bytes = H * D * static_cast<int64_t>(sizeof(KV));  // heads are adjacent
        for (int64_t j = 0; j < B; ++j) {
          const char* kn = reinterpret_cast<const char*>(row_of(k_pages, next, j, 0));
          const char* vn = reinterpret_cast<const char*>(row_of(v_pages, next, j, 0));
          for (int64_t c = 0; c < bytes; c += 64) {
            __builtin_prefetch(kn + c);
            __builtin_prefetch(vn + c);
          }
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* vrows[kMaxBlockSize];
      for (int64_t j = 0; j < n_keys; ++j)
        vrows[j] = load_row(row_of(v_pages, phys, j, h), v_pages, sh.v_scales, &vbuf[j * D], D);
      if (few_queries) {
        const float* krows[kMaxBlockSize];
        for (int64_t j = 0; j < n_keys; ++j)
          krows[j] = load_row(row_of(k_pages, phys, j, h), k_pages, sh.k_scales, &kbuf[j * D], D);
        for (int64_t mi = 0; mi < M; ++mi) {
          int64_t lo, hi;
          if (!visible(mi, kpos0, n_keys, lo, hi)) continue;
          const int64_t i = h * M + mi;
          const float* qv = &qs[i * D];
          for (int64_t j = lo; j < hi; ++j) s[j] = dot(qv, krows[j], D);
          softmax_step(i, lo, hi, s, kpos0);
          float* a = &acc[i * D];
          for (int64_t j = lo; j < hi; ++j) axpy(s[j], vrows[j], a, D);
        }
        continue;
      }
      // Many queries (prefill tile): transpose K once, then scores along the block.
      for (int64_t j = 0; j < n_keys; ++j) {
        const float* kr = load_row(row_of(k_pages, phys, j, h), k_pages, sh.k_scales, &kbuf[j * D], D);
        for (int64_t d = 0; d < D; ++d) kt[d * B + j] = kr[d];
      }
      for (int64_t j = n_keys; j < B; ++j)  // scored below but never used: keep them finite
        for (int64_t d = 0; d < D; ++d) kt[d * B + j] = 0.0f;
      for (int64_t mi = 0; mi < M; ++mi) {
        int64_t lo, hi;
        if (!visible(mi, kpos0, n_keys, lo, hi)) continue;
        const int64_t i = h * M + mi;
        const float* qv = &qs[i * D];
        for (int64_t j = 0; j < B; ++j) s[j] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qv[d];
          const float* kd = &kt[d * B];
#pragma omp simd
          for (int64_t j = 0; j < B; ++j) s[j] += qd * kd[j];
        }
        softmax_step(i, lo, hi, s, kpos0);
        float* a = &acc[i * D];
        for (int64_t j = lo; j < hi; ++j) axpy(s[j], vrows[j], a, D);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = h * M + r * G + g;
        const float inv = l_run[i] > 0 ? 1.0f / l_run[i] : 0.0f;
        const int64_t head = (w.head_begin + h) * G + g;
        float* dst = out + ((w.row_begin + r) * sh.num_q_heads + head) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
      }
}

#ifdef JAXPAGED_AVX2
// dst = scale * src (n % 16 == 0) in pair order: each 16 values as the 8 even, then the 8 odd.
inline void pair_order(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t c = 0; c < n; c += 16)
    for (int64_t i = 0; i < 8; ++i) {
      dst[c + i] = src[c + 2 * i] * scale;
      dst[c + 8 + i] = src[c + 2 * i + 1] * scale;
    }
}

// dst = scale * src (n % 16 == 0) back from pair order.
inline void natural_order(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t c = 0; c < n; c += 16)
    for (int64_t i = 0; i < 8; ++i) {
      dst[c + 2 * i] = src[c + i] * scale;
      dst[c + 2 * i + 1] = src[c + 8 + i] * scale;
    }
}

// One work item with the vector kernels: rows [row_begin, row_end) of sequence w.seq, KV
// heads [head_begin, head_end). Each row's G queries of a head share every K/V row read
// (row_kernels); the rows of a prefill tile take turns on a block while it is in L1.
// Blocks are read in order, each block's heads front to back; a decode item (all heads, so
// whole blocks) trickles the block kAheadBlocks on into cache while it computes, a prefill
// tile prefetches its head's rows of the next block at once (it computes far longer per block).
//
// A decode item's first blocks are prefetched at once, unless the item before it in a chain
// (attend_chain) trickled them in its own last blocks: `after` holds the next item's
// first blocks, trickled once this item's own run out.
//
// R is the element the kernels read: float (rows widened into a buffer unless the pool is
// float32), or uint16_t for a bfloat16 pool read in place (q and acc in pair order).
template <typename KV, typename R = float>
void attend_rows(const Shapes& sh, const RowKernelsOf<R>& fns, const WorkItem& w, const float* q,
                 const KV* k_pages, const KV* v_pages, const int32_t* kv_lens,
                 const int32_t* tables, const int32_t* cu_q_lens, float* out,
                 const BlockPair* after = nullptr, int64_t n_after = 0,
                 bool first_ready = false) {
  const int64_t D = sh.head_dim, B = sh.block_size, G = sh.group, Hkv = sh.num_kv_heads;
  const int64_t Hq = sh.num_q_heads;
  const int64_t rows = w.row_end - w.row_begin, H = w.head_end - w.head_begin;
  const ItemSpan span = item_span(sh, w, kv_lens, cu_q_lens);
  const int64_t pos0 = span.pos0, last_pos = span.last_pos, last_blk = span.last_blk;
  // State of query g of head h (relative to head_begin) of row r: index (r * H + h) * G + g.
  const int64_t NQ = rows * H * G;
  std::vector<float> qs(NQ * D), acc(NQ * D, 0.0f), m(NQ, -INFINITY), l(NQ, 0.0f);
  constexpr bool kInPlace = std::is_same_v<R, KV>;  // rows read straight from the pool
  constexpr bool kPairOrder = std::is_same_v<R, uint16_t>;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + ((w.row_begin + r) * Hq + w.head_begin * G) * D;
    float* dst = &qs[r * H * G * D];
    if constexpr (kPairOrder)
      pair_order(src, dst, H * G * D, sh.sm_scale);
    else
      for (int64_t i = 0; i < H * G * D; ++i) dst[i] = src[i] * sh.sm_scale;
  }

  const int32_t* table = tables + static_cast<int64_t>(w.seq) * sh.max_blocks;
  auto valid = [&](int64_t phys) { return phys >= 0 && phys < sh.num_pool_blocks; };
  auto row_of = [&](const KV* pages, int64_t phys, int64_t j, int64_t h) {
    return pages + ((phys * B + j) * Hkv + w.head_begin + h) * D;
  };
  alignas(64) float s[kMaxGroup * kMaxBlockSize];
  alignas(64) float kbuf[kMaxBlockSize * kMaxHeadDim];  // K/V rows as float (bfloat16 pools)
  alignas(64) float vbuf[kMaxBlockSize * kMaxHeadDim];
  float alpha[kMaxGroup];
  const int64_t head_bytes = H * D * static_cast<int64_t>(sizeof(KV));  // per token, adjacent
  const bool whole_blocks = H == Hkv;  // decode: each block read whole, trickled ahead
  const int64_t block_bytes = B * head_bytes;
  Trickle pf;
  auto trickle_block = [&](int64_t b) {  // starts block b's prefetch, if it is one to read
    if (b > last_blk) {  // past this item: the next item's first blocks, if chained
      if (b - last_blk > n_after) return false;
      pf.start(after[b - last_blk - 1].k, after[b - last_blk - 1].v, block_bytes);
      return true;
    }
    if (!valid(table[b])) return false;
    pf.start(row_of(k_pages, table[b], 0, 0), row_of(v_pages, table[b], 0, 0), block_bytes);
    return true;
  };
  if (whole_blocks && !first_ready)  // the first blocks, if nothing before prefetched them
    for (int64_t b = span.first_blk, e = b + kAheadBlocks; b < e; ++b)
      if (trickle_block(b)) pf.flush();

  for (int64_t blk = span.first_blk; blk <= last_blk; ++blk) {
    const int64_t phys = table[blk];
    if (!valid(phys)) continue;  // never read outside the pool
    if (whole_blocks) {
      if (!trickle_block(blk + kAheadBlocks)) pf.flush();
    } else if (blk + 1 <= last_blk && valid(table[blk + 1])) {
      for (int64_t j = 0; j < B; ++j) {
        const char* kn = reinterpret_cast<const char*>(row_of(k_pages, table[blk + 1], j, 0));
        const char* vn = reinterpret_cast<const char*>(row_of(v_pages, table[blk + 1], j, 0));
        for (int64_t c = 0; c < head_bytes; c += 64) {
          __builtin_prefetch(kn + c);
          __builtin_prefetch(vn + c);
        }
      }
    }
    const int64_t kpos0 = blk * B;
    const int64_t n_keys = std::min<int64_t>(B, last_pos - kpos0 + 1);
    for (int64_t h = 0; h < H; ++h) {
      const R* krows[kMaxBlockSize];
      const R* vrows[kMaxBlockSize];
      for (int64_t j = 0; j < n_keys; ++j) {
        if constexpr (kInPlace) {
          krows[j] = row_of(k_pages, phys, j, h);
          vrows[j] = row_of(v_pages, phys, j, h);
        } else {
          krows[j] = load_row(row_of(k_pages, phys, j, h), k_pages, sh.k_scales, &kbuf[j * D], D);
          vrows[j] = load_row(row_of(v_pages, phys, j, h), v_pages, sh.v_scales, &vbuf[j * D], D);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = pos0 + r;
        const int64_t last = last_visible(sh, w.row_begin + r, pos, kv_lens[w.seq]);
        const int64_t lo = std::max<int64_t>(0, first_visible(sh, pos) - kpos0);
        const int64_t hi = std::min<int64_t>(n_keys, last - kpos0 + 1);
        if (hi <= lo) continue;
        const int64_t n = hi - lo, i = (r * H + h) * G;
        fns.scores(&qs[i * D], krows + lo, n, D, s, &pf);
        if (sh.soft_cap > 0)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < n; ++j) {
              float& x = s[g * kMaxBlockSize + j];
              x = sh.soft_cap * std::tanh(x / sh.soft_cap);
            }
        if (sh.alibi)
          for (int64_t g = 0; g < G; ++g) {
            const float slope = sh.alibi[(w.head_begin + h) * G + g];
            const int64_t rel0 = kpos0 + lo - pos;  // key minus query position at j = 0
            float* sg = &s[g * kMaxBlockSize];
            for (int64_t j = 0; j < n; ++j) sg[j] += slope * static_cast<float>(rel0 + j);
          }
        fns.softmax(s, n, &m[i], &l[i], alpha);
        fns.pv(s, alpha, vrows + lo, n, D, &acc[i * D], &pf);
      }
    }
  }
  pf.flush();  // the rest of the next item's blocks
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((w.row_begin + r) * Hq + w.head_begin * G) * D;
    for (int64_t qi = 0; qi < H * G; ++qi) {
      const int64_t i = r * H * G + qi;
      const float inv = l[i] > 0 ? 1.0f / l[i] : 0.0f;
      if constexpr (kPairOrder)
        natural_order(&acc[i * D], dst + qi * D, D, inv);
      else
        for (int64_t d = 0; d < D; ++d) dst[qi * D + d] = acc[i * D + d] * inv;
    }
  }
}

// Item boundaries [chains[c], chains[c + 1]) of the chains the threads take turns on: runs of
// consecutive decode items (the longest first, as sorted), about four chains per thread, so
// a thread goes from one sequence's blocks to the next without a burst of misses (the next
// item's first blocks are trickled in during the current item's last). Prefill items, which
// prefetch a block ahead at once, stay alone.
std::vector<int64_t> decode_chains(const std::vector<WorkItem>& items, const Shapes& sh,
                                   int64_t threads) {
  auto whole = [&](const WorkItem& w) { return w.head_end - w.head_begin == sh.num_kv_heads; };
  int64_t n_decode = 0;
  for (const WorkItem& w : items) n_decode += whole(w) ? 1 : 0;
  const int64_t per_chain = std::max<int64_t>(1, n_decode / (4 * std::max<int64_t>(1, threads)));
  std::vector<int64_t> bounds{0};
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 1; i < n; ++i) {
    const bool joins = whole(items[i]) && whole(items[i - 1]) && i - bounds.back() < per_chain;
    if (!joins) bounds.push_back(i);
  }
  bounds.push_back(n);
  return bounds;
}

// Items [begin, end) in order, each handing the next its first blocks to prefetch.
template <typename KV, typename R = float>
void attend_chain(const Shapes& sh, const RowKernelsOf<R>& fns, const std::vector<WorkItem>& items,
                  int64_t begin, int64_t end, const float* q, const KV* k_pages,
                  const KV* v_pages, const int32_t* kv_lens, const int32_t* tables,
                  const int32_t* cu_q_lens, float* out) {
  const int64_t stride = sh.block_size * sh.num_kv_heads * sh.head_dim;  // elements per block
  for (int64_t i = begin; i < end; ++i) {
    BlockPair after[kAheadBlocks];
    int64_t n_after = 0;
    if (i + 1 < end) {
      const WorkItem& next = items[i + 1];
      const ItemSpan span = item_span(sh, next, kv_lens, cu_q_lens);
      const int32_t* table = tables + static_cast<int64_t>(next.seq) * sh.max_blocks;
      for (int64_t b = span.first_blk; b <= span.last_blk && n_after < kAheadBlocks; ++b) {
        if (table[b] < 0 || table[b] >= sh.num_pool_blocks) break;
        after[n_after++] = {k_pages + table[b] * stride, v_pages + table[b] * stride};
      }
    }
    attend_rows<KV, R>(sh, fns, items[i], q, k_pages, v_pages, kv_lens, tables, cu_q_lens, out,
                    after, n_after, /*first_ready=*/i > begin);
  }
}
#endif

// The 8-bit pools' instantiations, kept apart from the float ones' dispatch.
#ifdef JAXPAGED_AVX2
void attend_chain_8bit(ffi::DataType dtype, const Shapes& sh, const RowKernels& fns,
                       const std::vector<WorkItem>& items, int64_t begin, int64_t end,
                       const float* q, const void* kp, const void* vp, const int32_t* kv_lens,
                       const int32_t* tables, const int32_t* cu_q_lens, float* out) {
  if (dtype == ffi::DataType::S8)
    attend_chain<int8_t>(sh, fns, items, begin, end, q, static_cast<const int8_t*>(kp),
                         static_cast<const int8_t*>(vp), kv_lens, tables, cu_q_lens, out);
  else
    attend_chain<Fp8E4M3>(sh, fns, items, begin, end, q, static_cast<const Fp8E4M3*>(kp),
                          static_cast<const Fp8E4M3*>(vp), kv_lens, tables, cu_q_lens, out);
}
#endif
void attend_8bit(ffi::DataType dtype, const Shapes& sh, const WorkItem& w, const float* q,
                 const void* kp, const void* vp, const int32_t* kv_lens, const int32_t* tables,
                 const int32_t* cu_q_lens, float* out) {
  if (dtype == ffi::DataType::S8)
    attend<int8_t>(sh, w, q, static_cast<const int8_t*>(kp), static_cast<const int8_t*>(vp),
                   kv_lens, tables, cu_q_lens, out);
  else
    attend<Fp8E4M3>(sh, w, q, static_cast<const Fp8E4M3*>(kp), static_cast<const Fp8E4M3*>(vp),
                    kv_lens, tables, cu_q_lens, out);
}

// Both handlers' body; k_scales/v_scales are null for float pools.
ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, const float* k_scales, const float* v_scales,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> tables,
                          ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::RemainingArgs extra, ffi::ResultBuffer<ffi::F32> out,
                          float sm_scale, float soft_cap, int64_t sliding_window) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4)
    return ffi::Error::InvalidArgument("q must be rank 3 and k_pages rank 4");
  Shapes sh;
  sh.num_tokens = qd[0];
  sh.num_q_heads = qd[1];
  sh.head_dim = qd[2];
  sh.num_pool_blocks = kd[0];
  sh.block_size = kd[1];
  sh.num_kv_heads = kd[2];
  sh.group = sh.num_q_heads / sh.num_kv_heads;
  sh.max_seqs = kv_lens.dimensions()[0];
  sh.max_blocks = tables.dimensions()[1];
  sh.sm_scale = sm_scale;
  sh.soft_cap = soft_cap;
  sh.sliding_window = sliding_window;
  sh.k_scales = k_scales;
  sh.v_scales = v_scales;
  if (extra.size() > 2)
    return ffi::Error::InvalidArgument("at most two extra operands (slopes, limits)");
  for (size_t i = 0; i < extra.size(); ++i) {  // told apart by dtype
    auto limits = extra.get<ffi::Buffer<ffi::S32>>(i);
    if (limits.has_value()) {  // causal limits [T] int32
      if (limits->element_count() != sh.num_tokens || sh.limits != nullptr)
        return ffi::Error::InvalidArgument("causal limits must be one int32 [num_tokens]");
      sh.limits = limits->typed_data();
      continue;
    }
    auto slopes = extra.get<ffi::Buffer<ffi::F32>>(i);  // ALiBi slopes [Hq] float32
    if (!slopes.has_value()) return slopes.error();
    if (slopes->element_count() != sh.num_q_heads || sh.alibi != nullptr)
      return ffi::Error::InvalidArgument("alibi slopes must be one float32 [num_q_heads]");
    sh.alibi = slopes->typed_data();
  }
  if (sh.head_dim > kMaxHeadDim || sh.block_size > kMaxBlockSize)
    return ffi::Error::InvalidArgument("head_dim must be <= 256 and block_size <= 64");
  const auto dtype = k_pages.element_type();
  const bool eight_bit = dtype == ffi::DataType::S8 || dtype == ffi::DataType::F8E4M3FN;
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16 && !eight_bit)
    return ffi::Error::InvalidArgument("k_pages/v_pages must be float32, bfloat16, int8 or fp8");
  if (eight_bit != (k_scales != nullptr))
    return ffi::Error::InvalidArgument("int8/fp8 pools, and only they, come with scales");

  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int64_t n_seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, sh.max_seqs);
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * sh.num_tokens * sh.num_q_heads * sh.head_dim);

  std::vector<WorkItem> items;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t begin = std::clamp<int64_t>(cu[s], 0, sh.num_tokens);
    const int64_t end = std::clamp<int64_t>(cu[s + 1], begin, sh.num_tokens);
    if (end == begin || lens[s] < end - begin) continue;  // empty or inconsistent: zeros
    const auto seq = static_cast<int32_t>(s);
    if (end - begin == 1) {  // decode row: all heads in one item, blocks read in order
      items.push_back({seq, 0, static_cast<int32_t>(sh.num_kv_heads),
                            static_cast<int32_t>(begin), static_cast<int32_t>(end)});
      continue;
    }
    for (int64_t r = begin; r < end; r += kRowTile)
      for (int64_t h = 0; h < sh.num_kv_heads; ++h)
        items.push_back({seq, static_cast<int32_t>(h), static_cast<int32_t>(h + 1),
                              static_cast<int32_t>(r),
                              static_cast<int32_t>(std::min<int64_t>(r + kRowTile, end))});
  }
  // Longest items first (most keys x rows), so the threads finish together.
  std::stable_sort(items.begin(), items.end(),
                   [&](const WorkItem& a, const WorkItem& b) {
                     auto cost = [&](const WorkItem& x) {
                       return int64_t{lens[x.seq]} * (x.row_end - x.row_begin) *
                              (x.head_end - x.head_begin);
                     };
                     return cost(a) > cost(b);
                   });
  const float* qp = q.typed_data();
  const int32_t* tp = tables.typed_data();
  const void* kp = k_pages.untyped_data();
  const void* vp = v_pages.untyped_data();
  const RowKernels vec = row_kernels(sh.group, sh.head_dim);
#ifdef JAXPAGED_AVX2
  const RowKernelsOf<uint16_t> vec_bf16 = row_kernels_bf16(sh.group, sh.head_dim);
  if (vec.scores != nullptr) {
    const auto chains = decode_chains(items, sh, pool.num_threads());
    jaxpaged::parallel_for(pool, static_cast<int64_t>(chains.size()) - 1, [&](int64_t c) {
      if (dtype == ffi::DataType::F32)
        attend_chain<float>(sh, vec, items, chains[c], chains[c + 1], qp,
                            static_cast<const float*>(kp), static_cast<const float*>(vp), lens,
                            tp, cu, o);
      else if (eight_bit)
        attend_chain_8bit(dtype, sh, vec, items, chains[c], chains[c + 1], qp, kp, vp, lens,
                          tp, cu, o);
      else if (vec_bf16.scores != nullptr)
        attend_chain<uint16_t, uint16_t>(sh, vec_bf16, items, chains[c], chains[c + 1], qp,
                                         static_cast<const uint16_t*>(kp),
                                         static_cast<const uint16_t*>(vp), lens, tp, cu, o);
      else
        attend_chain<uint16_t>(sh, vec, items, chains[c], chains[c + 1], qp,
                               static_cast<const uint16_t*>(kp),
                               static_cast<const uint16_t*>(vp), lens, tp, cu, o);
    });
    return ffi::Error::Success();
  }
#endif
  jaxpaged::parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const WorkItem& w = items[i];
    if (dtype == ffi::DataType::F32)
      attend<float>(sh, w, qp, static_cast<const float*>(kp), static_cast<const float*>(vp),
                    lens, tp, cu, o);
    else if (eight_bit)
      attend_8bit(dtype, sh, w, qp, kp, vp, lens, tp, cu, o);
    else
      attend<uint16_t>(sh, w, qp, static_cast<const uint16_t*>(kp),
                       static_cast<const uint16_t*>(vp), lens, tp, cu, o);
  });
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                              ffi::RemainingArgs extra, ffi::ResultBuffer<ffi::F32> out,
                              float sm_scale, float soft_cap, int64_t sliding_window) {
  return PagedAttention(pool, q, k_pages, v_pages, nullptr, nullptr, kv_lens, tables, cu_q_lens,
                        num_seqs, extra, out, sm_scale, soft_cap, sliding_window);
}

// An 8-bit pool with its scales [NB, B, Hkv] float32 (one per token and KV head).
ffi::Error PagedAttentionQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                   ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                                   ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> tables,
                                   ffi::Buffer<ffi::S32> cu_q_lens,
                                   ffi::Buffer<ffi::S32> num_seqs, ffi::RemainingArgs extra,
                                   ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                                   float soft_cap, int64_t sliding_window) {
  const auto kd = k_pages.dimensions();
  if (kd.size() != 4 || k_scales.element_count() != kd[0] * kd[1] * kd[2] ||
      v_scales.element_count() != k_scales.element_count())
    return ffi::Error::InvalidArgument("k_scales/v_scales must be [NB, B, Hkv] like the pages");
  return PagedAttention(pool, q, k_pages, v_pages, k_scales.typed_data(), v_scales.typed_data(),
                        kv_lens, tables, cu_q_lens, num_seqs, extra, out, sm_scale, soft_cap,
                        sliding_window);
}

// Rows k[t], v[t] into flat slot slots[t] of the pools, in place: the outputs alias the
// pools (cpu.write_kv_native), so only the new rows move. Slots outside the pool (padding)
// are skipped. Rows arrive in the pool's dtype; any 2- or 4-byte element is copied as bytes.
ffi::Error WriteKVImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto pd = k_pages.dimensions();
  auto rd = k.dimensions();
  if (pd.size() != 4 || rd.size() != 3 || rd[1] != pd[2] || rd[2] != pd[3] ||
      k.element_type() != k_pages.element_type() || v.element_type() != k_pages.element_type() ||
      v_pages.element_type() != k_pages.element_type() || slots.dimensions()[0] != rd[0])
    return ffi::Error::InvalidArgument("need pools [NB, B, Hkv, D] and rows [T, Hkv, D] alike");
  const int64_t num_slots = pd[0] * pd[1];
  const size_t row_bytes = k.size_bytes() / std::max<int64_t>(rd[0], 1);
  const int32_t* sl = slots.typed_data();
  auto write = [&](const ffi::AnyBuffer& pages, const ffi::AnyBuffer& rows,
                   ffi::Result<ffi::AnyBuffer>& out) {
    char* dst = static_cast<char*>(out->untyped_data());
    if (dst != pages.untyped_data())  // not aliased after all: start from the pool
      std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
    const char* src = static_cast<const char*>(rows.untyped_data());
    for (int64_t t = 0; t < rd[0]; ++t)
      if (sl[t] >= 0 && sl[t] < num_slots)
        std::memcpy(dst + sl[t] * row_bytes, src + t * row_bytes, row_bytes);
  };
  write(k_pages, k, k_out);
  write(v_pages, v, v_out);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedWriteKV, WriteKVImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k_pages [NB, B, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()         // v_pages [NB, B, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()         // k [T, Hkv, D], pool dtype
                                  .Arg<ffi::AnyBuffer>()         // v [T, Hkv, D], pool dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Ret<ffi::AnyBuffer>()         // k_pages (aliases arg 0)
                                  .Ret<ffi::AnyBuffer>());       // v_pages (aliases arg 1)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pages [NB, B, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()          // v_pages [NB, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs [1]
                                  .RemainingArgs()  // [slopes f32 [Hq]] [limits s32 [T]]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttentionQuant, PagedAttentionQuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pages [NB, B, Hkv, D] 8-bit
                                  .Arg<ffi::AnyBuffer>()          // v_pages [NB, B, Hkv, D] 8-bit
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scales [NB, B, Hkv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scales [NB, B, Hkv]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs [1]
                                  .RemainingArgs()  // [slopes f32 [Hq]] [limits s32 [T]]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));
