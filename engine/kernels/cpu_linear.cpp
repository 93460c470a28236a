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
// build flags (engine/kernels/build.py): AVX-512, AVX2 with FMA, or plain C++ elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kChunkRows = 48;
#if defined(__AVX512F__)
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 6;
#endif

// One block's 16 accumulators of one row, and the block's weights at one k, widened to float32.
#if defined(__AVX512F__)
struct Acc {
  __m512 v = _mm512_setzero_ps();
  inline void fma(float x, const Acc& w) { v = _mm512_fmadd_ps(_mm512_set1_ps(x), w.v, v); }
  inline void store(float* lanes) const { _mm512_storeu_ps(lanes, v); }
};
inline Acc load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Acc load(const at::BFloat16* p) {
  // bfloat16 is the top half of a float32.
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
#elif defined(__AVX2__) && defined(__FMA__)
struct Acc {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  inline void fma(float x, const Acc& w) {
    const __m256 b = _mm256_set1_ps(x);
    lo = _mm256_fmadd_ps(b, w.lo, lo);
    hi = _mm256_fmadd_ps(b, w.hi, hi);
  }
  inline void store(float* lanes) const {
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
  }
};
inline Acc load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Acc load(const at::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
#else
struct Acc {
  float v[kBlock] = {};
  inline void fma(float x, const Acc& w) {
    for (int64_t j = 0; j < kBlock; ++j) v[j] += x * w.v[j];
  }
  inline void store(float* lanes) const { std::memcpy(lanes, v, sizeof v); }
};
inline Acc load(const float* p) {
  Acc a;
  std::memcpy(a.v, p, sizeof a.v);
  return a;
}
inline Acc load(const at::BFloat16* p) {
  Acc a;
  for (int64_t j = 0; j < kBlock; ++j) a.v[j] = static_cast<float>(p[j]);
  return a;
}
#endif

// Rows [0, Rows) of one tile times one block: x rows are `ldx` apart, `valid` of the block's 16 outputs are real.
// A multiply-add waits for the one before it on the same accumulator (4-5 cycles), so a tile of few rows has too
// few chains to keep the FMA units busy: it splits k over `Split` accumulators per row, summed at the end.
template <int Rows, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t k_size, const float* bias, int64_t valid,
                 float* out, int64_t ldo) {
#if defined(__AVX512F__)
  constexpr int Split = Rows <= 2 ? 4 : Rows <= 4 ? 2 : 1;
#else
  constexpr int Split = Rows == 1 ? 4 : Rows == 2 ? 2 : 1;
#endif
  Acc acc[Rows][Split];
  int64_t k = 0;
  for (; k + Split <= k_size; k += Split) {
    for (int s = 0; s < Split; ++s) {
      const Acc wk = load(w + (k + s) * kBlock);
      for (int r = 0; r < Rows; ++r) acc[r][s].fma(x[r * ldx + k + s], wk);
    }
  }
  for (; k < k_size; ++k) {
    const Acc wk = load(w + k * kBlock);
    for (int r = 0; r < Rows; ++r) acc[r][0].fma(x[r * ldx + k], wk);
  }
  for (int r = 0; r < Rows; ++r) {
    float lanes[kBlock];
    acc[r][0].store(lanes);
    for (int s = 1; s < Split; ++s) {
      float more[kBlock];
      acc[r][s].store(more);
      for (int64_t j = 0; j < kBlock; ++j) lanes[j] += more[j];
    }
    float* row = out + r * ldo;
    for (int64_t j = 0; j < valid; ++j) row[j] = bias == nullptr ? lanes[j] : lanes[j] + bias[j];
  }
}

// Runs `tile(std::integral_constant<int, rows>{})`, 1 <= rows <= kTileRows: a tile's height is a template argument,
// so that its accumulators live in registers.
template <typename Tile>
inline void with_rows(int64_t rows, Tile&& tile) {
  switch (rows) {
#define FERRY_TILE(n) \
  case n:             \
    return tile(std::integral_constant<int, n>{});
    FERRY_TILE(1)
    FERRY_TILE(2)
    FERRY_TILE(3)
    FERRY_TILE(4)
    FERRY_TILE(5)
    FERRY_TILE(6)
#if defined(__AVX512F__)
    FERRY_TILE(7)
    FERRY_TILE(8)
#endif
#undef FERRY_TILE
  }
  TORCH_CHECK(false, "a tile of ", rows, " rows");
}

template <typename W>
inline void tile_rows(int64_t rows, const float* x, int64_t ldx, const W* w, int64_t k_size, const float* bias,
                      int64_t valid, float* out, int64_t ldo) {
  with_rows(rows, [&](auto n) { tile<decltype(n)::value>(x, ldx, w, k_size, bias, valid, out, ldo); });
}

#if defined(__AVX512BF16__)
// The paired layout's tile (bfloat16 weights on a CPU with AVX512-BF16): each k pair of a block is one vector of 16
// outputs x 2 weights, and one `vdpbf16ps` adds both products of every output (exact products of bfloat16 values,
// summed in float32, denormals flushed), where the widening path takes a load, a widen, a shift and an FMA per k.
// Rows are bfloat16, k is even.
template <int Rows>
inline void pair_tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k_size, const float* bias,
                      int64_t valid, float* out, int64_t ldo) {
  constexpr int Split = Rows <= 2 ? 4 : Rows <= 4 ? 2 : 1;
  const auto x_pair = [&](int r, int64_t p) {
    int32_t bits;
    std::memcpy(&bits, x + r * ldx + 2 * p, sizeof bits);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
  };
  const auto weights = [&](int64_t p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + p * 2 * kBlock)); };
  __m512 acc[Rows][Split];
  for (auto& row : acc) {
    for (auto& a : row) a = _mm512_setzero_ps();
  }
  const int64_t pairs = k_size / 2;
  int64_t p = 0;
  for (; p + Split <= pairs; p += Split) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (p + 16) * 2 * kBlock), _MM_HINT_T0);
    for (int s = 0; s < Split; ++s) {
      const __m512bh wp = weights(p + s);
      for (int r = 0; r < Rows; ++r) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], wp, x_pair(r, p + s));
    }
  }
  for (; p < pairs; ++p) {
    const __m512bh wp = weights(p);
    for (int r = 0; r < Rows; ++r) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wp, x_pair(r, p));
  }
  for (int r = 0; r < Rows; ++r) {
    __m512 sum = acc[r][0];
    for (int s = 1; s < Split; ++s) sum = _mm512_add_ps(sum, acc[r][s]);
    float lanes[kBlock];
    _mm512_storeu_ps(lanes, sum);
    float* row = out + r * ldo;
    for (int64_t j = 0; j < valid; ++j) row[j] = bias == nullptr ? lanes[j] : lanes[j] + bias[j];
  }
}

inline void pair_tile_rows(int64_t rows, const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k_size,
                           const float* bias, int64_t valid, float* out, int64_t ldo) {
  with_rows(rows, [&](auto n) { pair_tile<decltype(n)::value>(x, ldx, w, k_size, bias, valid, out, ldo); });
}
#endif

// Rows x [m, k] times every block (`block_size` weights apart) of `packed`: `tile(rows, x, ldx, w, k, bias, valid,
// out, ldo)` computes one tile of rows times one block.
template <typename X, typename W, typename Tile>
void blocked_linear(const X* x, int64_t m_size, int64_t k_size, const W* packed, int64_t block_size,
                    int64_t num_blocks, int64_t out_features, const float* bias, float* out, Tile tile) {
  for (int64_t m0 = 0; m0 < m_size; m0 += kChunkRows) {
    const int64_t m1 = std::min(m_size, m0 + kChunkRows);
    // A block's work is 16 outputs of the chunk's rows (k * rows * 16 multiply-adds): a thread takes at least 32k,
    // about 2 us, so that even one row of a small layer spreads over the threads.
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, k_size * (m1 - m0) * kBlock));
    at::parallel_for(0, num_blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const W* w = packed + b * block_size;
        const int64_t n0 = b * kBlock;
        const int64_t valid = std::min(kBlock, out_features - n0);
        const float* block_bias = bias == nullptr ? nullptr : bias + n0;
        for (int64_t m = m0; m < m1; m += kTileRows) {
          const int64_t rows = std::min<int64_t>(kTileRows, m1 - m);
          tile(rows, x + m * k_size, k_size, w, k_size, block_bias, valid, out + m * out_features + n0,
               out_features);
        }
      }
    });
  }
}

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
                     pair_tile_rows);
#else
      TORCH_CHECK(false, "the paired bfloat16 layout needs the kernels built for AVX512-BF16");
#endif
    } else if (packed.scalar_type() == at::kFloat) {
      blocked_linear(rows.data_ptr<float>(), m_size, k_size, packed.data_ptr<float>(), k_size * kBlock, num_blocks,
                     out_features, bias_data, out.data_ptr<float>(), tile_rows<float>);
    } else {
      blocked_linear(rows.data_ptr<float>(), m_size, k_size, packed.data_ptr<at::BFloat16>(), k_size * kBlock,
                     num_blocks, out_features, bias_data, out.data_ptr<float>(), tile_rows<at::BFloat16>);
    }
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.to(x.scalar_type()).view(shape);
}

}  // namespace ferry

using namespace ferry;

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) {
  m.impl("linear", &linear);
}
