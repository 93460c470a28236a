// The Llama family's decoder stack on the CPU in one call: every layer's norms, projections, rotary embedding,
// K/V write, paged attention, residual adds and MLP, then the final norm.
//
// Why: at one token a step's arithmetic is a few hundred microseconds, and running the same ops one by one from
// Python (module calls, views, the dispatcher) cost as much again. This is engine/models/llama.py's eager forward
// pass op for op, calling the very kernels its modules call (kernels.h) with the same arguments, in the same order,
// in the same dtypes: the result is bit for bit the eager path's. Only the Python between the ops is gone.
//
// A linear's weight is in a CPU float layout (`project`: the blocked kernel's or oneDNN's) or quantized in one of
// cpu_quant_linear.cpp's schemes (`Scheme`: engine/layers/linear_method.py's `DecoderScheme`), three tensors a
// linear whatever its scheme (the weight or its codes, then scales and mins or code sums, None where a scheme has
// fewer). Each layer's tensors come in one flat list, kPerLayer per layer (absent ones None), in the order of
// `Slot`, and each layer's linears' schemes in `schemes`, kLinearsPerLayer per layer; attention is the
// `ferry_attention::paged_attention` op (engine/attention/cpu_paged.cpp, loaded beside this library by the CPU
// backend), called through the dispatcher with the layer's step metadata (its KV-cache group's).
//
// A step with LoRA adapters (engine/lora/) adds each adapted part's low-rank products to its projection's output
// with `lora_add`, as the eager layers do: the slots' tensors come kLoraPerLayer per layer (A and B, each transposed,
// per part in the order of `LoRAPart`), with each token's slot and the slots' scalings.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels.h"

#include <cstring>
#include <optional>
#include <vector>

namespace {

// A linear's slot is followed by its scales' and its third tensor's (`Linear`).
enum Slot : int64_t {
  kInputNorm,
  kQkv,
  kQkvBias = kQkv + 3,
  kQNorm,  // Qwen3's per-head norms of q and k, before rotary
  kKNorm,
  kOut,
  kOutBias = kOut + 3,
  kPostNorm,
  kGateUp,
  kGateUpBias = kGateUp + 3,
  kDown,
  kDownBias = kDown + 3,
  kPerLayer,
};

// The order of each layer's schemes.
enum LinearPart : int64_t { kQkvLinear, kOutLinear, kGateUpLinear, kDownLinear, kLinearsPerLayer };

// How a linear's weight is kept: DecoderScheme in engine/layers/linear_method.py, value for value.
enum Scheme : int64_t { kDense, kInt8, kInt4, kInt8Groups, kW8A8 };

enum LoRAPart : int64_t { kLoraQ, kLoraK, kLoraV, kLoraOut, kLoraGate, kLoraUp, kLoraDown, kLoraParts };
constexpr int64_t kLoraPerLayer = 2 * kLoraParts;

using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, double, int64_t, double,
                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                               const std::optional<at::Tensor>&, double, double);

const c10::TypedOperatorHandle<AttentionFn>& attention_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("ferry_attention::paged_attention", "").typed<AttentionFn>();
  return op;
}

// A linear's three tensors and its scheme: `multiply` calls the kernel its method's `apply` calls.
struct Linear {
  int64_t scheme;
  at::Tensor weight;  // kDense: either float layout; otherwise the codes
  std::optional<at::Tensor> scales, third;  // the scheme's scales, then its mins or code sums

  at::Tensor multiply(const at::Tensor& x, int64_t out_features, const std::optional<at::Tensor>& bias) const {
    switch (scheme) {
      case kDense:
        return ferry::project(x, weight, out_features, bias);
      case kInt8:
        return ferry::int8_linear(x, weight, *scales, *third, out_features, bias);
      case kInt4:
        return ferry::int4_linear(x, weight, *scales, *third, out_features, bias);
      case kInt8Groups:
        return ferry::int8_group_linear(x, weight, *scales, *third, out_features, bias);
      case kW8A8:
        return ferry::w8a8_linear(x, weight, *scales, *third, out_features, bias);
      default:
        TORCH_CHECK(false, "no linear scheme ", scheme);
    }
  }
};

// cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, rows), the eager path's write, as one row copy a token:
// index_copy_ indexes element by element (4-7 us for one to 32 tokens on the demo model, 0.3 ms for 2,048).
// `rows` is [tokens, kv_heads, head_dim] with each token's heads contiguous (k, or v's view into qkv).
void write_slots(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
  const int64_t slot_numel = cache.size(2) * cache.size(3);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  TORCH_CHECK(cache.is_contiguous() && rows.scalar_type() == cache.scalar_type() && rows.dim() == 3 &&
                  rows.size(1) * rows.size(2) == slot_numel && rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "write_slots: rows of a slot's shape and dtype, each token's heads contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows.size(0),
              "write_slots: one int64 slot a token");
  const at::Tensor slot_ids = slots.contiguous();
  const int64_t* slot = slot_ids.const_data_ptr<int64_t>();
  const int64_t bytes = slot_numel * cache.element_size();
  const auto* src = static_cast<const char*>(rows.const_data_ptr());
  auto* dst = static_cast<char*>(cache.mutable_data_ptr());
  for (int64_t t = 0; t < rows.size(0); ++t) {
    TORCH_CHECK(0 <= slot[t] && slot[t] < num_slots, "write_slots: slot ", slot[t], " outside the cache's ",
                num_slots);
    std::memcpy(dst + slot[t] * bytes, src + t * rows.stride(0) * cache.element_size(), bytes);
  }
}

}  // namespace

namespace ferry {

using PackedLinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                  c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                  std::optional<c10::string_view>);

// x @ W.T + b for a weight in either layout the CPU linear methods keep (engine/layers/linear_method.py): Ferry's
// blocked one (BlockedLinearMethod), or oneDNN's packed one (PackedLinearMethod: bfloat16 where the CPU multiplies
// it), through the op that method calls, with its arguments.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                   const std::optional<at::Tensor>& bias) {
  if (!weight.is_mkldnn()) {
    return ferry::linear(x, weight, out_features, bias);
  }
  static const auto packed_linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<PackedLinearFn>();
  return packed_linear.call(x, weight, bias, "none", c10::List<std::optional<c10::Scalar>>(), "");
}

// hidden [T, hidden]: the embedded tokens; cos, sin [T, 1, head_dim]; schemes: each linear's `Scheme`, in the order
// of `LinearPart`; sizes: heads, kv_heads, head_dim, the MLP's width, fused_silu_max_tokens (up to this many tokens
// SiLU-and-multiply is the kernel, as MLP.forward decides); per layer its KV caches, sliding window (0: none), slot
// mapping and page table.
at::Tensor llama_decoder(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::List<std::optional<at::Tensor>>& weights, const at::Tensor& final_norm,
                         at::IntArrayRef schemes, at::IntArrayRef sizes, double eps, double scale,
                         at::TensorList key_caches, at::TensorList value_caches, at::IntArrayRef windows,
                         at::TensorList slot_mappings, at::TensorList page_tables, const at::Tensor& query_start_loc,
                         const at::Tensor& seq_lens,
                         const c10::List<std::optional<at::Tensor>>& lora_weights,
                         const std::optional<at::Tensor>& lora_slots, const std::optional<at::Tensor>& lora_scalings,
                         int64_t lora_rank) {
  TORCH_CHECK(sizes.size() == 5, "sizes: heads, kv_heads, head_dim, width, fused_silu_max_tokens");
  const int64_t heads = sizes[0], kv_heads = sizes[1], head_dim = sizes[2], width = sizes[3];
  const int64_t silu_max_tokens = sizes[4];
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer, "weights: ", kPerLayer, " per layer");
  TORCH_CHECK(static_cast<int64_t>(schemes.size()) == layers * kLinearsPerLayer, "schemes: ", kLinearsPerLayer,
              " per layer");
  for (const size_t size : {value_caches.size(), windows.size(), slot_mappings.size(), page_tables.size()}) {
    TORCH_CHECK(static_cast<int64_t>(size) == layers, "one KV cache pair, window, slot mapping, page table a layer");
  }
  const int64_t tokens = hidden_in.size(0);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const auto& attention = attention_op();
  const bool adapters = lora_slots.has_value();
  TORCH_CHECK(!adapters || (lora_scalings.has_value() &&
                            static_cast<int64_t>(lora_weights.size()) == layers * kLoraPerLayer),
              "lora_weights: ", kLoraPerLayer, " per layer, with lora_slots and lora_scalings");

  at::Tensor hidden = hidden_in;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const auto w = [&](Slot slot) -> std::optional<at::Tensor> { return weights.get(layer * kPerLayer + slot); };
    const auto linear = [&](Slot slot, LinearPart part) -> Linear {
      return {schemes[layer * kLinearsPerLayer + part], *w(slot), w(static_cast<Slot>(slot + 1)),
              w(static_cast<Slot>(slot + 2))};
    };
    // out[:, offset:] += the adapters' products of x for `part` (LoRALayer.add in engine/lora/slots.py).
    const auto add_adapters = [&](at::Tensor& out, const at::Tensor& x, LoRAPart part, int64_t offset) {
      if (!adapters) return;
      const int64_t first = layer * kLoraPerLayer + 2 * part;
      lora_add(out, x, *lora_weights.get(first), *lora_weights.get(first + 1), *lora_slots, *lora_scalings, offset,
               lora_rank);
    };

    // Attention: Attention.forward in engine/models/llama.py.
    const at::Tensor normed = rms_norm(hidden, *w(kInputNorm), eps);
    at::Tensor qkv = linear(kQkv, kQkvLinear).multiply(normed, q_size + 2 * kv_size, w(kQkvBias));
    add_adapters(qkv, normed, kLoraQ, 0);
    add_adapters(qkv, normed, kLoraK, q_size);
    add_adapters(qkv, normed, kLoraV, q_size + kv_size);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
    if (w(kQNorm).has_value()) {
      q = rms_norm(q, *w(kQNorm), eps);
      k = rms_norm(k, *w(kKNorm), eps);
    }
    q = rotary(q, cos, sin);
    k = rotary(k, cos, sin);
    // write_kv in engine/attention/base.py: the cache has the model's dtype here, so the K/V go in as they are.
    const at::Tensor& key_cache = key_caches[layer];
    const at::Tensor& value_cache = value_caches[layer];
    const at::Tensor& slots = slot_mappings[layer];
    write_slots(key_cache, slots, k);
    write_slots(value_cache, slots, v);
    const at::Tensor attended =
        attention.call(q, key_cache, value_cache, query_start_loc, seq_lens, page_tables[layer], scale, windows[layer],
                       0.0, std::nullopt, std::nullopt, std::nullopt, 1.0, 1.0);
    const at::Tensor attended_rows = attended.reshape({tokens, q_size});
    at::Tensor out = linear(kOut, kOutLinear).multiply(attended_rows, hidden.size(1), w(kOutBias));
    add_adapters(out, attended_rows, kLoraOut, 0);
    hidden = at::add(hidden, out);

    // MLP: MLP.forward.
    const at::Tensor post_normed = rms_norm(hidden, *w(kPostNorm), eps);
    at::Tensor gate_up = linear(kGateUp, kGateUpLinear).multiply(post_normed, 2 * width, w(kGateUpBias));
    add_adapters(gate_up, post_normed, kLoraGate, 0);
    add_adapters(gate_up, post_normed, kLoraUp, width);
    const at::Tensor activated = tokens <= silu_max_tokens
                                     ? silu_mul(gate_up)
                                     : at::mul(at::silu(gate_up.narrow(1, 0, width)), gate_up.narrow(1, width, width));
    at::Tensor down = linear(kDown, kDownLinear).multiply(activated, hidden.size(1), w(kDownBias));
    add_adapters(down, activated, kLoraDown, 0);
    hidden = at::add(hidden, down);
  }
  return rms_norm(hidden, final_norm, eps);
}

}  // namespace ferry

using namespace ferry;

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def(
      "llama_decoder(Tensor hidden, Tensor cos, Tensor sin, Tensor?[] weights, Tensor final_norm, int[] schemes, "
      "int[] sizes, "
      "float eps, float scale, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, int[] windows, "
      "Tensor[] slot_mappings, Tensor[] page_tables, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor?[] lora_weights, Tensor? lora_slots, Tensor? lora_scalings, int lora_rank) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) {
  m.impl("llama_decoder", &llama_decoder);
}

// oneDNN-packed weights among the arguments make the call's dispatch key MkldnnCPU.
TORCH_LIBRARY_IMPL(ferry_kernels, MkldnnCPU, m) {
  m.impl("llama_decoder", &llama_decoder);
}
