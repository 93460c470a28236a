// The blocked weight layouts' shared machinery, for the linear kernels that stream them (cpu_linear.cpp,
// cpu_quant_linear.cpp): 16 output rows a block, their weights interleaved along k so that one k of a block is one
// vector of the 16 outputs' terms (see cpu_linear.cpp's header).
//
// - `Acc`: one block's 16 float32 accumulators of one row (with lane-wise arithmetic), and `load`, a block's 16
//   weights at one k widened to float32 (from float32, bfloat16 or int8).
// - `tile` / `pair_tile`: a tile of up to kTileRows rows times one block (or, for few rows, `streams` blocks at
//   once), float32 multiply-adds or, where the CPU has AVX512-BF16, bfloat16 dot products of weights in pairs along k.
// - `for_blocks` / `for_block_runs`: the rows in chunks of kChunkRows that stay in L2 while every block streams past
//   them once, the blocks spread over the threads.
//
// The instruction set comes from the build flags (engine/kernels/build.py): AVX-512, AVX2 with FMA, or plain C++.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "helping.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace ferry::blocked {

constexpr int64_t kBlock = 16;
constexpr int64_t kChunkRows = 48;
#if defined(__AVX512F__)
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 6;
#endif

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
inline Acc load(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline Acc load(const at::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Acc splat(float x) { return {_mm512_set1_ps(x)}; }
inline Acc operator+(const Acc& a, const Acc& b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Acc operator-(const Acc& a, const Acc& b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Acc operator*(const Acc& a, const Acc& b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Acc fmadd(const Acc& a, const Acc& b, const Acc& c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
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
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Acc load(const int8_t* p) { return {widen8(p), widen8(p + 8)}; }
inline __m256 widen8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Acc load(const at::Half* p) { return {widen8(p), widen8(p + 8)}; }
inline Acc splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Acc operator+(const Acc& a, const Acc& b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Acc operator-(const Acc& a, const Acc& b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Acc operator*(const Acc& a, const Acc& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Acc fmadd(const Acc& a, const Acc& b, const Acc& c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
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
inline Acc load(const int8_t* p) {
  Acc a;
  for (int64_t j = 0; j < kBlock; ++j) a.v[j] = static_cast<float>(p[j]);
  return a;
}
inline Acc load(const at::Half* p) {
  Acc a;
  for (int64_t j = 0; j < kBlock; ++j) a.v[j] = static_cast<float>(p[j]);
  return a;
}
template <typename Op>
inline Acc lanewise(Op op) {
  Acc a;
  for (int64_t j = 0; j < kBlock; ++j) a.v[j] = op(j);
  return a;
}
inline Acc splat(float x) {
  return lanewise([&](int64_t) { return x; });
}
inline Acc operator+(const Acc& a, const Acc& b) {
  return lanewise([&](int64_t j) { return a.v[j] + b.v[j]; });
}
inline Acc operator-(const Acc& a, const Acc& b) {
  return lanewise([&](int64_t j) { return a.v[j] - b.v[j]; });
}
inline Acc operator*(const Acc& a, const Acc& b) {
  return lanewise([&](int64_t j) { return a.v[j] * b.v[j]; });
}
inline Acc fmadd(const Acc& a, const Acc& b, const Acc& c) {
  return lanewise([&](int64_t j) { return a.v[j] * b.v[j] + c.v[j]; });
}
#endif

// The end of a tile: `valid` of a row's 16 sums, times the outputs' `scale` (a quantized weight's, else nullptr),
// plus `bias` (or nullptr), into `row`.
inline void finish(const float* lanes, const float* scale, const float* bias, int64_t valid, float* row) {
  for (int64_t j = 0; j < valid; ++j) {
    const float sum = scale == nullptr ? lanes[j] : lanes[j] * scale[j];
    row[j] = bias == nullptr ? sum : sum + bias[j];
  }
}

// How many accumulators a row of a tile of `Rows` rows splits k over. A multiply-add waits for the one before it
// on the same accumulator (4-5 cycles), so a tile of few rows has too few chains to keep the FMA units busy.
// `OneRow`: a single row's (4 by default; 8 makes the int8 kernel's single row 7% faster on a Xeon with AVX-512).
template <int Rows, int OneRow = 4>
constexpr int split() {
#if defined(__AVX512F__)
  return Rows == 1 ? OneRow : Rows == 2 ? 4 : Rows <= 4 ? 2 : 1;
#else
  return Rows == 1 ? 4 : Rows == 2 ? 2 : 1;
#endif
}

// Blocks a tile of `Rows` rows streams at once where the rows are few (decode): one core keeps more of memory's
// lines in flight from several sequential streams than from one (a stream's hardware prefetcher stops at every
// 4 KiB page). Measured on 24 cold layers of a 280M Llama in bfloat16, one row, two threads of a Zen 4 EPYC: one
// stream 24-28 GB/s, two 33-37, four 40-44 (llama.cpp's matrix-vector product: 43). An AVX2 build streams two
// blocks for one or two rows: on an AVX2-only Zen 3 EPYC, 280M-Llama decode on two threads (`ferry bench decode
// --sizes 1 --threads 2`, two rounds) took 23.3-26.5 against 32.2-34.8 ms a step in bfloat16 and 38.9-44.1 against
// 45.7-51.5 in float32, and served at one stream 32.4-33.8 against 27.1-28.7 tok/s in bfloat16. (On a Zen 4 with
// the AVX2 flags, four blocks had come out level with one, 0.60-0.62 against 0.48-0.62 of oneDNN's time.)
template <int Rows>
constexpr int streams() {
#if defined(__AVX512F__)
  return Rows <= 2 ? 4 : 2;
#else
  return Rows <= 2 ? 2 : 1;
#endif
}

// A tile's accumulators a row and block when it streams `blocks` blocks, from `split` for one: twice the chains of
// one block over them all, that many registers being free beside fewer rows (the probe above, whose four streams
// reached 40-44 GB/s, kept two chains a stream: one row of four blocks, 8 chains).
constexpr int with_streams(int split, int blocks) { return blocks == 1 ? split : std::max(1, 2 * split / blocks); }

// Rows [0, Rows) of one tile times `Blocks` consecutive blocks, `block_stride` weights apart: x rows are `ldx`
// apart, block j's outputs (and its scale and bias) at 16 j, `valid` of the last block's 16 outputs are real (the
// others are whole); k split over `with_streams(split<Rows, OneRow>(), Blocks)` accumulators a row and block,
// summed at the end.
template <int Rows, typename W, int OneRow = 4, int Blocks = 1>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t k_size, const float* scale, const float* bias,
                 int64_t valid, float* out, int64_t ldo, int64_t block_stride = 0) {
  constexpr int Split = with_streams(split<Rows, OneRow>(), Blocks);
  Acc acc[Blocks][Rows][Split];
  int64_t k = 0;
  for (; k + Split <= k_size; k += Split) {
    for (int s = 0; s < Split; ++s) {
      for (int j = 0; j < Blocks; ++j) {
        const Acc wk = load(w + j * block_stride + (k + s) * kBlock);
        for (int r = 0; r < Rows; ++r) acc[j][r][s].fma(x[r * ldx + k + s], wk);
      }
    }
  }
  for (; k < k_size; ++k) {
    for (int j = 0; j < Blocks; ++j) {
      const Acc wk = load(w + j * block_stride + k * kBlock);
      for (int r = 0; r < Rows; ++r) acc[j][r][0].fma(x[r * ldx + k], wk);
    }
  }
  for (int j = 0; j < Blocks; ++j) {
    for (int r = 0; r < Rows; ++r) {
      float lanes[kBlock];
      acc[j][r][0].store(lanes);
      for (int s = 1; s < Split; ++s) {
        float more[kBlock];
        acc[j][r][s].store(more);
        for (int64_t l = 0; l < kBlock; ++l) lanes[l] += more[l];
      }
      finish(lanes, scale == nullptr ? nullptr : scale + j * kBlock, bias == nullptr ? nullptr : bias + j * kBlock,
             j == Blocks - 1 ? valid : kBlock, out + r * ldo + j * kBlock);
    }
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

#if defined(__AVX512BF16__)
// The paired layout's tile (bfloat16 weights on a CPU with AVX512-BF16): each k pair of a block is one vector of 16
// outputs x 2 weights, and one `vdpbf16ps` adds both products of every output (exact products of bfloat16 values,
// summed in float32, denormals flushed), where the widening path takes a load, a widen, a shift and an FMA per k.
// Rows are bfloat16, k is even; `Blocks`, `block_stride` and `valid` as `tile`'s.
template <int Rows, int Blocks = 1>
inline void pair_tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k_size, const float* scale,
                      const float* bias, int64_t valid, float* out, int64_t ldo, int64_t block_stride = 0) {
  constexpr int Split = with_streams(Rows <= 2 ? 4 : Rows <= 4 ? 2 : 1, Blocks);
  const auto x_pair = [&](int r, int64_t p) {
    int32_t bits;
    std::memcpy(&bits, x + r * ldx + 2 * p, sizeof bits);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
  };
  const auto weights = [&](int j, int64_t p) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * block_stride + p * 2 * kBlock));
  };
  __m512 acc[Blocks][Rows][Split];
  for (auto& block : acc) {
    for (auto& row : block) {
      for (auto& a : row) a = _mm512_setzero_ps();
    }
  }
  const int64_t pairs = k_size / 2;
  int64_t p = 0;
  for (; p + Split <= pairs; p += Split) {
    // One stream runs ahead of its prefetcher at page ends; several streams (Blocks > 1) cover for each other, and
    // prefetches there only take line fill buffers from them.
    if constexpr (Blocks == 1) _mm_prefetch(reinterpret_cast<const char*>(w + (p + 16) * 2 * kBlock), _MM_HINT_T0);
    for (int s = 0; s < Split; ++s) {
      for (int j = 0; j < Blocks; ++j) {
        const __m512bh wp = weights(j, p + s);
        for (int r = 0; r < Rows; ++r) acc[j][r][s] = _mm512_dpbf16_ps(acc[j][r][s], wp, x_pair(r, p + s));
      }
    }
  }
  for (; p < pairs; ++p) {
    for (int j = 0; j < Blocks; ++j) {
      const __m512bh wp = weights(j, p);
      for (int r = 0; r < Rows; ++r) acc[j][r][0] = _mm512_dpbf16_ps(acc[j][r][0], wp, x_pair(r, p));
    }
  }
  for (int j = 0; j < Blocks; ++j) {
    for (int r = 0; r < Rows; ++r) {
      __m512 sum = acc[j][r][0];
      for (int s = 1; s < Split; ++s) sum = _mm512_add_ps(sum, acc[j][r][s]);
      float lanes[kBlock];
      _mm512_storeu_ps(lanes, sum);
      finish(lanes, scale == nullptr ? nullptr : scale + j * kBlock, bias == nullptr ? nullptr : bias + j * kBlock,
             j == Blocks - 1 ? valid : kBlock, out + r * ldo + j * kBlock);
    }
  }
}
#endif

// Calls `run(b0, b1, m0, m1)` for every chunk [m0, m1) of at most `chunk_rows` of the `m_size` rows and, within it,
// every run of blocks [b0, b1) a thread takes: chunk by chunk, the blocks spread over the threads.
template <typename Run>
void for_block_runs(int64_t m_size, int64_t k_size, int64_t num_blocks, Run&& run, int64_t chunk_rows = kChunkRows) {
  for (int64_t m0 = 0; m0 < m_size; m0 += chunk_rows) {
    const int64_t m1 = std::min(m_size, m0 + chunk_rows);
    // A block's work is 16 outputs of the chunk's rows (k * rows * 16 multiply-adds): a thread takes at least 32k,
    // about 2 us, so that even one row of a small layer spreads over the threads.
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, k_size * (m1 - m0) * kBlock));
    const auto blocks = [&](int64_t b0, int64_t b1) { run(b0, b1, m0, m1); };
    // On one thread the helper may take some of the blocks (helping.h); a step on several keeps OpenMP's.
    if (helping::enabled().load(std::memory_order_relaxed) && at::get_num_threads() == 1 &&
        !at::in_parallel_region()) {
      using Blocks = decltype(blocks);
      const auto call = [](const void* context, int64_t b0, int64_t b1) {
        (*static_cast<const Blocks*>(context))(b0, b1);
      };
      if (helping::Pool::instance().run(num_blocks, grain, call, &blocks)) continue;
    }
    at::parallel_for(0, num_blocks, grain, blocks);
  }
}

// Calls `block(b, m0, m1)` for every block b < `num_blocks` and every chunk [m0, m1) as `for_block_runs` spreads them.
template <typename Block>
void for_blocks(int64_t m_size, int64_t k_size, int64_t num_blocks, Block&& block) {
  for_block_runs(m_size, k_size, num_blocks, [&](int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
    for (int64_t b = b0; b < b1; ++b) block(b, m0, m1);
  });
}

}  // namespace ferry::blocked
