// Linear layers on the CPU from Ferry's blocked weight layout: y = x @ W.T + b.
//
// Layout (engine/kernels/linear.py packs it): W [out, in] becomes [ceil(out / 16), in, 16], the 16 output rows of a
// block interleaved along k, zero rows padding the last block. One k of a block is 16 contiguous weights, a
// vector of the 16 outputs' terms, so the kernel broadcasts an input element and accumulates 16 outputs per
// multiply-add: no horizontal sums, and each block is one sequential stream of memory.
//
// Decode (a few rows) is a matrix-vector product whose cost is reading the weights once: blocks stream in order,
// each multiplied by every row while it is in cache. More rows go in chunks of kChunkRows that stay in L2 while
// the weights stream past them, kTileRows rows a tile, whose accumulators fill the vector registers (6 x 16
// floats take 12 of AVX2's 16 registers; 8 x 16 take 8 of AVX-512's 32).
//
// bfloat16 weights are widened to float32 in registers (a 16-bit shift), inputs are widened once, sums are taken in
// float32 and rounded once at the end, as torch's own bfloat16 matmul does: a bfloat16 layer reads half the bytes
// of a float32 one on every CPU, whether or not it has bfloat16 arithmetic. Where the CPU has AVX512-BF16 a
// bfloat16 weight of even width is packed in pairs along k, [ceil(out / 16), in / 2, 16, 2], and multiplied by
// `vdpbf16ps`, both products of a pair in one instruction with no widening (`pair_tile`): the widening path's
// instructions, not memory, bounded one core there (25 GB/s of bfloat16 weights out of DRAM, against 37 GB/s for
// a plain float32 sum on the same core). The instruction set comes from the
// build flags (engine/kernels/build.py): AVX-512, AVX2 with FMA, or plain C++ elsewhere. The tiles and the loop over
// blocks are blocked.h's, shared with the quantized layouts' kernels (cpu_quant_linear.cpp).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "blocked.h"
#include "kernels.h"

#include <optional>
#include <vector>

namespace {

using namespace ferry::blocked;

// Rows x [m, k] times every block (`block_size` weights apart) of `packed`: `tile(rows, blocks, x, ldx, w, k, bias,
// valid, out, ldo, block_size)` computes one tile of `rows` rows times `blocks` consecutive blocks from w (both
// std::integral_constant), `valid` of the last block's outputs real. A chunk of one tile's rows or fewer (decode)
// takes its blocks `streams<rows>()` at a time; more rows take them one at a time, every tile of the chunk's rows
// by a block while it is in cache (two blocks a tile measured no faster there: the products bound it, not memory).
template <typename X, typename W, typename Tile>
void blocked_linear(const X* x, int64_t m_size, int64_t k_size, const W* packed, int64_t block_size,
                    int64_t num_blocks, int64_t out_features, const float* bias, float* out, Tile tile) {
  const auto blocks_at = [&](auto rows, auto blocks, int64_t b, int64_t m) {
    const int64_t n0 = b * kBlock;
    const int64_t valid = std::min(kBlock, out_features - n0 - (decltype(blocks)::value - 1) * kBlock);
    tile(rows, blocks, x + m * k_size, k_size, packed + b * block_size, k_size, bias == nullptr ? nullptr : bias + n0,
         valid, out + m * out_features + n0, out_features, block_size);
  };
  for_block_runs(m_size, k_size, num_blocks, [&](int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
    if (m1 - m0 <= kTileRows) {
      with_rows(m1 - m0, [&](auto rows) {
        constexpr int kStreams = streams<decltype(rows)::value>();
        int64_t b = b0;
        for (; b + kStreams <= b1; b += kStreams) blocks_at(rows, std::integral_constant<int, kStreams>{}, b, m0);
        for (; b < b1; ++b) blocks_at(rows, std::integral_constant<int, 1>{}, b, m0);
      });
      return;
    }
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t m = m0; m < m1; m += kTileRows) {
        with_rows(std::min<int64_t>(kTileRows, m1 - m),
                  [&](auto rows) { blocks_at(rows, std::integral_constant<int, 1>{}, b, m); });
      }
    }
  }, kChunkRows * static_cast<int64_t>(sizeof(float) / sizeof(X)));  // as many bytes of bfloat16 rows as of float32
}

// The widening tile (float32 rows; float32 or bfloat16 weights) and the paired one, as `blocked_linear` calls them.
template <typename W>
inline void widening_tile(auto rows, auto blocks, const float* x, int64_t ldx, const W* w, int64_t k_size,
                          const float* bias, int64_t valid, float* out, int64_t ldo, int64_t block_stride) {
  tile<decltype(rows)::value, W, 4, decltype(blocks)::value>(x, ldx, w, k_size, nullptr, bias, valid, out, ldo,
                                                             block_stride);
}

#if defined(__AVX512BF16__)
inline void paired_tile(auto rows, auto blocks, const at::BFloat16* x, int64_t ldx, const at::BFloat16* w,
                        int64_t k_size, const float* bias, int64_t valid, float* out, int64_t ldo,
                        int64_t block_stride) {
  pair_tile<decltype(rows)::value, decltype(blocks)::value>(x, ldx, w, k_size, nullptr, bias, valid, out, ldo,
                                                            block_stride);
}
#endif

}  // namespace

namespace ferry {

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  // [blocks, in, 16], or bfloat16 in pairs along k: [blocks, in / 2, 16, 2].
  const bool paired = packed.dim() == 4;
  TORCH_CHECK(((packed.dim() == 3 && packed.size(2) == kBlock) ||
               (paired && packed.size(2) == kBlock && packed.size(3) == 2)) &&
                  packed.is_contiguous(),
              "ferry_kernels.linear takes a packed [blocks, in, 16] or [blocks, in / 2, 16, 2] weight");
  TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16,
              "ferry_kernels.linear takes float32 or bfloat16 weights, not ", packed.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "ferry_kernels.linear runs on the CPU");
  const int64_t k_size = x.size(-1);
  const int64_t num_blocks = packed.size(0);
  TORCH_CHECK(paired ? 2 * packed.size(1) == k_size : packed.size(1) == k_size, "input has ", k_size,
              " features, the weight ", paired ? 2 * packed.size(1) : packed.size(1));
  TORCH_CHECK(0 < out_features && out_features <= num_blocks * kBlock && out_features > (num_blocks - 1) * kBlock,
              "out_features ", out_features, " does not fit ", num_blocks, " blocks");
  std::optional<at::Tensor> wide_bias;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out_features, "bias has ", bias->numel(), " elements for ", out_features, " outputs");
    wide_bias = bias->to(at::kFloat).contiguous();
  }
  const float* bias_data = wide_bias.has_value() ? wide_bias->data_ptr<float>() : nullptr;
  // The paired layout multiplies bfloat16 rows; the others widen the rows to float32 once.
  const at::Tensor rows = x.reshape({-1, k_size}).to(paired ? at::kBFloat16 : at::kFloat).contiguous();
  const int64_t m_size = rows.size(0);
  at::Tensor out = at::empty({m_size, out_features}, rows.options().dtype(at::kFloat));
  if (m_size > 0) {
    if (paired) {
#if defined(__AVX512BF16__)
      TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "the paired layout holds bfloat16 weights");
      blocked_linear(rows.data_ptr<at::BFloat16>(), m_size, k_size, packed.data_ptr<at::BFloat16>(),
                     packed.size(1) * 2 * kBlock, num_blocks, out_features, bias_data, out.data_ptr<float>(),
                     [](auto... args) { paired_tile(args...); });
#else
      TORCH_CHECK(false, "the paired bfloat16 layout needs the kernels built for AVX512-BF16");
#endif
    } else if (packed.scalar_type() == at::kFloat) {
      blocked_linear(rows.data_ptr<float>(), m_size, k_size, packed.data_ptr<float>(), k_size * kBlock, num_blocks,
                     out_features, bias_data, out.data_ptr<float>(), [](auto... args) { widening_tile<float>(args...); });
    } else {
      blocked_linear(rows.data_ptr<float>(), m_size, k_size, packed.data_ptr<at::BFloat16>(), k_size * kBlock,
                     num_blocks, out_features, bias_data, out.data_ptr<float>(),
                     [](auto... args) { widening_tile<at::BFloat16>(args...); });
    }
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.to(x.scalar_type()).view(shape);
}

// Rows `ids` of the matrix `packed` was made from (engine/kernels/linear.py's `embed_rows`), in its dtype: a tied
// embedding reads its rows out of the LM head's layout. One call, where torch's indexing of the layout (a divide, a
// remainder and an advanced index) took ~40 us for a decode step's single row.
at::Tensor embed_rows(const at::Tensor& packed, const at::Tensor& ids) {
  const bool paired = packed.dim() == 4;
  TORCH_CHECK((packed.dim() == 3 || (paired && packed.size(3) == 2)) && packed.size(2) == kBlock &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "ferry_kernels.embed_rows takes a packed [blocks, in, 16] or [blocks, in / 2, 16, 2] CPU weight");
  TORCH_CHECK(!at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
              "ferry_kernels.embed_rows takes integer ids, not ", ids.scalar_type());
  const int64_t group = paired ? 2 : 1, in_features = packed.size(1) * group, rows = packed.size(0) * kBlock;
  const at::Tensor flat = ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t count = flat.numel();
  const int64_t* id_data = flat.data_ptr<int64_t>();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(in_features);
  at::Tensor out = at::empty({count, in_features}, packed.options());
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(0 <= id_data[i] && id_data[i] < rows, "id ", id_data[i], " is out of range for ", rows, " rows");
  }
  // A row's k-th group of `group` weights (one word: 4 bytes of float32 or of a bfloat16 pair, 2 of one bfloat16)
  // lies at [id / 16][k][id % 16], 16 words after the one before.
  const auto gather = [&](auto word) {
    using Word = decltype(word);
    const int64_t words = packed.size(1);  // a row's: in, or in / 2 of the paired layout
    const auto* source = static_cast<const Word*>(packed.data_ptr());
    auto* target = static_cast<Word*>(out.data_ptr());
    at::parallel_for(0, count, std::max<int64_t>(1, 4096 / words), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t id = id_data[i];
        const Word* block = source + (id / kBlock) * words * kBlock + id % kBlock;
        Word* row = target + i * words;
        for (int64_t k = 0; k < words; ++k) row[k] = block[k * kBlock];
      }
    });
  };
  if (packed.element_size() * group == 4) {
    gather(uint32_t{});
  } else {
    TORCH_CHECK(packed.element_size() * group == 2, "ferry_kernels.embed_rows: ", packed.scalar_type(), " weights");
    gather(uint16_t{});
  }
  return out.view(shape);
}

}  // namespace ferry

using namespace ferry;

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("embed_rows(Tensor packed, Tensor ids) -> Tensor");
  // Whether a linear on one thread takes the helper thread (blocked.h, helping.h).
  m.def("set_linear_helper(bool on) -> ()", [](bool on) { ferry::helping::enabled() = on; });
  m.def("linear_helper_blocks() -> int", [] { return ferry::helping::Pool::instance().helped(); });
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) {
  m.impl("linear", &linear);
  m.impl("embed_rows", &embed_rows);
}
