// The CPU kernels' entry points, for kernels that call others in the same library (cpu_decoder.cpp): each is also
// a `torch.ops.ferry_kernels` op, and calling it here computes exactly what that op computes.

#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace ferry {

// cpu_linear.cpp: x @ W.T + b from the blocked weight `packed` [ceil(out / 16), in, 16].
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias);

// cpu_decoder.cpp: x @ W.T + b for a weight in either CPU layout: the blocked one above, or oneDNN's packed one
// (PackedLinearMethod), through the op that method calls.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                   const std::optional<at::Tensor>& bias);

// cpu_quant_linear.cpp: x @ W.T + b for a quantized weight in each scheme's layout (engine/kernels/quant_linear.py).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& code_sums, int64_t out_features, const std::optional<at::Tensor>& bias);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t out_features, const std::optional<at::Tensor>& bias);
at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t out_features, const std::optional<at::Tensor>& bias);
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& code_sums, int64_t out_features, const std::optional<at::Tensor>& bias);

// cpu_experts.cpp: a mixture of experts' routed rows, grouped by expert, through each expert's matrices.
at::Tensor experts(const at::Tensor& pairs, const at::Tensor& counts, at::TensorList w13, at::TensorList w2,
                   int64_t width, int64_t silu_max_rows, at::TensorList b13, at::TensorList b2, double swiglu_alpha,
                   double swiglu_limit);

// cpu_norm.cpp: the Llama family's RMSNorm over the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// cpu_pointwise.cpp: x [tokens, heads, head_dim] rotated by cos/sin [tokens, 1, head_dim]; silu(gate) * up.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);

// cpu_lora.cpp: out[:, offset:] += each token's adapter's low-rank product of x (engine/lora/slots.py).
void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& bt,
              const at::Tensor& slots, const at::Tensor& scalings, int64_t offset, int64_t rank);

}  // namespace ferry
