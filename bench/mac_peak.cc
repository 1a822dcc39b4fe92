// Sustained multiply-accumulates per core clock of the SIMD instructions the native matmuls
// can use (bench/mac_peak.py builds and runs this; AVX2 + FMA, the least the kernels need).
//
// Each loop keeps enough independent accumulators to cover its instruction's latency, so it
// runs at the ports' throughput: the ceiling of a matmul's inner loop on this CPU. The clock
// is measured with a chain of dependent 1-cycle adds, so results are per core cycle even
// where the VM reports no frequency. Every function returns its MACs (or adds) and the
// nanoseconds they took; accumulators are stored to a sink so nothing is optimized out.

#include <immintrin.h>

#include <chrono>
#include <cstdint>

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
}

volatile int64_t sink_i;
alignas(32) volatile float sink_f[8];

// The int8 kernel's register tile from L1 (cpu_linear_q8.cc): per k pair, a panel row of
// 16 outputs x 2 k as int16 (2 loads), MR broadcasts of an x pair, 2 MR vpmaddwd + vpaddd.
template <int MR>
double tile_i16(int64_t iters, double* ns) {
  constexpr int pairs = 64;
  alignas(64) static int16_t w[pairs * 32];
  alignas(64) static int32_t x[pairs * MR];
  for (int i = 0; i < pairs * 32; ++i) w[i] = static_cast<int16_t>(i % 7 - 3);
  for (int i = 0; i < pairs * MR; ++i) x[i] = i % 5;
  __m256i out = _mm256_setzero_si256();
  const auto t0 = Clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    __m256i lo[MR], hi[MR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int kk = 0; kk < pairs; ++kk) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + kk * 32));
      const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + kk * 32 + 16));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256i xb = _mm256_set1_epi32(x[kk * MR + m]);
        lo[m] = _mm256_add_epi32(lo[m], _mm256_madd_epi16(xb, w0));
        hi[m] = _mm256_add_epi32(hi[m], _mm256_madd_epi16(xb, w1));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) out = _mm256_add_epi32(out, _mm256_add_epi32(lo[m], hi[m]));
    asm volatile("" : "+x"(out));
  }
  *ns = since(t0);
  sink_i = _mm256_extract_epi64(out, 0);
  return MR * 16.0 * 2 * pairs * iters;
}

}  // namespace

extern "C" {

// Dependent scalar adds (1 cycle each): ns per iteration of 8 adds = ns per 8 cycles.
double clock_adds(int64_t iters, double* ns) {
  int64_t a = 1;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    asm volatile(
        "add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\t"
        "add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\t"
        : "+r"(a));
  }
  *ns = since(t0);
  sink_i = a;
  return 8.0 * iters;  // adds = cycles (the loop's own inc/cmp overlap with the chain)
}

// float32 FMA, ymm: 12 independent accumulators (latency 4 x 2 ports needs >= 8): 8 MACs
// per instruction.
double fma_f32(int64_t iters, double* ns) {
  const int64_t n = iters;
  const auto t0 = Clock::now();
  asm volatile(
      "vzeroall\n\t"  // zero inputs: no denormals
      "1:\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm0\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm1\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm2\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm3\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm4\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm5\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm6\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm7\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm8\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm9\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm10\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm11\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  *ns = since(t0);
  return 12.0 * 8 * n;
}

// vpmaddwd alone (no sums), 12 independent results: the multiplier's own throughput.
double madd_i16_only(int64_t iters, double* ns) {
  const int64_t n = iters;
  const auto t0 = Clock::now();
  asm volatile(
      "vzeroall\n\t"  // zero inputs: no denormals
      "1:\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm0\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm1\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm2\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm3\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm4\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm5\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm6\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm7\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm8\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm9\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm10\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm11\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  *ns = since(t0);
  return 12.0 * 16 * n;
}

// float32 FMA and int16 vpmaddwd + vpaddd interleaved, 6 chains each: whether the two use
// separate ports (MACs of both counted).
double fma_and_madd(int64_t iters, double* ns) {
  const int64_t n = iters;
  const auto t0 = Clock::now();
  asm volatile(
      "vzeroall\n\t"  // zero inputs: no denormals
      "1:\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm0\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm12\n\t"
      "vpaddd %%ymm12, %%ymm6, %%ymm6\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm1\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm13\n\t"
      "vpaddd %%ymm13, %%ymm7, %%ymm7\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm2\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm12\n\t"
      "vpaddd %%ymm12, %%ymm8, %%ymm8\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm3\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm13\n\t"
      "vpaddd %%ymm13, %%ymm9, %%ymm9\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm4\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm12\n\t"
      "vpaddd %%ymm12, %%ymm10, %%ymm10\n\t"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm5\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm13\n\t"
      "vpaddd %%ymm13, %%ymm11, %%ymm11\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  *ns = since(t0);
  return 6.0 * (8 + 16) * n;
}

// int16 x int16 -> int32 pairs (vpmaddwd) summed with vpaddd, 6 chains: 16 MACs per vpmaddwd.
double madd_i16(int64_t iters, double* ns) {
  const int64_t n = iters;
  const auto t0 = Clock::now();
  asm volatile(
      "vzeroall\n\t"  // zero inputs: no denormals
      "1:\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm6\n\t"
      "vpaddd %%ymm6, %%ymm0, %%ymm0\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm7\n\t"
      "vpaddd %%ymm7, %%ymm1, %%ymm1\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm8\n\t"
      "vpaddd %%ymm8, %%ymm2, %%ymm2\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm9\n\t"
      "vpaddd %%ymm9, %%ymm3, %%ymm3\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm10\n\t"
      "vpaddd %%ymm10, %%ymm4, %%ymm4\n\t"
      "vpmaddwd %%ymm15, %%ymm14, %%ymm11\n\t"
      "vpaddd %%ymm11, %%ymm5, %%ymm5\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  *ns = since(t0);
  return 6.0 * 16 * n;
}

// u8 x s8 -> saturated int16 pairs (vpmaddubsw), widened and summed by vpmaddwd against
// ones, then vpaddd, 4 chains: 32 MACs per vpmaddubsw, at two multiplier instructions.
double maddubs_u8s8(int64_t iters, double* ns) {
  const int64_t n = iters;
  const auto t0 = Clock::now();
  asm volatile(
      "vzeroall\n\t"  // zero inputs: no denormals
      "1:\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm4\n\t"
      "vpmaddwd %%ymm13, %%ymm4, %%ymm8\n\t"
      "vpaddd %%ymm8, %%ymm0, %%ymm0\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm5\n\t"
      "vpmaddwd %%ymm13, %%ymm5, %%ymm9\n\t"
      "vpaddd %%ymm9, %%ymm1, %%ymm1\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm6\n\t"
      "vpmaddwd %%ymm13, %%ymm6, %%ymm10\n\t"
      "vpaddd %%ymm10, %%ymm2, %%ymm2\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm7\n\t"
      "vpmaddwd %%ymm13, %%ymm7, %%ymm11\n\t"
      "vpaddd %%ymm11, %%ymm3, %%ymm3\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  *ns = since(t0);
  return 4.0 * 32 * n;
}

// vpmaddubsw alone, summed in int16 (vpaddsw), 6 chains: the 8-bit ceiling if int16 sums
// never saturate (only with small activations): 32 MACs per instruction.
double maddubs_u8s8_i16acc(int64_t iters, double* ns) {
  const int64_t n = iters;
  const auto t0 = Clock::now();
  asm volatile(
      "vzeroall\n\t"  // zero inputs: no denormals
      "1:\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm6\n\t"
      "vpaddsw %%ymm6, %%ymm0, %%ymm0\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm7\n\t"
      "vpaddsw %%ymm7, %%ymm1, %%ymm1\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm8\n\t"
      "vpaddsw %%ymm8, %%ymm2, %%ymm2\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm9\n\t"
      "vpaddsw %%ymm9, %%ymm3, %%ymm3\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm10\n\t"
      "vpaddsw %%ymm10, %%ymm4, %%ymm4\n\t"
      "vpmaddubsw %%ymm15, %%ymm14, %%ymm11\n\t"
      "vpaddsw %%ymm11, %%ymm5, %%ymm5\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  *ns = since(t0);
  return 6.0 * 32 * n;
}

// The float32 matmul's register tile from L1 (cpu_linear.cc): per k, a 16-wide panel row
// (2 loads), 6 broadcasts of x and 12 FMAs. `w` [kc, 16] and `x` [kc, 6] stay in L1.
double tile_f32(int64_t iters, double* ns) {
  constexpr int kc = 128;
  alignas(64) static float w[kc * 16], x[kc * 6];
  for (int i = 0; i < kc * 16; ++i) w[i] = 0.001f * (i % 7);
  for (int i = 0; i < kc * 6; ++i) x[i] = 0.001f * (i % 5);
  __m256 out = _mm256_setzero_ps();
  const auto t0 = Clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    __m256 lo[6], hi[6];
#pragma GCC unroll 8
    for (int m = 0; m < 6; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int k = 0; k < kc; ++k) {
      const __m256 w0 = _mm256_load_ps(w + k * 16), w1 = _mm256_load_ps(w + k * 16 + 8);
#pragma GCC unroll 6
      for (int m = 0; m < 6; ++m) {
        const __m256 xm = _mm256_broadcast_ss(x + k * 6 + m);
        lo[m] = _mm256_fmadd_ps(xm, w0, lo[m]);
        hi[m] = _mm256_fmadd_ps(xm, w1, hi[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < 6; ++m) out = _mm256_add_ps(out, _mm256_add_ps(lo[m], hi[m]));
    asm volatile("" : "+x"(out));
  }
  *ns = since(t0);
  _mm256_store_ps(const_cast<float*>(sink_f), out);
  return 6.0 * 16 * kc * iters;
}

double tile_i16_mr4(int64_t iters, double* ns) { return tile_i16<4>(iters, ns); }
double tile_i16_mr5(int64_t iters, double* ns) { return tile_i16<5>(iters, ns); }
double tile_i16_mr6(int64_t iters, double* ns) { return tile_i16<6>(iters, ns); }

}  // extern "C"
