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
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 4;  // tokens of one slot computed together: each row of A and B read once for them
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;  // floats in one vector register
#else
constexpr int64_t kLanes = 8;  // AVX2: wider GCC vectors than a register are split badly (3x slower, measured)
#endif
constexpr int64_t kColumns = kLanes;  // output columns summed in registers over the rank before one add to `out`

// W floats in one vector register (GCC's vector extensions), and the integer vectors bfloat16 passes through.
template <int64_t W>
struct VectorOf;
template <>
struct VectorOf<8> {
  typedef float type __attribute__((vector_size(32)));
  typedef uint16_t halves __attribute__((vector_size(16)));
  typedef uint32_t words __attribute__((vector_size(32)));
};
template <>
struct VectorOf<16> {
  typedef float type __attribute__((vector_size(64)));
  typedef uint16_t halves __attribute__((vector_size(32)));
  typedef uint32_t words __attribute__((vector_size(64)));
};
template <int64_t W>
using Floats = typename VectorOf<W>::type;

template <int64_t W>
inline Floats<W> load(const float* p) {
  Floats<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int64_t W>
inline Floats<W> load(const at::BFloat16* p) {
  using Halves = typename VectorOf<W>::halves;
  using Words = typename VectorOf<W>::words;
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words w = __builtin_convertvector(h, Words) << 16;
  Floats<W> v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

template <int64_t W>
inline void store(float* p, Floats<W> v) {
  std::memcpy(p, &v, sizeof v);
}

// Rounded to nearest even as ferry::from_float does, a NaN to 0x7FC0.
template <int64_t W>
inline void store(at::BFloat16* p, Floats<W> v) {
  using Halves = typename VectorOf<W>::halves;
  using Words = typename VectorOf<W>::words;
  Words bits;
  std::memcpy(&bits, &v, sizeof bits);
  Words rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  rounded = v != v ? 0x7FC0u : rounded;
  const Halves h = __builtin_convertvector(rounded, Halves);
  std::memcpy(p, &h, sizeof h);
}

// out[t, offset:offset+size] += scaling[s] * (x[t] @ A_s.T) @ B_s.T for the N tokens `ts` of slot s.
// a_t: [slots, in, rank], each slot's A transposed, read front to back: the shrink takes C ranks at a time, and for
// each input column adds x[t, i] times C contiguous values of A's column into C sums per token held in registers
// (no dot products to reduce). bt: [slots * rank, size], B transposed: the expand sums kColumns outputs per token
// in registers over the whole rank, one row of B a rank, then adds them to `out` once. shrunk: N * rank floats.
template <typename T, int64_t N, int64_t C>
void add_block(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t offset, int64_t size, const T* a_t,
               const T* bt, int64_t slot, float scaling, const int64_t* ts, int64_t in, int64_t rank,
               float* shrunk) {
  const T* rows[N];
  for (int64_t j = 0; j < N; ++j) rows[j] = x + ts[j] * x_stride;
  const T* a_slot = a_t + slot * in * rank;
  for (int64_t r0 = 0; r0 < rank; r0 += C) {
    Floats<C> sums[N] = {};
    for (int64_t i = 0; i < in; ++i) {
      const Floats<C> a = load<C>(a_slot + i * rank + r0);
      for (int64_t j = 0; j < N; ++j) sums[j] += ferry::to_float(rows[j][i]) * a;
    }
    for (int64_t j = 0; j < N; ++j) store<C>(shrunk + j * rank + r0, sums[j] * scaling);
  }
  const T* b_slot = bt + slot * rank * size;
  int64_t o0 = 0;
  for (; o0 + kColumns <= size; o0 += kColumns) {
    Floats<kColumns> sums[N] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const Floats<kColumns> b = load<kColumns>(b_slot + r * size + o0);
      for (int64_t j = 0; j < N; ++j) sums[j] += shrunk[j * rank + r] * b;
    }
    for (int64_t j = 0; j < N; ++j) {
      T* dst = out + ts[j] * out_stride + offset + o0;
      store<kColumns>(dst, load<kColumns>(dst) + sums[j]);
    }
  }
  for (int64_t j = 0; j < N && o0 < size; ++j) {  // the last columns, fewer than kColumns
    T* dst = out + ts[j] * out_stride + offset;
    for (int64_t o = o0; o < size; ++o) {
      float sum = 0.0f;
      for (int64_t r = 0; r < rank; ++r) sum += shrunk[j * rank + r] * ferry::to_float(b_slot[r * size + o]);
      dst[o] = ferry::from_float<T>(ferry::to_float(dst[o]) + sum);
    }
  }
}

// Every token with a slot (slots[t] >= 0), grouped by slot in blocks of up to kBlock tokens.
template <typename T>
void add_products(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t offset, int64_t size,
                  const T* a_t, const T* bt, const int64_t* slots, const float* scalings,
                  int64_t num_slots, int64_t tokens, int64_t in, int64_t rank) {
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
    for (int64_t b = b0; b < b1; ++b) {
      const auto [first, count, slot] = blocks[b];
      const int64_t* ts = order.data() + first;
      const auto run = [&](auto n) {
        constexpr int64_t kN = decltype(n)::value;
        if (rank % kLanes == 0) {
          add_block<T, kN, kLanes>(x, x_stride, out, out_stride, offset, size, a_t, bt, slot, scalings[slot],
                                   ts, in, rank, shrunk.data());
        } else {
          add_block<T, kN, 8>(x, x_stride, out, out_stride, offset, size, a_t, bt, slot, scalings[slot],
                              ts, in, rank, shrunk.data());
        }
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

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& bt,
              const at::Tensor& slots, const at::Tensor& scalings, int64_t offset, int64_t rank) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0),
              "ferry_kernels.lora_add takes x [T, in] and out [T, out] on the CPU");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out need contiguous rows");
  TORCH_CHECK(a_t.is_contiguous() && bt.is_contiguous() && a_t.dim() == 3 && a_t.size(1) == x.size(1) &&
                  a_t.size(2) == rank && bt.size(0) == a_t.size(0) * rank,
              "a_t [slots, in, rank] and bt [slots * rank, size] must be contiguous and agree with x");
  TORCH_CHECK(rank > 0 && rank % 8 == 0 && scalings.size(0) <= a_t.size(0),
              "the slots' rank must be a multiple of 8, and every slot of the scalings have its A and B");
  TORCH_CHECK(a_t.scalar_type() == x.scalar_type() && bt.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type(), "x, out, a and b must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == x.size(0),
              "slots: int64 [T]");
  TORCH_CHECK(scalings.scalar_type() == at::kFloat && scalings.is_contiguous(), "scalings: float32 [slots]");
  const int64_t size = bt.size(1);
  TORCH_CHECK(offset >= 0 && offset + size <= out.size(1), "the part's rows fall outside out");
  if (x.scalar_type() == at::kFloat) {
    add_products(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), out.stride(0), offset, size,
                 a_t.data_ptr<float>(), bt.data_ptr<float>(), slots.data_ptr<int64_t>(),
                 scalings.data_ptr<float>(), scalings.size(0), x.size(0), x.size(1), rank);
  } else if (x.scalar_type() == at::kBFloat16) {
    add_products(x.data_ptr<at::BFloat16>(), x.stride(0), out.data_ptr<at::BFloat16>(), out.stride(0), offset, size,
                 a_t.data_ptr<at::BFloat16>(), bt.data_ptr<at::BFloat16>(), slots.data_ptr<int64_t>(),
                 scalings.data_ptr<float>(), scalings.size(0), x.size(0), x.size(1), rank);
  } else {
    TORCH_CHECK(false, "ferry_kernels.lora_add takes float32 or bfloat16, not ", x.scalar_type());
  }
}

}  // namespace ferry

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a_t, Tensor bt, Tensor slots, Tensor scalings, int offset, "
        "int rank) -> ()");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) { m.impl("lora_add", &ferry::lora_add); }
