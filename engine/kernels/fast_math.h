// Transcendental functions in plain float arithmetic, for the pointwise loops of the CPU kernels.

#pragma once

#include <bit>
#include <cstdint>

namespace ferry {

// exp(x) as Cephes' expf computes it (relative error about 1e-7, as libm's), in plain arithmetic that vectorises
// inside an `omp simd` loop, where a call to std::exp stays one scalar call per element: the scans take an exp per
// state element and token (Mamba's) and the convolution's SiLU one per channel and token.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  // Rounded to the nearest integer by adding and taking away 1.5 * 2^23 (std::floor would not vectorise).
  const float whole = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float f = x - whole * 0.693359375f + whole * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(whole) + 127) << 23);
}

}  // namespace ferry
