// Helpers shared by the native CPU kernels (cpu_native.cc, cpu_linear.cc): element widening
// for any build, AVX2 ones when the compiler targets it.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxpaged {

// A float32 or bfloat16 element (its bits) as float32: bfloat16 is float32's top half.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

}  // namespace jaxpaged

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
