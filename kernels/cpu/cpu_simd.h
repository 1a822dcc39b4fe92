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

// JAXPAGED_AVX512: the compiler targets AVX-512 (F and BW), so 16-lane float vectors exist.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define JAXPAGED_AVX512 1
#endif

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

// The largest of the 8 lanes.
inline float hmax(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// exp of 8 floats (Cephes' range reduction and polynomial, ~1 ulp); -inf and anything below
// the float range give exactly 0, as a masked key's probability must.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(zero_mask, y);
}

// silu(g) = g / (1 + e^-g) of 8 floats: a SwiGLU MLP's activation.
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(
      g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

}  // namespace jaxpaged
#endif
