// A mixture of experts' feed-forward on the CPU (engine/layers/moe.py): the step's (token, expert) pairs, grouped by
// expert, through each routed expert's gate/up matrix, SiLU-and-multiply and down matrix, in the layout the model's
// dense linears use (`project`: the blocked kernel's or oneDNN's packed one).
//
// The loop over experts is here rather than in Python because a decode step routes a few rows to each of many
// experts (16 tokens of Qwen3-30B-A3B touch ~80 of its 128 experts a layer): at ~0.3 ms of weights an expert, six
// Python-level ops an expert cost about a sixth of the layer.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <vector>

namespace ferry {

namespace {

// gpt-oss's activation of [rows, 2 * width] gate/up outputs, gates in the even columns (transformers' GptOssExperts):
// the gate clamped above at `limit`, the up to +-`limit`, (up + 1) * gate * sigmoid(alpha * gate).
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  const at::Tensor gate = gate_up.slice(1, 0, std::nullopt, 2).clamp_max(limit);
  const at::Tensor up = gate_up.slice(1, 1, std::nullopt, 2).clamp(-limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

}  // namespace

// pairs [P, hidden]: the rows, grouped by expert; counts [experts] (int64): each expert's rows, in order;
// w13[e] [2 * width, hidden] and w2[e] [hidden, width] in a CPU layout, with biases b13[e], b2[e] where given (none,
// or one an expert). The activation is SiLU(gate) * up with gates in the first `width` columns (up to
// `silu_max_rows` rows an expert the pointwise kernel's, the dense MLP's rule; more take torch's vectorised SiLU),
// or, with `swiglu_limit` > 0, gpt-oss's clamped SwiGLU over interleaved columns.
at::Tensor experts(const at::Tensor& pairs, const at::Tensor& counts, at::TensorList w13, at::TensorList w2,
                   int64_t width, int64_t silu_max_rows, at::TensorList b13, at::TensorList b2, double swiglu_alpha,
                   double swiglu_limit) {
  TORCH_CHECK(pairs.dim() == 2, "experts: pairs must be [P, hidden]");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.device().is_cpu(),
              "experts: counts must be a CPU int64 vector");
  TORCH_CHECK(counts.size(0) == static_cast<int64_t>(w13.size()) && w13.size() == w2.size(),
              "experts: one count, one gate/up and one down matrix an expert");
  TORCH_CHECK((b13.empty() || b13.size() == w13.size()) && (b2.empty() || b2.size() == w2.size()),
              "experts: no biases, or one an expert");
  const at::Tensor count = counts.contiguous();
  const int64_t* rows_of = count.data_ptr<int64_t>();
  const int64_t num_experts = count.size(0);
  std::vector<int64_t> first(num_experts + 1, 0);
  std::vector<int64_t> routed;  // the experts with rows: what the threads share out
  for (int64_t e = 0; e < num_experts; ++e) {
    TORCH_CHECK(rows_of[e] >= 0, "experts: a negative count");
    first[e + 1] = first[e] + rows_of[e];
    if (rows_of[e] > 0) routed.push_back(e);
  }
  TORCH_CHECK(first[num_experts] == pairs.size(0), "experts: counts do not add up to the pairs");
  const int64_t hidden = pairs.size(1);
  at::Tensor out = at::empty_like(pairs);
  // The experts spread over the threads, each expert's products on one: its weights stream through one core, and
  // no thread waits for another until the end (a few rows an expert leave one matrix too little work to split).
  const at::ThreadLocalState caller;  // inference mode and the rest, which the pool's threads do not inherit
  at::parallel_for(0, static_cast<int64_t>(routed.size()), 1, [&](int64_t i0, int64_t i1) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = routed[i], rows = rows_of[e];
      const auto bias = [&](at::TensorList biases) {
        return biases.empty() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(biases[e]);
      };
      const at::Tensor gate_up = project(pairs.narrow(0, first[e], rows), w13[e], 2 * width, bias(b13));
      const at::Tensor act = swiglu_limit > 0        ? clamped_swiglu(gate_up, swiglu_alpha, swiglu_limit)
                             : rows <= silu_max_rows ? silu_mul(gate_up)
                                                     : at::silu(gate_up.narrow(1, 0, width)) *
                                                           gate_up.narrow(1, width, width);
      out.narrow(0, first[e], rows).copy_(project(act, w2[e], hidden, bias(b2)));
    }
  });
  return out;
}

}  // namespace ferry

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def(
      "experts(Tensor pairs, Tensor counts, Tensor[] w13, Tensor[] w2, int width, int silu_max_rows, "
      "Tensor[] b13, Tensor[] b2, float swiglu_alpha, float swiglu_limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) { m.impl("experts", &ferry::experts); }

// oneDNN-packed weights among the arguments make the call's dispatch key MkldnnCPU.
TORCH_LIBRARY_IMPL(ferry_kernels, MkldnnCPU, m) { m.impl("experts", &ferry::experts); }
