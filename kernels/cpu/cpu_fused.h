// The optional operands the native linears fuse into their matmul (cpu_linear.cc,
// cpu_linear_q8.cc): a SiLU gate [M, K], an RMSNorm weight [K] and a residual [M, N], each
// left out by a zero-size buffer, and the rows of x a step really uses.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

struct FusedOperands {
  const float* gate;      // nullptr: no gate
  const float* norm_w;    // nullptr: no norm
  const float* residual;  // nullptr: no residual
  int64_t rows;           // rows of x that are real, in [0, M]
};

// Checks the fused operands against x [M, K] and the product y [M, N], and writes y's padding
// rows (past num_rows: the residual's rows, or zero), which then cost no matmul.
inline xla::ffi::Error ReadFusedOperands(int64_t m, int64_t k, int64_t n,
                                         xla::ffi::Buffer<xla::ffi::S32> num_rows,
                                         xla::ffi::Buffer<xla::ffi::F32> gate_buf,
                                         xla::ffi::Buffer<xla::ffi::F32> norm_weight,
                                         xla::ffi::Buffer<xla::ffi::F32> residual_buf, float* y,
                                         FusedOperands* out) {
  const int64_t gate_size = gate_buf.element_count();
  const int64_t norm_size = norm_weight.element_count();
  const int64_t residual_size = residual_buf.element_count();
  if ((gate_size != 0 && gate_size != m * k) || (norm_size != 0 && norm_size != k) ||
      (residual_size != 0 && residual_size != m * n))
    return xla::ffi::Error::InvalidArgument(
        "gate must be [M, K], norm weight [K] and residual [M, N], or empty");
  out->gate = gate_size ? gate_buf.typed_data() : nullptr;
  out->norm_w = norm_size ? norm_weight.typed_data() : nullptr;
  out->residual = residual_size ? residual_buf.typed_data() : nullptr;
  out->rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, m);
  const int64_t rows = out->rows;
  if (out->residual != nullptr)
    std::copy(out->residual + rows * n, out->residual + m * n, y + rows * n);
  else
    std::fill(y + rows * n, y + m * n, 0.0f);
  return xla::ffi::Error::Success();
}

// One row of x [K] after the fused gate (silu(gate) * x; gate nullptr: none) and RMSNorm
// (norm_w nullptr: none), in float32 into out [K]: the prologue of the quantized linears,
// which multiply a prepared row (cpu_linear_q8.cc, cpu_linear_q4.cc). At one row it runs on
// the calling thread while the matmul's other threads wait, so it is vectorized (exp8 for the
// SiLU, 8 partial sums of squares).
inline void PrepareRow(const float* x, const float* gate, const float* norm_w, float eps,
                       int64_t K, float* out) {
  int64_t k = 0;
#ifdef JAXPAGED_AVX2
  __m256 squares8 = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_loadu_ps(x + k);
    if (gate) v = _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + k)), v);
    _mm256_storeu_ps(out + k, v);
    if (norm_w != nullptr) squares8 = _mm256_fmadd_ps(v, v, squares8);
  }
  float squares = hsum(squares8);
#else
  float squares = 0.0f;
#endif
  for (; k < K; ++k) {
    out[k] = gate ? gate[k] / (1.0f + std::exp(-gate[k])) * x[k] : x[k];
    if (norm_w != nullptr) squares += out[k] * out[k];
  }
  if (norm_w != nullptr) {
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(K) + eps);
    for (k = 0; k < K; ++k) out[k] = norm_w[k] * (out[k] * inv);
  }
}

}  // namespace jaxpaged
