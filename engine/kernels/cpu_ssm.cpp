// The state-space layers' step on the CPU (engine/layers/ssm.py), over the packed `[T, ...]` row as it is: each
// sequence's tokens in order, its state read from its slot once, carried in registers and cache across its tokens,
// and written back once. torch's ops instead pad the step's prompts into a block, materialise every position's
// decay and input (`[L, D, N]` per sequence), gather the slots' states and scatter them back: the profile of Mamba2
// and Jamba steps at 32 sequences spent most of their time there.
//
// `causal_conv`: SiLU of the depthwise causal convolution, continuing from the last K - 1 inputs in the slot.
// `ssd_scan` (Mamba2): a scalar decay per head, `h[p, n] = exp(dt·A[h])·h[p, n] + dt·x[p]·B[n]`, `y[p] = h[p]·C`.
// `selective_scan` (Mamba): a decay per channel and state element, `h[n] = exp(dt·A[d, n])·h[n] + dt·u·B[n]`,
// `y = h·C`. A sequence marked fresh starts from a zero state whatever its slot holds (which may be anything,
// non-finite included: it is never read). Scan inputs and states are float32; sequences (and heads, channels) run
// in parallel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "bfloat16.h"
#include "fast_math.h"

namespace {

struct Steps {
  const int64_t* starts;  // [B + 1] cumulative query lengths
  const int64_t* slots;   // [B]
  const bool* fresh;      // [B]
  int64_t count;
};

Steps steps_of(const at::Tensor& query_start, const at::Tensor& slots, const at::Tensor& fresh) {
  TORCH_CHECK(query_start.scalar_type() == at::kLong && query_start.is_contiguous(), "int64 query starts");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "int64 slots");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.is_contiguous(), "bool fresh flags");
  const int64_t count = slots.numel();
  TORCH_CHECK(query_start.numel() == count + 1 && fresh.numel() == count, "one slot and flag per sequence");
  return {query_start.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), fresh.data_ptr<bool>(), count};
}

void check_states(const at::Tensor& states) {
  TORCH_CHECK(states.device().is_cpu() && states.scalar_type() == at::kFloat && states.is_contiguous(),
              "the scan states are contiguous float32 on the CPU");
}

template <typename T>
void conv_rows(const T* x, int64_t channels, int64_t width, const T* weight, const T* bias, T* states, Steps steps,
               T* out) {
  // Per sequence and block of channels: the last K - 1 inputs of each channel kept as rows `[K - 1][block]`, every
  // product vectorised across the block's channels (contiguous in x and out).
  const int64_t held = width - 1;
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  at::parallel_for(0, steps.count * blocks, 1, [&](int64_t first, int64_t end) {
    std::vector<float> history(static_cast<size_t>((held + 1) * kBlock));
    std::vector<float> w(static_cast<size_t>(width * kBlock));
    float shift[kBlock];
    float acc[kBlock];
    for (int64_t task = first; task < end; ++task) {
      const int64_t b = task / blocks, c0 = (task % blocks) * kBlock, n = std::min(channels, c0 + kBlock) - c0;
      const int64_t t0 = steps.starts[b], t1 = steps.starts[b + 1];
      T* state = states + steps.slots[b] * channels * held;
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t k = 0; k < width; ++k) {
          w[k * kBlock + c] = ferry::to_float(weight[(c0 + c) * width + k]);
        }
        for (int64_t k = 0; k < held; ++k) {
          history[k * kBlock + c] = steps.fresh[b] ? 0.0f : ferry::to_float(state[(c0 + c) * held + k]);
        }
        shift[c] = bias != nullptr ? ferry::to_float(bias[c0 + c]) : 0.0f;
      }
      // history row `held` is the newest input: the rows shift down by one per token.
      for (int64_t t = t0; t < t1; ++t) {
        const T* row = x + t * channels + c0;
        float* newest = history.data() + held * kBlock;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) {
          newest[c] = ferry::to_float(row[c]);
          acc[c] = shift[c];
        }
        for (int64_t k = 0; k <= held; ++k) {
          const float* h = history.data() + k * kBlock;
          const float* wk = w.data() + k * kBlock;
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) {
            acc[c] += h[c] * wk[c];
          }
        }
        T* dst = out + t * channels + c0;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) {
          dst[c] = ferry::from_float<T>(acc[c] / (1.0f + ferry::fast_exp(-acc[c])));
        }
        std::copy(history.begin() + kBlock, history.end(), history.begin());
      }
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t k = 0; k < held; ++k) {
          state[(c0 + c) * held + k] = ferry::from_float<T>(history[k * kBlock + c]);
        }
      }
    }
  });
}

}  // namespace

namespace ferry {

// x [T, C]; states [S, C, K - 1]; weight [C, K]; bias [C] or none -> [T, C], in x's dtype.
at::Tensor causal_conv(const at::Tensor& x, at::Tensor& states, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& slots, const at::Tensor& fresh,
                       const at::Tensor& query_start) {
  const Steps steps = steps_of(query_start, slots, fresh);
  TORCH_CHECK(x.dim() == 2 && states.is_contiguous() && states.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "ferry_kernels.causal_conv: x, states and weight in one dtype, states contiguous");
  const int64_t channels = x.size(1), width = weight.size(1);
  TORCH_CHECK(states.size(1) == channels && states.size(2) == width - 1, "states hold K - 1 inputs per channel");
  const at::Tensor rows = x.contiguous(), w = weight.contiguous();
  const at::Tensor shift = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(rows);
  if (x.scalar_type() == at::kFloat) {
    conv_rows(rows.data_ptr<float>(), channels, width, w.data_ptr<float>(),
              shift.defined() ? shift.data_ptr<float>() : nullptr, states.data_ptr<float>(), steps,
              out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    conv_rows(rows.data_ptr<at::BFloat16>(), channels, width, w.data_ptr<at::BFloat16>(),
              shift.defined() ? shift.data_ptr<at::BFloat16>() : nullptr, states.data_ptr<at::BFloat16>(), steps,
              out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "ferry_kernels.causal_conv takes float32 or bfloat16, not ", x.scalar_type());
  }
  return out;
}

// states [S, H, P, N]; x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N] -> y [T, H, P], all float32.
at::Tensor ssd_scan(at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh,
                    const at::Tensor& query_start, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                    const at::Tensor& B, const at::Tensor& C) {
  check_states(states);
  const Steps steps = steps_of(query_start, slots, fresh);
  const int64_t heads = x.size(1), width = x.size(2), size = states.size(3), groups = B.size(1);
  TORCH_CHECK(states.size(1) == heads && states.size(2) == width && heads % groups == 0, "shapes disagree");
  const int64_t per_group = heads / groups;
  const at::Tensor xs = x.contiguous(), dts = dt.contiguous(), As = A.contiguous(), Bs = B.contiguous();
  const at::Tensor Cs = C.contiguous();
  TORCH_CHECK(xs.scalar_type() == at::kFloat && Bs.scalar_type() == at::kFloat && Cs.scalar_type() == at::kFloat &&
                  dts.scalar_type() == at::kFloat && As.scalar_type() == at::kFloat,
              "ferry_kernels.ssd_scan takes float32 inputs");
  at::Tensor y = at::empty_like(xs);
  float* state = states.data_ptr<float>();
  const float *xp = xs.data_ptr<float>(), *dtp = dts.data_ptr<float>(), *Ap = As.data_ptr<float>();
  const float *Bp = Bs.data_ptr<float>(), *Cp = Cs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, steps.count * heads, 1, [&](int64_t first, int64_t end) {
    for (int64_t task = first; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads, g = h / per_group;
      float* rows = state + ((steps.slots[b] * heads + h) * width) * size;
      if (steps.fresh[b]) {
        std::fill(rows, rows + width * size, 0.0f);
      }
      for (int64_t t = steps.starts[b]; t < steps.starts[b + 1]; ++t) {
        const float step = dtp[t * heads + h];
        const float decay = std::exp(step * Ap[h]);
        const float* bn = Bp + (t * groups + g) * size;
        const float* cn = Cp + (t * groups + g) * size;
        const float* xt = xp + (t * heads + h) * width;
        float* yt = yp + (t * heads + h) * width;
        for (int64_t p = 0; p < width; ++p) {
          float* s = rows + p * size;
          const float input = step * xt[p];
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t n = 0; n < size; ++n) {
            const float v = s[n] * decay + input * bn[n];
            s[n] = v;
            acc += v * cn[n];
          }
          yt[p] = acc;
        }
      }
    }
  });
  return y;
}

// states [S, N, D] (state element-major: every product runs across channels, contiguous); u, dt [T, D];
// A [N, D] (transposed likewise); B, C [T, N] -> y [T, D], all float32.
at::Tensor selective_scan(at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh,
                          const at::Tensor& query_start, const at::Tensor& u, const at::Tensor& dt,
                          const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  check_states(states);
  const Steps steps = steps_of(query_start, slots, fresh);
  const int64_t channels = u.size(1), size = states.size(1);
  TORCH_CHECK(states.size(2) == channels && A.size(0) == size && A.size(1) == channels, "shapes disagree");
  const at::Tensor us = u.contiguous(), dts = dt.contiguous(), As = A.contiguous(), Bs = B.contiguous();
  const at::Tensor Cs = C.contiguous();
  TORCH_CHECK(us.scalar_type() == at::kFloat && Bs.scalar_type() == at::kFloat && Cs.scalar_type() == at::kFloat &&
                  dts.scalar_type() == at::kFloat && As.scalar_type() == at::kFloat,
              "ferry_kernels.selective_scan takes float32 inputs");
  at::Tensor y = at::empty_like(us);
  float* state = states.data_ptr<float>();
  const float *up = us.data_ptr<float>(), *dtp = dts.data_ptr<float>(), *Ap = As.data_ptr<float>();
  const float *Bp = Bs.data_ptr<float>(), *Cp = Cs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  at::parallel_for(0, steps.count * blocks, 1, [&](int64_t first, int64_t end) {
    float input[kBlock];
    float step[kBlock];
    float acc[kBlock];
    for (int64_t task = first; task < end; ++task) {
      const int64_t b = task / blocks, d0 = (task % blocks) * kBlock, width = std::min(channels, d0 + kBlock) - d0;
      float* rows = state + steps.slots[b] * size * channels + d0;  // row n at rows + n * channels
      if (steps.fresh[b]) {
        for (int64_t n = 0; n < size; ++n) {
          std::fill(rows + n * channels, rows + n * channels + width, 0.0f);
        }
      }
      for (int64_t t = steps.starts[b]; t < steps.starts[b + 1]; ++t) {
        const float* dtt = dtp + t * channels + d0;
        const float* ut = up + t * channels + d0;
#pragma omp simd
        for (int64_t d = 0; d < width; ++d) {
          step[d] = dtt[d];
          input[d] = dtt[d] * ut[d];
          acc[d] = 0.0f;
        }
        for (int64_t n = 0; n < size; ++n) {
          float* s = rows + n * channels;
          const float* a = Ap + n * channels + d0;
          const float bn = Bp[t * size + n], cn = Cp[t * size + n];
#pragma omp simd
          for (int64_t d = 0; d < width; ++d) {
            const float v = s[d] * ferry::fast_exp(step[d] * a[d]) + input[d] * bn;
            s[d] = v;
            acc[d] += v * cn;
          }
        }
        float* yt = yp + t * channels + d0;
#pragma omp simd
        for (int64_t d = 0; d < width; ++d) {
          yt[d] = acc[d];
        }
      }
    }
  });
  return y;
}

}  // namespace ferry

using namespace ferry;

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def("causal_conv(Tensor x, Tensor(a!) states, Tensor weight, Tensor? bias, Tensor slots, Tensor fresh, "
        "Tensor query_start) -> Tensor");
  m.def("ssd_scan(Tensor(a!) states, Tensor slots, Tensor fresh, Tensor query_start, Tensor x, Tensor dt, Tensor A, "
        "Tensor B, Tensor C) -> Tensor");
  m.def("selective_scan(Tensor(a!) states, Tensor slots, Tensor fresh, Tensor query_start, Tensor u, Tensor dt, "
        "Tensor A, Tensor B, Tensor C) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) {
  m.impl("causal_conv", &causal_conv);
  m.impl("ssd_scan", &ssd_scan);
  m.impl("selective_scan", &selective_scan);
}
