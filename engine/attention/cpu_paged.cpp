// CPU paged attention: each query attends to its sequence's keys and values where they lie in the KV cache,
// found through the page table; nothing is gathered into a contiguous copy. Built at first use (and cached) by
// engine/attention/cpu_kernel.py, which picks the instruction-set flags; the source is written with GCC/Clang
// vector types, so the same code compiles to AVX-512, AVX2 or the baseline vectors.
//
// Work items are (sequence, block of consecutive queries), every head inside: keys are visited a block of
// kKeyBlock at a time for all KV heads, so each page is read front to back, and each key row serves every query
// head that shares its KV head (grouped-query attention). The softmax is online (flash-style); scores, the
// softmax and the weighted sum of values are float32 whatever the cache's dtype (bfloat16 and float16 are
// widened as read). Items are spread over torch's threads (at::parallel_for, so `torch.set_num_threads` governs
// it) by estimated cost rather than count, because one prefill chunk can cost as much as hundreds of decodes.
//
// Each query sees one interval of keys, [lo, hi): causal (from its window's start, if any, to itself), or for a
// query in a non-causal span the interval the runner computed from the span and the layer's window
// (engine/attention/base.py, span_intervals). A cache may hold another
// dtype than the queries (float8 e4m3, or bfloat16 under float32 queries), scaled: its scales fold into the
// score's scale and the output's normalisation, so a key or value costs only its widening. Sinks add one logit
// per query head to the softmax's denominator, at the end.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kKeyBlock = 32;
// Rows per KV head (queries x query heads per KV head) of one item of a multi-token chunk: enough to reuse each
// key row many times, few enough that the work a causal block wastes above the diagonal stays small.
constexpr int64_t kRowsPerItem = 32;
// Cost of an item beyond its row x key products, in the same units: locating pages, the softmax bookkeeping.
constexpr int64_t kItemOverhead = 64;
// Largest head size of the scalar path (head sizes without a vectorised instance of their own): room for a latent
// (MLA) head, whose keys are the latent and its rotary part.
constexpr int64_t kMaxScalarDim = 1024;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Lanes of the widest float vector the build targets (the flags decide: cpu_kernel.py).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

// W floats (or int32s) as one GCC/Clang vector: plain arithmetic on them compiles to the target's vector
// instructions, so one source serves AVX-512, AVX2 and the baseline; W = 1 is the scalar path.
template <int W>
struct VecTypes {
  typedef float F __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t I __attribute__((vector_size(W * sizeof(int32_t))));
};
template <int W>
using VecF = typename VecTypes<W>::F;
template <int W>
using VecI = typename VecTypes<W>::I;

template <int W>
inline VecF<W> load(const float* p) {
  VecF<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W>
inline void store(float* p, VecF<W> v) {
  std::memcpy(p, &v, sizeof v);
}

template <int W, std::size_t... I>
constexpr VecI<W> iota(std::index_sequence<I...>) {
  return VecI<W>{static_cast<int32_t>(I)...};
}

// x[lane] + x[lane's neighbour at distance B] for the lanes of x and y interleaved in blocks of B: one level of
// the transposing sum below.
template <int W, int B, std::size_t... I>
inline VecF<W> pair_sums(VecF<W> x, VecF<W> y, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, y, (((I / B) % 2 ? W : 0) + (I / B / 2) * 2 * B + I % B)...) +
         __builtin_shufflevector(x, y, (((I / B) % 2 ? W : 0) + (I / B / 2) * 2 * B + I % B + B)...);
}

// Lane l of the result is the sum of the lanes of v[l]: W dot products finished with 2(W - 1) shuffles and
// W - 1 additions instead of a horizontal sum each. Overwrites v.
template <int W, int B = 1>
inline VecF<W> transposed_sums(VecF<W>* v, int n = W) {
  if constexpr (B < W) {
    for (int i = 0; i < n / 2; ++i) v[i] = pair_sums<W, B>(v[2 * i], v[2 * i + 1], std::make_index_sequence<W>{});
    return transposed_sums<W, B * 2>(v, n / 2);
  } else {
    return v[0];
  }
}

template <int W>
inline float lane_max(VecF<W> v) {
  float m = v[0];
  for (int l = 1; l < W; ++l) m = std::max(m, v[l]);
  return m;
}

template <int W>
inline float lane_sum(VecF<W> v) {
  float s = v[0];
  for (int l = 1; l < W; ++l) s += v[l];
  return s;
}

// e^x for x <= 0 (a score minus its row's running maximum), lane by lane: Cephes' expf polynomial on
// [-ln2/2, ln2/2] after taking out a whole power of two; relative error about 2e-7. Inputs below -87 give about
// 1.6e-38 instead of a smaller value or 0, negligible beside the row's sum, which is at least 1.
template <int W>
inline VecF<W> exp_nonpositive(VecF<W> x) {
  const VecF<W> floor = VecF<W>{} - 87.0f;
  x = x < floor ? floor : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const VecF<W> n = (x * kLog2e + kRound) - kRound;
  const VecF<W> r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  VecF<W> poly = VecF<W>{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const VecF<W> e_r = poly * r * r + r + 1.0f;
  const VecI<W> exponent = (__builtin_convertvector(n, VecI<W>) + 127) << 23;
  return e_r * std::bit_cast<VecF<W>>(exponent);
}

// float8 e4m3 (`fn`: no infinities; 0x7F and 0xFF are NaN) as float32, exactly, in integer arithmetic without
// branches, which a row's loop vectorises. c10's conversion counts leading zeros one element at a time: a decode
// step of 16 sequences of 1024 tokens (32 heads over 8 KV heads of 128, one thread) took 170 ms over e4m3 against
// 12-15 ms over bfloat16; this takes 12 ms. Exponent and mantissa (7 bits) go under float32's with the exponent
// rebiased (127 - 7); a subnormal (exponent 0) is its mantissa times 2^-9; NaN, which the shift would read as 480,
// is set apart. Masks rather than `?:`, which GCC turns into branches that stop the vectoriser.
inline float widen_e4m3(uint8_t byte) {
  const uint32_t bits = byte, magnitude = bits & 0x7F;
  const uint32_t normal = (magnitude << 20) + (120u << 23);
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-9f);
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(magnitude < 8);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude == 0x7F);
  const uint32_t value = (subnormal & is_subnormal) | (normal & ~is_subnormal) | (is_nan & 0x7FC00000u);
  return std::bit_cast<float>(value | (bits & 0x80) << 24);
}

template <typename T>
inline float widen(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16);
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    return widen_e4m3(x.x);
  } else {
    return static_cast<float>(std::bit_cast<_Float16>(x.x));
  }
}

// A cache row as float32: the row itself for a float32 cache, else widened into `buffer`.
template <typename T>
inline const float* row_as_float(const T* row, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) buffer[d] = widen(row[d]);
    return buffer;
  }
}

struct Params {
  int64_t kv_heads, group, dim, page_size, num_pages;
  int64_t query_token_stride, query_head_stride, table_stride;
  int64_t window;  // 0: no sliding window
  float scale;         // times k_scale: the cache holds keys / k_scale
  float v_scale;       // the cache holds values / v_scale
  float softcap;       // 0: none
  const float* alibi;  // [heads] slopes, or nullptr
  const float* sinks;  // [heads] logits, or nullptr
  const int32_t* token_spans;  // [tokens, 2] keys [lo, hi) of each query in a non-causal span ((0, 0): none), or nullptr
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* page_tables;
};

// Queries [first, last) of one sequence (indices among its queries this step).
struct Block {
  int64_t seq, first, last;
};

// The keys [lo, hi) that the query at packed index `token`, position `pos`, sees.
inline std::pair<int64_t, int64_t> visible_keys(const Params& p, int64_t token, int64_t pos) {
  int64_t lo = p.window ? std::max<int64_t>(0, pos - p.window + 1) : 0, hi = pos + 1;
  if (p.token_spans) {
    const int64_t start = p.token_spans[2 * token], end = p.token_spans[2 * token + 1];
    if (start < end) {  // a query in a span sees the interval the runner computed for this layer's window
      lo = start;
      hi = end;
    }
  }
  return {lo, hi};
}

// The keys the queries of `block` see together: the union of their intervals.
inline std::pair<int64_t, int64_t> block_keys(const Params& p, const Block& block) {
  const int64_t start = p.query_start_loc[block.seq];
  const int64_t first_pos = p.seq_lens[block.seq] - (p.query_start_loc[block.seq + 1] - start) + block.first;
  int64_t lo = visible_keys(p, start + block.first, first_pos).first;
  int64_t hi = first_pos + block.last - block.first;
  if (p.token_spans) {
    for (int64_t t = block.first; t < block.last; ++t) {
      const auto [a, e] = visible_keys(p, start + t, first_pos + t - block.first);
      lo = std::min(lo, a);
      hi = std::max(hi, e);
    }
  }
  return {lo, hi};
}

// Per-thread buffers, sized once per call for the largest item.
struct Scratch {
  std::vector<float> queries, acc, row_max, row_sum, keys, values, zeros;
  std::vector<const float*> key_rows, value_rows;
  Scratch(int64_t rows, int64_t dim, int64_t kv_heads)
      : queries(rows * dim),
        acc(rows * dim),
        row_max(rows),
        row_sum(rows),
        keys(kKeyBlock * kv_heads * dim),
        values(kKeyBlock * kv_heads * dim),
        zeros(kv_heads * dim),
        key_rows(kKeyBlock),
        value_rows(kKeyBlock) {}
};

// One item: the block's queries, all their heads, over every key they may see. Keys are visited a block at a time
// for every KV head, so each page is read front to back (a slot holds all KV heads side by side). `kDim` is the
// head size with W-lane vectors, or 0 with W = 1 for any head size. Returns false when the page table points
// outside the cache.
template <typename T, typename C, int64_t kDim, int W>
bool attend(const Params& p, const T* query, const C* key_cache, const C* value_cache, T* out, const Block& block,
            Scratch& s) {
  static_assert(kDim % W == 0 && kKeyBlock % W == 0 && (kDim > 0 || W == 1));
  constexpr int64_t kChunks = kDim ? kDim / W : kMaxScalarDim;  // capacity of a row held in vectors
  constexpr int64_t kGroups = kKeyBlock / W;
  const int64_t dim = kDim ? kDim : p.dim;
  const int64_t chunks = dim / W;
  const int64_t heads = p.kv_heads * p.group;
  const int64_t slot_size = p.kv_heads * dim;  // one slot's keys (or values), every KV head
  const int64_t start = p.query_start_loc[block.seq];
  const int64_t num_queries = p.query_start_loc[block.seq + 1] - start;
  const int64_t first_pos = p.seq_lens[block.seq] - num_queries + block.first;  // position of the block's first query
  const int64_t block_queries = block.last - block.first;
  const int64_t rows = block_queries * heads;  // row m = query t * heads + query head
  const int32_t* table = p.page_tables + block.seq * p.table_stride;
  const float scale = p.scale, softcap = p.softcap;
  const VecI<W> lane = iota<W>(std::make_index_sequence<W>{});

  for (int64_t t = 0; t < block_queries; ++t) {
    for (int64_t hq = 0; hq < heads; ++hq) {
      const T* src = query + (start + block.first + t) * p.query_token_stride + hq * p.query_head_stride;
      float* dst = s.queries.data() + (t * heads + hq) * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) dst[d] = widen(src[d]);
    }
  }
  std::fill_n(s.acc.data(), rows * dim, 0.0f);
  std::fill_n(s.row_max.data(), rows, kMinusInf);
  std::fill_n(s.row_sum.data(), rows, 0.0f);

  const auto [key_lo, key_hi] = block_keys(p, block);
  for (int64_t j0 = key_lo; j0 < key_hi; j0 += kKeyBlock) {
    const int64_t j1 = std::min(j0 + kKeyBlock, key_hi);
    int64_t page_index = j0 / p.page_size;
    int64_t slot = j0 - page_index * p.page_size;
    int64_t page = table[page_index];
    for (int64_t jj = 0; jj < j1 - j0; ++jj, ++slot) {
      if (slot == p.page_size) {
        slot = 0;
        page = table[++page_index];
      }
      if ((jj == 0 || slot == 0) && (page < 0 || page >= p.num_pages)) return false;
      const int64_t offset = (page * p.page_size + slot) * slot_size;
      s.key_rows[jj] = row_as_float(key_cache + offset, s.keys.data() + jj * slot_size, slot_size);
      s.value_rows[jj] = row_as_float(value_cache + offset, s.values.data() + jj * slot_size, slot_size);
    }
    // A partial last group of keys reads zeros; its lanes are masked out.
    for (int64_t jj = j1 - j0; jj < kKeyBlock; ++jj) s.key_rows[jj] = s.zeros.data();

    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t t = 0; t < block_queries; ++t) {
        const int64_t pos = first_pos + t;
        // Keys [j0 + a, j0 + e) of this block are visible to query `pos`.
        const auto [lo, hi] = visible_keys(p, start + block.first + t, pos);
        const int64_t a = std::max(j0, lo) - j0;
        const int64_t e = std::min(j1, hi) - j0;
        if (a >= e) continue;
        const int64_t group_lo = a / W, group_hi = (e + W - 1) / W;
        for (int64_t g = 0; g < p.group; ++g) {
          const int64_t hq = h * p.group + g;
          const int64_t m = t * heads + hq;
          VecF<W> q[kChunks];
          for (int64_t c = 0; c < chunks; ++c) q[c] = load<W>(s.queries.data() + m * dim + c * W);

          VecF<W> scores[kGroups];
          for (int64_t gi = group_lo; gi < group_hi; ++gi) {
            VecF<W> dots[W];
            for (int l = 0; l < W; ++l) {
              const float* k = s.key_rows[gi * W + l] + h * dim;
              VecF<W> sum = q[0] * load<W>(k);
              for (int64_t c = 1; c < chunks; ++c) sum += q[c] * load<W>(k + c * W);
              dots[l] = sum;
            }
            // The order of operations is the torch backend's: scale, soft-cap, then the ALiBi bias.
            VecF<W> score = transposed_sums<W>(dots) * scale;
            if (softcap != 0.0f) {
              for (int l = 0; l < W; ++l) score[l] = std::tanh(score[l] / softcap) * softcap;
            }
            if (p.alibi) {
              const VecI<W> distance = lane + static_cast<int32_t>(j0 + gi * W - pos);
              score += p.alibi[hq] * __builtin_convertvector(distance, VecF<W>);
            }
            const VecI<W> index = lane + static_cast<int32_t>(gi * W);
            const VecI<W> visible = (index >= static_cast<int32_t>(a)) & (index < static_cast<int32_t>(e));
            scores[gi] = visible ? score : VecF<W>{} + kMinusInf;
          }

          VecF<W> highest = scores[group_lo];
          for (int64_t gi = group_lo + 1; gi < group_hi; ++gi) highest = highest > scores[gi] ? highest : scores[gi];
          const float old_max = s.row_max[m];
          const float new_max = std::max(old_max, lane_max<W>(highest));
          alignas(64) float probs[kKeyBlock];
          VecF<W> sums{};
          for (int64_t gi = group_lo; gi < group_hi; ++gi) {
            // Masked lanes hold -inf, whose e^x the polynomial would not give as 0.
            const VecF<W> prob = scores[gi] == kMinusInf ? VecF<W>{} : exp_nonpositive<W>(scores[gi] - new_max);
            store<W>(probs + gi * W, prob);
            sums += prob;
          }

          float* acc_row = s.acc.data() + m * dim;
          VecF<W> acc[kChunks];
          for (int64_t c = 0; c < chunks; ++c) acc[c] = load<W>(acc_row + c * W);
          float row_sum = s.row_sum[m];
          if (new_max != old_max && old_max != kMinusInf) {
            const float correction = exp_nonpositive<1>(VecF<1>{old_max - new_max})[0];
            row_sum *= correction;
            for (int64_t c = 0; c < chunks; ++c) acc[c] *= correction;
          }
          s.row_sum[m] = row_sum + lane_sum<W>(sums);
          s.row_max[m] = new_max;
          for (int64_t jj = a; jj < e; ++jj) {
            const float prob = probs[jj];
            const float* v = s.value_rows[jj] + h * dim;
            for (int64_t c = 0; c < chunks; ++c) acc[c] += prob * load<W>(v + c * W);
          }
          for (int64_t c = 0; c < chunks; ++c) store<W>(acc_row + c * W, acc[c]);
        }
      }
    }
  }

  for (int64_t m = 0; m < rows; ++m) {
    const float sink = p.sinks ? std::exp(p.sinks[m % heads] - s.row_max[m]) : 0.0f;
    const float inverse = p.v_scale / (s.row_sum[m] + sink);
    const float* acc = s.acc.data() + m * dim;
    T* dst = out + (start + block.first) * heads * dim + m * dim;  // out is [tokens, heads, dim], contiguous
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inverse);
  }
  return true;
}

template <typename T, typename C, int64_t kDim, int W>
void run(const Params& p, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         at::Tensor& out, int64_t num_seqs) {
  // Blocks of queries, and a running total of their estimated cost for splitting them among threads.
  std::vector<Block> blocks;
  std::vector<int64_t> cost_before{0};
  blocks.reserve(num_seqs);
  int64_t max_rows = 0;
  const int64_t chunk_block = std::max<int64_t>(1, kRowsPerItem / p.group);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t n = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    const int64_t total = p.seq_lens[seq];
    for (int64_t first = 0; first < n; first += chunk_block) {
      const int64_t last = std::min(n, first + chunk_block);
      blocks.push_back({seq, first, last});
      const auto [key_lo, key_hi] = block_keys(p, blocks.back());
      const int64_t keys = key_hi - key_lo;
      cost_before.push_back(cost_before.back() + (last - first) * p.group * keys + kItemOverhead);
      max_rows = std::max(max_rows, (last - first) * p.group * p.kv_heads);
    }
  }
  if (blocks.empty()) return;

  const T* q = query.const_data_ptr<T>();
  const C* k = key_cache.const_data_ptr<C>();
  const C* v = value_cache.const_data_ptr<C>();
  T* o = out.mutable_data_ptr<T>();
  const int64_t total_cost = cost_before.back();
  const int64_t num_tasks = std::min<int64_t>(at::get_num_threads(), blocks.size());
  std::atomic<bool> bad_page{false};
  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    Scratch scratch(max_rows, p.dim, p.kv_heads);
    for (int64_t task = task_begin; task < task_end; ++task) {
      // This task's share of the cost, as a range of blocks.
      const auto first = std::lower_bound(cost_before.begin(), cost_before.end() - 1, total_cost * task / num_tasks);
      const auto last = std::lower_bound(cost_before.begin(), cost_before.end() - 1, total_cost * (task + 1) / num_tasks);
      for (auto b = first - cost_before.begin(); b < last - cost_before.begin(); ++b) {
        if (!attend<T, C, kDim, W>(p, q, k, v, o, blocks[b], scratch)) bad_page = true;
      }
    }
  });
  TORCH_CHECK(!bad_page, "paged_attention: a page table entry points outside the KV cache");
}

template <typename T, typename C>
void run_dim(const Params& p, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             at::Tensor& out, int64_t num_seqs) {
  // The head sizes models use get vectors and a fixed trip count (rows held in registers); any other the scalar
  // path.
  switch (p.dim) {
    case 16: return run<T, C, 16, kLanes>(p, query, key_cache, value_cache, out, num_seqs);
    case 32: return run<T, C, 32, kLanes>(p, query, key_cache, value_cache, out, num_seqs);
    case 64: return run<T, C, 64, kLanes>(p, query, key_cache, value_cache, out, num_seqs);
    case 128: return run<T, C, 128, kLanes>(p, query, key_cache, value_cache, out, num_seqs);
    case 256: return run<T, C, 256, kLanes>(p, query, key_cache, value_cache, out, num_seqs);
    case 576: return run<T, C, 576, kLanes>(p, query, key_cache, value_cache, out, num_seqs);  // DeepSeek's latent
    default: return run<T, C, 0, 1>(p, query, key_cache, value_cache, out, num_seqs);
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& page_tables, double scale, int64_t window, double softcap,
                           const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
                           const std::optional<at::Tensor>& token_spans, double k_scale, double v_scale) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "key and value caches must be contiguous [pages, page_size, kv_heads, head_dim]");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "key and value caches must share a dtype");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and cache head sizes differ");
  TORCH_CHECK(query.size(2) <= kMaxScalarDim, "head sizes up to ", kMaxScalarDim, " are supported");
  const int64_t heads = query.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &page_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1, "step metadata must be int32, rows contiguous");
  }
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && page_tables.dim() == 2 && page_tables.size(0) == num_seqs,
              "query_start_loc must have one entry more than seq_lens, page_tables one row per sequence");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  for (const auto* slopes : {&alibi_slopes, &sinks}) {
    TORCH_CHECK(!*slopes || ((*slopes)->scalar_type() == at::kFloat && (*slopes)->is_contiguous() &&
                             (*slopes)->numel() == heads),
                "alibi_slopes and sinks must be float32 [heads]");
  }
  if (token_spans) {
    TORCH_CHECK(token_spans->scalar_type() == at::kInt && token_spans->is_contiguous() && token_spans->dim() == 2 &&
                    token_spans->size(0) == query.size(0) && token_spans->size(1) == 2,
                "token_spans must be int32 [tokens, 2]");
  }

  Params p{};
  p.kv_heads = kv_heads;
  p.group = heads / kv_heads;
  p.dim = query.size(2);
  p.page_size = key_cache.size(1);
  p.num_pages = key_cache.size(0);
  p.query_token_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.table_stride = page_tables.stride(0);
  p.window = window;
  p.scale = static_cast<float>(scale * k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.softcap = static_cast<float>(softcap);
  p.alibi = alibi_slopes ? alibi_slopes->const_data_ptr<float>() : nullptr;
  p.sinks = sinks ? sinks->const_data_ptr<float>() : nullptr;
  p.token_spans = token_spans ? token_spans->const_data_ptr<int32_t>() : nullptr;
  p.query_start_loc = query_start_loc.const_data_ptr<int32_t>();
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.page_tables = page_tables.const_data_ptr<int32_t>();

  at::Tensor out = at::empty({query.size(0), heads, p.dim}, query.options());
  using Float8 = c10::Float8_e4m3fn;
  const auto query_type = query.scalar_type(), cache_type = key_cache.scalar_type();
  const auto is = [&](at::ScalarType q, at::ScalarType c) { return query_type == q && cache_type == c; };
  const auto args = std::tie(p, query, key_cache, value_cache, out, num_seqs);
  if (is(at::kFloat, at::kFloat)) {
    std::apply(run_dim<float, float>, args);
  } else if (is(at::kFloat, at::kBFloat16)) {
    std::apply(run_dim<float, c10::BFloat16>, args);
  } else if (is(at::kFloat, at::kFloat8_e4m3fn)) {
    std::apply(run_dim<float, Float8>, args);
  } else if (is(at::kBFloat16, at::kBFloat16)) {
    std::apply(run_dim<c10::BFloat16, c10::BFloat16>, args);
  } else if (is(at::kBFloat16, at::kFloat8_e4m3fn)) {
    std::apply(run_dim<c10::BFloat16, Float8>, args);
  } else if (is(at::kHalf, at::kHalf)) {
    std::apply(run_dim<c10::Half, c10::Half>, args);
  } else if (is(at::kHalf, at::kFloat8_e4m3fn)) {
    std::apply(run_dim<c10::Half, Float8>, args);
  } else {
    TORCH_CHECK(false, "paged_attention computes float32, bfloat16 or float16 over a cache of the same dtype or ",
                "float8_e4m3fn (float32 also over bfloat16), not ", query_type, " over ", cache_type);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(ferry_attention, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor page_tables, float scale, int window, float softcap, Tensor? alibi_slopes, "
      "Tensor? sinks, Tensor? token_spans, float k_scale, float v_scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
