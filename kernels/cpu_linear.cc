// y = x @ w[layer].T for few rows of x (decode), as an XLA FFI custom call (kernels/cpu.py).
//
// Why native: XLA:CPU's GEMM packs the weight panel before multiplying, which pays off for
// many rows but not for the 1-64 rows of a decode step, where the dot runs at about half
// of the machine's matmul peak (bench/weight_layout.py). Here each group of 3 weight rows
// ([out, in] layout: a row is contiguous) is read from memory once, held in L1, and dotted
// with every row of x in 4 x 3 register tiles. The weight is passed whole with all its
// layers and indexed in place, so a decoder's lax.scan never copies a layer's slice.

#include <algorithm>
#include <cstdint>

#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerItem = 64;  // weight rows (outputs) per parallel work item
// A register tile: 4 x 3 accumulators + 3 weight vectors + 1 x vector fill the 16 AVX2
// registers exactly (larger tiles spill and run ~1.5x slower).
constexpr int64_t kN = 3;  // weight rows per register tile
constexpr int64_t kM = 4;  // x rows per register tile

#ifdef JAXPAGED_AVX2
// y[m, n] for the tile's nm x rows and nn weight rows (nm <= kM, nn <= kN); K % 8 == 0.
template <int NM, int NN>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t N,
                 int64_t prefetch_rows) {
  __m256 acc[NM][NN];
  for (int m = 0; m < NM; ++m)
    for (int n = 0; n < NN; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NN];
    for (int n = 0; n < NN; ++n) {
      wv[n] = _mm256_loadu_ps(w + n * K + k);
      if (prefetch_rows) __builtin_prefetch(w + (prefetch_rows + n) * K + k);
    }
    for (int m = 0; m < NM; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NN; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < NM; ++m)
    for (int n = 0; n < NN; ++n) y[m * N + n] = jaxpaged::hsum(acc[m][n]);
}

template <int NN>
void rows_of_x(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
               int64_t prefetch_rows) {
  int64_t m = 0;
  // Only the first pass over these weight rows prefetches the next group.
  for (; m + kM <= M; m += kM, prefetch_rows = 0)
    tile<kM, NN>(x + m * K, w, y + m * N, K, N, prefetch_rows);
  static_assert(kM == 4, "the remainder cases below assume 4-row tiles");
  if (M - m == 3) tile<3, NN>(x + m * K, w, y + m * N, K, N, prefetch_rows);
  if (M - m == 2) tile<2, NN>(x + m * K, w, y + m * N, K, N, prefetch_rows);
  if (M - m == 1) tile<1, NN>(x + m * K, w, y + m * N, K, N, prefetch_rows);
}
#endif

// Outputs [n0, n1) for every row of x.
void linear_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
#ifdef JAXPAGED_AVX2
  if (K % 8 == 0) {
    int64_t n = n0;
    for (; n + kN <= n1; n += kN) {
      const int64_t ahead = n + 2 * kN <= n1 ? kN : 0;
      rows_of_x<kN>(x, w + n * K, y + n, M, K, N, ahead);
    }
    for (; n < n1; ++n) rows_of_x<1>(x, w + n * K, y + n, M, K, N, 0);
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      y[m * N + n] = s;
    }
}

ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("need x [M, K] and w [L, N, K]");
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[1];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("layer index out of range");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + l * N * K;
  float* yp = y->typed_data();
  const int64_t items = (N + kRowsPerItem - 1) / kRowsPerItem;
  jaxpaged::parallel_for(pool, items, [&](int64_t i) {
    const int64_t n0 = i * kRowsPerItem;
    linear_rows(xp, wp, yp, M, K, N, n0, std::min(N, n0 + kRowsPerItem));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);
