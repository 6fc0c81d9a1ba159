// tpserve's CPU operators: paged attention that reads the KV cache in place, the KV store, and
// the small fused element-wise ops of a decoder layer (RMSNorm + residual, rotary, SiLU-and-mul).
//
// Registered as torch.ops.tpserve_cpu.* (see tpserve/kernels/cpu_extension.py, which builds and
// loads this file). Every op writes into tensors the caller allocated; argument errors raise
// ValueError naming the argument. Work is split with at::parallel_for, so it uses exactly
// torch.get_num_threads() threads.
//
// Precision: attention accumulates in fp32 whatever the storage dtype. The element-wise ops
// round to the storage dtype exactly where the plain-torch code they replace does (each torch op
// on bf16 rounds its result), so both paths produce the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "gemma_ops.h"
#include "linear_ops.h"
#include "moe_ops.h"
#include "prompt_bf16.h"
#include "norm.h"
#include "vec.h"

namespace {

using namespace tpserve;

void check_dtype(const at::Tensor& t, const char* what) {
  const auto s = t.scalar_type();
  check_value(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, what);
}

// ---- paged attention ----------------------------------------------------------------------------

constexpr int64_t kQueryChunk = 16;  // query rows of one sequence handled by one work item
constexpr int64_t kKeyTile = 32;     // keys converted to fp32 and scored together

struct WorkItem {
  int32_t seq, row_begin, row_end;
};

// An int8 KV cache (--kv-cache-dtype int8): int8 codes in the cache's [num_blocks, block_size,
// Hkv, D] and one fp32 scale per slot and KV head ([num_blocks, block_size, Hkv], contiguous),
// symmetric per token and head: value = code * scale, scale = absmax / 127 of the head's row.
// The kernels read the codes and fold the scale into a score (keys) or a softmax weight (values).
// Null pointers: the cache holds the model's dtype (KT == T).
struct KvScales {
  const float* k = nullptr;
  const float* v = nullptr;
};

template <typename KT>
constexpr bool kInt8 = std::is_same_v<KT, int8_t>;

// Calls run(T*, KT*) with null pointers typed as the activations (fp32, else bf16) and the KV
// cache (the activations' type, or int8 codes): the instantiations the attention paths take.
template <typename Run>
void dispatch_kv(bool fp32, bool int8_kv, Run&& run) {
  if (fp32) {
    if (int8_kv) run(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
    else run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  } else {
    if (int8_kv) run(static_cast<at::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
    else run(static_cast<at::BFloat16*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  }
}

// One head's row of n values as int8 codes; returns its scale. The torch store
// (torch_store.py) computes the same bits: fp32 absmax, 127 / absmax, round half to even.
template <typename T>
inline float quantize_row(const T* src, int8_t* dst, int64_t n) {
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(to_f<T>(src[d])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < n; ++d) {
    const float c = std::nearbyint(to_f<T>(src[d]) * inv);
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
  }
  return amax / 127.f;
}

// Head sizes compiled with a constant head_dim (the loops unroll and the per-row accumulators
// stay in registers); any other head_dim up to kMaxHeadDim takes the kD == 0 instantiation.
constexpr int64_t kMaxHeadDim = 512;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

template <typename T, int64_t kD>
void attend_item(const WorkItem& w, const T* q, int64_t q_s0, int64_t q_s1, T* out,
                 const T* k_cache, const T* v_cache, const int32_t* tables, int64_t table_width,
                 int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                 int64_t q_begin, int64_t q_len, int64_t k_len, float scale,
                 std::vector<float>& scratch, const AttnOpts& o) {
  const int64_t D = kD > 0 ? kD : head_dim;
  const int64_t rows = w.row_end - w.row_begin;
  const int64_t hq = num_kv_heads * group;
  const int64_t nq = rows * hq;  // query vectors: (row, query head)
  const int64_t row_stride = num_kv_heads * D;  // between consecutive slots of the cache
  scratch.resize(static_cast<size_t>(nq * D * 2 + nq * 2 + kKeyTile + kKeyTile * row_stride * 2));
  float* qf = scratch.data();
  float* acc = qf + nq * D;
  float* mx = acc + nq * D;
  float* sum = mx + nq;
  float* s = sum + nq;
  float* kt = s + kKeyTile;
  float* vt = kt + kKeyTile * row_stride;

  const int64_t offset = k_len - q_len;  // absolute position of the sequence's first query row
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t v = r * hq + h;
      const T* src = q + (q_begin + w.row_begin + r) * q_s0 + h * q_s1;
      for (int64_t d = 0; d < D; ++d) qf[v * D + d] = to_f<T>(src[d]) * scale;
      mx[v] = o.start_max(h);
      sum[v] = o.start_sum();
    }
  }
  std::fill(acc, acc + nq * D, 0.f);

  const int32_t* table = tables + static_cast<int64_t>(w.seq) * table_width;
  const int64_t k_end = offset + w.row_end;  // keys past the chunk's last row are never needed
  float pv[kD > 0 ? kD : kMaxHeadDim];
  auto slot_of = [&](int64_t p) {
    return static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
  };
  for (int64_t p0 = o.first_key(offset + w.row_begin); p0 < k_end; p0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, k_end - p0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = slot_of(p0 + j);
      // Whole slot rows (every KV head): the cache is read front to back, once per item.
      load_row(k_cache + slot * row_stride, kt + j * row_stride, row_stride);
      load_row(v_cache + slot * row_stride, vt + j * row_stride, row_stride);
    }
    for (int64_t v = 0; v < nq; ++v) {
      const int64_t qpos = offset + w.row_begin + v / hq;
      const int64_t kv_off = ((v % hq) / group) * D;  // this query head's KV head in a slot row
      const int64_t visible = std::min<int64_t>(nk, qpos - p0 + 1);  // causal: keys <= qpos
      const int64_t lo = std::max<int64_t>(0, o.first_key(qpos) - p0);  // the window's first
      if (visible <= lo) continue;
      const float* qv = qf + v * D;
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j < visible; ++j) s[j] = dot(qv, kt + j * row_stride + kv_off, D);
      o.cap(s + lo, visible - lo);
      for (int64_t j = lo; j < visible; ++j) tile_max = std::max(tile_max, s[j]);
      const float new_max = std::max(mx[v], tile_max);
      const float alpha = exp_nonpos(mx[v] - new_max);  // exp(-inf) -> 0 on the first tile
      for (int64_t j = lo; j < visible; ++j) s[j] = exp_nonpos(s[j] - new_max);
      float tile_sum = 0.f;
      for (int64_t j = lo; j < visible; ++j) tile_sum += s[j];
      mx[v] = new_max;
      sum[v] = sum[v] * alpha + tile_sum;
      // P @ V for this tile, summed in a local row first (registers when D is a constant)
      // rather than read-modify-writing the accumulator once per key.
      float* av = acc + v * D;
      for (int64_t d = 0; d < D; ++d) pv[d] = av[d] * alpha;
      for (int64_t j = lo; j < visible; ++j) {
        const float pj = s[j];
        const float* vj = vt + j * row_stride + kv_off;
        for (int64_t d = 0; d < D; ++d) pv[d] += pj * vj[d];
      }
      for (int64_t d = 0; d < D; ++d) av[d] = pv[d];
    }
  }
  for (int64_t v = 0; v < nq; ++v) {
    T* dst = out + ((q_begin + w.row_begin) * hq + v) * D;
    const float inv = 1.f / sum[v];
    for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(acc[v * D + d] * inv);
  }
}

template <typename T>
using AttendFn = void (*)(const WorkItem&, const T*, int64_t, int64_t, T*, const T*, const T*,
                          const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, std::vector<float>&, const AttnOpts&);

template <typename T>
AttendFn<T> attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 64: return &attend_item<T, 64>;
    case 128: return &attend_item<T, 128>;
    case 256: return &attend_item<T, 256>;
    default: return &attend_item<T, 0>;
  }
}

// ---- decode rows: one query row per sequence ------------------------------------------------------
//
// The hot path of a decode step. One work item is one sequence: its keys are read slot row by
// slot row (every KV head of a slot is one contiguous run of memory, so the cache streams front
// to back through whole cache lines), and each KV head's row is widened once for the query heads
// of its group. Rows are vectors of the machine's width (vfl below: one AVX-512 or AVX2 register)
// written with GCC's vector extensions. Scores go to a per-item buffer (two
// passes, not an online softmax: a sequence's scores fit in L1/L2, and no rescaling sits in the
// key loop), then values are summed with the softmax weights. Blocks are walked entry by entry,
// so there is no division per key. Measured at batch 64 (~280 keys, 8/4 heads of 64, bf16, one
// thread, medians of 50 calls): the general kernel above 3.7-4.5 ms, this path 2.8 ms.

// A prompt key tile is 16 keys, one or two vectors. (64-key tiles were measured: ~10% faster on a
// 2,000-token prompt, ~15% slower on the benchmark's short prompts.)
constexpr int64_t kPromptKeys = 16;  // keys per prompt tile
constexpr int64_t kTileVectors = kPromptKeys / kLanes;

// fn(row, i, slot) for the cache's slot row of each position k_begin + i < k_len, in order, walking
// the block table entry by entry from the block holding k_begin (blocks before it are not read).
// With pf_bytes, the bytes [pf_offset, pf_offset + pf_bytes) of the blocks ahead are requested
// row by row as this block's rows are read: row j of the next block into L1, row j of the one
// after into L2. Blocks lie anywhere in the pool, so the hardware prefetchers, which follow one
// block's rows, stall at every block's start. 26 layers of 32 sequences x 1,100 keys (4 / 1
// heads of 256, window 512, two threads, a pool of 2 MB pages): 12-13 GB/s with no prefetch
// or the next block's rows all asked for at its start, 17.7 GB/s this way.
template <typename T, typename Fn>
inline void for_each_slot_row(const T* cache, const int32_t* table, int64_t block_size,
                              int64_t row_stride, int64_t k_begin, int64_t k_len, Fn&& fn,
                              int64_t pf_offset = 0, int64_t pf_bytes = 0) {
  int64_t c = k_begin / block_size, j = k_begin - c * block_size;
  const int64_t last = (k_len - 1) / block_size;
  const int64_t rs = row_stride * static_cast<int64_t>(sizeof(T));
  auto block_bytes = [&](int64_t b) {
    return reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[b]) * block_size * row_stride) +
           pf_offset;
  };
  auto prefetch_row = [&](const char* row, int locality) {
    for (int64_t b = 0; b < pf_bytes; b += 64) {
      if (locality == 3) {
        __builtin_prefetch(row + b, 0, 3);
      } else {
        __builtin_prefetch(row + b, 0, 1);
      }
    }
  };
  for (int64_t p0 = c * block_size; p0 < k_len; p0 += block_size, ++c, j = 0) {
    const int64_t n = std::min(block_size, k_len - p0);
    const int64_t slot0 = static_cast<int64_t>(table[c]) * block_size;
    const char* next = pf_bytes > 0 && c < last ? block_bytes(c + 1) : nullptr;
    const char* after = pf_bytes > 0 && c + 1 < last ? block_bytes(c + 2) : nullptr;
    for (int64_t r = 0; next != nullptr && r < j; ++r) prefetch_row(next + r * rs, 3);  // rows skipped here
    const T* row = cache + (slot0 + j) * row_stride;
    for (; j < n; ++j, row += row_stride) {
      if (next != nullptr) prefetch_row(next + j * rs, 3);
      if (after != nullptr) prefetch_row(after + j * rs, 1);
      fn(row, p0 + j - k_begin, slot0 + j);
    }
  }
}

// Value sums a decode work item keeps in registers at once (pass 3 below).
constexpr int64_t kAccVectors = 16;

// Pass 3 of a decode item for NH query heads of KV head kh and CV vectors of the head dimension
// starting at `off` (kh * D + the chunk's first element): each key's value vectors are widened
// once for all NH heads, whose sums stay in registers over every key, then are stored to `acc`
// (the first head's row of the chunk; heads D apart). `w` holds the first head's softmax weights
// (heads n apart). Each sum is the same sequence of fused multiply-adds in key order whatever NH
// and CV are, so the chunking does not change a bit.
template <typename KT, int64_t NH, int64_t CV>
inline void decode_values(const KT* v_cache, const int32_t* table, int64_t block_size, int64_t row_stride,
                          int64_t k_begin, int64_t k_len, int64_t off, const float* w, int64_t n,
                          const float* v_scales, int64_t num_kv_heads, int64_t kh, float* acc, int64_t D) {
  vfl a[NH][CV];
  for (int64_t g = 0; g < NH; ++g) {
    for (int64_t i = 0; i < CV; ++i) a[g][i] = vfl{} * 0.f;
  }
  for_each_slot_row(v_cache, table, block_size, row_stride, k_begin, k_len,
                    [&](const KT* vp, int64_t p, int64_t slot) {
    vfl row[CV];
    for (int64_t i = 0; i < CV; ++i) row[i] = loadl(vp + off + i * kLanes);
    float vs = 1.f;
    if constexpr (kInt8<KT>) vs = v_scales[slot * num_kv_heads + kh];
    for (int64_t g = 0; g < NH; ++g) {
      const float wg = kInt8<KT> ? w[g * n + p] * vs : w[g * n + p];
      for (int64_t i = 0; i < CV; ++i) a[g][i] += wg * row[i];
    }
  }, off * static_cast<int64_t>(sizeof(KT)), CV * kLanes * static_cast<int64_t>(sizeof(KT)));
  for (int64_t g = 0; g < NH; ++g) {
    for (int64_t i = 0; i < CV; ++i) storel(acc + g * D + i * kLanes, a[g][i]);
  }
}

// The heads of a KV head in runs of NH, the head dimension in chunks of CV vectors (kC of them in
// all), so that NH * CV sums fit the registers.
template <typename KT, int64_t kC, int64_t NH>
inline void decode_values_heads(const KT* v_cache, const int32_t* table, int64_t block_size,
                                int64_t row_stride, int64_t k_begin, int64_t k_len, const float* s, int64_t n,
                                const float* v_scales, int64_t num_kv_heads, int64_t kh, int64_t group,
                                float* acc) {
  constexpr int64_t kRegs = kLanes == 16 ? kAccVectors : kAccVectors / 2;  // AVX2: 16 registers
  constexpr int64_t CV = std::max<int64_t>(1, std::min<int64_t>(kC, kRegs / NH));
  static_assert(kC % CV == 0, "chunks of the head dimension must divide it");
  constexpr int64_t D = kC * kLanes;
  for (int64_t h0 = kh * group; h0 < (kh + 1) * group; h0 += NH) {
    for (int64_t c0 = 0; c0 < kC; c0 += CV) {
      decode_values<KT, NH, CV>(v_cache, table, block_size, row_stride, k_begin, k_len,
                                kh * D + c0 * kLanes, s + h0 * n, n, v_scales, num_kv_heads, kh,
                                acc + h0 * D + c0 * kLanes, D);
    }
  }
}

#if defined(__AVX512BF16__)
// Pass 1 of a bf16 decode item on AVX512-BF16: a key row's bf16 pairs times the query heads' own
// bf16 pairs (vdpbf16ps: exact products, fp32 sums, two chains a head), the scale applied to the
// sum, so no lane of the key row is widened. kC: the head dimension in 16-float vectors.
template <int64_t kC>
inline void decode_scores_bf16(const at::BFloat16* k_cache, const int32_t* table, int64_t block_size,
                               int64_t row_stride, int64_t k_begin, int64_t k_len, const uint16_t* qb,
                               int64_t kv_begin, int64_t kv_end, int64_t group, float scale, float* s,
                               int64_t n) {
  constexpr int64_t D = kC * 16, kPairs = D / 32;
  static_assert(kPairs >= 2 && kPairs % 2 == 0, "head_dim: a multiple of 64");
  for_each_slot_row(k_cache, table, block_size, row_stride, k_begin, k_len,
                    [&](const at::BFloat16* kp, int64_t p, int64_t) {
    for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
      __m512bh kr[kPairs];
      for (int64_t i = 0; i < kPairs; ++i) {
        kr[i] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(kp) + kh * D + i * 32);
      }
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        const uint16_t* qh = qb + h * D;
        __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
        for (int64_t i = 0; i < kPairs; i += 2) {
          t0 = _mm512_dpbf16_ps(t0, (__m512bh)_mm512_loadu_si512(qh + i * 32), kr[i]);
          t1 = _mm512_dpbf16_ps(t1, (__m512bh)_mm512_loadu_si512(qh + (i + 1) * 32), kr[i + 1]);
        }
        s[h * n + p] = _mm512_reduce_add_ps(_mm512_add_ps(t0, t1)) * scale;
      }
    }
  }, kv_begin * D * 2, (kv_end - kv_begin) * D * 2);
}
#endif

// kC: head_dim / kLanes as a constant (registers, unrolled loops), or 0 for any multiple of 16.
// KT: the cache's element type, T or int8_t (then `kvs` holds the scales: a key's scale multiplies
// its scores, a value's scale its softmax weights).
template <typename T, typename KT, int64_t kC>
void decode_item(int64_t seq, const T* q, int64_t q_s0, int64_t q_s1, T* out, const KT* k_cache,
                 const KT* v_cache, const int32_t* table, int64_t block_size, int64_t num_kv_heads,
                 int64_t group, int64_t head_dim, int64_t k_len, float scale,
                 std::vector<float>& scratch, int64_t kv_begin, int64_t kv_end, const AttnOpts& o,
                 const KvScales& kvs) {
  const int64_t C = kC > 0 ? kC : head_dim / kLanes;
  const int64_t D = C * kLanes;
  const int64_t hq = num_kv_heads * group;
  const int64_t row_stride = num_kv_heads * D;
  const int64_t h_begin = kv_begin * group, h_end = kv_end * group;
  const int64_t k_begin = o.first_key(k_len - 1);  // the row's window: keys k_begin .. k_len - 1
  const int64_t n = k_len - k_begin;
  scratch.resize(static_cast<size_t>(hq * D * 2 + hq + hq * n + (hq * D + 1) / 2));  // + bf16 queries
  float* qf = scratch.data();
  float* acc = qf + hq * D;
  float* inv = acc + hq * D;
  float* s = inv + hq;  // scores [hq][n], then softmax weights
  for (int64_t h = h_begin; h < h_end; ++h) {
    const T* src = q + seq * q_s0 + h * q_s1;
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f<T>(src[d]) * scale;
  }
  vfl row[kC > 0 ? kC : kMaxHeadDim / kLanes];

  // Pass 1: scores.
#if defined(__AVX512BF16__)
  constexpr bool kDp = std::is_same_v<T, at::BFloat16> && std::is_same_v<KT, at::BFloat16> && kC >= 4 &&
                       kC % 4 == 0;
  if constexpr (kDp) {
    // The query heads' bf16 rows as they are (the scale multiplies the sums instead).
    uint16_t* qb = reinterpret_cast<uint16_t*>(s + hq * n);
    for (int64_t h = h_begin; h < h_end; ++h) {
      std::memcpy(qb + h * D, q + seq * q_s0 + h * q_s1, D * sizeof(uint16_t));
    }
    decode_scores_bf16<kC>(k_cache, table, block_size, row_stride, k_begin, k_len, qb, kv_begin, kv_end,
                           group, scale, s, n);
  } else
#endif
  for_each_slot_row(k_cache, table, block_size, row_stride, k_begin, k_len,
                    [&](const KT* kp, int64_t p, int64_t slot) {
    for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
      for (int64_t i = 0; i < C; ++i) row[i] = loadl(kp + kh * D + i * kLanes);
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        const float* qh = qf + h * D;
        vfl t = loadl(qh) * row[0];
        for (int64_t i = 1; i < C; ++i) t += loadl(qh + i * kLanes) * row[i];
        if constexpr (kInt8<KT>) {
          s[h * n + p] = hsuml(t) * kvs.k[slot * num_kv_heads + kh];
        } else {
          s[h * n + p] = hsuml(t);
        }
      }
    }
  }, kv_begin * D * static_cast<int64_t>(sizeof(KT)),
     (kv_end - kv_begin) * D * static_cast<int64_t>(sizeof(KT)));
  // Pass 2: softmax weights (unnormalised) and their sums; a sink joins the maximum and the sum.
  for (int64_t h = h_begin; h < h_end; ++h) {
    float* sh = s + h * n;
    o.cap(sh, n);
    float mx = o.start_max(h);
    for (int64_t p = 0; p < n; ++p) mx = std::max(mx, sh[p]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < n; ++p) {
      sh[p] = exp_nonpos(sh[p] - mx);
      sum += sh[p];
    }
    if (o.sinks) sum += exp_nonpos(o.sinks[h] - mx);
    inv[h] = 1.f / sum;
  }
  // Pass 3: weighted sum of the values, a KV head and a run of its query heads at a time, their
  // sums in registers (kAccVectors of them) over every key, then stored. Each sum is the same
  // sequence of fused multiply-adds in key order whichever run a head falls in. With the head
  // dimension known (kC), the values are widened once for a run of up to 4 heads
  // (decode_values_heads); otherwise once per head.
  if constexpr (kC > 0) {
    for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
      if (group % 4 == 0) {
        decode_values_heads<KT, kC, 4>(v_cache, table, block_size, row_stride, k_begin, k_len, s, n, kvs.v,
                                       num_kv_heads, kh, group, acc);
      } else if (group % 2 == 0) {
        decode_values_heads<KT, kC, 2>(v_cache, table, block_size, row_stride, k_begin, k_len, s, n, kvs.v,
                                       num_kv_heads, kh, group, acc);
      } else {
        decode_values_heads<KT, kC, 1>(v_cache, table, block_size, row_stride, k_begin, k_len, s, n, kvs.v,
                                       num_kv_heads, kh, group, acc);
      }
    }
  } else
  for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
    const int64_t run = std::max<int64_t>(1, kAccVectors / C);
    for (int64_t h0 = kh * group; h0 < (kh + 1) * group; h0 += run) {
      const int64_t nh = std::min(run, (kh + 1) * group - h0);
      vfl a[kC > 0 ? std::max<int64_t>(kAccVectors, kC) : kMaxHeadDim / kLanes];
      for (int64_t i = 0; i < nh * C; ++i) a[i] = vfl{} * 0.f;
      for_each_slot_row(v_cache, table, block_size, row_stride, k_begin, k_len,
                        [&](const KT* vp, int64_t p, int64_t slot) {
        for (int64_t i = 0; i < C; ++i) row[i] = loadl(vp + kh * D + i * kLanes);
        float vs = 1.f;
        if constexpr (kInt8<KT>) vs = kvs.v[slot * num_kv_heads + kh];
        for (int64_t g = 0; g < nh; ++g) {
          const float w = kInt8<KT> ? s[(h0 + g) * n + p] * vs : s[(h0 + g) * n + p];
          for (int64_t i = 0; i < C; ++i) a[g * C + i] += w * row[i];
        }
      });
      for (int64_t g = 0; g < nh; ++g) {
        for (int64_t i = 0; i < C; ++i) storel(acc + (h0 + g) * D + i * kLanes, a[g * C + i]);
      }
    }
  }
  T* dst = out + seq * hq * D;
  for (int64_t h = h_begin; h < h_end; ++h) {
    for (int64_t d = 0; d < D; ++d) dst[h * D + d] = from_f<T>(acc[h * D + d] * inv[h]);
  }
}

template <typename T, typename KT>
using DecodeFn = void (*)(int64_t, const T*, int64_t, int64_t, T*, const KT*, const KT*,
                          const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          std::vector<float>&, int64_t, int64_t, const AttnOpts&, const KvScales&);

template <typename T, typename KT>
DecodeFn<T, KT> decode_for(int64_t head_dim) {
  switch (head_dim) {
    case 64: return &decode_item<T, KT, 64 / kLanes>;
    case 128: return &decode_item<T, KT, 128 / kLanes>;
    case 256: return &decode_item<T, KT, 256 / kLanes>;
    default: return &decode_item<T, KT, 0>;
  }
}

// The decode path's preconditions: one row per sequence, fp32 or bf16, head_dim % 16 == 0.
template <typename T, typename KT = T>
void paged_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const int32_t* tables, int64_t width,
                  const int32_t* ctx, int64_t B, float scale, const AttnOpts& o,
                  const KvScales& kvs = {}) {
  const int64_t hkv = k_cache.size(2), group = q.size(1) / hkv, D = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const KT* kp = k_cache.data_ptr<KT>();
  const KT* vp = v_cache.data_ptr<KT>();
  const DecodeFn<T, KT> fn = decode_for<T, KT>(D);
  // A work item is a sequence, or with fewer sequences than threads a run of its KV heads, so
  // that one stream's attention is not one thread's. Each head's arithmetic is the same either way.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = B >= threads ? 1 : std::min(hkv, (threads + B - 1) / B);
  const int64_t chunk = (hkv + parts - 1) / parts, per_seq = (hkv + chunk - 1) / chunk;
  at::parallel_for(0, B * per_seq, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;  // kept: no allocation per layer and step
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / per_seq, kv0 = item % per_seq * chunk;
      fn(b, qp, q.stride(0), q.stride(1), op, kp, vp, tables + b * width, block_size, hkv, group,
         D, ctx[b], scale, scratch, kv0, std::min(hkv, kv0 + chunk), o, kvs);
    }
  });
}

// ---- batch-invariant rows: every query row as a decode row ------------------------------------------
//
// The batch-invariant mode (EngineConfig.batch_invariant, docs/protocol.md "Reproducibility")
// computes every query row, a prompt's as well as a decode's or a speculative verification's, with
// the decode path's arithmetic: row t of sequence b is a one-row "sequence" whose keys are the
// first offset + r + 1 of b's (r its index among b's rows). decode_item's sums depend only on the
// row's query, its keys and their count, never on the other rows of the call, how they are split
// into work items or threads, nor on whether the row came as a prompt chunk, a prefix-cache hit's
// remainder, a preempted sequence's recomputation or a draft being verified. So a token's
// attention is the same bits in every situation, and equal to what a pure decode step (this path,
// decode_attention, the DecodeStack) computes. Its cost: a prompt's keys are read once per row
// instead of once per tile of rows (prompt attention is a small part of a step at the lengths the
// benchmark serves; the matmuls dominate).
template <typename T, typename KT = T>
void paged_rows(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const int32_t* tables, int64_t width,
                const int32_t* cu, const int32_t* ctx, int64_t B, float scale, const AttnOpts& o,
                const KvScales& kvs = {}) {
  const int64_t hkv = k_cache.size(2), group = q.size(1) / hkv, D = q.size(2);
  const int64_t block_size = k_cache.size(1), T_rows = q.size(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const KT* kp = k_cache.data_ptr<KT>();
  const KT* vp = v_cache.data_ptr<KT>();
  const DecodeFn<T, KT> fn = decode_for<T, KT>(D);
  std::vector<int32_t> seq_of(static_cast<size_t>(T_rows)), keys_of(static_cast<size_t>(T_rows));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b], offset = ctx[b] - q_len;
    for (int64_t r = 0; r < q_len; ++r) {
      seq_of[cu[b] + r] = static_cast<int32_t>(b);
      keys_of[cu[b] + r] = static_cast<int32_t>(offset + r + 1);
    }
  }
  // Work items as paged_decode splits them (a row, or a run of its KV heads): each head's
  // arithmetic is the same either way.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = T_rows >= threads ? 1 : std::min(hkv, (threads + T_rows - 1) / T_rows);
  const int64_t chunk = (hkv + parts - 1) / parts, per_row = (hkv + chunk - 1) / chunk;
  at::parallel_for(0, T_rows * per_row, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / per_row, kv0 = item % per_row * chunk;
      fn(t, qp, q.stride(0), q.stride(1), op, kp, vp, tables + seq_of[t] * width, block_size, hkv, group,
         D, keys_of[t], scale, scratch, kv0, std::min(hkv, kv0 + chunk), o, kvs);
    }
  });
}

// ---- prompt rows: tiles of query rows against tiles of keys ---------------------------------------
//
// Prompt rows are GEMM-shaped: many query rows of one sequence see the same keys. A work item is
// (sequence, up to kPromptRows query positions, one KV head) with every query head of that KV
// head's group, so each key tile is read from the cache and widened once for all of them. Keys
// come in tiles of 16 at absolute positions 0, 16, 32, ...: a tile's keys are transposed into a
// [D][16] block, so one query vector's 16 scores are D vector FMAs (a broadcast query element
// times a row of the block), and the values of the tile multiply the softmax weights row by row.
// The softmax is online over tiles, in fp32.
//
// A query row's arithmetic depends only on its position and its keys, never on which other
// rows share its item or where its item starts: the tiles are aligned to absolute positions, a
// row reads exactly its visible keys of each tile, and tiles it cannot see are skipped. So a
// prompt computes the same bits whether its prefix was just computed in this step or read from
// the prefix cache (docs/protocol.md promises this; tests/test_determinism.py checks it).
//
// Items are handed out largest first from a shared counter, so threads finish together even
// when prompts differ in length.

// kC: head_dim / kLanes as a constant, or 0 for any multiple of 16. KT: the cache's element type
// (T, or int8_t with `kvs`' scales applied as a tile is widened).
template <typename T, typename KT, int64_t kC>
void prompt_item(const PromptItem& w, const T* q, int64_t q_s0, int64_t q_s1, T* out,
                 const KT* k_cache, const KT* v_cache, const int32_t* table, int64_t block_size,
                 int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t q_begin,
                 int64_t offset, float scale, std::vector<float>& scratch, const AttnOpts& o,
                 const KvScales& kvs) {
  constexpr int64_t K = kPromptKeys, NV = kTileVectors;
  const int64_t C = kC > 0 ? kC : head_dim / kLanes;
  const int64_t D = C * kLanes;
  const int64_t hq = num_kv_heads * group;
  const int64_t row_stride = num_kv_heads * D;
  const int64_t rows = w.row_end - w.row_begin;
  const int64_t nq = rows * group;  // query vectors (row, head of the group), row-major
  scratch.resize(static_cast<size_t>(nq * D * 2 + nq * 2 + D * K * 2 + K));
  float* qf = scratch.data();  // [nq][D], scaled
  float* acc = qf + nq * D;    // [nq][D]
  float* mx = acc + nq * D;
  float* sum = mx + nq;
  float* kt = sum + nq;       // [D][K]: the tile's keys, transposed
  float* vt = kt + D * K;     // [K][D]: the tile's values
  float* p = vt + D * K;      // [K]: one row's softmax weights
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      const T* src = q + (q_begin + w.row_begin + r) * q_s0 + (w.kv_head * group + g) * q_s1;
      for (int64_t d = 0; d < D; ++d) qf[v * D + d] = to_f<T>(src[d]) * scale;
      mx[v] = o.start_max(w.kv_head * group + g);
      sum[v] = o.start_sum();
    }
  }
  std::fill(acc, acc + nq * D, 0.f);
  const int64_t first_pos = offset + w.row_begin;  // absolute position of the item's first row
  const int64_t k_end = offset + w.row_end;        // keys past the last row are never needed
  // With a window: tiles from the one holding the first row's first key; keys before it (some of
  // that tile's) are not read.
  const int64_t k_lo = o.first_key(first_pos);
  vfl a[kC > 0 ? kC : kMaxHeadDim / kLanes];
  for (int64_t p0 = k_lo / K * K; p0 < k_end; p0 += K) {
    const int64_t nk = std::min<int64_t>(K, k_end - p0);
    for (int64_t j = 0; j < K; ++j) {
      if (j < nk && p0 + j >= k_lo) {
        const int64_t pos = p0 + j;
        const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
        const KT* kr = k_cache + slot * row_stride + w.kv_head * D;
        const KT* vr = v_cache + slot * row_stride + w.kv_head * D;
        if constexpr (kInt8<KT>) {
          const int64_t at = slot * num_kv_heads + w.kv_head;
          const float ks = kvs.k[at], vs = kvs.v[at];
          for (int64_t d = 0; d < D; ++d) kt[d * K + j] = static_cast<float>(kr[d]) * ks;
          for (int64_t d = 0; d < D; ++d) vt[j * D + d] = static_cast<float>(vr[d]) * vs;
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * K + j] = to_f<T>(kr[d]);
          for (int64_t d = 0; d < D; ++d) vt[j * D + d] = to_f<T>(vr[d]);
        }
      } else {  // past the last row or before the window: never visible, but kept finite
        for (int64_t d = 0; d < D; ++d) kt[d * K + j] = 0.f;
      }
    }
    // Rows before p0 see none of this tile, nor (with a window) rows whose window starts past it.
    const int64_t v_begin = std::max<int64_t>(0, p0 - first_pos) * group;
    const int64_t v_end = o.window > 0
        ? std::min<int64_t>(nq, std::max<int64_t>(0, p0 + K + o.window - 1 - first_pos) * group) : nq;
    for (int64_t v0 = v_begin; v0 < v_end; v0 += 4) {
      const int64_t nv = std::min<int64_t>(4, v_end - v0);
      vfl s[4][NV] = {};
      const float* q0 = qf + v0 * D;
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t h = 0; h < NV; ++h) {
          const vfl kd = loadl(kt + d * K + h * kLanes);
          for (int64_t u = 0; u < 4; ++u) s[u][h] += q0[u * D + d] * kd;
        }
      }
      for (int64_t u = 0; u < nv; ++u) {
        const int64_t v = v0 + u;
        const int64_t qpos = first_pos + v / group;
        const int64_t visible = std::min<int64_t>(K, qpos - p0 + 1);
        const int64_t lo = std::max<int64_t>(0, o.first_key(qpos) - p0);  // the window's first
        float sc[K];
        for (int64_t h = 0; h < NV; ++h) storel(sc + h * kLanes, s[u][h]);
        o.cap(sc, K);
        float tile_max = -std::numeric_limits<float>::infinity();
        if (visible == K && lo == 0 && o.softcap == 0.f) {
          vfl m = s[u][0];
          for (int64_t h = 1; h < NV; ++h) m = m > s[u][h] ? m : s[u][h];
          tile_max = hmaxl(m);
        } else {
          for (int64_t j = lo; j < visible; ++j) tile_max = std::max(tile_max, sc[j]);
        }
        const float new_max = std::max(mx[v], tile_max);
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) p[j] = j >= lo && j < visible ? exp_nonpos(sc[j] - new_max) : 0.f;
        vfl ps = loadl(p);
        for (int64_t h = 1; h < NV; ++h) ps += loadl(p + h * kLanes);
        float* av = acc + v * D;
        if (new_max == mx[v]) {  // the running maximum stands: exp(0) = 1, nothing to rescale
          sum[v] += hsuml(ps);
          for (int64_t i = 0; i < C; ++i) a[i] = loadl(av + i * kLanes);
        } else {
          const float alpha = exp_nonpos(mx[v] - new_max);  // exp(-inf) -> 0 on the first tile
          mx[v] = new_max;
          sum[v] = sum[v] * alpha + hsuml(ps);
          for (int64_t i = 0; i < C; ++i) a[i] = loadl(av + i * kLanes) * alpha;
        }
        for (int64_t j = lo; j < visible; ++j) {
          const float pj = p[j];
          const float* vj = vt + j * D;
          for (int64_t i = 0; i < C; ++i) a[i] += pj * loadl(vj + i * kLanes);
        }
        for (int64_t i = 0; i < C; ++i) storel(av + i * kLanes, a[i]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      T* dst = out + ((q_begin + w.row_begin + r) * hq + w.kv_head * group + g) * D;
      const float inv = 1.f / sum[v];
      for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(acc[v * D + d] * inv);
    }
  }
}

template <typename T, typename KT>
using PromptFn = void (*)(const PromptItem&, const T*, int64_t, int64_t, T*, const KT*, const KT*,
                          const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          float, std::vector<float>&, const AttnOpts&, const KvScales&);

template <typename T, typename KT>
PromptFn<T, KT> prompt_for(int64_t head_dim) {
  switch (head_dim) {
    case 64: return &prompt_item<T, KT, 64 / kLanes>;
    case 128: return &prompt_item<T, KT, 128 / kLanes>;
    case 256: return &prompt_item<T, KT, 256 / kLanes>;
    default: return &prompt_item<T, KT, 0>;
  }
}

// The prompt path's preconditions: fp32 or bf16, head_dim % 16 == 0.
template <typename T, typename KT = T>
void paged_prompt(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const int32_t* tables, int64_t width,
                  const int32_t* cu, const int32_t* ctx, int64_t B, float scale, const AttnOpts& o,
                  const KvScales& kvs = {}) {
  const int64_t hkv = k_cache.size(2), group = q.size(1) / hkv, D = q.size(2);
  const int64_t block_size = k_cache.size(1);
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16> && std::is_same_v<KT, at::BFloat16>;
  const bool pairs = kBf16 && prompt_pairs_runs(D), tiles = pairs && prompt_amx_runs(D);  // prompt_bf16.cpp
  const int64_t item_rows = pairs ? prompt_pairs_rows(group) : kPromptRows;
  std::vector<PromptItem> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b], offset = ctx[b] - q_len;
    for (int64_t r = 0; r < q_len; r += item_rows) {
      const int64_t r1 = std::min(q_len, r + item_rows);
      const int64_t keys = offset + r1 - o.first_key(offset + r);
      for (int64_t kh = 0; kh < hkv; ++kh) {
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(r), static_cast<int32_t>(r1),
                         static_cast<int32_t>(kh), (r1 - r) * (keys + 16)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const PromptItem& x, const PromptItem& y) { return x.cost > y.cost; });
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const KT* kp = k_cache.data_ptr<KT>();
  const KT* vp = v_cache.data_ptr<KT>();
  const PromptFn<T, KT> fn = prompt_for<T, KT>(D);
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < n; i = next++) {
      const PromptItem& w = items[i];
      if constexpr (kBf16) {
        if (pairs) {
          const PagedKv kv{kp, vp, tables + w.seq * width, block_size, hkv};
          prompt_item_bf16(w, qp, q.stride(0), q.stride(1), op, kv, group, D, cu[w.seq],
                           ctx[w.seq] - (cu[w.seq + 1] - cu[w.seq]), scale, scratch, o, tiles);
          continue;
        }
      }
      fn(w, qp, q.stride(0), q.stride(1), op, kp, vp, tables + w.seq * width, block_size, hkv,
         group, D, cu[w.seq], ctx[w.seq] - (cu[w.seq + 1] - cu[w.seq]), scale, scratch, o, kvs);
    }
  });
}

// Every sequence's keys fit its block-table row and every block they need is a valid id: what a
// step's plan promises, checked once per step (check_block_tables) rather than once per layer.
// With a window (> 0) the blocks before the first row's window are not needed (may be -1).
void check_tables(const int32_t* cu, const int32_t* ctx, const int32_t* tables, int64_t B,
                  int64_t width, int64_t num_blocks, int64_t block_size, int64_t window = 0) {
  const AttnOpts o{window};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    check_value(q_len >= 0 && ctx[b] >= q_len,
                "context_lens: each sequence needs at least as many keys as new query rows");
    const int64_t used_blocks = (ctx[b] + block_size - 1) / block_size;
    check_value(used_blocks <= width, "block_tables: fewer columns than a sequence's blocks");
    for (int64_t c = o.first_key(ctx[b] - q_len) / block_size; c < used_blocks; ++c) {
      const int32_t blk = tables[b * width + c];
      check_value(blk >= 0 && blk < num_blocks,
                  "block_tables: a block a sequence's keys need is -1 or out of range");
    }
  }
}

void check_index_arrays(const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                        const at::Tensor& context_lens) {
  for (const at::Tensor* t : {&block_tables, &cu_seqlens_q, &context_lens}) {
    check_value(t->scalar_type() == at::kInt && t->is_contiguous(),
                "block_tables/cu_seqlens_q/context_lens: expected contiguous int32");
  }
  check_value(block_tables.dim() == 2, "block_tables: expected [B, W]");
  const int64_t B = context_lens.size(0);
  check_value(cu_seqlens_q.size(0) == B + 1 && block_tables.size(0) == B,
              "cu_seqlens_q/block_tables: expected B+1 entries / B rows for B = len(context_lens)");
}

void check_block_tables(const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                        const at::Tensor& context_lens, int64_t num_blocks, int64_t block_size,
                        int64_t window) {
  check_value(window >= 0, "window: expected >= 0 (0: no window)");
  check_index_arrays(block_tables, cu_seqlens_q, context_lens);
  check_tables(cu_seqlens_q.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
               block_tables.data_ptr<int32_t>(), context_lens.size(0), block_tables.size(1),
               num_blocks, block_size, window);
}

// The options of paged_attention / decode_attention, checked against q's query heads.
AttnOpts attn_opts(int64_t window, const c10::optional<at::Tensor>& sinks, double softcap,
                   int64_t num_heads) {
  check_value(window >= 0, "window: expected >= 0 (0: no window)");
  check_value(softcap >= 0, "softcap: expected >= 0 (0: no soft-capping)");
  AttnOpts o{window, nullptr, static_cast<float>(softcap)};
  if (sinks.has_value()) {
    check_value(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == num_heads,
                "sinks: expected a contiguous float32 [num_heads]");
    o.sinks = sinks->data_ptr<float>();
  }
  return o;
}

// The scales of an int8 cache (KvScales): float32 [num_blocks, block_size, Hkv] each, contiguous;
// none for a cache of the model's dtype.
KvScales kv_scales(const at::Tensor& k_cache, const c10::optional<at::Tensor>& k_scale,
                   const c10::optional<at::Tensor>& v_scale) {
  if (k_cache.scalar_type() != at::kChar) {
    check_value(!k_scale.has_value() && !v_scale.has_value(),
                "k_scale/v_scale: only an int8 cache has scales");
    return {};
  }
  check_value(k_scale.has_value() && v_scale.has_value(), "k_scale/v_scale: an int8 cache needs both");
  for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
    check_value(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1) &&
                    t->size(2) == k_cache.size(2),
                "k_scale/v_scale: expected contiguous float32 [num_blocks, block_size, Hkv]");
  }
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}

// out [T, Hq, D] (contiguous) = attention of q [T, Hq, D] (head_dim contiguous) over the paged
// cache [num_blocks, block_size, Hkv, D]. Sequence b owns query rows cu_seqlens_q[b]..[b+1],
// which are the last q_len rows of its context_lens[b] keys (causal). Keys come from
// block_tables[b, p / block_size] * block_size + p % block_size; table entries past a
// sequence's last block are never read.
// Paths (fp32/bf16 with head_dim % 16 == 0; anything else takes the general kernel): a plan of
// one row per sequence takes the decode path unless `prompt` is set; any other plan, or one with
// `prompt`, takes the tiled prompt path, whose rows do not depend on how a prompt was split.
// `num_decodes` (>= 0) says how many leading sequences have one row each, as the plan states it
// (-1: count them); `checked`: check_block_tables already ran on these arrays for this step.
// `rows` (the batch-invariant mode): every row takes the decode arithmetic (paged_rows), whatever
// the plan; fp32/bf16 with head_dim % 16 == 0 only.
// `window` (0: none), `sinks` (float32 [Hq] or None), `softcap` (0: none): the layer's options
// (AttnOpts); `checked` with a window means check_block_tables ran with that window.
// An int8 cache comes with `k_scale` / `v_scale` (KvScales); it takes the vector paths only.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens,
                     double scale, bool prompt, int64_t num_decodes, bool checked, bool rows,
                     int64_t window, const c10::optional<at::Tensor>& sinks, double softcap,
                     const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  check_dtype(q, "q: expected float32, bfloat16 or float16");
  check_value(q.dim() == 3 && q.stride(2) == 1, "q: expected [T, Hq, D] with a contiguous head_dim");
  check_value(out.is_contiguous() && out.sizes() == q.sizes() && out.dtype() == q.dtype(),
              "out: expected a contiguous tensor of q's shape and dtype");
  check_value(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache/v_cache: expected contiguous [num_blocks, block_size, Hkv, D] of one shape");
  const bool int8_kv = k_cache.scalar_type() == at::kChar;
  check_value((k_cache.dtype() == q.dtype() || int8_kv) && v_cache.dtype() == k_cache.dtype(),
              "k_cache/v_cache: dtype must equal q's (or be int8 with scales)");
  check_value(k_cache.size(3) == q.size(2), "k_cache: head_dim differs from q's");
  const KvScales kvs = kv_scales(k_cache, k_scale, v_scale);
  check_value(q.size(2) >= 1 && q.size(2) <= kMaxHeadDim, "q: head_dim must be in [1, 512]");
  const int64_t hkv = k_cache.size(2);
  check_value(hkv > 0 && q.size(1) % hkv == 0, "k_cache: num_kv_heads must divide q's num_heads");
  check_index_arrays(block_tables, cu_seqlens_q, context_lens);
  const int64_t B = context_lens.size(0);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t width = block_tables.size(1);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  check_value(cu[0] == 0 && cu[B] == q.size(0), "cu_seqlens_q: must run from 0 to T");
  check_value(num_decodes <= B, "num_decodes: more than the sequences");

  const int64_t group = q.size(1) / hkv;
  const AttnOpts o = attn_opts(window, sinks, softcap, q.size(1));
  if (!checked) check_tables(cu, ctx, tables, B, width, num_blocks, block_size, window);
  bool one_row_each = num_decodes == B;  // a decode plan: the decode path below
  if (num_decodes < 0) {
    one_row_each = true;
    for (int64_t b = 0; b < B; ++b) one_row_each = one_row_each && cu[b + 1] - cu[b] == 1;
  }
  if (q.size(0) == 0) return;
  const bool vector_path = q.size(2) % 16 == 0 &&
      (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16);
  check_value(!rows || vector_path, "rows: the batch-invariant path takes fp32 or bf16 with head_dim % 16 == 0");
  check_value(!int8_kv || vector_path, "k_cache: an int8 cache takes fp32 or bf16 q with head_dim % 16 == 0");
  if (vector_path) {
    auto run = [&](auto* tag, auto* kv_tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      using KT = std::remove_pointer_t<decltype(kv_tag)>;
      const float sc = static_cast<float>(scale);
      if (rows) {  // the batch-invariant mode: every row with the decode path's arithmetic
        paged_rows<T, KT>(out, q, k_cache, v_cache, tables, width, cu, ctx, B, sc, o, kvs);
      } else if (prompt || !one_row_each) {
        paged_prompt<T, KT>(out, q, k_cache, v_cache, tables, width, cu, ctx, B, sc, o, kvs);
      } else {
        paged_decode<T, KT>(out, q, k_cache, v_cache, tables, width, ctx, B, sc, o, kvs);
      }
    };
    dispatch_kv(q.scalar_type() == at::kFloat, int8_kv, run);
    return;
  }
  std::vector<WorkItem> items;  // the general kernel's: chunks of kQueryChunk rows
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    for (int64_t r = 0; r < q_len; r += kQueryChunk) {
      items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(r),
                       static_cast<int32_t>(std::min(q_len, r + kQueryChunk))});
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const AttendFn<scalar_t> attend = attend_for<scalar_t>(q.size(2));
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t i = begin; i < end; ++i) {
        const WorkItem& w = items[i];
        attend(w, qp, q.stride(0), q.stride(1), op, kp, vp, tables, width,
                              block_size, hkv, group, q.size(2), cu[w.seq], cu[w.seq + 1] - cu[w.seq],
                              ctx[w.seq], static_cast<float>(scale), scratch, o);
      }
    });
  });
}

// ---- KV store -----------------------------------------------------------------------------------

// k_cache/v_cache viewed as [num_blocks * block_size, Hkv, D]: row slot_mapping[t] = key/value[t]
// for every t whose slot is >= 0. key/value may be strided views (slices of the fused QKV output).
// An int8 cache stores each head's row quantized (quantize_row) and its scale in k_scale/v_scale.
void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                   at::Tensor v_cache, const at::Tensor& slot_mapping,
                   const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  check_dtype(key, "key: expected float32, bfloat16 or float16");
  check_value(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 &&
                  value.stride(2) == 1,
              "key/value: expected [T, Hkv, D] of one shape with a contiguous head_dim");
  check_value(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == key.size(1) &&
                  k_cache.size(3) == key.size(2),
              "k_cache/v_cache: expected contiguous [num_blocks, block_size, Hkv, D] matching key");
  const bool int8_kv = k_cache.scalar_type() == at::kChar;
  check_value(value.dtype() == key.dtype() && v_cache.dtype() == k_cache.dtype() &&
                  (key.dtype() == k_cache.dtype() || int8_kv),
              "key/value: dtype must equal the cache's");
  const KvScales kvs = kv_scales(k_cache, k_scale, v_scale);
  check_value(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
              "slot_mapping: expected contiguous int32/int64 [T]");
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor slots = slot_mapping.to(at::kLong);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    check_value(sp[t] < num_slots, "slot_mapping: slot past the end of the cache");
  }
  if (int8_kv) {
    float* ks = const_cast<float*>(kvs.k);
    float* vs = const_cast<float*>(kvs.v);
    int8_t* kc = k_cache.data_ptr<int8_t>();
    int8_t* vc = v_cache.data_ptr<int8_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "store_kvcache", [&] {
      const scalar_t* kp = key.data_ptr<scalar_t>();
      const scalar_t* vp = value.data_ptr<scalar_t>();
      at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (sp[t] < 0) continue;
          for (int64_t h = 0; h < H; ++h) {
            const int64_t row = sp[t] * H + h;
            ks[row] = quantize_row(kp + t * key.stride(0) + h * key.stride(1), kc + row * D, D);
            vs[row] = quantize_row(vp + t * value.stride(0) + h * value.stride(1), vc + row * D, D);
          }
        }
      });
    });
    return;
  }
  const int64_t esize = key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = (sp[t] * H + h) * D * esize;
        std::memcpy(kc + dst, kp + (t * key.stride(0) + h * key.stride(1)) * esize, D * esize);
        std::memcpy(vc + dst, vp + (t * value.stride(0) + h * value.stride(1)) * esize, D * esize);
      }
    }
  });
}

// ---- element-wise ops of a decoder layer ----------------------------------------------------------

// Rows per at::parallel_for chunk for element-wise work: small ops run on one thread, because
// waking the pool costs more than ~256k elements of this work, and on a loaded machine a chunk that
// waits for a descheduled thread costs a whole time slice.
inline int64_t grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, 262144 / std::max<int64_t>(1, elems_per_row));
}

// rms_norm: out = weight * round(x / rms(x)) over the last dim (norm.h, shared with Gemma's norm of
// gemma_ops.cpp); x is [N, H] or [N, M, H] with a contiguous last dim and any other strides (the
// q/k heads sliced out of the fused QKV output). With a residual: residual_out = round(x +
// residual) is formed first and normalised instead of x (residual_out may be residual itself).
// Statistics in fp32, as Hugging Face's Llama/Qwen RMSNorm does.
void rms_norm(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
              c10::optional<at::Tensor> residual_out, const at::Tensor& weight, double eps) {
  rms_norm_rows<false>(out, x, residual, residual_out, weight, eps);
}

// silu_mul_row (one row of it) is in vec.h, shared with the grouped experts (moe_ops.cpp).
// out [N, I] = round(silu(gate)) * up for x [N, 2I] laid out [gate | up].
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  gated_and_mul(out, x, [](const auto* g, const auto* u, auto* o, int64_t I, std::vector<float>& row) {
    silu_mul_row(g, u, o, I, row);
  });
}

// ---- greedy sampling --------------------------------------------------------------------------------

// The index of the first maximum of row[0, V), as torch.argmax picks it (a NaN counts as the
// maximum, so the first NaN wins). The row is reduced in chunks of 64 (vectorised max and NaN
// count per chunk); the first chunk holding the answer is then scanned. `chunk_max` is scratch.
// (A single pass carrying per-lane indices compiled to slow code for AVX2 targets.)
template <typename T>
int64_t argmax_row(const T* row, int64_t V, std::vector<float>& chunk_max) {
  constexpr int64_t kChunk = 64;
  const int64_t n = (V + kChunk - 1) / kChunk;
  chunk_max.resize(static_cast<size_t>(n));
  float best = -std::numeric_limits<float>::infinity();
  int64_t first_nan_chunk = -1;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(V, lo + kChunk);
    float m = -std::numeric_limits<float>::infinity();
    int64_t nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
    for (int64_t i = lo; i < hi; ++i) {
      const float v = to_f<T>(row[i]);
      m = std::max(m, v);  // a NaN v leaves m as it was
      nans += v != v;
    }
    if (nans > 0) {
      first_nan_chunk = c;
      break;
    }
    chunk_max[c] = m;
    best = std::max(best, m);
  }
  int64_t c = first_nan_chunk;
  if (c < 0) {
    for (c = 0; c < n && chunk_max[c] != best; ++c) {
    }
  }
  for (int64_t i = c * kChunk; i < std::min(V, (c + 1) * kChunk); ++i) {
    const float v = to_f<T>(row[i]);
    if (first_nan_chunk >= 0 ? v != v : v == best) return i;
  }
  return 0;  // not reached
}

// out [S] (int64) = argmax of each row of x [S, V] (fp32 or bf16, contiguous rows): the greedy
// token of every row, read from the logits as the LM head wrote them (no widened copy).
void argmax_rows(at::Tensor out, const at::Tensor& x) {
  check_value(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: expected float32 or bfloat16 [S, V] with V >= 1 and contiguous rows");
  check_value(out.dim() == 1 && out.size(0) == x.size(0) && out.is_contiguous() &&
                  out.scalar_type() == at::kLong,
              "out: expected a contiguous int64 [S]");
  const int64_t S = x.size(0), V = x.size(1), xs = x.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, S, grain_rows(V), [&](int64_t begin, int64_t end) {
      std::vector<float> chunk_max;
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * xs, V, chunk_max);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>());
  } else {
    run(x.data_ptr<at::BFloat16>());
  }
}

// argmax_rows, and whether every row is greedy (temperatures float32 [S], each <= 0): the
// sampler's whole greedy step in one call (its Python and numpy around two ops cost more than
// the argmax right after a decode step, whose weights have just gone through the caches).
bool argmax_rows_greedy(at::Tensor out, const at::Tensor& x, const at::Tensor& temperatures) {
  check_value(temperatures.dim() == 1 && temperatures.size(0) == x.size(0) &&
                  temperatures.is_contiguous() && temperatures.scalar_type() == at::kFloat,
              "temperatures: expected a contiguous float32 [S]");
  argmax_rows(out, x);
  const float* t = temperatures.data_ptr<float>();
  return std::all_of(t, t + temperatures.size(0), [](float v) { return v <= 0.f; });
}

// In place on x [T, H, D] (head_dim contiguous), "neox" layout: halves (x1, x2) of each head
// become (x1*c - x2*s, x2*c + x1*s) with c = cos[positions[t]], s = sin[positions[t]] rounded
// to x's dtype first, and each product and sum rounded as the torch expression does.
// A vector of lanes at a time, then the scalar tail; the same roundings either way (every
// caller, rotary_embedding and qkv_to_cache alike, runs this function, so their bits agree).
template <typename T>
void rotate_rows(T* xp, int64_t s0, int64_t s1, int64_t H, int64_t half, const float* cs,
                 const float* sn, int64_t t) {
  T* const tag = nullptr;
  for (int64_t h = 0; h < H; ++h) {
    T* x1 = xp + t * s0 + h * s1;
    T* x2 = x1 + half;
    int64_t v = 0;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
      for (; v + kLanes <= half; v += kLanes) {
        const vfl c = roundl(loadl(cs + v), tag), s = roundl(loadl(sn + v), tag);
        const vfl a = loadl(x1 + v), b = loadl(x2 + v);
        storel(x1 + v, roundl(roundl(a * c, tag) - roundl(b * s, tag), tag));
        storel(x2 + v, roundl(roundl(b * c, tag) + roundl(a * s, tag), tag));
      }
    }
    for (int64_t i = v; i < half; ++i) {
      const float c = round_to<T>(cs[i]), s = round_to<T>(sn[i]);
      const float a = to_f(x1[i]), b = to_f(x2[i]);
      const float lo = round_to<T>(round_to<T>(a * c) - round_to<T>(b * s));
      const float hi = round_to<T>(round_to<T>(b * c) + round_to<T>(a * s));
      x1[i] = from_f<T>(lo);
      x2[i] = from_f<T>(hi);
    }
  }
}

void rotary_embedding(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                      const at::Tensor& cos, const at::Tensor& sin) {
  check_value(positions.dim() == 1 && positions.is_contiguous() &&
                  (positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong),
              "positions: expected contiguous int32/int64 [T]");
  check_value(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  q.size(0) == positions.size(0) && k.size(0) == positions.size(0) &&
                  q.size(2) == k.size(2) && q.dtype() == k.dtype(),
              "q/k: expected [T, H, D] of one dtype with a contiguous head_dim");
  check_dtype(q, "q: expected float32, bfloat16 or float16");
  const int64_t half = q.size(2) / 2;
  check_value(q.size(2) % 2 == 0 && cos.dim() == 2 && cos.size(1) == half && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin: expected contiguous float32 [max_position, head_dim / 2]");
  const at::Tensor pos = positions.to(at::kLong);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t T = q.size(0), max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t) {
    check_value(pp[t] >= 0 && pp[t] < max_pos, "positions: outside [0, max_position)");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows((q.size(1) + k.size(1)) * q.size(2)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cs = cp + pp[t] * half;
        const float* sn = sp + pp[t] * half;
        rotate_rows<scalar_t>(qp, q.stride(0), q.stride(1), q.size(1), half, cs, sn, t);
        rotate_rows<scalar_t>(kp, k.stride(0), k.stride(1), k.size(1), half, cs, sn, t);
      }
    });
  });
}


// ---- a decoder layer's decode step in two calls ---------------------------------------------------
//
// A decode step at batch 1 is ~45 small operators per layer when Python calls them one by one,
// and their dispatch cost more than the arithmetic of a small model. These two ops run the
// same operators (the same functions, so the same bits) in one call each: the attention half of
// a layer up to o_proj, and the MLP half. Between them and after them, a tensor-parallel model
// all-reduces the partial sums in Python. The plan's block tables are checked once per step
// (check_block_tables) before the first layer, not here.

PackedLinear packed_linear(const at::Tensor& data, int64_t kind, int64_t n, int64_t k,
                           const c10::optional<at::Tensor>& scales,
                           const c10::optional<at::Tensor>& colsum,
                           const c10::optional<at::Tensor>& bias, const char* what) {
  PackedLinear w;
  w.data = data;
  w.kind = kind;
  w.n = n;
  w.k = k;
  if (scales.has_value()) w.scales = *scales;
  if (colsum.has_value()) w.colsum = *colsum;
  if (bias.has_value()) w.bias = *bias;
  check_packed(w, what);
  return w;
}

// residual (in/out) and normed: norm(hidden + residual) with the sum kept as the new residual,
// or, for the first layer, residual = hidden and norm(hidden). `gemma`: Gemma's (1 + w) norm.
void norm_with_residual(at::Tensor& normed, const at::Tensor& hidden, at::Tensor& residual,
                        bool has_residual, const at::Tensor& weight, double eps, bool gemma = false) {
  const auto norm = gemma ? &gemma_rms_norm : &rms_norm;
  if (has_residual) {
    norm(normed, hidden, residual, residual, weight, eps);
  } else {
    std::memcpy(residual.data_ptr(), hidden.data_ptr(), hidden.numel() * hidden.element_size());
    norm(normed, hidden, c10::nullopt, c10::nullopt, weight, eps);
  }
}

// The intermediate tensors of a decode layer, kept between layers and steps by a DecodeStack
// (a decode step at batch 1 made ~50 small allocations; each costs microseconds on caches the
// weight stream has just emptied). get() hands back the tensor in slot i if it has these sizes
// and dtype, else allocates it.
struct DecodeScratch {
  at::Tensor slots[14];
  MoeScratch moe;  // the grouped experts' (every MoE layer's in turn)
  at::Tensor get(int i, at::IntArrayRef sizes, const at::TensorOptions& opt) {
    at::Tensor& t = slots[i];
    if (!t.defined() || t.sizes() != sizes || t.scalar_type() != opt.dtype().toScalarType()) {
      t = at::empty(sizes, opt);
    }
    return t;
  }
};
enum ScratchSlot {
  kNormed, kQkv, kQuery, kAttn, kGateUp, kAct, kResidual, kOther,
  kRouterLogits, kTopIds, kTopWeights, kShared, kSharedGate,  // mixture-of-experts layers
  kUnnormed,  // Gemma: a half's output before its post-norm
};

// Reads entry m of a contiguous int32/int64 [M] tensor.
inline int64_t index_at(const at::Tensor& t, int64_t m) {
  return t.scalar_type() == at::kInt ? t.data_ptr<int32_t>()[m] : t.data_ptr<int64_t>()[m];
}

// The step from the fused QKV output to attention, for decode rows, in one pass per row: the
// q/k norms (Qwen3, or Gemma's (1 + w) ones with `gemma`; absent: copies), rotary, the query
// heads into q_out [M, Hq, D] and the key and value heads straight into their cache slots. The
// same row functions as rms_norm (gemma_rms_norm), rotary_embedding and store_kvcache, in the
// same order, so the same bits; three ops and their tensors fewer per layer. An int8 cache
// (KT = int8_t) gets each key and value head quantized as store_kvcache quantizes it
// (quantize_row), its scale in `kvs`.
template <typename T, typename KT = T>
void qkv_to_cache(const at::Tensor& qkv_out, at::Tensor& q_out, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& cos,
                  const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                  const c10::optional<at::Tensor>& k_norm, double eps, int64_t Hq, int64_t Hkv, int64_t D,
                  const KvScales& kvs = {}, bool gemma = false, bool parallel = false) {
  const int64_t M = qkv_out.size(0), ld = qkv_out.stride(0), half = D / 2;
  check_value(positions.dim() == 1 && positions.is_contiguous() &&
                  (positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong),
              "positions: expected contiguous int32/int64 [T]");
  check_value(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
              "slot_mapping: expected contiguous int32/int64 [T]");
  check_value(cos.dim() == 2 && cos.size(1) == half && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin: expected contiguous float32 [max_position, head_dim / 2]");
  check_value(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == Hkv && k_cache.size(3) == D &&
                  (k_cache.scalar_type() == qkv_out.scalar_type() || kInt8<KT>) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache/v_cache: expected contiguous [num_blocks, block_size, Hkv, D] matching key");
  check_value(q_norm.has_value() == k_norm.has_value(), "q_norm/k_norm: given together");
  if (q_norm.has_value()) {
    for (const at::Tensor* w : {&*q_norm, &*k_norm}) {
      check_value(w->dim() == 1 && w->size(0) == D && w->is_contiguous() &&
                      w->scalar_type() == qkv_out.scalar_type(),
                  "weight: expected a contiguous [hidden] tensor of x's dtype");
    }
  }
  // cos/sin without rows: a layer without rotary (SmolLM3's no-rope layers), q and k unrotated.
  const int64_t max_pos = cos.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const bool rotate = max_pos > 0;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t p = index_at(positions, m);
    check_value(p >= 0 && (p < max_pos || !rotate), "positions: outside [0, max_position)");
    check_value(index_at(slot_mapping, m) < num_slots, "slot_mapping: slot past the end of the cache");
  }
  const T* src = qkv_out.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  KT* kc = k_cache.data_ptr<KT>();
  KT* vc = v_cache.data_ptr<KT>();
  const T* qw = q_norm.has_value() ? q_norm->data_ptr<T>() : nullptr;
  const T* kw = k_norm.has_value() ? k_norm->data_ptr<T>() : nullptr;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  // Rows write distinct slots (the scheduler never gives two tokens one slot), so ranges of
  // rows may run in parallel; each range has its own spare head.
  auto rows = [&](int64_t begin, int64_t end) {
  T spare[kMaxHeadDim];  // a key head of a row without a slot (padding): computed, not stored
  for (int64_t m = begin; m < end; ++m) {
    const T* row = src + m * ld;
    const float* cs = rotate ? cp + index_at(positions, m) * half : nullptr;
    const float* sn = rotate ? sp + index_at(positions, m) * half : nullptr;
    const int64_t slot = index_at(slot_mapping, m);
    auto head = [&](const T* in, T* out, const T* w) {
      if (w != nullptr && gemma) {
        rms_norm_row_vec<T, true>(in, static_cast<const T*>(nullptr), static_cast<T*>(nullptr), out, w, D,
                                  feps);
      } else if (w != nullptr) {
        rms_norm_row_vec<T, false>(in, static_cast<const T*>(nullptr), static_cast<T*>(nullptr), out, w, D,
                                   feps);
      } else {
        std::memcpy(out, in, D * sizeof(T));
      }
      if (rotate) rotate_rows<T>(out, 0, 0, 1, half, cs, sn, 0);
    };
    for (int64_t h = 0; h < Hq; ++h) head(row + h * D, qo + (m * Hq + h) * D, qw);
    for (int64_t h = 0; h < Hkv; ++h) {
      if constexpr (kInt8<KT>) {
        head(row + (Hq + h) * D, spare, kw);
        if (slot >= 0) {
          float* ks = const_cast<float*>(kvs.k);
          float* vs = const_cast<float*>(kvs.v);
          ks[slot * Hkv + h] = quantize_row(spare, kc + (slot * Hkv + h) * D, D);
          vs[slot * Hkv + h] = quantize_row(row + (Hq + Hkv + h) * D, vc + (slot * Hkv + h) * D, D);
        }
      } else {
        head(row + (Hq + h) * D, slot >= 0 ? kc + (slot * Hkv + h) * D : spare, kw);
        if (slot >= 0) std::memcpy(vc + (slot * Hkv + h) * D, row + (Hq + Hkv + h) * D, D * sizeof(T));
      }
    }
  }
  };
  if (parallel) {
    at::parallel_for(0, M, grain_rows((Hq + 2 * Hkv) * D), rows);
  } else {
    rows(0, M);
  }
}

// qkv_to_cache as an operator, for prompt rows (attention.py): qkv [T, (Hq + 2 Hkv) D] (rows
// contiguous), q_out [T, Hq, D] contiguous; ranges of rows in parallel. The same bits as the
// q/k norm, rotary_embedding and store_kvcache ops in turn, in one pass over the rows. cos/sin
// without rows: a layer without rotary.
void qkv_to_cache_op(const at::Tensor& qkv, at::Tensor q_out, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& cos,
                     const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                     const c10::optional<at::Tensor>& k_norm, double eps, int64_t num_heads,
                     int64_t num_kv_heads, bool gemma, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale) {
  check_value(k_cache.dim() == 4, "k_cache: expected [num_blocks, block_size, Hkv, D]");
  const int64_t D = k_cache.size(3), T = qkv.dim() == 2 ? qkv.size(0) : -1;
  check_value(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              "qkv: expected float32/bfloat16 [T, (num_heads + 2 num_kv_heads) head_dim], rows contiguous");
  check_value(D % 2 == 0 && D <= kMaxHeadDim, "k_cache: head_dim must be even and at most 512");
  check_value(q_out.dim() == 3 && q_out.is_contiguous() && q_out.size(0) == T && q_out.size(1) == num_heads &&
                  q_out.size(2) == D && q_out.scalar_type() == qkv.scalar_type(),
              "q_out: expected a contiguous [T, num_heads, head_dim] tensor of qkv's dtype");
  check_value(positions.dim() == 1 && positions.size(0) == T && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == T,
              "positions/slot_mapping: expected [T] each");
  const bool int8_kv = k_cache.scalar_type() == at::kChar;
  check_value(int8_kv == k_scale.has_value() && k_scale.has_value() == v_scale.has_value(),
              "k_scale/v_scale: given together, exactly when the cache is int8");
  KvScales kvs;
  if (int8_kv) {
    for (const at::Tensor* sc : {&*k_scale, &*v_scale}) {
      check_value(sc->scalar_type() == at::kFloat && sc->is_contiguous() &&
                      sc->numel() == k_cache.size(0) * k_cache.size(1) * num_kv_heads,
                  "k_scale/v_scale: expected contiguous float32 [num_blocks, block_size, Hkv]");
    }
    kvs = KvScales{k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
  }
  auto run = [&](auto* tag, auto* kv_tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    using KT = std::remove_pointer_t<decltype(kv_tag)>;
    qkv_to_cache<T_, KT>(qkv, q_out, k_cache, v_cache, positions, slot_mapping, cos, sin, q_norm, k_norm, eps,
                         num_heads, num_kv_heads, D, kvs, gemma, /*parallel=*/true);
  };
  dispatch_kv(qkv.scalar_type() == at::kFloat, int8_kv, run);
}

// A decoder layer's fixed arguments (weights, norms, sizes, its KV cache), as the per-layer ops
// take them on every call and a DecodeStack keeps them.
struct AttentionArgs {
  at::Tensor k_cache, v_cache, ln_weight, cos, sin;
  double eps, scale;
  c10::optional<at::Tensor> q_norm, k_norm;
  int64_t num_heads, num_kv_heads, head_dim;
  PackedLinear qkv, o;
  // The layer's attention options (AttnOpts; sinks float32 [num_heads] or undefined).
  int64_t window = 0;
  at::Tensor sinks;
  double softcap = 0;
  // An int8 cache's scales (KvScales; undefined: the cache holds the model's dtype).
  at::Tensor k_scale, v_scale;
  // Gemma's layers (defined: this one): its post_attention_layernorm's weight. The input and
  // q/k norms are then Gemma's (1 + w) ones too, and o_proj's output is normalised before it
  // joins the residual.
  at::Tensor post_norm;
  // Gemma's norms without the post-norm here (tensor parallelism: o_proj's output is normalised
  // after its all-reduce, in Python).
  bool gemma_norms = false;
  bool gemma() const { return gemma_norms || post_norm.defined(); }
  AttnOpts opts() const {
    return AttnOpts{window, sinks.defined() ? sinks.data_ptr<float>() : nullptr, static_cast<float>(softcap)};
  }
  KvScales scales() const {
    return k_scale.defined() ? KvScales{k_scale.data_ptr<float>(), v_scale.data_ptr<float>()} : KvScales{};
  }
};

// A mixture-of-experts layer's MLP half (moe.py's SparseMoeBlock): the router, the routed
// experts, and Qwen2-MoE's shared expert with its sigmoid gate.
struct MoeArgs {
  PackedLinear router;  // [num_experts, H]
  int64_t top_k;
  bool renormalize, round_weights;
  MoeWeights experts;
  bool has_shared = false, has_shared_gate = false;
  int64_t shared_inter = 0;
  PackedLinear shared_gate_up, shared_down, shared_gate;
};

struct MlpArgs {
  at::Tensor ln_weight;
  double eps;
  int64_t intermediate;
  PackedLinear gate_up, down;     // a dense MLP
  std::shared_ptr<MoeArgs> moe;  // or, when set, a mixture of experts
  // Gemma's layers (defined: this one): its post_feedforward_layernorm's weight. ln_weight is
  // then its pre_feedforward_layernorm's, the norms are (1 + w) ones, the activation is
  // GELU-tanh, and down_proj's output is normalised.
  at::Tensor post_norm;
  bool gemma_norms = false;  // Gemma's norm and GELU-tanh without the post-norm (as AttentionArgs')
};

// out = x w^T, then Gemma's post-norm of it where the layer has one (post_norm defined).
void linear_post_norm(at::Tensor& out, const at::Tensor& x, const PackedLinear& w, const at::Tensor& post_norm,
                      double eps, DecodeScratch& scratch) {
  if (!post_norm.defined()) {
    linear_into(out, x, w);
    return;
  }
  at::Tensor unnormed = scratch.get(kUnnormed, out.sizes(), out.options());
  linear_into(unnormed, x, w);
  gemma_rms_norm(out, unnormed, c10::nullopt, c10::nullopt, post_norm, eps);
}

// out [M, H] = o_proj(attention(rotary(qkv_proj(norm(hidden (+ residual)))))) for M decode
// rows, one per sequence; residual [M, H] is updated in place (see norm_with_residual).
void decode_attention_into(at::Tensor& out, at::Tensor& residual, const at::Tensor& hidden,
                           bool has_residual, const at::Tensor& positions, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const AttentionArgs& a, DecodeScratch& scratch) {
  const int64_t M = hidden.size(0), q_size = a.num_heads * a.head_dim;
  const at::TensorOptions opt = hidden.options();
  at::Tensor normed = scratch.get(kNormed, hidden.sizes(), opt);
  norm_with_residual(normed, hidden, residual, has_residual, a.ln_weight, a.eps, a.gemma());
  at::Tensor qkv_out = scratch.get(kQkv, {M, a.qkv.n}, opt);
  linear_into(qkv_out, normed, a.qkv);
  at::Tensor q = scratch.get(kQuery, {M, a.num_heads, a.head_dim}, opt);
  at::Tensor k_cache = a.k_cache, v_cache = a.v_cache;
  at::Tensor attn = scratch.get(kAttn, {M, a.num_heads, a.head_dim}, opt);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const float scale = static_cast<float>(a.scale);
  auto run = [&](auto* tag, auto* kv_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using KT = std::remove_pointer_t<decltype(kv_tag)>;
    const KvScales kvs = a.scales();
    qkv_to_cache<T, KT>(qkv_out, q, k_cache, v_cache, positions, slot_mapping, a.cos, a.sin, a.q_norm,
                        a.k_norm, a.eps, a.num_heads, a.num_kv_heads, a.head_dim, kvs, a.gemma());
    paged_decode<T, KT>(attn, q, k_cache, v_cache, tables, block_tables.size(1), ctx, M, scale, a.opts(),
                        kvs);
  };
  const bool int8_kv = k_cache.scalar_type() == at::kChar;
  dispatch_kv(hidden.scalar_type() == at::kFloat, int8_kv, run);
  linear_post_norm(out, attn.view({M, q_size}), a.o, a.post_norm, a.eps, scratch);
}

// The attention half as an operator: tensor parallelism's layer-by-layer calls. `gemma`: Gemma's
// (1 + w) input and q/k norms, o_proj's partial output left unnormalised (the caller normalises
// the sum after its all-reduce).
void decode_attention(at::Tensor out, at::Tensor residual, const at::Tensor& hidden,
                      bool has_residual, const at::Tensor& positions, const at::Tensor& k_cache_in,
                      const at::Tensor& v_cache_in, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const at::Tensor& ln_weight, double eps, const c10::optional<at::Tensor>& q_norm,
                      const c10::optional<at::Tensor>& k_norm, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin, double scale,
                      const at::Tensor& qkv_data, int64_t qkv_kind, const c10::optional<at::Tensor>& qkv_scales,
                      const c10::optional<at::Tensor>& qkv_colsum, const c10::optional<at::Tensor>& qkv_bias,
                      const at::Tensor& o_data, int64_t o_kind, const c10::optional<at::Tensor>& o_scales,
                      const c10::optional<at::Tensor>& o_colsum, const c10::optional<at::Tensor>& o_bias,
                      int64_t window, const c10::optional<at::Tensor>& sinks, double softcap,
                      const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                      bool gemma) {
  const int64_t M = hidden.size(0), H = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  check_value(hidden.dim() == 2 && hidden.is_contiguous() && residual.sizes() == hidden.sizes() &&
                  residual.is_contiguous() && out.sizes() == hidden.sizes(),
              "hidden/residual/out: expected contiguous [M, hidden] tensors");
  check_value(M >= 1, "hidden: a decode step has at least one row");
  check_value(context_lens.size(0) == M && slot_mapping.size(0) == M && positions.size(0) == M,
              "context_lens/slot_mapping/positions: one entry per decode row");
  check_value(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == M,
              "block_tables/context_lens: expected contiguous int32 [M, W] / [M]");
  check_value(head_dim % 16 == 0 && head_dim <= kMaxHeadDim &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "hidden: the fused decode takes fp32/bf16 and head_dim % 16 == 0");
  AttentionArgs a{k_cache_in, v_cache_in, ln_weight, cos, sin, eps, scale, q_norm, k_norm,
                  num_heads, num_kv_heads, head_dim,
                  packed_linear(qkv_data, qkv_kind, q_size + 2 * kv_size, H, qkv_scales, qkv_colsum,
                                qkv_bias, "qkv_proj"),
                  packed_linear(o_data, o_kind, H, q_size, o_scales, o_colsum, o_bias, "o_proj")};
  attn_opts(window, sinks, softcap, num_heads);  // checked
  a.window = window;
  a.sinks = sinks.has_value() ? *sinks : at::Tensor();
  a.softcap = softcap;
  a.gemma_norms = gemma;
  kv_scales(k_cache_in, k_scale, v_scale);  // checked
  check_value(k_cache_in.scalar_type() == hidden.scalar_type() || k_cache_in.scalar_type() == at::kChar,
              "k_cache: expected the model's dtype or int8");
  if (k_scale.has_value()) {
    a.k_scale = *k_scale;
    a.v_scale = *v_scale;
  }
  DecodeScratch scratch;
  decode_attention_into(out, residual, hidden, has_residual, positions, slot_mapping, block_tables,
                        context_lens, a, scratch);
}

// out [M, H] = down_proj(silu_and_mul(gate_up_proj(norm(hidden + residual)))); residual is
// updated in place.
// A mixture-of-experts layer's MLP half from its normed input: router, routing, the shared
// expert's output and gate, the routed experts with both joining their sum. The functions of the
// module path (SparseMoeBlock.forward on packed experts), in its order, so the same bits.
void decode_moe_into(at::Tensor& out, const at::Tensor& normed, const MoeArgs& e, DecodeScratch& scratch) {
  const int64_t M = normed.size(0), H = normed.size(1);
  const at::TensorOptions opt = normed.options();
  at::Tensor logits = scratch.get(kRouterLogits, {M, e.router.n}, opt);
  linear_into(logits, normed, e.router);
  at::Tensor ids = scratch.get(kTopIds, {M, e.top_k}, opt.dtype(at::kLong));
  at::Tensor weights = scratch.get(kTopWeights, {M, e.top_k}, opt.dtype(at::kFloat));
  moe_route_into(ids, weights, logits, e.renormalize, e.round_weights && normed.scalar_type() == at::kBFloat16);
  at::Tensor shared, gate;
  if (e.has_shared) {
    at::Tensor gate_up = scratch.get(kGateUp, {M, 2 * e.shared_inter}, opt);
    linear_into(gate_up, normed, e.shared_gate_up);
    at::Tensor act = scratch.get(kAct, {M, e.shared_inter}, opt);
    silu_and_mul(act, gate_up);
    shared = scratch.get(kShared, {M, H}, opt);
    linear_into(shared, act, e.shared_down);
    if (e.has_shared_gate) {
      gate = scratch.get(kSharedGate, {M, 1}, opt);
      linear_into(gate, normed, e.shared_gate);
    }
  }
  moe_experts_into(out, normed, ids, weights, e.experts, scratch.moe, e.has_shared ? &shared : nullptr,
                   e.has_shared_gate ? &gate : nullptr);
}

void decode_mlp_into(at::Tensor& out, at::Tensor& residual, const at::Tensor& hidden, const MlpArgs& m,
                     DecodeScratch& scratch) {
  const int64_t M = hidden.size(0);
  const at::TensorOptions opt = hidden.options();
  at::Tensor normed = scratch.get(kNormed, hidden.sizes(), opt);
  const bool gemma = m.gemma_norms || m.post_norm.defined();
  norm_with_residual(normed, hidden, residual, true, m.ln_weight, m.eps, gemma);
  if (m.moe) {
    decode_moe_into(out, normed, *m.moe, scratch);
    return;
  }
  at::Tensor gate_up = scratch.get(kGateUp, {M, 2 * m.intermediate}, opt);
  linear_into(gate_up, normed, m.gate_up);
  at::Tensor act = scratch.get(kAct, {M, m.intermediate}, opt);
  (gemma ? gelu_tanh_and_mul : silu_and_mul)(act, gate_up);
  linear_post_norm(out, act, m.down, m.post_norm, m.eps, scratch);
}

// The MLP half as an operator (as decode_attention). `gemma`: Gemma's (1 + w) norm and GELU-tanh,
// down_proj's partial output left unnormalised.
void decode_mlp(at::Tensor out, at::Tensor residual, const at::Tensor& hidden,
                const at::Tensor& ln_weight, double eps, int64_t intermediate,
                const at::Tensor& gu_data, int64_t gu_kind, const c10::optional<at::Tensor>& gu_scales,
                const c10::optional<at::Tensor>& gu_colsum, const c10::optional<at::Tensor>& gu_bias,
                const at::Tensor& down_data, int64_t down_kind, const c10::optional<at::Tensor>& down_scales,
                const c10::optional<at::Tensor>& down_colsum, const c10::optional<at::Tensor>& down_bias,
                bool gemma) {
  const int64_t H = hidden.size(1);
  check_value(hidden.dim() == 2 && hidden.is_contiguous() && residual.sizes() == hidden.sizes() &&
                  out.sizes() == hidden.sizes(),
              "hidden/residual/out: expected contiguous [M, hidden] tensors");
  MlpArgs m{ln_weight, eps, intermediate,
                  packed_linear(gu_data, gu_kind, 2 * intermediate, H, gu_scales, gu_colsum, gu_bias,
                                "gate_up_proj"),
                  packed_linear(down_data, down_kind, H, intermediate, down_scales, down_colsum, down_bias,
                                "down_proj")};
  m.gemma_norms = gemma;
  DecodeScratch scratch;
  decode_mlp_into(out, residual, hidden, m, scratch);
}

// ---- a whole decode step's layer stack in one call ------------------------------------------------
//
// Without tensor parallelism nothing has to happen between the layer halves, so the stack runs
// here in one call: per layer decode_attention then decode_mlp, exactly as the Python loop of
// fused_decode.py calls them (the same functions, so the same bits), then the final norm. Each
// torch.ops call costs ~5-9 us of argument conversion for its ~30 arguments: 16 of them per step
// at 8 layers, against a ~3 ms step of the 40M model at batch 1. The static arguments (weights,
// norms, sizes, the KV cache) are given once, layer by layer, when the stack is built, and the
// layers' intermediate tensors are kept from step to step (DecodeScratch).
struct DecodeStack : torch::CustomClassHolder {
  std::vector<std::pair<AttentionArgs, MlpArgs>> layers;
  // The KV-cache group of each layer (kv_group_runner.py): group g reads the g-th of run_groups'
  // block tables and slot mappings. 0 for every layer unless set_group says otherwise.
  std::vector<int64_t> group_of;
  at::Tensor norm_weight, embedding;
  double norm_eps = 0;
  bool gemma_norm = false;  // the final norm: Gemma's (1 + w) one
  DecodeScratch scratch;  // the layers' intermediate tensors, reused by every step

  // Checked once here, as decode_attention / decode_mlp check theirs on every call.
  static PackedLinear packed(const std::vector<c10::optional<at::Tensor>>& t, int64_t kind, int64_t n, int64_t k,
                             const char* what) {
    TORCH_CHECK_VALUE(t.size() == 4 && t[0].has_value(), what, ": expected [data, scales, colsum, bias]");
    return packed_linear(*t[0], kind, n, k, t[1], t[2], t[3], what);
  }

  static AttentionArgs attention_args(at::Tensor k_cache, at::Tensor v_cache, at::Tensor ln_weight, double eps,
                                      c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor cos,
                                      at::Tensor sin, double scale, const std::vector<c10::optional<at::Tensor>>& qkv,
                                      const std::vector<int64_t>& qkv_o_kinds,
                                      const std::vector<c10::optional<at::Tensor>>& o) {
    check_value(qkv_o_kinds.size() == 2, "kinds: expected two per half");
    check_value(ln_weight.dim() == 1, "ln_weight: expected [hidden]");
    check_value(head_dim % 16 == 0 && head_dim <= kMaxHeadDim,
                "head_dim: the fused decode takes a multiple of 16 up to 512");
    const int64_t H = ln_weight.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    return AttentionArgs{k_cache, v_cache, ln_weight, cos, sin, eps, scale, q_norm, k_norm, num_heads, num_kv_heads,
                         head_dim, packed(qkv, qkv_o_kinds[0], q_size + 2 * kv_size, H, "qkv_proj"),
                         packed(o, qkv_o_kinds[1], H, q_size, "o_proj")};
  }

  void add_layer(at::Tensor k_cache, at::Tensor v_cache, at::Tensor ln_weight, double eps,
                 c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor cos,
                 at::Tensor sin, double scale, std::vector<c10::optional<at::Tensor>> qkv,
                 std::vector<int64_t> qkv_o_kinds, std::vector<c10::optional<at::Tensor>> o,
                 at::Tensor post_ln_weight, double post_eps, int64_t intermediate,
                 std::vector<c10::optional<at::Tensor>> gate_up, std::vector<int64_t> mlp_kinds,
                 std::vector<c10::optional<at::Tensor>> down) {
    check_value(mlp_kinds.size() == 2, "kinds: expected two per half");
    AttentionArgs a = attention_args(k_cache, v_cache, ln_weight, eps, q_norm, k_norm, num_heads, num_kv_heads,
                                     head_dim, cos, sin, scale, qkv, qkv_o_kinds, o);
    const int64_t H = ln_weight.size(0);
    layers.emplace_back(std::move(a), MlpArgs{post_ln_weight, post_eps, intermediate,
                                              packed(gate_up, mlp_kinds[0], 2 * intermediate, H, "gate_up_proj"),
                                              packed(down, mlp_kinds[1], H, intermediate, "down_proj"), nullptr});
    group_of.push_back(0);
  }

  // A mixture-of-experts layer: the attention half as add_layer's; then the router ([data,
  // scales, colsum, bias]; router_ints: its kind, num_experts, top_k, renormalize, round_weights
  // (to bf16 in a bf16 model)); the experts (moe_kernel.PackedExperts.stack_args: w13 data, kind, scales, colsum, w2
  // data, kind, scales, colsum; hidden, intermediate, num_experts, expert_start); and the shared
  // expert's gate_up, down and gate (empty lists: none; shared_ints: their kinds, intermediate).
  void add_moe_layer(at::Tensor k_cache, at::Tensor v_cache, at::Tensor ln_weight, double eps,
                     c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor cos,
                     at::Tensor sin, double scale, std::vector<c10::optional<at::Tensor>> qkv,
                     std::vector<int64_t> qkv_o_kinds, std::vector<c10::optional<at::Tensor>> o,
                     at::Tensor post_ln_weight, double post_eps, std::vector<c10::optional<at::Tensor>> router,
                     std::vector<int64_t> router_ints,
                     std::vector<c10::optional<at::Tensor>> experts, std::vector<int64_t> expert_ints,
                     std::vector<c10::optional<at::Tensor>> shared_gate_up,
                     std::vector<c10::optional<at::Tensor>> shared_down,
                     std::vector<c10::optional<at::Tensor>> shared_gate, std::vector<int64_t> shared_ints) {
    AttentionArgs a = attention_args(k_cache, v_cache, ln_weight, eps, q_norm, k_norm, num_heads, num_kv_heads,
                                     head_dim, cos, sin, scale, qkv, qkv_o_kinds, o);
    const int64_t H = ln_weight.size(0);
    check_value(router_ints.size() == 5,
                "router_ints: expected [kind, num_experts, top_k, renormalize, round_weights]");
    check_value(experts.size() == 8 && experts[0].has_value() && experts[4].has_value() && expert_ints.size() == 6,
                "experts: expected PackedExperts.stack_args()");
    auto e = std::make_shared<MoeArgs>();
    e->router = packed(router, router_ints[0], router_ints[1], H, "router");
    e->top_k = router_ints[2];
    check_value(e->top_k >= 1 && e->top_k <= e->router.n, "top_k: expected 1 <= top_k <= num_experts");
    e->renormalize = router_ints[3] != 0;
    e->round_weights = router_ints[4] != 0;
    e->experts = make_moe_weights(*experts[0], expert_ints[0], experts[1], experts[2], *experts[4], expert_ints[1],
                                  experts[5], experts[6], expert_ints[2], expert_ints[3], expert_ints[4],
                                  expert_ints[5]);
    check_value(e->experts.hidden == H && e->experts.num_experts == e->router.n,
                "experts: hidden size / num_experts differ from the layer's / router's");
    e->has_shared = !shared_gate_up.empty();
    if (e->has_shared) {
      check_value(shared_ints.size() == 4, "shared_ints: expected [gate_up kind, down kind, gate kind, inter]");
      e->shared_inter = shared_ints[3];
      e->shared_gate_up = packed(shared_gate_up, shared_ints[0], 2 * e->shared_inter, H, "shared_expert.gate_up_proj");
      e->shared_down = packed(shared_down, shared_ints[1], H, e->shared_inter, "shared_expert.down_proj");
      e->has_shared_gate = !shared_gate.empty();
      if (e->has_shared_gate) e->shared_gate = packed(shared_gate, shared_ints[2], 1, H, "shared_expert_gate");
    }
    layers.emplace_back(std::move(a), MlpArgs{post_ln_weight, post_eps, 0, PackedLinear{}, PackedLinear{}, e});
    group_of.push_back(0);
  }

  // Layer i is one of Gemma's (dense): its post_attention_layernorm and post_feedforward_layernorm
  // weights; add_layer's post_ln_weight was its pre_feedforward_layernorm's (AttentionArgs and
  // MlpArgs say what changes).
  void set_gemma(int64_t i, at::Tensor post_attention_weight, at::Tensor post_feedforward_weight) {
    check_value(i >= 0 && i < static_cast<int64_t>(layers.size()), "layer: outside the stack");
    auto& [a, m] = layers[i];
    check_value(!m.moe, "set_gemma: a dense layer's (Gemma has no experts)");
    for (const at::Tensor* w : {&post_attention_weight, &post_feedforward_weight}) {
      check_value(w->dim() == 1 && w->sizes() == a.ln_weight.sizes() && w->is_contiguous() &&
                      w->scalar_type() == a.ln_weight.scalar_type(),
                  "set_gemma: expected contiguous [hidden] weights of the layer's dtype");
    }
    a.post_norm = post_attention_weight;
    m.post_norm = post_feedforward_weight;
  }

  // Layer i reads KV-cache group g's block tables and slot mapping (run_groups).
  void set_group(int64_t i, int64_t g) {
    check_value(i >= 0 && i < static_cast<int64_t>(layers.size()), "layer: outside the stack");
    check_value(g >= 0, "group: expected >= 0");
    group_of[i] = g;
  }

  // The attention options of layer i (as decode_attention's window / sinks / softcap).
  void set_attention_options(int64_t i, int64_t window, c10::optional<at::Tensor> sinks, double softcap) {
    check_value(i >= 0 && i < static_cast<int64_t>(layers.size()), "layer: outside the stack");
    AttentionArgs& a = layers[i].first;
    attn_opts(window, sinks, softcap, a.num_heads);  // checked
    a.window = window;
    a.sinks = sinks.has_value() ? *sinks : at::Tensor();
    a.softcap = softcap;
  }

  // Layer i's int8 cache scales (KvScales), for a stack built with int8 caches.
  void set_kv_scales(int64_t i, at::Tensor k_scale, at::Tensor v_scale) {
    check_value(i >= 0 && i < static_cast<int64_t>(layers.size()), "layer: outside the stack");
    AttentionArgs& a = layers[i].first;
    kv_scales(a.k_cache, k_scale, v_scale);  // checked
    a.k_scale = k_scale;
    a.v_scale = v_scale;
  }

  // Layer i's MLP half alone (dense or experts), for the layer-by-layer path of tensor
  // parallelism (the all-reduce between the calls): out = mlp(norm(hidden + residual)), residual
  // updated in place, as decode_mlp.
  void mlp(int64_t i, at::Tensor out, at::Tensor residual, at::Tensor hidden) {
    check_value(i >= 0 && i < static_cast<int64_t>(layers.size()), "layer: outside the stack");
    check_value(hidden.dim() == 2 && hidden.is_contiguous() && residual.sizes() == hidden.sizes() &&
                    residual.is_contiguous() && out.sizes() == hidden.sizes() && out.is_contiguous() &&
                    hidden.size(1) == layers[i].second.ln_weight.size(0),
                "hidden/residual/out: expected contiguous [M, hidden] tensors");
    check_value(hidden.size(0) >= 1, "hidden: a decode step has at least one row");
    decode_mlp_into(out, residual, hidden, layers[i].second, scratch);
  }

  void set_norm(at::Tensor weight, double eps) {
    norm_weight = weight;
    norm_eps = eps;
    gemma_norm = false;
  }

  // The final norm, Gemma's (1 + w) one.
  void set_gemma_norm(at::Tensor weight, double eps) {
    set_norm(weight, eps);
    gemma_norm = true;
  }

  void set_embedding(at::Tensor weight) {
    check_value(weight.dim() == 2 && weight.is_contiguous(), "embedding: expected a contiguous [V, H]");
    embedding = weight;
  }

  // The rows of `embedding` for input_ids (int32 or int64 [M]), each id checked against V.
  at::Tensor embed(const at::Tensor& input_ids) const {
    check_value(input_ids.dim() == 1 && input_ids.is_contiguous() &&
                    (input_ids.scalar_type() == at::kInt || input_ids.scalar_type() == at::kLong),
                "input_ids: expected a contiguous int32/int64 [M]");
    const int64_t M = input_ids.size(0), V = embedding.size(0), H = embedding.size(1);
    at::Tensor hidden = at::empty({M, H}, embedding.options());
    const int64_t row_bytes = H * embedding.element_size();
    const char* src = static_cast<const char*>(embedding.data_ptr());
    char* dst = static_cast<char*>(hidden.data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      const int64_t id = index_at(input_ids, m);
      TORCH_CHECK_INDEX(id >= 0 && id < V, "input_ids: token id ", id, " is outside [0, ", V, ")");
      std::memcpy(dst + m * row_bytes, src + id * row_bytes, row_bytes);
    }
    return hidden;
  }

  // input_ids [M], one per decode row (or their embedded rows [M, H], for an embedding that is
  // not a float table: a tied head's group codes, Gemma's scaled rows); one slot mapping and
  // block table per KV-cache group (set_group; one without groups), every table checked before
  // the first layer against the widest window of its group's layers. Returns the final norm of
  // the last layer's output.
  at::Tensor run_groups(const at::Tensor& input_ids, const at::Tensor& positions,
                        const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                        const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens) {
    const bool embedded = input_ids.is_floating_point();
    check_value(!layers.empty() && norm_weight.defined() && (embedded || embedding.defined()),
                "DecodeStack: no layers, final norm or embedding");
    const int64_t groups = static_cast<int64_t>(block_tables.size());
    check_value(groups >= 1 && slot_mappings.size() == block_tables.size(),
                "block_tables/slot_mappings: expected one of each per KV-cache group");
    check_value(*std::max_element(group_of.begin(), group_of.end()) < groups,
                "block_tables: fewer groups than the stack's layers read");
    at::Tensor hidden = embedded ? input_ids : embed(input_ids);
    check_value(hidden.dim() == 2 && hidden.is_contiguous() &&
                    hidden.size(1) == layers[0].first.qkv.k,
                "input_ids: expected ids [M] or embedded rows [M, hidden]");
    const int64_t M = hidden.size(0);
    check_value(M >= 1, "hidden: a decode step has at least one row");
    check_value(context_lens.size(0) == M && positions.size(0) == M,
                "context_lens/positions: one entry per decode row");
    for (int64_t g = 0; g < groups; ++g) {
      // The blocks the widest of the group's layers reads (every block when one has no window).
      int64_t widest = -1;
      for (size_t i = 0; i < layers.size(); ++i) {
        if (group_of[i] != g) continue;
        const int64_t w = layers[i].first.window;
        widest = widest < 0 ? w : (w == 0 || widest == 0 ? 0 : std::max(widest, w));
      }
      if (widest < 0) continue;  // no layer reads this group
      check_value(slot_mappings[g].size(0) == M, "slot_mapping: one entry per decode row");
      check_value(block_tables[g].dim() == 2 && block_tables[g].size(0) == M,
                  "block_tables/context_lens: expected contiguous int32 [M, W] / [M]");
      check_block_tables(block_tables[g], cu_seqlens_q, context_lens, layers[0].first.k_cache.size(0),
                         layers[0].first.k_cache.size(1), widest);
    }
    at::Tensor residual = scratch.get(kResidual, hidden.sizes(), hidden.options());
    at::Tensor other = scratch.get(kOther, hidden.sizes(), hidden.options());
    for (const auto& l : layers) {
      check_value(l.first.k_cache.scalar_type() != at::kChar || l.first.k_scale.defined(),
                  "DecodeStack: an int8 cache without its scales (set_kv_scales)");
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      const int64_t g = group_of[i];
      decode_attention_into(other, residual, hidden, i > 0, positions, slot_mappings[g], block_tables[g],
                            context_lens, layers[i].first, scratch);
      decode_mlp_into(hidden, residual, other, layers[i].second, scratch);
    }
    at::Tensor out = at::empty_like(hidden);
    (gemma_norm ? &gemma_rms_norm : &rms_norm)(out, hidden, residual, residual, norm_weight, norm_eps);
    return out;
  }
};
}  // namespace

TORCH_LIBRARY(tpserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor context_lens, float scale, "
        "bool prompt=False, int num_decodes=-1, bool checked=False, bool rows=False, "
        "int window=0, Tensor? sinks=None, float softcap=0., Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> ()");
  m.def("check_block_tables(Tensor block_tables, Tensor cu_seqlens_q, Tensor context_lens, "
        "int num_blocks, int block_size, int window=0) -> ()");
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor? residual, Tensor(b!)? residual_out, "
        "Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("decode_attention(Tensor(a!) out, Tensor(b!) residual, Tensor hidden, bool has_residual, "
        "Tensor positions, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor ln_weight, float eps, Tensor? q_norm, "
        "Tensor? k_norm, int num_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin, "
        "float scale, Tensor qkv_data, int qkv_kind, Tensor? qkv_scales, Tensor? qkv_colsum, "
        "Tensor? qkv_bias, Tensor o_data, int o_kind, Tensor? o_scales, Tensor? o_colsum, "
        "Tensor? o_bias, int window=0, Tensor? sinks=None, float softcap=0., Tensor(e!)? k_scale=None, "
        "Tensor(f!)? v_scale=None, bool gemma=False) -> ()");
  m.def("decode_mlp(Tensor(a!) out, Tensor(b!) residual, Tensor hidden, Tensor ln_weight, float eps, "
        "int intermediate, Tensor gu_data, int gu_kind, Tensor? gu_scales, Tensor? gu_colsum, "
        "Tensor? gu_bias, Tensor down_data, int down_kind, Tensor? down_scales, "
        "Tensor? down_colsum, Tensor? down_bias, bool gemma=False) -> ()");
  m.def("qkv_to_cache(Tensor qkv, Tensor(a!) q_out, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor positions, Tensor slot_mapping, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, "
        "float eps, int num_heads, int num_kv_heads, bool gemma=False, Tensor(d!)? k_scale=None, "
        "Tensor(e!)? v_scale=None) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows_greedy(Tensor(a!) out, Tensor x, Tensor temperatures) -> bool");
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_moe_layer", &DecodeStack::add_moe_layer)
      .def("mlp", &DecodeStack::mlp)
      .def("set_attention_options", &DecodeStack::set_attention_options)
      .def("set_kv_scales", &DecodeStack::set_kv_scales)
      .def("set_norm", &DecodeStack::set_norm)
      .def("set_gemma_norm", &DecodeStack::set_gemma_norm)
      .def("set_gemma", &DecodeStack::set_gemma)
      .def("set_group", &DecodeStack::set_group)
      .def("set_embedding", &DecodeStack::set_embedding)
      .def("run_groups", &DecodeStack::run_groups);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("check_block_tables", &check_block_tables);
  m.impl("store_kvcache", &store_kvcache);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_mlp", &decode_mlp);
  m.impl("qkv_to_cache", &qkv_to_cache_op);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("argmax_rows_greedy", &argmax_rows_greedy);
  m.impl("rotary_embedding", &rotary_embedding);
}
