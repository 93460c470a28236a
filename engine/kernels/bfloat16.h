// float32 <-> bfloat16 as c10::BFloat16 converts (the top half of a float32; rounding to nearest even, a NaN to
// 0x7FC0), written without branches so that `omp simd` loops vectorise: c10's conversion, with its NaN branch, kept
// the pointwise kernels' loops scalar (RMSNorm over 2,048 x 1,024 bfloat16: 8.6 ms on two cores, about 4 ns an
// element, for what is a memory pass). float32 passes through unchanged.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace ferry {

inline float to_float(float x) { return x; }

inline float to_float(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

template <>
inline at::BFloat16 from_float<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return at::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : rounded), at::BFloat16::from_bits());
}

}  // namespace ferry
