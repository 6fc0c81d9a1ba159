// Scalar and vector helpers shared by tpserve's CPU operators (cpu_ops.cpp, linear_ops.cpp):
// bf16 <-> fp32 conversions that round as c10 does, a vectorisable exp, and float vectors of the
// machine's width (GCC vector extensions, so one source builds for AVX-512, AVX2 or anything else).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace tpserve {

// ---- scalar helpers ---------------------------------------------------------------------------

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <>
inline float to_f<at::BFloat16>(at::BFloat16 x) {
  // bf16 is the top half of an fp32: a shift the compiler vectorises (the c10 conversion
  // goes through a function the vectoriser does not see through).
  return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16);
}

template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

template <>
inline at::BFloat16 from_f<at::BFloat16>(float x) {
  // Round to nearest even, as c10 does, but branch-free so that loops over it vectorise.
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t out = std::isnan(x) ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return at::BFloat16(out, at::BFloat16::from_bits());
}

template <typename T>
inline float round_to(float x) { return to_f<T>(from_f<T>(x)); }

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f<T>(src[i]);
}

// A pragma cannot sit inside the dispatch macros' lambdas, hence this helper.
inline float sum_squares(const float* x, int64_t n) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

// exp(x) for x <= 0 (softmax arguments after subtracting the running maximum): Cody-Waite range
// reduction and a degree-6 polynomial, relative error ~2e-7. Written so that a loop over it
// vectorises; the libm expf call does not, and at 2M exponentials a decode step that matters.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

// ---- streaming a packed weight ---------------------------------------------------------------

// The tile loops that stream a weight panel ask for its lines ahead of the ones they multiply:
// into L1 kPrefetchBytes ahead, and into L2 kPrefetchL2Bytes ahead. A panel is one sequential
// stream, yet the hardware prefetchers alone kept a thread at ~12 GB/s: the bf16 LM head of
// Qwen3-30B-A3B (151,936 x 2048, 622 MB) at one row took 27.3 ms on two threads, 19.7 ms with the
// L1 prefetches (512 B ahead: 21.2, 2 KB: 20.5, 4 KB: 21.5). The L2 ones, 8 KB ahead, keep more
// lines in flight than the L1 fill buffers allow: a one-stream decode step of the 0.6B shape went
// 26.4 -> 23.6 ms in int8 and 18.1 -> 15.6 ms in Q4_0 (2-core Xeon with AMX, quiet; 6 and 12 KB
// gave the same within noise, 16 KB less). Prefetches past the end of a buffer are harmless
// (they never fault).
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kPrefetchL2Bytes = 8192;

// Prefetch the `bytes` (a multiple of 64) that a tile step reads at p, at both distances.
template <int64_t bytes>
inline void prefetch_ahead(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(c + kPrefetchBytes + i, 0, 3);
    __builtin_prefetch(c + kPrefetchL2Bytes + i, 0, 1);
  }
}

// Vectors of the machine's width: 16 floats with AVX-512, 8 otherwise (GCC lowers a 16-float
// vector on an AVX2 target to spills and lane inserts when many are live: with -march=haswell
// the attention prompt path ran 10x slower that way, the decode path 2x).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfl __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vu16l __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vu32l __attribute__((vector_size(kLanes * 4)));

inline vfl loadl(const float* p) {
  vfl v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vfl loadl(const at::BFloat16* p) {
  vu16l h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vfl>(__builtin_convertvector(h, vu32l) << 16);
}

// int8 KV-cache rows (a per-row scale is applied by the caller). Intrinsics: GCC lowers a
// __builtin_convertvector of int8 lanes to floats to one scalar conversion per lane.
inline vfl loadl(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfl>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vfl>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(p)))));
#else
  vfl v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline void storel(float* p, vfl v) { std::memcpy(p, &v, sizeof(v)); }

// Rounds to bf16 as from_f does (nearest even, NaN -> 0x7FC0), a vector at a time.
inline vu32l bf16_bits(vfl v) {
  const vu32l bits = reinterpret_cast<vu32l>(v);
  const vu32l rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vu32l nan = rounded * 0u + 0x7FC0u;
  return v != v ? nan : rounded;
}

inline void storel(at::BFloat16* p, vfl v) {
  const vu16l h = __builtin_convertvector(bf16_bits(v), vu16l);
  std::memcpy(p, &h, sizeof(h));
}

// round_to<T> for a vector: the value a store to T and a load back would give.
inline vfl roundl(vfl v, float*) { return v; }
inline vfl roundl(vfl v, at::BFloat16*) { return reinterpret_cast<vfl>(bf16_bits(v) << 16); }

// Sums and maxima across lanes as trees of halves (a serial scalar loop was slower in the
// decode path, which sums one vector per key and head).
inline vf4 to_quarters(vf8 v, bool max) {
  const vf4 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3), hi = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return max ? (lo > hi ? lo : hi) : lo + hi;
}

inline vf4 fold_lanes(vfl v, bool max) {
#if defined(__AVX512F__)
  const vf8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vf8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return to_quarters(max ? (lo > hi ? lo : hi) : lo + hi, max);
#else
  return to_quarters(v, max);
#endif
}

inline float hsuml(vfl v) {
  const vf4 b = fold_lanes(v, false);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmaxl(vfl v) {
  const vf4 b = fold_lanes(v, true);
  return std::max(std::max(b[0], b[2]), std::max(b[1], b[3]));
}

// One row of a gated activation, out = round(act(gate)) * up for [gate | up] rows, in three flat
// loops (widen, fp32 math, narrow), each of which the compiler vectorises; `row` is scratch of I
// floats. act(gate) is rounded to T before the product, as the module path's separate ops round it.
template <typename T, typename Act>
inline void gated_mul_row(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t I,
                          std::vector<float>& row, Act act) {
  float* r = row.data();
  load_row(g, r, I);
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) r[i] = act(r[i]);
  for (int64_t i = 0; i < I; ++i) o[i] = from_f<T>(round_to<T>(r[i]) * to_f<T>(u[i]));
}

// One row of silu_and_mul (cpu_ops.cpp; the grouped experts of moe_ops.cpp too).
template <typename T>
inline void silu_mul_row(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t I,
                         std::vector<float>& row) {
  gated_mul_row(g, u, o, I, row, [](float x) {
    // sigmoid from exp(-|g|) <= 1: the vectorised exp_nonpos, and no overflow.
    const float e = exp_nonpos(std::min(x, -x));
    const float num = x >= 0.f ? 1.f : e;  // a select, not a branch
    return x * (num / (1.f + e));
  });
}

// Argument checks: TORCH_CHECK_VALUE raises ValueError in Python.
inline void check_value(bool ok, const char* what) { TORCH_CHECK_VALUE(ok, what); }

// A gated activation's operator: out [N, I] for x [N, 2I] laid out [gate | up] (rows of any
// stride, contiguous within), each row by row_fn(gate, up, out, I, scratch) of T's type.
template <typename RowFn>
void gated_and_mul(at::Tensor& out, const at::Tensor& x, RowFn row_fn) {
  const auto st = x.scalar_type();
  check_value(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "x: expected float32, bfloat16 or float16");
  check_value(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x: expected [N, 2I] with a contiguous last dimension");
  const int64_t N = x.size(0), I = x.size(1) / 2;
  check_value(out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == I &&
                  out.dtype() == x.dtype(),
              "out: expected a contiguous [N, I] tensor of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "gated_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    // Rows per chunk: waking the pool costs more than ~256k elements of this work.
    const int64_t grain = std::max<int64_t>(1, 262144 / std::max<int64_t>(1, I));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(I);
      for (int64_t n = begin; n < end; ++n) row_fn(xp + n * xs, xp + n * xs + I, op + n * I, I, row);
    });
  });
}

}  // namespace tpserve
