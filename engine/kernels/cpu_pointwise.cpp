// The small per-layer ops of a decoder layer on the CPU, each in one call where torch runs several (each a few us
// of dispatch, which at one token is most of their cost): rotary embedding and SiLU-and-multiply. Each rounds where
// the Llama family's modules round (engine/layers/rotary.py, engine/models/llama.py), so bfloat16 results are theirs.
// The vision encoders' pointwise ops too (engine/layers/activation.py, engine/models/qwen2_vl.py): over an image's
// thousand patches torch's op-by-op passes, each widening bfloat16 and writing its own result, took two fifths of
// Qwen2-VL's encoder; here each element is read and written once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bfloat16.h"
#include "fast_math.h"
#include "kernels.h"

#include <cmath>
#include <type_traits>

namespace {

// out = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x[half:], x[:half]). `Stepwise`: each product
// and the sum rounded to T, as torch computes the expression in T (the Llama family's tables are in the model's
// dtype); otherwise float32 throughout from float32 tables, rounded to T once (transformers' vision rotary, which
// widens q and k before rotating them).
template <typename T, typename Table, bool Stepwise>
void rotate(const T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride,
            const Table* cos, const Table* sin, T* out) {
  const int64_t half = dim / 2;
  const auto term = [](float product) {
    if constexpr (Stepwise) {
      return ferry::to_float(ferry::from_float<T>(product));
    } else {
      return product;
    }
  };
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, heads * dim)), [&](int64_t t0,
                                                                                                    int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Table* c = cos + t * dim;
      const Table* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* row = x + t * token_stride + h * head_stride;
        T* dst = out + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = term(ferry::to_float(row[d]) * ferry::to_float(c[d]));
          const float b = term(-ferry::to_float(row[d + half]) * ferry::to_float(s[d]));
          dst[d] = ferry::from_float<T>(a + b);
        }
#pragma omp simd
        for (int64_t d = half; d < dim; ++d) {
          const float a = term(ferry::to_float(row[d]) * ferry::to_float(c[d]));
          const float b = term(ferry::to_float(row[d - half]) * ferry::to_float(s[d]));
          dst[d] = ferry::from_float<T>(a + b);
        }
      }
    }
  });
}

// out = x * sigmoid(1.702 * x) (transformers' QuickGELUActivation: CLIP's and Qwen2-VL's vision MLPs), rounded to T
// where torch rounds the expression: the scaled input, the sigmoid, the product.
template <typename T>
void quick_gelu_elements(const T* x, int64_t count, T* out) {
  at::parallel_for(0, count, 16384, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const float v = ferry::to_float(x[i]);
      const float scaled = ferry::to_float(ferry::from_float<T>(v * 1.702f));
      const float gate = ferry::to_float(ferry::from_float<T>(1.0f / (1.0f + ferry::fast_exp(-scaled))));
      out[i] = ferry::from_float<T>(v * gate);
    }
  });
}

// out = silu(gate) * up over [tokens, 2 * width] (gate, then up): silu rounded to T, then the product.
template <typename T>
void silu_mul_rows(const T* gate_up, int64_t tokens, int64_t width, T* out) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, 2048 / std::max<int64_t>(1, width)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* gate = gate_up + t * 2 * width;
      const T* up = gate + width;
      T* dst = out + t * width;
      for (int64_t j = 0; j < width; ++j) {
        const float g = static_cast<float>(gate[j]);
        const T silu = static_cast<T>(g / (1.0f + std::exp(-g)));
        dst[j] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[j]));
      }
    }
  });
}

}  // namespace

namespace ferry {

// x [tokens, heads, head_dim] rotated by its tokens' cos/sin [tokens, head_dim]: tables in x's dtype, rounded as
// torch rounds the expression (`rotary`), or float32 tables in float32 rounded once (`rotary_widened`).
template <bool Widened>
at::Tensor rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3, name, " takes [tokens, heads, head_dim] on the CPU");
  const at::ScalarType table_type = Widened ? at::kFloat : x.scalar_type();
  TORCH_CHECK(cos.scalar_type() == table_type && sin.scalar_type() == table_type, name, ": tables of ",
              cos.scalar_type(), ", not ", table_type);
  const at::Tensor rows = x.stride(2) == 1 ? x : x.contiguous();
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2);
  TORCH_CHECK(dim % 2 == 0, "head_dim ", dim, " is odd");
  const at::Tensor c = cos.reshape({tokens, dim}).contiguous();
  const at::Tensor s = sin.reshape({tokens, dim}).contiguous();
  at::Tensor out = at::empty({tokens, heads, dim}, rows.options());
  if (x.scalar_type() == at::kFloat) {
    rotate<float, float, !Widened>(rows.data_ptr<float>(), tokens, heads, dim, rows.stride(0), rows.stride(1),
                                   c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    using Table = std::conditional_t<Widened, float, at::BFloat16>;
    rotate<at::BFloat16, Table, !Widened>(rows.data_ptr<at::BFloat16>(), tokens, heads, dim, rows.stride(0),
                                          rows.stride(1), c.data_ptr<Table>(), s.data_ptr<Table>(),
                                          out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, name, " takes float32 or bfloat16, not ", x.scalar_type());
  }
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotated<false>(x, cos, sin, "ferry_kernels.rotary");
}

at::Tensor rotary_widened(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotated<true>(x, cos, sin, "ferry_kernels.rotary_widened");
}

at::Tensor quick_gelu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "ferry_kernels.quick_gelu takes a CPU tensor");
  const at::Tensor elements = x.contiguous();
  at::Tensor out = at::empty_like(elements);
  if (x.scalar_type() == at::kFloat) {
    quick_gelu_elements(elements.data_ptr<float>(), elements.numel(), out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    quick_gelu_elements(elements.data_ptr<at::BFloat16>(), elements.numel(), out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "ferry_kernels.quick_gelu takes float32 or bfloat16, not ", x.scalar_type());
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "ferry_kernels.silu_mul takes [tokens, 2 * width] on the CPU");
  const at::Tensor rows = gate_up.contiguous();
  const int64_t tokens = rows.size(0), width = rows.size(1) / 2;
  at::Tensor out = at::empty({tokens, width}, rows.options());
  if (rows.scalar_type() == at::kFloat) {
    silu_mul_rows(rows.data_ptr<float>(), tokens, width, out.data_ptr<float>());
  } else if (rows.scalar_type() == at::kBFloat16) {
    silu_mul_rows(rows.data_ptr<at::BFloat16>(), tokens, width, out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "ferry_kernels.silu_mul takes float32 or bfloat16, not ", rows.scalar_type());
  }
  return out;
}

}  // namespace ferry

using namespace ferry;

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_widened(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("quick_gelu(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) {
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_widened", &rotary_widened);
  m.impl("quick_gelu", &quick_gelu);
}
