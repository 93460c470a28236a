// Greedy sampling's argmax on the CPU: each row's first maximum, as `torch.argmax(x, dim=-1)` gives it (a NaN counts
// as the maximum, so the first NaN's index), in one vectorised pass over float32 logits.
//
// torch's CPU argmax compares element by element: one row took 6.9 us of a 4,096-token vocabulary, 37 us of 32,000
// and 195 us of 151,936, where one pass of `amax` over the last takes 12 us (engine/sampling/sampler.py's two passes,
// block maxima and then one block's argmax, took 78 us there). Here 4.4, 7.6 and 23 us (one thread of an AVX2
// EPYC); 32 rows of 151,936 are bound by reading their 19 MB (~1 ms, as the two passes). Four accumulators of 8
// lanes each keep a running maximum and where each lane first saw it (only a strictly greater value replaces it),
// so the earliest index among the lanes holding the row's maximum is the row's first maximum.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(row[j])) return j;
  }
  return -1;
}

// The first maximum of row[0, n), n > 0.
int64_t row_argmax(const float* row, int64_t n) {
  if (std::isnan(row[0])) return 0;
  float best = row[0];
  int64_t best_at = 0;
  int64_t j = 1;
#if defined(__AVX2__)
  constexpr int kAccs = 4, kLanes = 8, kStride = kAccs * kLanes;
  if (n >= kStride) {
    __m256 value[kAccs];
    __m256i at[kAccs], seen_at[kAccs];
    const __m256i step = _mm256_set1_epi32(kStride);
    for (int a = 0; a < kAccs; ++a) {
      // -inf where each lane starts, at the lane's first index: a lane that sees only -inf keeps that index,
      // whose value is -inf indeed.
      value[a] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      at[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(a * kLanes));
      seen_at[a] = at[a];
    }
    __m256 nan = _mm256_setzero_ps();
    for (j = 0; j + kStride <= n; j += kStride) {
      for (int a = 0; a < kAccs; ++a) {
        const __m256 v = _mm256_loadu_ps(row + j + a * kLanes);
        const __m256 greater = _mm256_cmp_ps(v, value[a], _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        value[a] = _mm256_blendv_ps(value[a], v, greater);
        seen_at[a] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(seen_at[a]), _mm256_castsi256_ps(at[a]), greater));
        at[a] = _mm256_add_epi32(at[a], step);
      }
    }
    if (_mm256_movemask_ps(nan) != 0) return first_nan(row, n);
    alignas(32) float values[kStride];
    alignas(32) int32_t indices[kStride];
    for (int a = 0; a < kAccs; ++a) {
      _mm256_store_ps(values + a * kLanes, value[a]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(indices + a * kLanes), seen_at[a]);
    }
    best = values[0];
    best_at = indices[0];
    for (int l = 1; l < kStride; ++l) {
      if (values[l] > best || (values[l] == best && indices[l] < best_at)) {
        best = values[l];
        best_at = indices[l];
      }
    }
  }
#endif
  // The rest, after every index above: only a greater value or a NaN (the first one: none came before) moves it.
  for (; j < n; ++j) {
    if (std::isnan(row[j])) return j;
    if (row[j] > best) {
      best = row[j];
      best_at = j;
    }
  }
  return best_at;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "ferry_kernels.argmax_rows takes [rows, width] float32 CPU logits");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(width > 0 && width < (int64_t{1} << 31), "ferry_kernels.argmax_rows: a row of ", width, " logits");
  // Rows may be strided (a padded vocabulary's head cut to the real one), their elements not.
  const at::Tensor logits = x.stride(1) == 1 ? x : x.contiguous();
  const float* data = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out_data[r] = row_argmax(data + r * row_stride, width);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
