// AVX2 helpers shared by the native CPU kernels (cpu_native.cc, cpu_linear.cc).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define JAXPAGED_AVX2 1
#include <immintrin.h>

namespace jaxpaged {

// The sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

}  // namespace jaxpaged
#endif
