// Packed linear layers on CPU: out = x W^T (+ bias) for fp32, bf16 and int8 weights, one kernel
// for every row count (a decode step's single row as well as a prompt's thousands).
//
// Layout. The weight [N, K] is cut into panels of P = 4 vectors of output channels (64 with
// AVX-512, 32 otherwise; N is padded with zero channels to a whole panel). Within a panel the
// channels of one input feature are contiguous, so one panel is one stream read front to back:
//     fp32, int8 (weight-only)  [N/P][K][P]
//     bf16                      [N/P][K/2][P][2]   (the pairs vdpbf16ps multiplies)
//     int8 with int8 activations [N/P][K/4][P][4]  (the quads vpdpbusd multiplies)
// (packed_gemm.py builds these with torch reshapes.) A vector of the panel holds consecutive
// output channels, so the sums never need a horizontal reduction: each input feature (pair,
// quad) is broadcast from x and multiplied into the panel's 4 vectors, for up to kTile rows of x
// at once (4 x kTile accumulators). With one row the kernel is bound by reading the weight once;
// with many, each panel stays in L2 while the rows stream past it.
//
// Sums: fp32, in order of k, whatever the row count or the rows around a row, so a row's result
// does not depend on what shares its call. bf16 on AVX512-BF16 multiplies pairs with vdpbf16ps
// (exact products, fp32 sums, denormals flushed); elsewhere bf16 is widened and summed with FMAs.
// int8 weight-only: x (widened to fp32) times the int8 weights, summed in fp32, times the channel
// scale at the end. int8 dynamic: each row of x is quantized symmetrically to [-127, 127] with
// its own scale (absmax / 127), the int32 sums are exact, then scaled by both scales. The bias is
// added in fp32 before the result is rounded to the output dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdlib>
#include <string>

#include "amx.h"
#include "linear_ops.h"
#include "quant_ops.h"
#include "vec.h"

namespace tpserve {

bool amx_granted() {
#if !TPSERVE_AMX
  return false;
#else
  static const bool granted = [] {
    const char* env = std::getenv("TPSERVE_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#endif
}

namespace {

constexpr int64_t kPanel = 4 * kLanes;
// Rows of x per micro-tile: 4 x kTile accumulators plus 4 weight vectors must fit the registers
// (32 with AVX-512, 16 with AVX2).
#if defined(__AVX512F__)
constexpr int64_t kTile = 4;
#else
constexpr int64_t kTile = 2;
#endif
// Rows per work item: items are (panel, block of rows), so small panels counts still split.
constexpr int64_t kRowBlock = 64;
// Rows a call's panels pass together before the next rows (linear_typed): a multiple of kRowBlock.
constexpr int64_t kRowChunk = 512;

#if defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;
#else
constexpr bool kNativeBf16 = false;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kInt8Path = 2;  // vpdpbusd: unsigned activations (x + 128), compensated by colsum
#elif defined(__AVX2__)
constexpr int kInt8Path = 1;  // vpmaddubsw on |x| and sign-adjusted weights (no saturation)
#else
constexpr int kInt8Path = 0;  // scalar
#endif

typedef int32_t vi32l __attribute__((vector_size(kLanes * 4)));
typedef int8_t vi8l __attribute__((vector_size(kLanes)));

int64_t panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// Bytes of packed data per (panel, input feature).
int64_t bytes_per_k(int64_t kind) {
  return kind == kFloat32 ? kPanel * 4 : kind == kBFloat16 ? kPanel * 2 : kPanel;
}

int64_t k_multiple(int64_t kind) { return kind == kBFloat16 ? 2 : kind == kInt8Dynamic ? 4 : 1; }

// ---- activations in the form a kernel reads ------------------------------------------------

// x rows as the kernels read them (LinearRows, linear_ops.h): the original rows (fp32 kind; bf16
// with dpbf16), widened fp32 rows, or quantized rows with their scales.
using Rows = LinearRows;

thread_local RowBuffers t_rows;

template <typename T>
void widen_rows(const T* x, int64_t xs, int64_t M, int64_t K, float* dst) {
  at::parallel_for(0, M, std::max<int64_t>(1, 262144 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      for (int64_t k = 0; k < K; ++k) dst[m * K + k] = to_f<T>(x[m * xs + k]);
    }
  });
}

// Row m -> q = round(x / s) in [-127, 127], s = max|x| / 127 (1 for a zero row); stored as
// q + 128 (unsigned) on the vpdpbusd path. Rounding: to nearest, ties to even (nearbyint under
// the default mode; so does vcvtps2dq).
template <typename T>
void quantize_row(const T* row, int64_t K, int8_t* q, float* scale) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 vmax = _mm512_setzero_ps();
  for (; k + kLanes <= K; k += kLanes) vmax = _mm512_max_ps(vmax, _mm512_abs_ps((__m512)loadl(row + k)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(to_f<T>(row[k])));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  const float inv = 1.f / s;
  *scale = s;
  k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i offset = _mm512_set1_epi32(kInt8Path == 2 ? 128 : 0);
  for (; k + kLanes <= K; k += kLanes) {
    __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps((__m512)loadl(row + k), vinv));
    c = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(c, lo), hi), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(c));  // low byte
  }
#endif
  for (; k < K; ++k) {
    const float v = std::nearbyint(to_f<T>(row[k]) * inv);
    const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
    q[k] = static_cast<int8_t>(kInt8Path == 2 ? c + 128 - 256 * (c >= 0) : c);
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t xs, int64_t M, int64_t K, int8_t* dst, float* scales) {
  at::parallel_for(0, M, std::max<int64_t>(1, 131072 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row(x + m * xs, K, dst + m * K, scales + m);
  });
}

// ---- micro-kernels: tm <= kTile rows of x times one panel, over all of K ------------------------
//
// acc[t][i] holds output channels [i * kLanes, (i + 1) * kLanes) of the panel for row t.

inline vfl load_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vfl)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vfl)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vi8l v;  // GCC's generic conversion of this vector is scalar code on x86: the intrinsics above
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, vfl);
#endif
}

inline vfl load_w(const float* p) { return loadl(p); }
inline vfl load_w(const int8_t* p) { return load_i8(p); }

// fp32 weights, or int8 ones widened (their scale comes in the epilogue), times fp32 rows.
template <int64_t TM, bool PF, typename W>
inline void tile_fma(const W* w, int64_t K, const float* x, int64_t ld, vfl (&acc)[kTile][4]) {
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    if constexpr (PF) prefetch_ahead<kPanel * sizeof(W)>(w);
    const vfl w0 = load_w(w), w1 = load_w(w + kLanes), w2 = load_w(w + 2 * kLanes), w3 = load_w(w + 3 * kLanes);
    for (int64_t t = 0; t < TM; ++t) {
      const float xv = x[t * ld + k];
      acc[t][0] += xv * w0;
      acc[t][1] += xv * w1;
      acc[t][2] += xv * w2;
      acc[t][3] += xv * w3;
    }
  }
}

// bf16 pairs without vdpbf16ps: the even feature of a pair is the low half of a 32-bit lane.
inline void load_pair(const uint16_t* p, vfl& even, vfl& odd) {
  vu32l v;
  std::memcpy(&v, p, sizeof(v));
  even = reinterpret_cast<vfl>(v << 16);
  odd = reinterpret_cast<vfl>(v & 0xFFFF0000u);
}

template <int64_t TM, bool PF>
inline void tile_bf16_widened(const uint16_t* w, int64_t K, const float* x, int64_t ld,
                              vfl (&acc)[kTile][4]) {
  for (int64_t k = 0; k < K; k += 2, w += 2 * kPanel) {
    if constexpr (PF) prefetch_ahead<2 * kPanel * 2>(w);
    vfl e[4], o[4];
    for (int64_t i = 0; i < 4; ++i) load_pair(w + 2 * i * kLanes, e[i], o[i]);
    for (int64_t t = 0; t < TM; ++t) {
      const float x0 = x[t * ld + k], x1 = x[t * ld + k + 1];
      for (int64_t i = 0; i < 4; ++i) acc[t][i] += x0 * e[i] + x1 * o[i];
    }
  }
}

#if defined(__AVX512BF16__)
template <int64_t TM, bool PF>
inline void tile_bf16_dp(const uint16_t* w, int64_t K, const uint16_t* x, int64_t ld,
                         vfl (&acc)[kTile][4]) {
  __m512 a[TM][4];
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) a[t][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2, w += 2 * kPanel) {
    if constexpr (PF) prefetch_ahead<2 * kPanel * 2>(w);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int64_t t = 0; t < TM; ++t) {
      int32_t pair;
      std::memcpy(&pair, x + t * ld + k, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      a[t][0] = _mm512_dpbf16_ps(a[t][0], w0, xb);
      a[t][1] = _mm512_dpbf16_ps(a[t][1], w1, xb);
      a[t][2] = _mm512_dpbf16_ps(a[t][2], w2, xb);
      a[t][3] = _mm512_dpbf16_ps(a[t][3], w3, xb);
    }
  }
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) acc[t][i] = (vfl)a[t][i];
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// acc += u8 quads of x times s8 quads of w. GCC 12 compiles _mm512_dpbusd_epi32 on an array
// of accumulators into a register copy of every accumulator per step, one spilled to the stack,
// and a memory operand per instruction (each weight vector loaded TM times): 45% of the
// instruction's peak against 77% for the same loop on vdpbf16ps. Tied in asm, the loop is clean.
inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
#endif

// int8 x int8 quads -> exact int32 sums, returned as floats (before any scale or compensation).
template <int64_t TM, bool PF>
inline void tile_i8i8(const int8_t* w, int64_t K, const int8_t* x, int64_t ld, vfl (&acc)[kTile][4]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i a[TM][4];
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) a[t][i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 4, w += 4 * kPanel) {
    if constexpr (PF) prefetch_ahead<4 * kPanel>(w);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
    const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
    for (int64_t t = 0; t < TM; ++t) {
      int32_t quad;
      std::memcpy(&quad, x + t * ld + k, 4);
      const __m512i xb = _mm512_set1_epi32(quad);
      a[t][0] = dpbusd(a[t][0], xb, w0);
      a[t][1] = dpbusd(a[t][1], xb, w1);
      a[t][2] = dpbusd(a[t][2], xb, w2);
      a[t][3] = dpbusd(a[t][3], xb, w3);
    }
  }
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) acc[t][i] = (vfl)_mm512_cvtepi32_ps(a[t][i]);
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a[TM][4];
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) a[t][i] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 4, w += 4 * kPanel) {
    if constexpr (PF) prefetch_ahead<4 * kPanel>(w);
    __m256i wv[4];
    for (int64_t i = 0; i < 4; ++i) wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * i));
    for (int64_t t = 0; t < TM; ++t) {
      int32_t quad;
      std::memcpy(&quad, x + t * ld + k, 4);
      const __m256i xb = _mm256_set1_epi32(quad);
      const __m256i ax = _mm256_sign_epi8(xb, xb);  // |x|, unsigned
      for (int64_t i = 0; i < 4; ++i) {
        // |x| * (w * sign(x)) = x * w; pairs of such products stay within int16.
        const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[i], xb));
        a[t][i] = _mm256_add_epi32(a[t][i], _mm256_madd_epi16(p, ones));
      }
    }
  }
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) acc[t][i] = (vfl)_mm256_cvtepi32_ps(a[t][i]);
#else
  int32_t a[TM][kPanel] = {};
  for (int64_t k = 0; k < K; k += 4, w += 4 * kPanel) {
    for (int64_t t = 0; t < TM; ++t) {
      const int8_t* xq = x + t * ld + k;
      for (int64_t j = 0; j < kPanel; ++j) {
        int32_t s = 0;
        for (int64_t q = 0; q < 4; ++q) s += static_cast<int32_t>(w[j * 4 + q]) * xq[q];
        a[t][j] += s;
      }
    }
  }
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t l = 0; l < kLanes; ++l) acc[t][i][l] = static_cast<float>(a[t][i * kLanes + l]);
#endif
}

// ---- one work item: a block of rows times one panel -----------------------------------------

template <typename T>
inline void store_row(T* dst, const vfl* v, int64_t valid) {
  if (valid == kPanel) {
    for (int64_t i = 0; i < 4; ++i) storel(dst + i * kLanes, v[i]);
    return;
  }
  float buf[kPanel];
  for (int64_t i = 0; i < 4; ++i) storel(buf + i * kLanes, v[i]);
  for (int64_t j = 0; j < valid; ++j) dst[j] = from_f<T>(buf[j]);
}

// What a panel's sums become: int8 kinds' channel scales (kInt8Dynamic: less the +128
// compensation, times the row's scale), the bias, then the output's rounding. Shared by the
// vector and the tile kernels, so both end a row with the same operations.
template <typename T>
struct Epilogue {
  vfl scale[4], comp[4], bias[4];
  bool scaled, compensate, has_bias, dynamic;
  int64_t n0, valid;

  Epilogue(const PackedLinear& w, int64_t p)
      : scaled(w.kind == kInt8 || w.kind == kInt8Dynamic),
        compensate(w.kind == kInt8Dynamic && kInt8Path == 2),
        has_bias(w.bias.has_value()),
        dynamic(w.kind == kInt8Dynamic),
        n0(p * kPanel),
        valid(std::min(kPanel, w.n - p * kPanel)) {
    if (scaled) {
      const float* s = w.scales->data_ptr<float>() + n0;
      for (int64_t i = 0; i < 4; ++i) scale[i] = loadl(s + i * kLanes);
    }
    if (compensate) {
      const int32_t* c = w.colsum->data_ptr<int32_t>() + n0;
      for (int64_t i = 0; i < 4; ++i) {
        vi32l ci;
        std::memcpy(&ci, c + i * kLanes, sizeof(ci));
        comp[i] = __builtin_convertvector(ci, vfl) * 128.f;
      }
    }
    if (has_bias) {
      float b[kPanel] = {};
      const T* bp = w.bias->data_ptr<T>() + n0;
      for (int64_t j = 0; j < valid; ++j) b[j] = to_f<T>(bp[j]);
      for (int64_t i = 0; i < 4; ++i) bias[i] = loadl(b + i * kLanes);
    }
  }

  // Row r's sums (the panel's 4 vectors) into out's row r. Not inlined: one copy of the code,
  // so the compiler's contraction of its multiply-adds cannot differ between the kernels.
  __attribute__((noinline)) void finish(const vfl (&acc)[4], const Rows& rows, int64_t r, T* out,
                                        int64_t ldo) const {
    vfl v[4];
    for (int64_t i = 0; i < 4; ++i) {
      v[i] = acc[i];
      if (compensate) v[i] -= comp[i];
      if (dynamic) v[i] *= rows.scales[r];
      if (scaled) v[i] *= scale[i];
      if (has_bias) v[i] += bias[i];
    }
    store_row(out + r * ldo + n0, v, valid);
  }
};

template <typename T, int64_t TM, bool PF>
void run_tile(const PackedLinear& w, const Rows& rows, int64_t p, int64_t r0, T* out, int64_t ldo) {
  const int64_t K = w.k;
  vfl acc[kTile][4];
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) acc[t][i] = vfl{};
  const char* panel = static_cast<const char*>(w.data.data_ptr()) + p * K * bytes_per_k(w.kind);
  switch (w.kind) {
    case kFloat32:
      tile_fma<TM, PF>(reinterpret_cast<const float*>(panel), K,
                   static_cast<const float*>(rows.data) + r0 * rows.ld, rows.ld, acc);
      break;
    case kBFloat16:
#if defined(__AVX512BF16__)
      tile_bf16_dp<TM, PF>(reinterpret_cast<const uint16_t*>(panel), K,
                       static_cast<const uint16_t*>(rows.data) + r0 * rows.ld, rows.ld, acc);
#else
      tile_bf16_widened<TM, PF>(reinterpret_cast<const uint16_t*>(panel), K,
                            static_cast<const float*>(rows.data) + r0 * rows.ld, rows.ld, acc);
#endif
      break;
    case kInt8:
      tile_fma<TM, PF>(reinterpret_cast<const int8_t*>(panel), K,
                  static_cast<const float*>(rows.data) + r0 * rows.ld, rows.ld, acc);
      break;
    default:
      tile_i8i8<TM, PF>(reinterpret_cast<const int8_t*>(panel), K,
                    static_cast<const int8_t*>(rows.data) + r0 * rows.ld, rows.ld, acc);
      break;
  }
  const Epilogue<T> e(w, p);
  for (int64_t t = 0; t < TM; ++t) e.finish(acc[t], rows, r0 + t, out, ldo);
}

// ---- bf16 and int8 on AMX: tiles of up to 16 rows x 16 channels --------------------------------
//
// With AMX a bf16 or int8-dynamic weight runs on the tile unit instead of the vector kernels: one
// tdpbf16ps is 16 x 16 x 32 multiply-adds (tdpbusd: 16 x 16 x 64), 16x a vector instruction's
// work, where the vector loop is bound by its FMA ports at any row count above a few. The packed
// layout is read as it is: a B tile is 16 pairs (quads) of input features, the tile's 16 rows 256
// bytes apart, by 16 output channels (64 bytes), so the 4 B tiles of a panel are the 4 vectors
// of the vector kernels; A tiles are x's rows (or their int8 quantization), 64 bytes each, read in
// place. Every row's sum is the same sequence of tile instructions whatever the row count and
// whichever rows share a tile (the tile unit's result for a row depends on that row and the
// weights only), so a row's result does not depend on what shares its call, as on the vector
// path. int8 sums are exact, so they equal the vector path's bit for bit; bf16 sums differ from
// vdpbf16ps's in the last bits. Used for a weight whose K is a multiple of the tile's depth (bf16
// 32, int8 64) when the CPU has AMX and the kernel grants the tile state (arch_prctl): bf16 at
// every row count, int8 from kAmxInt8Rows rows. TPSERVE_AMX=0 keeps the vector kernels (to
// compare).
#if TPSERVE_AMX

constexpr int64_t kAmxRows = 16;    // rows of x per A tile
constexpr int64_t kAmxBytes = 64;   // bytes of a tile row: 32 bf16 or 64 int8 input features
constexpr int64_t kKStep = 256;     // bytes of a panel per pair (bf16) or quad (int8) of features
constexpr int64_t kAmxChunkSteps = 8;  // tile steps per range of input features (32 KB of a panel)
static_assert(kRowBlock % (2 * kAmxRows) == 0, "an item's rows are whole blocks of 32 but the last");

// The shape this thread's tiles were last configured for (m0 * 32 + m1 + 1), while a
// TileShapeScope lives on the thread; 0 when unknown. ldtilecfg stalls the tile unit: loaded per
// block of 32 rows it took a quarter of a K = 256 matmul's time. Within one call's loop nothing
// else runs on the thread, so the shape is known there; outside it (torch's oneDNN also uses the
// tiles, and may release them) every block configures again.
thread_local int64_t t_tile_shape = 0;
thread_local bool t_tile_scope = false;

struct TileShapeScope {
  TileShapeScope() {
    t_tile_shape = 0;
    t_tile_scope = true;
  }
  ~TileShapeScope() {
    t_tile_shape = 0;
    t_tile_scope = false;
  }
};

// Tiles: C 0-3, A 4-5, B 6-7. Shape (a): one A tile of m0 rows times the panel's 4 B tiles into
// C 0-3. Shape (b): A tiles of m0 and m1 rows times 2 B tiles (half a panel) into C 0-3.
inline void amx_configure(int64_t m0, int64_t m1) {
  const int64_t shape = m0 * 32 + m1 + 1;
  if (t_tile_scope && shape == t_tile_shape) return;
  if (t_tile_scope) t_tile_shape = shape;
  TileConfig c;
  const auto set = [&](int t, int64_t rows) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = kAmxBytes;
  };
  if (m1 == 0) {
    for (int t = 0; t < 4; ++t) set(t, m0);
  } else {
    set(0, m0), set(1, m0), set(2, m1), set(3, m1);
    set(5, m1);
  }
  set(4, m0);
  set(6, 16), set(7, 16);
  load_tile_config(c);
}

// Input features per tile step of a kind, 0 where the tiles do not run it.
constexpr int64_t amx_depth(int64_t kind) {
  return kind == kBFloat16 ? 32 : kind == kInt8Dynamic && kInt8Path == 2 ? 64 : 0;
}

// int8 sums are exact on both paths, so int8 can choose by row count: below kAmxInt8Rows rows the
// vector kernel, which prefetches the weights it streams, was ~10% faster (16 weights of 3072 x
// 1024 at one row: 2.00 vs 2.21 ms on one thread). bf16 runs on the tiles at every row count
// (its bits differ between the paths), and one row costs what it costs on the vector path.
constexpr int64_t kAmxInt8Rows = 8;

inline bool amx_runs(const PackedLinear& w, int64_t rows) {
  const int64_t depth = amx_depth(w.kind);
  return depth != 0 && w.k % depth == 0 && (w.kind != kInt8Dynamic || rows >= kAmxInt8Rows) &&
         amx_granted();
}

// One tile multiply-add of the kind (the tile numbers must be immediates, hence a macro).
#define TPSERVE_AMX_DOT(I8, C, A, B) \
  do {                               \
    if constexpr (I8) {              \
      _tile_dpbusd(C, A, B);         \
    } else {                         \
      _tile_dpbf16ps(C, A, B);       \
    }                                \
  } while (0)

// Rows [0, m) (m <= 32) of x (bytes xstride apart) times one panel of `steps` tile steps ->
// c[m][kPanel]: fp32 sums (bf16) or int32 ones (int8). With `more`, the sums continue from those
// in c (a previous range of the input features), stored and reloaded exactly.
template <bool I8>
inline void amx_block(const char* b, int64_t steps, const char* x, int64_t xstride, int64_t m, void* c,
                      bool more = false) {
  constexpr int64_t ldc = kPanel * 4;
  char* cb = static_cast<char*>(c);
  if (m <= kAmxRows) {
    amx_configure(m, 0);
    if (more) {
      _tile_loadd(0, cb, ldc);
      _tile_loadd(1, cb + 64, ldc);
      _tile_loadd(2, cb + 128, ldc);
      _tile_loadd(3, cb + 192, ldc);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t s = 0; s < steps; ++s, b += 16 * kKStep, x += kAmxBytes) {
      _tile_loadd(4, x, xstride);
      _tile_loadd(6, b, kKStep);
      _tile_loadd(7, b + 64, kKStep);
      TPSERVE_AMX_DOT(I8, 0, 4, 6);
      TPSERVE_AMX_DOT(I8, 1, 4, 7);
      _tile_loadd(6, b + 128, kKStep);
      _tile_loadd(7, b + 192, kKStep);
      TPSERVE_AMX_DOT(I8, 2, 4, 6);
      TPSERVE_AMX_DOT(I8, 3, 4, 7);
    }
    _tile_stored(0, cb, ldc);
    _tile_stored(1, cb + 64, ldc);
    _tile_stored(2, cb + 128, ldc);
    _tile_stored(3, cb + 192, ldc);
    return;
  }
  amx_configure(kAmxRows, m - kAmxRows);
  for (int64_t half = 0; half < 2; ++half) {
    char* ch = cb + half * 128;
    if (more) {
      _tile_loadd(0, ch, ldc);
      _tile_loadd(1, ch + 64, ldc);
      _tile_loadd(2, ch + kAmxRows * ldc, ldc);
      _tile_loadd(3, ch + kAmxRows * ldc + 64, ldc);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    const char* bh = b + half * 128;
    const char* x0 = x;
    for (int64_t s = 0; s < steps; ++s, bh += 16 * kKStep, x0 += kAmxBytes) {
      // Half a panel is every other pair of cache lines, which the hardware prefetchers do not
      // follow: ask for the lines two steps ahead (256 rows x 12288 x 1024 on one thread: 6.9-7.5
      // ms with, 8.5 without).
      for (int64_t r = 0; r < 16; ++r) {
        __builtin_prefetch(bh + 32 * kKStep + r * kKStep, 0, 3);
        __builtin_prefetch(bh + 32 * kKStep + r * kKStep + 64, 0, 3);
      }
      _tile_loadd(4, x0, xstride);
      _tile_loadd(5, x0 + kAmxRows * xstride, xstride);
      _tile_loadd(6, bh, kKStep);
      _tile_loadd(7, bh + 64, kKStep);
      TPSERVE_AMX_DOT(I8, 0, 4, 6);
      TPSERVE_AMX_DOT(I8, 1, 4, 7);
      TPSERVE_AMX_DOT(I8, 2, 5, 6);
      TPSERVE_AMX_DOT(I8, 3, 5, 7);
    }
    _tile_stored(0, ch, ldc);
    _tile_stored(1, ch + 64, ldc);
    _tile_stored(2, ch + kAmxRows * ldc, ldc);
    _tile_stored(3, ch + kAmxRows * ldc + 64, ldc);
  }
}

// Rows [r0, r1) times panel p on the tile unit, ended by the vector kernels' epilogue.
template <typename T>
void run_rows_amx(const PackedLinear& w, const Rows& rows, int64_t p, int64_t r0, int64_t r1, T* out,
                  int64_t ldo) {
  if (r1 - r0 > kRowBlock) {  // (the grouped experts' pieces may be longer than an item)
    for (int64_t r = r0; r < r1; r += kRowBlock) {
      run_rows_amx<T>(w, rows, p, r, std::min(r1, r + kRowBlock), out, ldo);
    }
    return;
  }
  const bool i8 = w.kind == kInt8Dynamic;
  const int64_t elem = i8 ? 1 : 2;  // bytes per element of x's rows
  const char* panel = static_cast<const char*>(w.data.data_ptr()) + p * w.k * bytes_per_k(w.kind);
  const int64_t steps = w.k / amx_depth(w.kind);
  const Epilogue<T> e(w, p);
  const char* x = static_cast<const char*>(rows.data);
  const int64_t xstride = rows.ld * elem;
  // The item's blocks of 32 rows take the input features kAmxChunkSteps tile steps at a time, each
  // range for every block before the next, so the range of the panel (32 KB) stays in L1 for all
  // of them instead of streaming from L2 once per block; the sums wait in cs between ranges
  // (stored and reloaded exactly, in the same order of k: the bits do not change).
  alignas(64) float cs[kRowBlock / (2 * kAmxRows)][2 * kAmxRows * kPanel];
  const int64_t nblocks = (r1 - r0 + 2 * kAmxRows - 1) / (2 * kAmxRows);
  for (int64_t s0 = 0; s0 < steps; s0 += kAmxChunkSteps) {
    const int64_t ns = std::min(kAmxChunkSteps, steps - s0);
    for (int64_t bi = 0; bi < nblocks; ++bi) {
      const int64_t r = r0 + bi * 2 * kAmxRows, m = std::min(2 * kAmxRows, r1 - r);
      const char* xr = x + r * xstride + s0 * kAmxBytes;
      if (i8) {
        amx_block<true>(panel + s0 * 16 * kKStep, ns, xr, xstride, m, cs[bi], s0 > 0);
      } else {
        amx_block<false>(panel + s0 * 16 * kKStep, ns, xr, xstride, m, cs[bi], s0 > 0);
      }
    }
  }
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const int64_t r = r0 + bi * 2 * kAmxRows, m = std::min(2 * kAmxRows, r1 - r);
    const float* c = cs[bi];
    if (!i8) {
      // bf16 sums end with the bias (an add: nothing to contract) and the rounding, the same
      // operations as Epilogue::finish, here inline: called per row, finish cost a third of the
      // kernel's time at K = 256.
      for (int64_t t = 0; t < m; ++t) {
        vfl v[4];
        for (int64_t i = 0; i < 4; ++i) {
          v[i] = loadl(c + t * kPanel + i * kLanes);
          if (e.has_bias) v[i] += e.bias[i];
        }
        store_row(out + (r + t) * ldo + e.n0, v, e.valid);
      }
      continue;
    }
    for (int64_t t = 0; t < m; ++t) {
      vfl acc[4];
      for (int64_t i = 0; i < 4; ++i) {
        if (i8) {
          vi32l ci;
          std::memcpy(&ci, c + t * kPanel + i * kLanes, sizeof(ci));
          acc[i] = __builtin_convertvector(ci, vfl);
        } else {
          acc[i] = loadl(c + t * kPanel + i * kLanes);
        }
      }
      e.finish(acc, rows, r + t, out, ldo);
    }
  }
}
#else
struct TileShapeScope {};
inline bool amx_runs(const PackedLinear&, int64_t) { return false; }
template <typename T>
void run_rows_amx(const PackedLinear&, const Rows&, int64_t, int64_t, int64_t, T*, int64_t) {}
#endif

template <typename T>
void run_rows(const PackedLinear& w, const Rows& rows, int64_t p, int64_t r0, int64_t r1, T* out,
              int64_t ldo) {
  if (amx_runs(w, r1 - r0)) return run_rows_amx<T>(w, rows, p, r0, r1, out, ldo);
  // Only a block's first tile reads the panel from memory and prefetches; the others find it in
  // cache, and their loops go without the prefetches (with them, 64-row bf16 matmuls were ~8%
  // slower).
  int64_t r = r0;
  if (r + kTile <= r1) {
    run_tile<T, kTile, true>(w, rows, p, r, out, ldo);
    for (r += kTile; r + kTile <= r1; r += kTile) run_tile<T, kTile, false>(w, rows, p, r, out, ldo);
  }
  const bool first = r == r0;
  switch (r1 - r) {
    case 1:
      first ? run_tile<T, 1, true>(w, rows, p, r, out, ldo) : run_tile<T, 1, false>(w, rows, p, r, out, ldo);
      break;
    case 2:
      if constexpr (kTile > 2) {
        first ? run_tile<T, 2, true>(w, rows, p, r, out, ldo) : run_tile<T, 2, false>(w, rows, p, r, out, ldo);
      }
      break;
    case 3:
      if constexpr (kTile > 3) {
        first ? run_tile<T, 3, true>(w, rows, p, r, out, ldo) : run_tile<T, 3, false>(w, rows, p, r, out, ldo);
      }
      break;
    default: break;
  }
}

template <typename T>
Rows prepare_typed(const at::Tensor& x, int64_t kind, RowBuffers& buf) {
  const int64_t M = x.size(0), K = x.size(1);
  const T* xp = x.data_ptr<T>();
  const int64_t xs = x.stride(0);
  const bool reads_x = kind == kFloat32 || (kind == kBFloat16 && kNativeBf16);
  if (kind == kInt8Dynamic) {
    buf.quantized.resize(static_cast<size_t>(M * K));
    buf.scales.resize(static_cast<size_t>(M));
    quantize_rows(xp, xs, M, K, buf.quantized.data(), buf.scales.data());
    return Rows{buf.quantized.data(), K, buf.scales.data()};
  }
  if (!reads_x) {
    buf.widened.resize(static_cast<size_t>(M * K));
    widen_rows(xp, xs, M, K, buf.widened.data());
    return Rows{buf.widened.data(), K};
  }
  return Rows{xp, xs};
}

template <typename T>
void linear_typed(at::Tensor& out, const at::Tensor& x, const PackedLinear& w) {
  const int64_t M = x.size(0);
  const Rows rows = prepare_typed<T>(x, w.kind, t_rows);
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0);
  const int64_t P = panels(w.n);
  // At least ~64 KB of weights, or a block of rows, per thread's share: waking the pool for less
  // costs more than it saves.
  const int64_t panel_bytes = w.k * bytes_per_k(w.kind);
  const int64_t grain = M > kTile ? 1 : std::max<int64_t>(1, 65536 / std::max<int64_t>(panel_bytes, 1));
  // Rows in chunks of kRowChunk, each passed by every panel before the next: a chunk's rows stay
  // in L2 while the panels stream past them. All rows at once re-read x from memory for every
  // panel (8,192 rows x 1,024 -> 6,144 bf16 on two threads: 128 ms at once, 67 ms in chunks).
  for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
    const int64_t c1 = std::min(M, c0 + kRowChunk), blocks = (c1 - c0 + kRowBlock - 1) / kRowBlock;
    // Items panel-major: a thread's consecutive items reuse one panel (in L2) across row blocks.
    at::parallel_for(0, P * blocks, grain, [&](int64_t begin, int64_t end) {
      const TileShapeScope tile_scope;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t p = item / blocks, r0 = c0 + item % blocks * kRowBlock;
        run_rows<T>(w, rows, p, r0, std::min(c1, r0 + kRowBlock), op, ldo);
      }
    });
  }
}

void check_x(const at::Tensor& x, const PackedLinear& w) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == w.k && x.stride(1) == 1,
                    "x: expected [M, ", w.k, "] with contiguous rows, got ", x.sizes());
  const auto dt = x.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16, "x: expected float32 or bfloat16");
  TORCH_CHECK_VALUE(w.kind != kFloat32 || dt == at::kFloat, "x: fp32 weights take fp32 activations");
  TORCH_CHECK_VALUE(w.kind != kBFloat16 || dt == at::kBFloat16, "x: bf16 weights take bf16 activations");
}

}  // namespace

int64_t linear_panel_width() { return kPanel; }

void check_packed(const PackedLinear& w, const char* what) {
  if (is_group_kind(w.kind)) return check_group_packed(w, what);  // quant_ops.cpp
  TORCH_CHECK_VALUE(w.kind >= kFloat32 && w.kind <= kInt8Dynamic, what, ": unknown weight kind ", w.kind);
  TORCH_CHECK_VALUE(w.n >= 1 && w.k >= 1 && w.k % k_multiple(w.kind) == 0, what,
                    ": expected N >= 1 and K a multiple of ", k_multiple(w.kind), ", got N=", w.n, " K=", w.k);
  const at::ScalarType dt = w.kind == kFloat32 ? at::kFloat : w.kind == kBFloat16 ? at::kBFloat16 : at::kChar;
  const int64_t elems = panels(w.n) * kPanel * w.k;
  TORCH_CHECK_VALUE(w.data.is_contiguous() && w.data.scalar_type() == dt && w.data.numel() == elems,
                    what, ": packed data must be a contiguous ", c10::toString(dt), " tensor of ", elems,
                    " elements (", panels(w.n), " panels of ", kPanel, " x ", w.k, ")");
  const int64_t n_pad = panels(w.n) * kPanel;
  const bool scaled = w.kind == kInt8 || w.kind == kInt8Dynamic;
  TORCH_CHECK_VALUE(scaled == w.scales.has_value(), what, ": scales are given exactly for int8 weights");
  if (scaled) {
    TORCH_CHECK_VALUE(w.scales->is_contiguous() && w.scales->scalar_type() == at::kFloat &&
                          w.scales->numel() == n_pad,
                      what, ": scales must be a contiguous float32 [", n_pad, "]");
  }
  TORCH_CHECK_VALUE((w.kind == kInt8Dynamic) == w.colsum.has_value(), what,
                    ": colsum is given exactly for int8 weights with int8 activations");
  if (w.colsum.has_value()) {
    TORCH_CHECK_VALUE(w.colsum->is_contiguous() && w.colsum->scalar_type() == at::kInt &&
                          w.colsum->numel() == n_pad,
                      what, ": colsum must be a contiguous int32 [", n_pad, "]");
  }
  if (w.bias.has_value()) {
    TORCH_CHECK_VALUE(w.bias->is_contiguous() && w.bias->dim() == 1 && w.bias->size(0) == w.n, what,
                      ": bias must be a contiguous [", w.n, "]");
  }
}

void linear_into(at::Tensor& out, const at::Tensor& x, const PackedLinear& w) {
  check_x(x, w);
  const auto dt = x.scalar_type();
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == w.n &&
                        out.stride(1) == 1 && out.scalar_type() == dt,
                    "out: expected [M, N] of x's dtype with contiguous rows");
  TORCH_CHECK_VALUE(!w.bias.has_value() || w.bias->scalar_type() == dt, "bias: expected x's dtype");
  if (x.size(0) == 0) return;
  if (is_group_kind(w.kind)) return group_linear_into(out, x, w);  // quant_ops.cpp
  if (dt == at::kFloat) {
    linear_typed<float>(out, x, w);
  } else {
    linear_typed<at::BFloat16>(out, x, w);
  }
}

LinearRows prepare_rows(const at::Tensor& x, int64_t kind, RowBuffers& buf) {
  PackedLinear like;  // only what check_x reads
  like.kind = kind;
  like.k = x.dim() == 2 ? x.size(1) : -1;
  check_x(x, like);
  if (x.size(0) == 0) return LinearRows{x.data_ptr(), x.stride(0)};
  return x.scalar_type() == at::kFloat ? prepare_typed<float>(x, kind, buf)
                                       : prepare_typed<at::BFloat16>(x, kind, buf);
}

void linear_block(void* out, int64_t ldo, at::ScalarType dt, const LinearRows& rows, const PackedLinear& w,
                  int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
  for (int64_t p = p0; p < p1; ++p) {
    if (dt == at::kFloat) {
      run_rows<float>(w, rows, p, r0, r1, static_cast<float*>(out), ldo);
    } else {
      run_rows<at::BFloat16>(w, rows, p, r0, r1, static_cast<at::BFloat16*>(out), ldo);
    }
  }
}

int64_t linear_panel_bytes(const PackedLinear& w) {
  if (is_group_kind(w.kind)) return group_panel_bytes(w);  // quant_ops.cpp
  return w.k * bytes_per_k(w.kind);
}

int64_t linear_row_block() { return kRowBlock; }

namespace {

void linear_op(at::Tensor out, const at::Tensor& x, const at::Tensor& data, int64_t kind, int64_t n,
               const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& colsum,
               const c10::optional<at::Tensor>& bias) {
  PackedLinear w;
  w.data = data;
  w.kind = kind;
  w.n = n;
  w.k = x.dim() == 2 ? x.size(1) : 0;
  if (scales.has_value()) w.scales = *scales;
  if (colsum.has_value()) w.colsum = *colsum;
  if (bias.has_value()) w.bias = *bias;
  check_packed(w, "weight");
  linear_into(out, x, w);
}

// Whether this build quantizes activations for kInt8Dynamic as q + 128 (vpdpbusd) and so needs
// colsum; 0: scalar, 1: AVX2 sign trick, 2: AVX512-VNNI.
int64_t linear_int8_path() { return kInt8Path; }
bool linear_native_bf16() { return kNativeBf16; }
// Whether bf16 and int8-dynamic weights run on the AMX tile unit (above).
bool linear_amx() {
#if TPSERVE_AMX
  return amx_granted();
#else
  return false;
#endif
}

}  // namespace
}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("linear(Tensor(a!) out, Tensor x, Tensor data, int kind, int n, Tensor? scales, "
        "Tensor? colsum, Tensor? bias) -> ()");
  m.def("linear_panel_width() -> int", &tpserve::linear_panel_width);
  m.def("linear_int8_path() -> int", &tpserve::linear_int8_path);
  m.def("linear_native_bf16() -> bool", &tpserve::linear_native_bf16);
  m.def("linear_amx() -> bool", &tpserve::linear_amx);
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("linear", &tpserve::linear_op); }
