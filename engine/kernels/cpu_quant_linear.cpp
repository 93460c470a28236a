// Quantized linear layers on the CPU: y = x @ W.T + b with W kept as 8- or 4-bit codes in blocked layouts of 16
// output rows (cpu_linear.cpp's, engine/kernels/quant_linear.py packs them), the codes widened in registers.
//
// Decode (a few rows) costs what reading the weights costs, so a weight read as one byte (int8) or half a byte
// (int4) a term instead of bfloat16's two is what makes these layers faster; more rows go in the same chunks and
// tiles as the blocked kernel (blocked.h).
//
// - int8, weight only (`int8_linear`): a float32 scale per output row, y = scale * sum_k x_k q_k, and two layouts.
//   Where the CPU has int8 dot products (VNNI), W8A8's layout below: each row of x goes in fixed point, N = round(x *
//   2^(30 - e)) with |x| < 2^e, as 4 byte planes, each multiplied by the codes with `vpdpbusd` (64 terms an
//   instruction) and the planes' int32 sums put together in int64: sum_k N_k q_k exactly, rounded once at the end
//   (the float32 path's sums round at every term). x is exact on 31 bits below its row's largest |x| (every
//   bfloat16 within 2^23 of it); what lies below is rounded by at most 2^-31 of 2^e. Elsewhere the blocked layout
//   of the codes, [ceil(out / 16), in, 16] int8: a tile widens a block's 16 codes at one k to float32 (a sign
//   extension and a conversion) and multiplies them as blocked.h's tiles multiply float32 weights. The widening
//   takes 3 instructions per 16 bytes where a dot product takes 1 per 64: a core widening them streamed int8
//   weights out of DRAM at three quarters of the rate it reads them in planes (a Xeon with AVX512-VNNI, one row of
//   an 8192 x 2048 layer: 2150 us widened, 1640 us in planes, 2920 us for the blocked bfloat16 kernel), and the
//   planes were faster at every row count up to 256.
// - int4, weight only, asymmetric in groups of `group` (32, 64, 128) along k (`int4_linear`): w = min + scale * q,
//   q in 0..15. codes [ceil(out / 16), in / 8, 16, 4] uint8: for 8 k a block's row j has 4 bytes, one
//   little-endian 32-bit word; byte c holds the code of k = 8o + c in its low 4 bits, that of 8o + 4 + c in its
//   high 4 (o: which 8). scales, mins: [ceil(out / 16), in / group, 16] bfloat16, or float16 (a checkpoint's own
//   float16 scales, GPTQ's and GGUF's, kept exactly). A code is widened with no conversion: OR-ed into the mantissa
//   of 1.0 it is f = 1 + q / 16 (a shift and one `vpternlogd`), and since w = 16 scale f + (min - 16 scale), a
//   group's sum is 16 scale * sum_k x_k f_k + (min - 16 scale) * sum_k x_k, the last sum taken once a row.
// - int8 in groups (`int8_group_linear`): the same with 8-bit codes, q in 0..255 (a checkpoint's signed codes plus
//   128, its minimum -128 scale), 4 k a word (byte c: k = 4o + c), f = 1 + q / 256: GGUF's Q8_0, GPTQ's 8 bits,
//   compressed-tensors' int8 by group.
//   Measured slower on a Xeon with AVX512-BF16, VNNI and AMX: f in bfloat16 pairs for `vdpbf16ps` (at every row
//   count: it takes 2 cycles and 13 of latency where an FMA takes half a cycle and 4), and int8's planes with the
//   low and high 4 bits as bytes for `vpdpbusd` (faster only out of cache and up to 2 rows: out of DRAM a row's
//   decode is as fast, 8 rows half as fast).
// - W8A8 (`w8a8_linear`): int8 weights per output row as for int8, codes [ceil(out / 16), ceil(in / 4), 16, 4]
//   (4 consecutive k of a row together, zeros past in), float32 scales and each row's sum of codes. Each row of x
//   is quantized as it comes, symmetric per row (s = max |x| / 127, q = round(x / s), as quant_linear.py's
//   `quantize_activations`), and the int8 x int8 products are summed exactly in int32 (4 k at once): AVX512-VNNI's
//   `vpdpbusd` (16 outputs an instruction) or AVX-VNNI's, which take unsigned x, so x goes in as q + 128 and 128
//   times the row's sum of codes comes off the sum; elsewhere AVX2's `vpmaddubsw` of |w| and x with w's sign
//   (products at most 127 * 127, pairs of them within int16: nothing saturates). y = float(sum) * s_x * s_w + b.
//
// A row with a NaN gives NaN outputs in every scheme (one with an infinity: NaN or infinite ones).
//
// The instruction set comes from the build flags (engine/kernels/build.py: AVX-512, with AVX512-VNNI where the CPU
// has it; AVX2, with AVX-VNNI where the CPU has it; or plain C++).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "blocked.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace {

using namespace ferry::blocked;

// ---- codes in groups, weight only: int4, and int8 with a scale per group (int8 by row takes blocked.h's tiles) ----

// A code of Bits bits OR-ed into the top of the mantissa of 1.0 (bits 23 - Bits .. 22) is f = 1 + q / 2^Bits.
constexpr uint32_t kOne = 0x3F800000;
template <int Bits>
constexpr uint32_t code_mask() {
  return ((1u << Bits) - 1) << (23 - Bits);
}
template <int Bits>
constexpr int codes_per_word() {
  return 32 / Bits;
}

// Bit position, in a row's 32-bit word, of the word's n-th code (in k order): int4, byte n % 4's low 4 bits, then
// its high 4; int8, byte n.
template <int Bits>
constexpr int code_bit(int n) {
  return Bits == 4 ? 8 * (n % 4) + 4 * (n / 4) : 8 * n;
}

// One block's words for a few k (16 x 32 bits), and `unpack<Bits, Bit>`: each row's code at bit Bit as f.
#if defined(__AVX512F__)
struct Words {
  __m512i v;
};
inline Words load_words(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
template <int Bits, int Bit>
inline Acc unpack(const Words& w) {
  constexpr int To = 23 - Bits;
  const __m512i at = Bit <= To ? _mm512_slli_epi32(w.v, To - Bit) : _mm512_srli_epi32(w.v, Bit - To);
  return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(at, _mm512_set1_epi32(code_mask<Bits>()),
                                                        _mm512_set1_epi32(kOne), 0xEA))};  // (at & bits) | one
}
#elif defined(__AVX2__) && defined(__FMA__)
struct Words {
  __m256i lo, hi;
};
inline Words load_words(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
template <int Bits, int Bit>
inline __m256 unpack8(__m256i v) {
  constexpr int To = 23 - Bits;
  const __m256i at = Bit <= To ? _mm256_slli_epi32(v, To - Bit) : _mm256_srli_epi32(v, Bit - To);
  return _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(at, _mm256_set1_epi32(code_mask<Bits>())), _mm256_set1_epi32(kOne)));
}
template <int Bits, int Bit>
inline Acc unpack(const Words& w) {
  return {unpack8<Bits, Bit>(w.lo), unpack8<Bits, Bit>(w.hi)};
}
#else
struct Words {
  uint32_t v[kBlock];
};
inline Words load_words(const uint8_t* p) {
  Words w;
  std::memcpy(w.v, p, sizeof w.v);
  return w;
}
template <int Bits, int Bit>
inline Acc unpack(const Words& w) {
  return lanewise([&](int64_t j) {
    const uint32_t bits = (((w.v[j] >> Bit) & ((1u << Bits) - 1)) << (23 - Bits)) | kOne;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  });
}
#endif

// How far ahead (in 64-byte words) a tile asks for the codes it will read. A row's decode spends as long
// unpacking the codes as waiting for them: without it the core asks for too few at once to stream them out of DRAM
// at its full rate (measured on a Xeon, one row of an 8192 x 2048 int4 layer from DRAM: 1450 us without, 880 with).
constexpr int64_t kPrefetchWords = 32;

// Where a block's codes are and what to add at each group's end; Scale: bfloat16, or float16 (a checkpoint's own
// scales, kept as they are).
template <typename Scale>
struct GroupedBlock {
  const uint8_t* codes;  // [k / codes a word, 16, 4]
  const Scale* scales;  // [groups, 16]
  const Scale* mins;  // [groups, 16]
  int64_t groups, group;
};

// A group's sums of x f (`acc`) into the row's total: 2^Bits scale * acc + (min - 2^Bits scale) * the group's sum
// of x.
template <int Bits, typename Scale>
inline Acc add_group(const GroupedBlock<Scale>& w, int64_t g, const Acc& acc, float x_sum, const Acc& total) {
  const Acc scale_n = load(w.scales + g * kBlock) * splat(static_cast<float>(1 << Bits));
  const Acc offset = load(w.mins + g * kBlock) - scale_n;
  return fmadd(offset, splat(x_sum), fmadd(scale_n, acc, total));
}

// Rows [0, Rows) of float32 x times one block of grouped codes; `x_sums` [Rows, groups]: each row's sum of x over
// each group.
template <int Bits, typename Scale, int Rows, int... N>
inline void grouped_tile(const float* x, int64_t ldx, const GroupedBlock<Scale>& w, const float* x_sums,
                         const float* bias, int64_t valid, float* out, int64_t ldo, std::integer_sequence<int, N...>) {
  constexpr int Split = split<Rows>();
  constexpr int kPerWord = codes_per_word<Bits>();
  Acc total[Rows];
  const int64_t words_a_group = w.group / kPerWord;
  for (int64_t g = 0; g < w.groups; ++g) {
    Acc acc[Rows][Split];
    for (int64_t o = g * words_a_group; o < (g + 1) * words_a_group; ++o) {
      _mm_prefetch(reinterpret_cast<const char*>(w.codes + (o + kPrefetchWords) * 4 * kBlock), _MM_HINT_T0);
      const Words words = load_words(w.codes + o * 4 * kBlock);
      const auto term = [&](auto n) {
        const Acc f = unpack<Bits, code_bit<Bits>(decltype(n)::value)>(words);
        for (int r = 0; r < Rows; ++r) acc[r][decltype(n)::value % Split].fma(x[r * ldx + kPerWord * o + n], f);
      };
      (term(std::integral_constant<int, N>{}), ...);
    }
    for (int r = 0; r < Rows; ++r) {
      Acc sum = acc[r][0];
      for (int s = 1; s < Split; ++s) sum = sum + acc[r][s];
      total[r] = add_group<Bits>(w, g, sum, x_sums[r * w.groups + g], total[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    float lanes[kBlock];
    total[r].store(lanes);
    finish(lanes, nullptr, bias, valid, out + r * ldo);
  }
}

// ---- int8 dot products: W8A8, and int8 weight-only on CPUs with VNNI ----

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
// vpdpbusd multiplies unsigned bytes of x by signed bytes of w: W8A8's x goes in as q + 128.
constexpr int32_t kXOffset = 128;
#else
constexpr int32_t kXOffset = 0;
#endif
#if defined(__AVX512F__)
constexpr int kW8A8Rows = 8;
#else
constexpr int kW8A8Rows = 4;  // 2 accumulators a row in 16 registers, with the weights and their magnitudes
#endif

// max |x| of a row, and whether all of it is finite.
inline float abs_max(const float* x, int64_t k_size, bool* finite) {
  float amax = 0.0f;
  bool all_finite = true;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_setzero_ps();
  __mmask16 not_finite = 0;
  for (; k + 16 <= k_size; k += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + k));
    not_finite |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NLT_UQ);
    top = _mm512_max_ps(top, a);
  }
  amax = _mm512_reduce_max_ps(top);
  all_finite = not_finite == 0;
#elif defined(__AVX2__)
  __m256 top = _mm256_setzero_ps(), not_finite = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (; k + 8 <= k_size; k += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude);
    not_finite = _mm256_or_ps(
        not_finite, _mm256_cmp_ps(a, _mm256_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NLT_UQ));
    top = _mm256_max_ps(top, a);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (const float v : lanes) amax = std::max(amax, v);
  all_finite = _mm256_movemask_ps(not_finite) == 0;
#endif
  for (; k < k_size; ++k) {
    all_finite &= std::isfinite(x[k]);
    amax = std::max(amax, std::abs(x[k]));
  }
  *finite = all_finite;
  return amax;
}

// Row m of `x` [m, k] quantized into `q` (k4 bytes: q + kXOffset, padded with kXOffset) and its scale.
// Bit for bit quant_linear.py's quantize_activations: s = max|x| / 127 (1 where that is 0), q = round half to even
// of x / s, within [-127, 127].
inline void quantize_row(const float* x, int64_t k_size, int64_t k4, uint8_t* q, float* scale) {
  bool finite;
  float s = abs_max(x, k_size, &finite) / 127.0f;
  if (!finite) {  // a row with an infinity or a NaN: NaN outputs, whatever its codes
    *scale = std::numeric_limits<float>::quiet_NaN();
    std::fill(q, q + k4, static_cast<uint8_t>(kXOffset));
    return;
  }
  if (s == 0.0f) s = 1.0f;
  *scale = s;
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(s);
  for (; k + 16 <= k_size; k += 16) {
    // Rounds as the MXCSR says: to nearest, ties to even.
    __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + k), vs));
    v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    v = _mm512_add_epi32(v, _mm512_set1_epi32(kXOffset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
  }
#endif
  for (; k < k_size; ++k) {
    const float v = std::nearbyint(x[k] / s);
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(v, -127.0f, 127.0f)) + kXOffset);
  }
  for (; k < k4; ++k) q[k] = static_cast<uint8_t>(kXOffset);
}

inline int32_t quad(const uint8_t* q) {
  int32_t bits;
  std::memcpy(&bits, q, sizeof bits);
  return bits;
}

// The int32 sums of `Planes` byte vectors of each of Rows rows times one block of `quads` groups of 4 k (codes
// [quads, 16, 4]): sums[r][d][j] = sum_k x_rdk w_jk, where row r's 4 bytes of plane d for the p-th 4 k are at
// x + r * ldx + (p * Planes + d) * 4. Bytes of x are unsigned where the CPU has vpdpbusd; elsewhere (W8A8's one plane
// only) they are signed.
template <int Rows, int Planes>
inline void dot_sums(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t quads, int32_t (*sums)[Planes][kBlock]) {
  const auto x_quad = [&](int r, int64_t p, int d) { return quad(x + r * ldx + (p * Planes + d) * 4); };
#if defined(__AVX512VNNI__)
  // A vpdpbusd waits 5 cycles for the one before it on the same accumulator, and 2 issue a cycle: few rows and
  // planes split k into more chains (a single row's 4 planes into 16, measured faster than 8 with the prefetch).
  constexpr int Split = Rows * Planes >= 8 ? 1 : Rows * Planes >= 4 && Planes == 1 ? 2 : 4;
  __m512i acc[Rows][Planes][Split];
  for (auto& row : acc) {
    for (auto& plane : row) {
      for (auto& a : plane) a = _mm512_setzero_si512();
    }
  }
  const auto step = [&](int64_t p, int s) {
    // The int8 kernel's rows in planes ask for their codes ahead of use, as the int4 kernel does (kPrefetchWords):
    // 15% faster out of DRAM on a Xeon; W8A8's one plane streams them at DRAM's rate without, slower with.
    if constexpr (Planes > 1) _mm_prefetch(reinterpret_cast<const char*>(w + (p + 16) * 4 * kBlock), _MM_HINT_T0);
    const __m512i wq = _mm512_loadu_si512(w + p * 4 * kBlock);
    for (int r = 0; r < Rows; ++r) {
      for (int d = 0; d < Planes; ++d) {
        acc[r][d][s] = _mm512_dpbusd_epi32(acc[r][d][s], _mm512_set1_epi32(x_quad(r, p, d)), wq);
      }
    }
  };
  int64_t p = 0;
  for (; p + Split <= quads; p += Split) {
    for (int s = 0; s < Split; ++s) step(p + s, s);
  }
  for (; p < quads; ++p) step(p, 0);
  for (int r = 0; r < Rows; ++r) {
    for (int d = 0; d < Planes; ++d) {
      __m512i sum = acc[r][d][0];
      for (int s = 1; s < Split; ++s) sum = _mm512_add_epi32(sum, acc[r][d][s]);
      _mm512_storeu_si512(sums[r][d], sum);
    }
  }
#elif defined(__AVX2__)
  __m256i lo[Rows][Planes], hi[Rows][Planes];
  for (int r = 0; r < Rows; ++r) {
    for (int d = 0; d < Planes; ++d) lo[r][d] = hi[r][d] = _mm256_setzero_si256();
  }
#if !defined(__AVXVNNI__)
  static_assert(Planes == 1, "without VNNI only W8A8's signed x");
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t p = 0; p < quads; ++p) {
    const __m256i w_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 4 * kBlock));
    const __m256i w_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 4 * kBlock + 32));
#if defined(__AVXVNNI__)
    for (int r = 0; r < Rows; ++r) {
      for (int d = 0; d < Planes; ++d) {
        const __m256i xb = _mm256_set1_epi32(x_quad(r, p, d));
        lo[r][d] = _mm256_dpbusd_avx_epi32(lo[r][d], xb, w_lo);
        hi[r][d] = _mm256_dpbusd_avx_epi32(hi[r][d], xb, w_hi);
      }
    }
#else
    // |w| times x with w's sign: products of magnitudes at most 127, so a pair's sum fits int16.
    const __m256i abs_lo = _mm256_abs_epi8(w_lo), abs_hi = _mm256_abs_epi8(w_hi);
    for (int r = 0; r < Rows; ++r) {
      const __m256i xb = _mm256_set1_epi32(x_quad(r, p, 0));
      const __m256i products_lo = _mm256_maddubs_epi16(abs_lo, _mm256_sign_epi8(xb, w_lo));  // int16 pairs
      const __m256i products_hi = _mm256_maddubs_epi16(abs_hi, _mm256_sign_epi8(xb, w_hi));
      lo[r][0] = _mm256_add_epi32(lo[r][0], _mm256_madd_epi16(products_lo, ones));
      hi[r][0] = _mm256_add_epi32(hi[r][0], _mm256_madd_epi16(products_hi, ones));
    }
#endif
  }
  for (int r = 0; r < Rows; ++r) {
    for (int d = 0; d < Planes; ++d) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[r][d]), lo[r][d]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[r][d] + 8), hi[r][d]);
    }
  }
#else
  static_assert(Planes == 1, "without VNNI only W8A8's signed x");
  for (int r = 0; r < Rows; ++r) {
    for (int64_t j = 0; j < kBlock; ++j) sums[r][0][j] = 0;
    for (int64_t p = 0; p < quads; ++p) {
      for (int64_t j = 0; j < kBlock; ++j) {
        for (int64_t t = 0; t < 4; ++t) {
          sums[r][0][j] += static_cast<int8_t>(x[r * ldx + 4 * p + t]) * w[(p * kBlock + j) * 4 + t];
        }
      }
    }
  }
#endif
}

// Rows [0, Rows) of quantized x (`ldq` bytes apart) times one W8A8 block: float(sum - offset * codes' sum) * s_x *
// s_w + b.
template <int Rows>
inline void w8a8_tile(const uint8_t* xq, int64_t ldq, const float* x_scales, const int8_t* w, int64_t quads,
                      const float* scale, const int32_t* code_sums, const float* bias, int64_t valid, float* out,
                      int64_t ldo) {
  int32_t sums[Rows][1][kBlock];
  dot_sums<Rows, 1>(xq, ldq, w, quads, sums);
  for (int r = 0; r < Rows; ++r) {
    for (int64_t j = 0; j < valid; ++j) {
      const float y = static_cast<float>(sums[r][0][j] - kXOffset * code_sums[j]) * x_scales[r] * scale[j];
      out[r * ldo + j] = bias == nullptr ? y : y + bias[j];
    }
  }
}

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
// int8 weight-only with dot products: a row of x in fixed point, N = round(x * 2^(30 - e)) with |x| < 2^e (e from the
// row's largest |x|), stored as U = N + 2^31 in kPlanes byte planes (U's bytes), each multiplied by the codes with
// vpdpbusd and the planes' int32 sums put together in int64: sum_k N_k q_k exactly, where the float32 path's sums
// round at every term. Exact for x of 31 bits below the row's largest (bfloat16 values within 2^23 of it); any
// other x is rounded by at most 2^-31 of 2^e.
constexpr int kPlanes = 4;
constexpr int kPlaneShift = 30;
constexpr int kNotFinite = std::numeric_limits<int>::min();
#if defined(__AVX512F__)
constexpr int kPlaneRows = 6;  // 24 accumulators of 32 registers
#else
constexpr int kPlaneRows = 1;  // 8 accumulators a row of 16 registers
#endif

// Row x [k] into its planes, `quads` * 16 bytes (4 k at a time: plane 0's 4 bytes, plane 1's, ...), N = 0 past k;
// returns e, or kNotFinite for a row with an infinity or a NaN.
inline int to_planes(const float* x, int64_t k_size, int64_t quads, uint8_t* planes) {
  bool finite;
  const float amax = abs_max(x, k_size, &finite);
  if (!finite) return kNotFinite;
  int e;
  std::frexp(amax, &e);  // amax < 2^e
  e = std::max(e, kPlaneShift - 126);  // 2^(30 - e) a float32; smaller x round to 0, below 2^-126 of 2^e
  const float unit = std::ldexp(1.0f, kPlaneShift - e);
  const auto offset = [&](float v) {  // U = N + 2^31, N within +-2^30
    return static_cast<uint32_t>(static_cast<int32_t>(std::nearbyint(v * unit))) ^ 0x80000000u;
  };
  int64_t k = 0;
#if defined(__AVX512F__)
  // Each 128-bit lane's 4 U (one quad) into bytes by plane: a shuffle within the lane.
  const __m512i by_plane = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  for (; k + 16 <= k_size; k += 16) {
    const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(unit)));
    const __m512i u = _mm512_xor_si512(n, _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
    _mm512_storeu_si512(planes + k * kPlanes, _mm512_shuffle_epi8(u, by_plane));
  }
#else
  const __m256i by_plane =
      _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  for (; k + 8 <= k_size; k += 8) {
    const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(unit)));
    const __m256i u = _mm256_xor_si256(n, _mm256_set1_epi32(static_cast<int32_t>(0x80000000u)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(planes + k * kPlanes), _mm256_shuffle_epi8(u, by_plane));
  }
#endif
  for (; k < 4 * quads; ++k) {
    const uint32_t u = k < k_size ? offset(x[k]) : 0x80000000u;
    for (int d = 0; d < kPlanes; ++d) {
      planes[(k / 4) * 4 * kPlanes + d * 4 + k % 4] = static_cast<uint8_t>(u >> (8 * d));
    }
  }
  return e;
}

// Rows [0, Rows) of x in planes (`ldq` bytes apart, their e in `exponents`) times one int8 block:
// (sum_d 2^8d sums_d - 2^31 * codes' sum) * 2^(e - 30) * scale + b, in double, rounded once to float32.
template <int Rows>
inline void plane_tile(const uint8_t* planes, int64_t ldq, const int* exponents, const int8_t* w, int64_t quads,
                       const float* scale, const int32_t* code_sums, const float* bias, int64_t valid, float* out,
                       int64_t ldo) {
  int32_t sums[Rows][kPlanes][kBlock];
  dot_sums<Rows, kPlanes>(planes, ldq, w, quads, sums);
  for (int r = 0; r < Rows; ++r) {
    if (exponents[r] == kNotFinite) {
      for (int64_t j = 0; j < valid; ++j) out[r * ldo + j] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const double unit = std::ldexp(1.0, exponents[r] - kPlaneShift);
    for (int64_t j = 0; j < valid; ++j) {
      int64_t total = -(static_cast<int64_t>(code_sums[j]) << 31);
      for (int d = 0; d < kPlanes; ++d) total += static_cast<int64_t>(sums[r][d][j]) << (8 * d);
      const double y = static_cast<double>(total) * unit * scale[j];
      out[r * ldo + j] = static_cast<float>(bias == nullptr ? y : y + bias[j]);
    }
  }
}
#endif

template <int Height, typename Tile>
inline void with_height(int64_t rows, Tile&& tile) {
  if constexpr (Height > 1) {
    if (rows < Height) return with_height<Height - 1>(rows, tile);
  }
  tile(std::integral_constant<int, Height>{});
}

// ---- shared ----

// The last dimension of `x` as a [m, k] contiguous matrix in `dtype`, and its output [m, out_features] float32.
std::pair<at::Tensor, at::Tensor> rows_and_output(const at::Tensor& x, at::ScalarType dtype, int64_t out_features) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(dtype).contiguous();
  return {rows, at::empty({rows.size(0), out_features}, rows.options().dtype(at::kFloat))};
}

std::optional<at::Tensor> float_bias(const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value()) return std::nullopt;
  TORCH_CHECK(bias->numel() == out_features, "bias has ", bias->numel(), " elements for ", out_features, " outputs");
  return bias->to(at::kFloat).contiguous();
}

const float* data_or_null(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// The output [m, out_features] float32 as x's dtype, in x's leading shape.
at::Tensor shaped(const at::Tensor& out, const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.to(x.scalar_type()).view(shape);
}

void check_blocks(const char* op, const at::Tensor& x, const at::Tensor& codes, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "ferry_kernels.", op, " runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "ferry_kernels.", op,
              " takes float32 or bfloat16 x, not ", x.scalar_type());
  TORCH_CHECK(codes.is_contiguous() && codes.size(2) == kBlock, "ferry_kernels.", op, " takes packed codes");
  const int64_t num_blocks = codes.size(0);
  TORCH_CHECK(0 < out_features && out_features <= num_blocks * kBlock && out_features > (num_blocks - 1) * kBlock,
              "out_features ", out_features, " does not fit ", num_blocks, " blocks");
}

void check_vector(const at::Tensor& t, at::ScalarType dtype, int64_t size, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == size, what, ": ", size, " ", dtype,
              " values");
}

}  // namespace

namespace ferry {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& code_sums, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && (codes.dim() == 3 || (codes.dim() == 4 && codes.size(3) == 4)),
              "ferry_kernels.int8_linear takes int8 codes [blocks, in, 16] or [blocks, ceil(in / 4), 16, 4]");
  check_blocks("int8_linear", x, codes, out_features);
  check_vector(scales, at::kFloat, out_features, "scales");
  check_vector(code_sums, at::kInt, out_features, "code_sums");
  const int64_t k_size = x.size(-1), num_blocks = codes.size(0);
  const std::optional<at::Tensor> wide_bias = float_bias(bias, out_features);
  const float* bias_data = data_or_null(wide_bias);
  const float* scale_data = scales.data_ptr<float>();
  const int8_t* packed = codes.data_ptr<int8_t>();
  auto [rows, out] = rows_and_output(x, at::kFloat, out_features);
  const int64_t m_size = rows.size(0);
  const float* x_data = rows.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  if (codes.dim() == 4) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    const int64_t quads = codes.size(1), k4 = 4 * quads, ldq = quads * 4 * kPlanes;
    TORCH_CHECK(quads == (k_size + 3) / 4, "input has ", k_size, " features, the weight ", k4);
    TORCH_CHECK(k4 <= 65536, "int8 takes at most 65536 input features");  // a plane's int32 sums stay exact
    const at::Tensor planes = at::empty({m_size, ldq}, rows.options().dtype(at::kByte));
    const at::Tensor exponents = at::empty({m_size}, rows.options().dtype(at::kInt));
    uint8_t* plane_data = planes.data_ptr<uint8_t>();
    int* exponent_data = exponents.data_ptr<int>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k_size));
    at::parallel_for(0, m_size, grain, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        exponent_data[m] = to_planes(x_data + m * k_size, k_size, quads, plane_data + m * ldq);
      }
    });
    const int32_t* sums_data = code_sums.data_ptr<int32_t>();
    for_blocks(m_size, k4, num_blocks, [&](int64_t b, int64_t m0, int64_t m1) {
      const int64_t n0 = b * kBlock, valid = std::min(kBlock, out_features - n0);
      for (int64_t m = m0; m < m1; m += kPlaneRows) {
        with_height<kPlaneRows>(std::min<int64_t>(kPlaneRows, m1 - m), [&](auto n) {
          plane_tile<decltype(n)::value>(plane_data + m * ldq, ldq, exponent_data + m, packed + b * k4 * kBlock, quads,
                                         scale_data + n0, sums_data + n0,
                                         bias_data == nullptr ? nullptr : bias_data + n0, valid,
                                         out_data + m * out_features + n0, out_features);
        });
      }
    });
    return shaped(out, x, out_features);
#else
    TORCH_CHECK(false, "int8 codes in groups of 4 k need the kernels built with VNNI");
#endif
  }
  TORCH_CHECK(codes.size(1) == k_size, "input has ", k_size, " features, the weight ", codes.size(1));
  for_blocks(m_size, k_size, num_blocks, [&](int64_t b, int64_t m0, int64_t m1) {
    const int64_t n0 = b * kBlock, valid = std::min(kBlock, out_features - n0);
    for (int64_t m = m0; m < m1; m += kTileRows) {
      with_rows(std::min<int64_t>(kTileRows, m1 - m), [&](auto n) {
        tile<decltype(n)::value, int8_t, 8>(x_data + m * k_size, k_size, packed + b * k_size * kBlock, k_size,
                                            scale_data + n0, bias_data == nullptr ? nullptr : bias_data + n0, valid,
                                            out_data + m * out_features + n0, out_features);
      });
    }
  });
  return shaped(out, x, out_features);
}

template <int Bits, typename Scale>
void run_grouped(const at::Tensor& rows, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                 const at::Tensor& x_sums, const float* bias_data, int64_t out_features, at::Tensor& out) {
  const int64_t m_size = rows.size(0), k_size = rows.size(1), num_blocks = codes.size(0);
  const int64_t groups = scales.size(1), group = k_size / groups;
  const float* sums = x_sums.data_ptr<float>();
  const float* x_data = rows.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  for_blocks(m_size, k_size, num_blocks, [&](int64_t b, int64_t m0, int64_t m1) {
    const GroupedBlock<Scale> w{codes.data_ptr<uint8_t>() + b * k_size / codes_per_word<Bits>() * 4 * kBlock,
                                scales.data_ptr<Scale>() + b * groups * kBlock,
                                mins.data_ptr<Scale>() + b * groups * kBlock, groups, group};
    const int64_t n0 = b * kBlock, valid = std::min(kBlock, out_features - n0);
    const float* block_bias = bias_data == nullptr ? nullptr : bias_data + n0;
    for (int64_t m = m0; m < m1; m += kTileRows) {
      with_rows(std::min<int64_t>(kTileRows, m1 - m), [&](auto n) {
        grouped_tile<Bits, Scale, decltype(n)::value>(
            x_data + m * k_size, k_size, w, sums + m * groups, block_bias, valid, out_data + m * out_features + n0,
            out_features, std::make_integer_sequence<int, codes_per_word<Bits>()>{});
      });
    }
  });
}

// int4 (Bits 4) and int8 in groups (Bits 8): codes [blocks, in / (32 / Bits), 16, 4] uint8, scales and mins
// [blocks, in / group, 16] bfloat16 or float16 (both the same).
template <int Bits>
at::Tensor grouped_linear(const char* name, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t out_features, const std::optional<at::Tensor>& bias) {
  constexpr int kPerWord = codes_per_word<Bits>();
  TORCH_CHECK(codes.dim() == 4 && codes.size(3) == 4 && codes.scalar_type() == at::kByte, name,
              " takes uint8 codes [blocks, in / ", kPerWord, ", 16, 4]");
  check_blocks(name, x, codes, out_features);
  const int64_t k_size = x.size(-1), num_blocks = codes.size(0);
  TORCH_CHECK(codes.size(1) * kPerWord == k_size, "input has ", k_size, " features, the weight ",
              codes.size(1) * kPerWord);
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == num_blocks && scales.size(2) == kBlock &&
                  (half || scales.scalar_type() == at::kBFloat16) && scales.is_contiguous() &&
                  mins.sizes() == scales.sizes() && mins.scalar_type() == scales.scalar_type() && mins.is_contiguous(),
              "scales and mins: [blocks, in / group, 16] bfloat16 or float16");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(k_size % groups == 0 && (k_size / groups) % kPerWord == 0, k_size, " features do not go in ", groups,
              " groups of a multiple of ", kPerWord);
  const std::optional<at::Tensor> wide_bias = float_bias(bias, out_features);
  auto [rows, out] = rows_and_output(x, at::kFloat, out_features);
  // [m, groups]: each row's sum of x over each group, for the groups' offsets.
  const at::Tensor x_sums = at::sum(rows.view({rows.size(0), groups, k_size / groups}), -1, false, at::kFloat);
  if (half) {
    run_grouped<Bits, at::Half>(rows, codes, scales, mins, x_sums, data_or_null(wide_bias), out_features, out);
  } else {
    run_grouped<Bits, at::BFloat16>(rows, codes, scales, mins, x_sums, data_or_null(wide_bias), out_features, out);
  }
  return shaped(out, x, out_features);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t out_features, const std::optional<at::Tensor>& bias) {
  return grouped_linear<4>("ferry_kernels.int4_linear", x, codes, scales, mins, out_features, bias);
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t out_features, const std::optional<at::Tensor>& bias) {
  return grouped_linear<8>("ferry_kernels.int8_group_linear", x, codes, scales, mins, out_features, bias);
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& code_sums, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(3) == 4 && codes.scalar_type() == at::kChar,
              "ferry_kernels.w8a8_linear takes int8 codes [blocks, ceil(in / 4), 16, 4]");
  check_blocks("w8a8_linear", x, codes, out_features);
  check_vector(scales, at::kFloat, out_features, "scales");
  check_vector(code_sums, at::kInt, out_features, "code_sums");
  const int64_t k_size = x.size(-1), quads = codes.size(1), k4 = 4 * quads, num_blocks = codes.size(0);
  TORCH_CHECK(quads == (k_size + 3) / 4, "input has ", k_size, " features, the weight ", k4);
  // Sums of up to k4 products of 255 * 127 (the offset x) stay within int32.
  TORCH_CHECK(k4 <= 65536, "W8A8 takes at most 65536 input features");
  const std::optional<at::Tensor> wide_bias = float_bias(bias, out_features);
  const float* bias_data = data_or_null(wide_bias);
  auto [rows, out] = rows_and_output(x, at::kFloat, out_features);
  const int64_t m_size = rows.size(0);
  const at::Tensor xq = at::empty({m_size, k4}, rows.options().dtype(at::kByte));
  const at::Tensor x_scales = at::empty({m_size}, rows.options());
  uint8_t* q_data = xq.data_ptr<uint8_t>();
  float* s_data = x_scales.data_ptr<float>();
  const float* x_data = rows.data_ptr<float>();
  at::parallel_for(0, m_size, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k_size)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x_data + m * k_size, k_size, k4, q_data + m * k4, s_data + m);
  });
  const int8_t* packed = codes.data_ptr<int8_t>();
  const float* scale_data = scales.data_ptr<float>();
  const int32_t* sums_data = code_sums.data_ptr<int32_t>();
  float* out_data = out.data_ptr<float>();
  for_blocks(m_size, k4, num_blocks, [&](int64_t b, int64_t m0, int64_t m1) {
    const int64_t n0 = b * kBlock, valid = std::min(kBlock, out_features - n0);
    for (int64_t m = m0; m < m1; m += kW8A8Rows) {
      with_height<kW8A8Rows>(std::min<int64_t>(kW8A8Rows, m1 - m), [&](auto n) {
        w8a8_tile<decltype(n)::value>(q_data + m * k4, k4, s_data + m, packed + b * k4 * kBlock, quads,
                                      scale_data + n0, sums_data + n0, bias_data == nullptr ? nullptr : bias_data + n0,
                                      valid, out_data + m * out_features + n0, out_features);
      });
    }
  });
  return shaped(out, x, out_features);
}

}  // namespace ferry

using namespace ferry;

TORCH_LIBRARY_FRAGMENT(ferry_kernels, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor code_sums, int out_features, Tensor? bias) -> "
        "Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_group_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int out_features, Tensor? bias) -> "
        "Tensor");
  m.def("w8a8_linear(Tensor x, Tensor codes, Tensor scales, Tensor code_sums, int out_features, Tensor? bias) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(ferry_kernels, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_group_linear", &int8_group_linear);
  m.impl("w8a8_linear", &w8a8_linear);
}
