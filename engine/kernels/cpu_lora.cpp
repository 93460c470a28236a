// LoRA's shrink and expand on the CPU (engine/lora/slots.py): each token of a step against its own adapter's slot
// only, in one call per adapted part. torch's matmuls can only multiply every token by every slot in use and mask
// the products after (k times the work with k adapters in the step, and three ops a part); here a token costs
// rank * (in + out) multiply-adds whichever adapters its neighbours use, and a base-model token nothing.
//
// The low-rank product is summed in float32 and rounded to the output's dtype once, when added to it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bfloat16.h"

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 4;  // tokens of one slot computed together: each row of A and B read once for them

// out[t, offset:offset+size] += scaling[s] * (x[t] @ a[s*rank : (s+1)*rank].T) @ bt[s*rank : (s+1)*rank] for the N
// tokens `ts` of slot s. a: [slots * rank, in]; bt: [slots * rank, size] (B transposed, so that the expand runs
// along contiguous rows of it: rank scaled row additions, no dot products). shrunk: rank * N floats; sums: size * N.
template <typename T, int64_t N>
void add_block(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t offset, int64_t size, const T* a,
               const T* bt, int64_t slot, float scaling, const int64_t* ts, int64_t in, int64_t rank, float* shrunk,
               float* sums) {
  const T* rows[N];
  for (int64_t j = 0; j < N; ++j) rows[j] = x + ts[j] * x_stride;
  for (int64_t r = 0; r < rank; ++r) {
    const T* a_row = a + (slot * rank + r) * in;
    float dot[N] = {};
    for (int64_t j = 0; j < N; ++j) {
      const T* row = rows[j];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < in; ++i) sum += ferry::to_float(row[i]) * ferry::to_float(a_row[i]);
      dot[j] = sum;
    }
    for (int64_t j = 0; j < N; ++j) shrunk[j * rank + r] = dot[j] * scaling;
  }
  std::fill(sums, sums + N * size, 0.0f);
  for (int64_t r = 0; r < rank; ++r) {
    const T* b_row = bt + (slot * rank + r) * size;
    for (int64_t j = 0; j < N; ++j) {
      const float s = shrunk[j * rank + r];
      float* acc = sums + j * size;
#pragma omp simd
      for (int64_t o = 0; o < size; ++o) acc[o] += s * ferry::to_float(b_row[o]);
    }
  }
  for (int64_t j = 0; j < N; ++j) {
    T* dst = out + ts[j] * out_stride + offset;
    const float* acc = sums + j * size;
#pragma omp simd
    for (int64_t o = 0; o < size; ++o) dst[o] = ferry::from_float<T>(ferry::to_float(dst[o]) + acc[o]);
  }
}

// Every token with a slot (slots[t] >= 0), grouped by slot in blocks of up to kBlock tokens.
template <typename T>
void add_products(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t offset, int64_t size,
                  const T* a, const T* bt, const int64_t* slots, const float* scalings, int64_t num_slots,
                  int64_t tokens, int64_t in, int64_t rank) {
  // The tokens by slot (a counting sort), then the blocks: (first index into `order`, count, slot).
  std::vector<int64_t> starts(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "token ", t, " is in slot ", slots[t], " of ", num_slots);
    if (slots[t] >= 0) ++starts[slots[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) starts[s + 1] += starts[s];
  std::vector<int64_t> order(starts[num_slots]);
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0) order[next[slots[t]]++] = t;
  }
  std::vector<std::array<int64_t, 3>> blocks;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (int64_t first = starts[s]; first < starts[s + 1]; first += kBlock) {
      blocks.push_back({first, std::min(kBlock, starts[s + 1] - first), s});
    }
  }
  const int64_t work = std::max<int64_t>(1, kBlock * rank * (in + size));
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), std::max<int64_t>(1, 262144 / work), [&](int64_t b0,
                                                                                                     int64_t b1) {
    std::vector<float> shrunk(kBlock * rank);
    std::vector<float> sums(kBlock * size);
    for (int64_t b = b0; b < b1; ++b) {
      const auto [first, count, slot] = blocks[b];
      const int64_t* ts = order.data() + first;
      const auto run = [&](auto n) {
        add_block<T, decltype(n)::value>(x, x_stride, out, out_stride, offset, size, a, bt, slot, scalings[slot], ts,
                                         in, rank, shrunk.data(), sums.data());
      };
      switch (count) {
        case 1: run(std::integral_constant<int64_t, 1>{}); break;
        case 2: run(std::integral_constant<int64_t, 2>{}); break;
        case 3: run(std::integral_constant<int64_t, 3>{}); break;
        default: run(std::integral_constant<int64_t, 4>{}); break;
      }
    }
  });
}

}  // namespace

namespace ferry {

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& slots, const at::Tensor& scalings, int64_t offset, int64_t rank) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0),
              "ferry_kernels.lora_add takes x [T, in] and out [T, out] on the CPU");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out need contiguous rows");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.size(1) == x.size(1) && bt.size(0) == a.size(0),
              "a [slots * rank, in] and bt [slots * rank, size] must be contiguous and agree with x");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && bt.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type(), "x, out, a and b must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == x.size(0),
              "slots: int64 [T]");
  TORCH_CHECK(scalings.scalar_type() == at::kFloat && scalings.is_contiguous(), "scalings: float32 [slots]");
  const int64_t size = bt.size(1);
  TORCH_CHECK(offset >= 0 && offset + size <= out.size(1), "the part's rows fall outside out");
  if (x.scalar_type() == at::kFloat) {
    add_products(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), out.stride(0), offset, size,
                 a.data_ptr<float>(), bt.data_ptr<float>(), slots.data_ptr<int64_t>(),
                 scalings.data_ptr<float>(), scalings.size(0), x.size(0), x.size(1), rank);
  } else if (x.scalar_type() == at::kBFloat16) {
    add_products(x.data_ptr<at::BFloat16>(), x.stride(0), out.data_ptr<at::BFloat16>(), out.stride(0), offset, size,
                 a.data_ptr<at::BFloat16>(), bt.data_ptr<at::BFloat16>(), slots.data_ptr<int64_t>(),
                 scalings.data_ptr<float>(), scalings.size(0), x.size(0), x.size(1), rank);
  } else {
    TORCH_CHECK(false, "ferry_kernels.lora_add takes float32 or bfloat16, not ", x.scalar_type());
  }
}

}  // namespace ferry

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor slots, Tensor scalings, int offset, "
        "int rank) -> ()");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) { m.impl("lora_add", &ferry::lora_add); }
