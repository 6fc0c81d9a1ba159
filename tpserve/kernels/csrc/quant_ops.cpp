// Group-quantized linear layers on CPU: out = x W^T (+ bias) with
//     W[o, i] = scale[o, i / g] * code[o, i] + min[o, i / g]
// codes of 4 bits (two per byte) or 8 bits, one scale and one min (fp32) per group of g inputs
// (g a multiple of 16; tpserve/models/group_quant.py describes the representation and packs it).
//
// Activations: each row of x is quantized to int8 per group of g, a_scale = absmax / 127 (1 for
// a zero group), a_q = round-half-even(x * (1 / a_scale)), with sum(a_q) per group kept. Then
// per (row, output, group) the int32 dot(code, a_q) is exact, and
//     out[m, o] = sum_g a_scale * (scale * dot + min * sum(a_q))          (W4A8 / W8A8)
// summed in fp32, group after group. The codes are unsigned and the activations signed, which
// is the operand order of vpdpbusd (AVX512-VNNI: u8 x s8 quads summed into int32, no
// saturation) and of vpmaddubsw (AVX2: u8 x s8 pairs into int16; a 4-bit code times |a_q| <= 127,
// twice, stays below 2^15; an 8-bit code is split into its nibbles, 16 * hi + lo). No offset or
// compensation is needed either way.
//
// Layout: panels of P = 4 vectors of output channels (P = 64 with AVX-512, 32 otherwise), as
// linear_ops.cpp's, each lane of a vector holding a quad of consecutive inputs of one channel:
//     8-bit codes [N/P][K/4][4][L][4]
//     4-bit codes [N/P][K/8][4][L][4]  a byte: low nibble input 8j + q, high nibble 8j + 4 + q
//     6-bit codes [N/P][K/16]: two 4-bit steps (the low nibbles), then [4][L][4] bytes of the
//                 2-bit high parts (field f of byte q: input 16b + 4f + q); a kGroup8 weight
//                 with codes below 64, told apart by its size (3/4 of the 8-bit one's)
//     scales, mins [N/P][G][P]  (fp32, or fp16 when exact)
//     or, a symmetric weight's scales as int8 multiples of an fp32 scale per 16 groups (GGUF's
//     Q6_K: d * sc), per panel [G][P] int8 then [G/16][P] fp32: a kChar scales tensor of
//     1.25 bytes per group and channel instead of 4
// so a panel is one stream read front to back, 4 bits per weight (plus 4 or 8 bytes per group and
// channel for its scale and min). A symmetric weight (every min -off * scale, one integer off:
// GGUF's Q4_0, Q5_0, Q6_K, Q8_0) holds one int32, off, in place of the mins and reads none: its
// group dots less off * sum(a_q), exact in int32, times scale * a_scale. A decode row reads every
// weight once; prompt rows stream past a panel while it sits in L2, in blocks of 64 rows, up to
// kGTile rows per register tile (kQTile of 4- and 6-bit codes), or from 16 rows on the AMX tiles
// (4- and 8-bit codes: the same exact group dots, so the same bits; below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "linear_ops.h"
#include "quant_ops.h"
#include "vec.h"

namespace tpserve {
namespace {

constexpr int64_t kPanel = 4 * kLanes;
constexpr int64_t kRowBlock = 64;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TPSERVE_GROUP_PATH 2  // vpdpbusd
constexpr int64_t kGTile = 4;
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define TPSERVE_GROUP_PATH 1  // vpmaddubsw + vpmaddwd
constexpr int64_t kGTile = 2;
#else
#define TPSERVE_GROUP_PATH 0  // scalar
constexpr int64_t kGTile = 2;
#endif
constexpr int kPath = TPSERVE_GROUP_PATH;
// Rows per register tile of 4- and 6-bit codes on AVX2, two vectors of a panel at a time
// (group_tile: HALVES).
constexpr int64_t kQTile = kPath == 1 ? 4 : kGTile;
constexpr int64_t kMaxTile = kQTile > kGTile ? kQTile : kGTile;
// The largest offset of a symmetric weight (mins = -offset * scales): 2^bits - 1 covers every
// code range, and offset * sum(a_q) stays far inside int32 (256 * 127 * 255 < 2^23).
constexpr int32_t kMaxOffset = 255;

int64_t panels(int64_t n) { return (n + kPanel - 1) / kPanel; }
// A symmetric weight: its colsum slot is one int32, the offset, instead of the mins.
bool is_symmetric(const PackedLinear& w) {
  return w.colsum->numel() == 1 && w.colsum->scalar_type() == at::kInt;
}
// Groups that share one fp32 scale of int8 sub-scales (kChar scales), and the bytes per group
// and channel: an int8, and a quarter of the shared fp32 (4 / 16 bytes).
constexpr int64_t kSubGroups = 16;
bool has_sub_scales(const PackedLinear& w) { return w.scales->scalar_type() == at::kChar; }
// Groups of a weight from its scales' size (int8 sub-scales: 5 bytes per 4 groups and channel).
int64_t groups_of(const PackedLinear& w) {
  const int64_t n_pad = panels(w.n) * kPanel;
  if (!w.scales.has_value() || n_pad == 0) return 0;
  const int64_t numel = w.scales->numel();
  if (has_sub_scales(w)) return numel % (5 * n_pad) == 0 ? numel / (5 * n_pad) * 4 : 0;
  return numel / n_pad;
}
// Bytes of codes per panel of `bits`-bit codes (6: a 4-bit plane and a 2-bit plane).
int64_t panel_code_bytes(int64_t bits, int64_t K) { return K * kPanel * bits / 8; }
// A kGroup8 weight whose codes are all below 64 may hold them in 6 bits: told apart by its size.
int64_t bits_of(const PackedLinear& w) {
  if (w.kind == kGroup4) return 4;
  return w.data.numel() == panels(w.n) * panel_code_bytes(6, w.k) ? 6 : 8;
}

// ---- activations: int8 per row and group -------------------------------------------------------

using QRows = GroupRows;

// The quantized rows' buffer holds a multiple of this many rows (an AMX tile reads 16).
constexpr int64_t kPadRows = 16;

using QBuffers = GroupRowBuffers;
thread_local QBuffers t_buf;

typedef int32_t vi32l __attribute__((vector_size(kLanes * 4)));
typedef int8_t vi8l __attribute__((vector_size(kLanes)));

// One row, group by group, a vector of kLanes inputs at a time (g is a multiple of 16, so of
// kLanes). Rounding to nearest even by adding and subtracting 1.5 * 2^23 (|x / a_scale| <= 127
// here), as torch.round rounds the reference's.
template <typename T>
void quantize_row(const T* row, int64_t K, int64_t g, int8_t* q, float* s, float* ms, int32_t* sums) {
  const vfl zero = vfl{} * 0.f;
  for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
    vfl vmax = zero;
    for (int64_t k = k0; k < k0 + g; k += kLanes) {
      vfl v = loadl(row + k);
      v = v < zero ? -v : v;
      vmax = v > vmax ? v : vmax;
    }
    float amax = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) amax = std::max(amax, vmax[l]);
    const float sc = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / sc;
    vi32l vsum = vi32l{} * 0;
    for (int64_t k = k0; k < k0 + g; k += kLanes) {
      vfl v = loadl(row + k) * inv;
      v = (v + 12582912.f) - 12582912.f;
      v = v > 127.f ? zero + 127.f : v;
      v = v < -127.f ? zero - 127.f : v;
      const vi32l c = __builtin_convertvector(v, vi32l);
      vsum += c;
      const vi8l b = __builtin_convertvector(c, vi8l);
      std::memcpy(q + k, &b, sizeof(b));
    }
    int32_t sum = 0;
    for (int64_t l = 0; l < kLanes; ++l) sum += vsum[l];
    s[gi] = sc;
    ms[gi] = sc * static_cast<float>(sum);
    sums[gi] = sum;
  }
}

template <typename T>
QRows quantize_rows(const at::Tensor& x, int64_t g, QBuffers& b = t_buf) {
  const int64_t M = x.size(0), K = x.size(1), G = K / g, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  b.q.resize(static_cast<size_t>((M + kPadRows - 1) / kPadRows * kPadRows * K));  // tiles read whole 16 rows
  b.s.resize(static_cast<size_t>(M * G));
  b.ms.resize(static_cast<size_t>(M * G));
  b.sum.resize(static_cast<size_t>(M * G));
  int8_t* q = b.q.data();
  float* s = b.s.data();
  float* ms = b.ms.data();
  int32_t* sums = b.sum.data();
  at::parallel_for(0, M, std::max<int64_t>(1, 131072 / std::max<int64_t>(K, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      quantize_row(xp + m * xs, K, g, q + m * K, s + m * G, ms + m * G, sums + m * G);
    }
  });
  return QRows{q, s, ms, sums, K, G};
}

// ---- the per-ISA integer dot products of one group --------------------------------------------

#if TPSERVE_GROUP_PATH == 2
using vi = __m512i;
inline vi vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vi vzero() { return _mm512_setzero_si512(); }
inline vi lo_nib(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vi hi_nib(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
// The high nibble in place (16 * code), and a sum of such products brought back down (exact).
inline vi hi_nib16(vi v) { return _mm512_andnot_si512(_mm512_set1_epi8(0x0F), v); }
inline vi high16_sum(vi v) { return _mm512_srai_epi32(v, 4); }
inline vi vadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi vor(vi a, vi b) { return _mm512_or_si512(a, b); }
inline vi bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// acc += quads of unsigned codes times signed activations (tied in asm: see linear_ops.cpp's
// dpbusd for why).
inline vi dot_small(vi acc, vi w, vi x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}
inline vi dot_byte(vi acc, vi w, vi x) { return dot_small(acc, w, x); }
// (The AVX2 path's int16 sums, defined for the lambda that uses them: vpdpbusd needs none.)
inline vi dot16(vi acc, vi w, vi x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)); }
inline vi widen16(vi acc, vi h) { return _mm512_add_epi32(acc, _mm512_madd_epi16(h, _mm512_set1_epi16(1))); }
inline vfl to_fl(vi v) { return (vfl)_mm512_cvtepi32_ps(v); }
inline vi vsub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi vset1(int32_t v) { return _mm512_set1_epi32(v); }
// 2-bit field f of each byte, times 16 (bits 4..5; a byte's shifted-in neighbours are masked).
template <int f>
inline vi field16(vi v) {
  const vi m = _mm512_set1_epi8(0x30);
  if constexpr (f < 2) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - 2 * f), m);
  if constexpr (f == 2) return _mm512_and_si512(v, m);
  return _mm512_and_si512(_mm512_srli_epi16(v, 2), m);
}
#elif TPSERVE_GROUP_PATH == 1
using vi = __m256i;
inline vi vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi vzero() { return _mm256_setzero_si256(); }
inline vi lo_nib(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline vi hi_nib(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline vi hi_nib16(vi v) { return _mm256_andnot_si256(_mm256_set1_epi8(0x0F), v); }
inline vi high16_sum(vi v) { return _mm256_srai_epi32(v, 4); }
inline vi vadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi vor(vi a, vi b) { return _mm256_or_si256(a, b); }
inline vi bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// Codes below 16: pairs of products stay within int16, so vpmaddubsw never saturates.
inline vi dot_small(vi acc, vi w, vi x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
// 4-bit codes' pairs summed in int16 lanes (dot16), widened to int32 every 32 inputs (widen16):
// a lane then holds 16 products of a code below 16 and an activation of at most 127 in
// magnitude, 16 * 15 * 127 = 30,480 < 2^15, so the sums are exact, and each step costs one
// vpaddw where dot_small costs a vpmaddwd and a vpaddd.
inline vi dot16(vi acc, vi w, vi x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
inline vi widen16(vi acc, vi h) { return _mm256_add_epi32(acc, _mm256_madd_epi16(h, _mm256_set1_epi16(1))); }
// 8-bit codes: 16 * dot(high nibbles) + dot(low nibbles), each exact.
inline vi dot_byte(vi acc, vi w, vi x) {
  const vi lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo_nib(w), x), _mm256_set1_epi16(1));
  const vi hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi_nib(w), x), _mm256_set1_epi16(16));
  return _mm256_add_epi32(acc, _mm256_add_epi32(lo, hi));
}
inline vfl to_fl(vi v) { return (vfl)_mm256_cvtepi32_ps(v); }
inline vi vsub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi vset1(int32_t v) { return _mm256_set1_epi32(v); }
template <int f>
inline vi field16(vi v) {
  const vi m = _mm256_set1_epi8(0x30);
  if constexpr (f < 2) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - 2 * f), m);
  if constexpr (f == 2) return _mm256_and_si256(v, m);
  return _mm256_and_si256(_mm256_srli_epi16(v, 2), m);
}
#endif

#if TPSERVE_GROUP_PATH > 0
// A group's dot products of one row, exact in int32, into its fp32 sums: the one expression of
// each form that every kernel uses, so the compiler contracts its multiply-adds alike.
inline vfl fold_sym(vfl acc, vi dot, vi osum, vfl s, float as) {
  return acc + to_fl(vsub(dot, osum)) * (s * as);
}
inline vfl fold_asym(vfl acc, vi dot, vfl s, float as, vfl m, float ams) {
  return acc + (to_fl(dot) * (s * as) + m * ams);
}
#endif

// Scales and mins are fp32, or fp16 when every one of a weight's is exactly an fp16 (GGUF's
// Q4_0 / Q8_0 blocks; --quantization int4 rounds its own to fp16): 2 bytes fewer per group
// and channel, which at group 32 is a sixth of the bytes a decode step reads.
inline vfl load_scales(const float* p) { return loadl(p); }
inline vfl load_scales(const at::Half* p) {
#if defined(__AVX512F__)
  return (vfl)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX2__)
  return (vfl)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfl v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// A panel's int8 sub-scales [G][P] and their fp32 scales [G / 16][P] (a symmetric kChar weight).
struct SubScales {
  const int8_t* sub;
  const float* top;
};
// The 4 vectors of group gi's scales of a panel (fp32, fp16 or int8 sub-scales).
template <typename S>
inline void group_scales(const S* sc, int64_t gi, vfl (&s)[4]) {
  for (int64_t i = 0; i < 4; ++i) s[i] = load_scales(sc + gi * kPanel + i * kLanes);
}
inline void group_scales(const SubScales* sc, int64_t gi, vfl (&s)[4]) {
  const float* top = sc->top + (gi / kSubGroups) * kPanel;
  for (int64_t i = 0; i < 4; ++i) s[i] = loadl(sc->sub + gi * kPanel + i * kLanes) * loadl(top + i * kLanes);
}
template <typename S>
inline float scale_at(const S* sc, int64_t gi, int64_t j) { return static_cast<float>(sc[gi * kPanel + j]); }
inline float scale_at(const SubScales* sc, int64_t gi, int64_t j) {
  return static_cast<float>(sc->sub[gi * kPanel + j]) * sc->top[(gi / kSubGroups) * kPanel + j];
}

// TM rows (r0..) times one panel over all of K: acc[t][i] = output channels [i*L, (i+1)*L).
// SYM: every min is -off * scale (mn unused): the group's integer dot less off * sum(a_q), exact
// in int32, times scale * a_scale.
// BITS 6: blocks of 16 inputs, each two 4-bit steps (as BITS 4) then one vector step of 2-bit
// fields, the high bits of the codes: field f of a lane's byte q is input 16b + 4f + q; a code
// (below 64) is lo + 16 * hi, so 16 * hi (below 64) multiplies in place and needs no
// accumulator of its own.
template <int64_t TM, int BITS, bool PF, bool SYM, typename S>
inline void group_tile(const uint8_t* w, const S* sc, const S* mn, int32_t off, int64_t g, const QRows& r,
                       int64_t r0, vfl (&acc)[kMaxTile][4]) {
  const int64_t K = r.K, G = r.G;
  const int8_t* xq = r.q + r0 * K;
#if TPSERVE_GROUP_PATH > 0
  constexpr int64_t kVec = kLanes * 4;   // bytes of a vector
  constexpr int64_t kBytes = 4 * kVec;  // bytes of codes per step (4 vectors)
  constexpr int64_t kStep = BITS == 6 ? 16 : BITS == 4 ? 8 : 4;  // inputs per step
  constexpr int64_t kStepBytes = BITS == 6 ? 3 * kBytes : kBytes;
  // 8 inputs of 4-bit codes (the low nibbles: inputs k + q, the high: k + 4 + q) from `w`, summed
  // by `dot` (dot_small into int32, or dot16 into int16: PAIR16 below)
  auto nibbles_by = [&](auto dot, vi (&a)[TM][4], const uint8_t* p, int64_t k) {
    vi wv[4], hv[4];
    for (int64_t i = 0; i < 4; ++i) {
      wv[i] = vload(p + i * kVec);
      hv[i] = hi_nib(wv[i]);
      wv[i] = lo_nib(wv[i]);
    }
    for (int64_t t = 0; t < TM; ++t) {
      const vi xa = bcast4(xq + t * K + k), xb = bcast4(xq + t * K + k + 4);
      for (int64_t i = 0; i < 4; ++i) a[t][i] = dot(dot(a[t][i], wv[i], xa), hv[i], xb);
    }
  };
  auto nibbles = [&](vi (&a)[TM][4], const uint8_t* p, int64_t k) {
    nibbles_by([](vi acc, vi w, vi x) { return dot_small(acc, w, x); }, a, p, k);
  };
  // The same 8 inputs with the high nibbles in place (16 * code) summed into `b` (SPLIT).
  auto nibbles_split = [&](vi (&a)[TM][4], vi (&b)[TM][4], const uint8_t* p, int64_t k) {
    vi wv[4], hv[4];
    for (int64_t i = 0; i < 4; ++i) {
      const vi v = vload(p + i * kVec);
      wv[i] = lo_nib(v);
      hv[i] = hi_nib16(v);
    }
    for (int64_t t = 0; t < TM; ++t) {
      const vi xa = bcast4(xq + t * K + k), xb = bcast4(xq + t * K + k + 4);
      for (int64_t i = 0; i < 4; ++i) {
        a[t][i] = dot_small(a[t][i], wv[i], xa);
        b[t][i] = dot_small(b[t][i], hv[i], xb);
      }
    }
  };
  // PAIR16 (4-bit codes, AVX2): a group's dots in int16 lanes 32 inputs at a time (see dot16):
  // 0.8x the instructions of dot_small's, the same exact int32 dots.
  constexpr bool PAIR16 = BITS == 4 && kPath == 1;
  // SPLIT (4-bit codes, one or two rows, AVX512-VNNI): a high nibble stays in place, 16 * code
  // (below 256), and sums into accumulators of its own, shifted down at the group's end (exact:
  // multiples of 16). One mask per vector instead of a shift and a mask, and two chains of
  // dot products per vector instead of one: a panel from L2 at one row went 42 -> 50 GB/s.
  constexpr bool SPLIT = BITS == 4 && TM <= 2 && kPath == 2;
  // HALVES (AVX2, 4- and 6-bit codes, from 4 rows): two of a step's four vectors at a time,
  // their codes unpacked once for the TM rows and each row's activations broadcast once for
  // both. All four at once kept 2 rows' 8 sums, 8 unpacked vectors and 4 broadcasts live: more
  // than AVX2's 16 registers, so the sums went to the stack and back at every step. 4-bit codes
  // sum in int16 32 inputs at a time (dot16); a 6-bit code's whole value (below 64) pairs its
  // products for 8 inputs in int16 (4 * 63 * 127 < 2^15) before widening. At 32 rows (Zen 4 at
  // AVX2, medians of 3) a Q4_0 / Q4_1 / group-128 set of the 0.6B shape's linears went 28.0 /
  // 31.2 / 23.1 -> 27.5 / 28.8 / 20.8 ms, and its Q6_K head (151,936 x 1,024) 54-55 -> 43 ms.
  constexpr bool HALVES = (BITS == 4 || BITS == 6) && kPath == 1 && TM >= 4;
  if constexpr (HALVES) {
    constexpr int64_t NV = 2;
    for (int64_t gi = 0; gi < G; ++gi) {
      const uint8_t* wg = w + gi * (g / kStep) * kStepBytes;
      const int8_t* xg = xq + gi * g;
      vfl s[4];
      group_scales(sc, gi, s);
      // each row's off * sum(a_q), which each vector's fold broadcasts from memory
      int32_t osums[TM];
      if constexpr (SYM)
        for (int64_t t = 0; t < TM; ++t) osums[t] = off * r.sum[(r0 + t) * G + gi];
      for (int64_t i0 = 0; i0 < 4; i0 += NV) {
        vi a[TM][NV];
        for (int64_t t = 0; t < TM; ++t)
          for (int64_t j = 0; j < NV; ++j) a[t][j] = vzero();
        if constexpr (BITS == 4) {
          for (int64_t c = 0; c < g; c += 32) {
            vi h[TM][NV];
            for (int64_t t = 0; t < TM; ++t)
              for (int64_t j = 0; j < NV; ++j) h[t][j] = vzero();
            for (int64_t k = c, cend = std::min(g, c + 32); k < cend; k += kStep) {
              const uint8_t* ws = wg + (k / kStep) * kStepBytes;
              if constexpr (PF) {
                if (i0 == 0) prefetch_ahead<kStepBytes>(ws);
              }
              vi lo[NV], hi[NV];
              for (int64_t j = 0; j < NV; ++j) {
                const vi v = vload(ws + (i0 + j) * kVec);
                lo[j] = lo_nib(v);
                hi[j] = hi_nib(v);
              }
              for (int64_t t = 0; t < TM; ++t) {
                const vi xa = bcast4(xg + t * K + k), xb = bcast4(xg + t * K + k + 4);
                for (int64_t j = 0; j < NV; ++j) h[t][j] = dot16(dot16(h[t][j], lo[j], xa), hi[j], xb);
              }
            }
            for (int64_t t = 0; t < TM; ++t)
              for (int64_t j = 0; j < NV; ++j) a[t][j] = widen16(a[t][j], h[t][j]);
          }
        } else {
          // fields 2P and 2P + 1 (inputs k + 8P .. k + 8P + 7): the nibbles of step P, each
          // or'ed with its 2-bit high part
          for (int64_t k = 0; k < g; k += kStep) {
            const uint8_t* ws = wg + (k / kStep) * kStepBytes;
            if constexpr (PF) {
              if (i0 == 0) prefetch_ahead<kStepBytes>(ws);
            }
            auto pair = [&](auto pc) {
              constexpr int P = decltype(pc)::value;
              vi c0[NV], c1[NV];
              for (int64_t j = 0; j < NV; ++j) {
                const vi nb = vload(ws + P * kBytes + (i0 + j) * kVec);
                const vi hb = vload(ws + 2 * kBytes + (i0 + j) * kVec);
                c0[j] = vor(lo_nib(nb), field16<2 * P>(hb));
                c1[j] = vor(hi_nib(nb), field16<2 * P + 1>(hb));
              }
              for (int64_t t = 0; t < TM; ++t) {
                const vi x0 = bcast4(xg + t * K + k + 8 * P), x1 = bcast4(xg + t * K + k + 8 * P + 4);
                for (int64_t j = 0; j < NV; ++j)
                  a[t][j] = widen16(a[t][j], dot16(dot16(vzero(), c0[j], x0), c1[j], x1));
              }
            };
            pair(std::integral_constant<int, 0>{});
            pair(std::integral_constant<int, 1>{});
          }
        }
        for (int64_t j = 0; j < NV; ++j) {
          const int64_t i = i0 + j;
          if constexpr (SYM) {
            (void)mn;
            for (int64_t t = 0; t < TM; ++t)
              acc[t][i] = fold_sym(acc[t][i], a[t][j], bcast4(reinterpret_cast<const int8_t*>(osums + t)),
                                   s[i], r.s[(r0 + t) * G + gi]);
          } else {
            (void)off;
            const vfl m = load_scales(mn + gi * kPanel + i * kLanes);
            for (int64_t t = 0; t < TM; ++t) {
              const float as = r.s[(r0 + t) * G + gi], ams = r.ms[(r0 + t) * G + gi];
              acc[t][i] = fold_asym(acc[t][i], a[t][j], s[i], as, m, ams);
            }
          }
        }
      }
    }
    return;
  }
  for (int64_t gi = 0; gi < G; ++gi) {
    vi a[TM][4];
    vi b[SPLIT ? TM : 1][4];
    for (int64_t t = 0; t < TM; ++t)
      for (int64_t i = 0; i < 4; ++i) a[t][i] = b[SPLIT ? t : 0][i] = vzero();
    const int64_t kend = (gi + 1) * g;
    if constexpr (PAIR16) {
      for (int64_t k = gi * g; k < kend;) {
        vi h[TM][4];
        for (int64_t t = 0; t < TM; ++t)
          for (int64_t i = 0; i < 4; ++i) h[t][i] = vzero();
        for (const int64_t cend = std::min(kend, k + 32); k < cend; k += kStep, w += kStepBytes) {
          if constexpr (PF) prefetch_ahead<kStepBytes>(w);
          nibbles_by([](vi acc, vi c, vi x) { return dot16(acc, c, x); }, h, w, k);
        }
        for (int64_t t = 0; t < TM; ++t)
          for (int64_t i = 0; i < 4; ++i) a[t][i] = widen16(a[t][i], h[t][i]);
      }
    } else
    for (int64_t k = gi * g; k < kend; k += kStep, w += kStepBytes) {
      if constexpr (PF) prefetch_ahead<kStepBytes>(w);
      if constexpr (SPLIT) {
        nibbles_split(a, b, w, k);
      } else if constexpr (BITS == 4) {
        nibbles(a, w, k);
      } else if constexpr (BITS == 6) {
        // Whole codes, a nibble | 16 * its 2-bit field, and one dot product per 4 inputs: half
        // the dot products of a nibble's and a field's each (the same exact sums). Field f holds
        // inputs k + 4f + q, the low (f even) or high nibbles of step f / 2. A code below 64:
        // pairs of products (2 * 63 * 127) stay within int16 on AVX2.
        vi hb[4];
        for (int64_t i = 0; i < 4; ++i) hb[i] = vload(w + 2 * kBytes + i * kVec);
        auto field = [&](auto f) {
          constexpr int F = decltype(f)::value;
          vi v[4];
          for (int64_t i = 0; i < 4; ++i) {
            const vi b = vload(w + (F / 2) * kBytes + i * kVec);
            v[i] = vor(F % 2 ? hi_nib(b) : lo_nib(b), field16<F>(hb[i]));
          }
          for (int64_t t = 0; t < TM; ++t) {
            const vi x = bcast4(xq + t * K + k + 4 * F);
            for (int64_t i = 0; i < 4; ++i) a[t][i] = dot_small(a[t][i], v[i], x);
          }
        };
        field(std::integral_constant<int, 0>{});
        field(std::integral_constant<int, 1>{});
        field(std::integral_constant<int, 2>{});
        field(std::integral_constant<int, 3>{});
      } else {
        vi wv[4];
        for (int64_t i = 0; i < 4; ++i) wv[i] = vload(w + i * kVec);
        for (int64_t t = 0; t < TM; ++t) {
          const vi xa = bcast4(xq + t * K + k);
          for (int64_t i = 0; i < 4; ++i) a[t][i] = dot_byte(a[t][i], wv[i], xa);
        }
      }
    }
    if constexpr (SPLIT)
      for (int64_t t = 0; t < TM; ++t)
        for (int64_t i = 0; i < 4; ++i) a[t][i] = vadd(a[t][i], high16_sum(b[t][i]));
    vfl s[4];
    group_scales(sc, gi, s);
    if constexpr (SYM) {
      (void)mn;
      for (int64_t t = 0; t < TM; ++t) {
        const float as = r.s[(r0 + t) * G + gi];
        const vi osum = vset1(off * r.sum[(r0 + t) * G + gi]);
        for (int64_t i = 0; i < 4; ++i) acc[t][i] = fold_sym(acc[t][i], a[t][i], osum, s[i], as);
      }
    } else {
      (void)off;
      vfl m[4];
      for (int64_t i = 0; i < 4; ++i) m[i] = load_scales(mn + gi * kPanel + i * kLanes);
      for (int64_t t = 0; t < TM; ++t) {
        const float as = r.s[(r0 + t) * G + gi], ams = r.ms[(r0 + t) * G + gi];
        for (int64_t i = 0; i < 4; ++i) acc[t][i] = fold_asym(acc[t][i], a[t][i], s[i], as, m[i], ams);
      }
    }
  }
#else
  (void)PF;
  for (int64_t gi = 0; gi < G; ++gi) {
    int32_t a[TM][kPanel] = {};
    for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t i = j / kLanes, l = j % kLanes;
        int32_t code;
        const int64_t lane = i * kLanes * 4 + l * 4 + (k % 4);
        if constexpr (BITS == 4) {
          const uint8_t byte = w[(k / 8) * kPanel * 4 + lane];
          code = (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
        } else if constexpr (BITS == 6) {
          const uint8_t* b = w + (k / 16) * kPanel * 12;
          const uint8_t byte = b[((k % 16) / 8) * kPanel * 4 + lane];
          const int32_t hi = (b[2 * kPanel * 4 + lane] >> (2 * ((k % 16) / 4))) & 3;
          code = ((k % 8) < 4 ? (byte & 0x0F) : (byte >> 4)) | (hi << 4);
        } else {
          code = w[(k / 4) * kPanel * 4 + i * kLanes * 4 + l * 4 + (k % 4)];
        }
        for (int64_t t = 0; t < TM; ++t) a[t][j] += code * static_cast<int32_t>(xq[t * K + k]);
      }
    }
    for (int64_t t = 0; t < TM; ++t) {
      const float as = r.s[(r0 + t) * G + gi], ams = r.ms[(r0 + t) * G + gi];
      const int32_t osum = off * r.sum[(r0 + t) * G + gi];
      for (int64_t j = 0; j < kPanel; ++j) {
        const float s = scale_at(sc, gi, j);
        if constexpr (SYM) {
          acc[t][j / kLanes][j % kLanes] += static_cast<float>(a[t][j] - osum) * (s * as);
        } else {
          acc[t][j / kLanes][j % kLanes] += static_cast<float>(a[t][j]) * (s * as) +
                                            static_cast<float>(mn[gi * kPanel + j]) * ams;
        }
      }
    }
  }
#endif
}

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

// fn(sym, sc, mn, off) with panel p's scales (fp32, fp16 or int8 sub-scales) and mins (or a
// symmetric weight's offset): `sym` std::true_type or std::false_type.
template <typename Fn>
inline void with_panel_scales(const PackedLinear& w, int64_t p, int64_t G, Fn&& fn) {
  const bool half = w.scales->scalar_type() == at::kHalf;
  if (is_symmetric(w) && has_sub_scales(w)) {
    const int8_t* base = w.scales->data_ptr<int8_t>() + p * G * kPanel * 5 / 4;
    const SubScales sc{base, reinterpret_cast<const float*>(base + G * kPanel)};
    fn(std::true_type{}, &sc, &sc, w.colsum->data_ptr<int32_t>()[0]);
  } else if (is_symmetric(w)) {
    const int32_t off = w.colsum->data_ptr<int32_t>()[0];
    if (half) {
      const at::Half* sc = w.scales->data_ptr<at::Half>() + p * G * kPanel;
      fn(std::true_type{}, sc, sc, off);
    } else {
      const float* sc = w.scales->data_ptr<float>() + p * G * kPanel;
      fn(std::true_type{}, sc, sc, off);
    }
  } else if (half) {
    fn(std::false_type{}, w.scales->data_ptr<at::Half>() + p * G * kPanel,
       w.colsum->data_ptr<at::Half>() + p * G * kPanel, 0);
  } else {
    fn(std::false_type{}, w.scales->data_ptr<float>() + p * G * kPanel,
       w.colsum->data_ptr<float>() + p * G * kPanel, 0);
  }
}

// Rows of the output's panel p from their sums (4 vectors each): the bias, widened once per
// panel, added, then the store.
template <typename T>
struct PanelStore {
  int64_t n0, valid;
  bool has_bias;
  vfl bias[4];
  PanelStore(const PackedLinear& w, int64_t p)
      : n0(p * kPanel), valid(std::min(kPanel, w.n - p * kPanel)), has_bias(w.bias.has_value()) {
    if (!has_bias) return;
    float b[kPanel] = {};
    const T* bp = w.bias->data_ptr<T>() + n0;
    for (int64_t j = 0; j < valid; ++j) b[j] = to_f<T>(bp[j]);
    for (int64_t i = 0; i < 4; ++i) bias[i] = loadl(b + i * kLanes);
  }
  void store(const vfl (&acc)[4], T* out_row) const {
    vfl v[4];
    for (int64_t i = 0; i < 4; ++i) v[i] = has_bias ? acc[i] + bias[i] : acc[i];
    store_row(out_row + n0, v, valid);
  }
};

template <typename T, int64_t TM, bool PF>
void run_tile(const PackedLinear& w, int64_t g, const QRows& r, int64_t p, int64_t r0, T* out, int64_t ldo) {
  const int64_t K = w.k, G = K / g;
  vfl acc[kMaxTile][4];
  for (int64_t t = 0; t < TM; ++t)
    for (int64_t i = 0; i < 4; ++i) acc[t][i] = vfl{};
  const int64_t bits = bits_of(w);
  const uint8_t* codes = static_cast<const uint8_t*>(w.data.data_ptr()) + p * panel_code_bytes(bits, K);
  with_panel_scales(w, p, G, [&](auto sym, const auto* sc, const auto* mn, int32_t off) {
    constexpr bool kSym = decltype(sym)::value;
    if (bits == 4) {
      group_tile<TM, 4, PF, kSym>(codes, sc, mn, off, g, r, r0, acc);
    } else if (bits == 6) {
      group_tile<TM, 6, PF, kSym>(codes, sc, mn, off, g, r, r0, acc);
    } else if constexpr (TM <= kGTile) {  // (tiles of kQTile rows: 4- and 6-bit codes only)
      group_tile<TM, 8, PF, kSym>(codes, sc, mn, off, g, r, r0, acc);
    }
  });
  const PanelStore<T> st(w, p);
  for (int64_t t = 0; t < TM; ++t) st.store(acc[t], out + (r0 + t) * ldo);
}

// ---- 4- and 8-bit codes on AMX ---------------------------------------------------------------
//
// From kAmxGroupRows rows a weight of 4- or 8-bit codes runs its integer dots on the tile unit:
// tdpbsud multiplies signed bytes (the int8 activations, an A tile of 16 rows) by unsigned ones
// (the codes, a B tile of 16 channels: quads of inputs, 4 bytes per channel, as the vector
// layout's lanes), 16 x 16 x 64 at a time. A tile step is one group's inputs (up to 64; larger
// groups take several steps), so the tile's int32 sums are the group's dots, exact as the vector
// path's; each is then folded into the fp32 sums by the same expression (fold_sym / fold_asym),
// so every output equals the vector path's bit for bit, whatever the row count. 8-bit codes are
// read in place (a quad of inputs per 256 bytes of the panel); 4-bit ones are unpacked a group at
// a time into that layout (the low nibbles of a step are one quad, the high nibbles the next).
// The quantized rows' buffer holds whole tiles of 16 rows (kPadRows); the rows past M are read
// and dropped. 6-bit codes stay on the vector path.
#if TPSERVE_AMX && TPSERVE_GROUP_PATH == 2
constexpr int64_t kAmxGroupRows = 16;

// Whether a weight's group fits the tile steps: up to 64 inputs, or a multiple of 64.
inline int64_t amx_group_step(int64_t g) { return g <= 64 ? g : g % 64 == 0 ? 64 : 0; }

inline bool group_amx_runs(const PackedLinear& w, int64_t g, int64_t rows) {
  const int64_t bits = bits_of(w);
  return rows >= kAmxGroupRows && (bits == 4 || bits == 8) && amx_group_step(g) != 0 && amx_granted();
}

// Tiles: C 0-3 (16 rows x 16 channels, int32), A 4 (16 rows x `step` inputs), B 5-7 (step / 4
// quads x 16 channels; the fourth vector reuses tile 5).
inline void group_amx_configure(int64_t step) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  c.rows[4] = 16, c.colsb[4] = static_cast<uint16_t>(step);
  for (int t = 5; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(step / 4), c.colsb[t] = 64;
  load_tile_config(c);
}

// One group step's dots for 16 rows: A tile from `x` (rows xstride bytes apart), the 4 B tiles
// from `b` (quads 256 bytes apart, vector v at 64 v), summed into C 0-3.
inline void group_amx_step(const int8_t* x, int64_t xstride, const uint8_t* b) {
  _tile_loadd(4, x, xstride);
  _tile_loadd(5, b, 256);
  _tile_dpbsud(0, 4, 5);
  _tile_loadd(6, b + 64, 256);
  _tile_dpbsud(1, 4, 6);
  _tile_loadd(7, b + 128, 256);
  _tile_dpbsud(2, 4, 7);
  _tile_loadd(5, b + 192, 256);
  _tile_dpbsud(3, 4, 5);
}

// 4-bit codes of `steps` steps of 8 inputs (vector layout) -> bytes, a quad of inputs per 256
// bytes: step j's low nibbles are quad 2j, its high nibbles quad 2j + 1.
inline void unpack_nibbles(const uint8_t* w, int64_t steps, uint8_t* out) {
  for (int64_t j = 0; j < steps; ++j, w += 4 * 64, out += 2 * 256) {
    prefetch_ahead<4 * 64>(w);
    for (int64_t i = 0; i < 4; ++i) {
      const vi v = vload(w + i * 64);
      _mm512_storeu_si512(out + i * 64, lo_nib(v));
      _mm512_storeu_si512(out + 256 + i * 64, hi_nib(v));
    }
  }
}

// An item's rows [r0, r1) times panel p (codes, scales sc, mins mn or offset off) into acc
// ([r1 - r0][kPanel] fp32), group after group, 16 rows at a time. Each group's tile sums go
// through memory to be folded, and the tile stores bound this path: a 64-row matmul of 4-bit
// codes ran at 0.88 TF/s on two cores against the vector path's 0.65, and 1.35x faster again
// with the stores left out (wrong sums, as a measure).
template <bool SYM, typename S>
void group_amx_rows(const uint8_t* codes, int64_t bits, const S* sc, const S* mn, int32_t off, int64_t g,
                    const QRows& r, int64_t r0, int64_t r1, float* acc) {
  const int64_t K = r.K, G = r.G, step = amx_group_step(g);
  alignas(64) int32_t dots[16][kPanel];
  alignas(64) uint8_t unpacked[256 * 64];  // a group of up to 256 inputs, a quad per 256 bytes
  group_amx_configure(step);
  for (int64_t gi = 0; gi < G; ++gi) {
    const uint8_t* b = bits == 8 ? codes + gi * g * kPanel : unpacked;
    if (bits == 4) unpack_nibbles(codes + gi * g * kPanel / 2, g / 8, unpacked);
    vfl s[4], m[4];
    group_scales(sc, gi, s);
    if constexpr (!SYM)
      for (int64_t i = 0; i < 4; ++i) m[i] = load_scales(mn + gi * kPanel + i * kLanes);
    for (int64_t row0 = r0; row0 < r1; row0 += 16) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < g; k += step) group_amx_step(r.q + row0 * K + gi * g + k, K, b + k * kPanel);
      _tile_stored(0, &dots[0][0], kPanel * 4);
      _tile_stored(1, &dots[0][kLanes], kPanel * 4);
      _tile_stored(2, &dots[0][2 * kLanes], kPanel * 4);
      _tile_stored(3, &dots[0][3 * kLanes], kPanel * 4);
      for (int64_t row = row0; row < std::min(r1, row0 + 16); ++row) {
        const float as = r.s[row * G + gi];
        float* a = acc + (row - r0) * kPanel;
        const uint8_t* d = reinterpret_cast<const uint8_t*>(&dots[row - row0][0]);
        if constexpr (SYM) {
          const vi osum = vset1(off * r.sum[row * G + gi]);
          for (int64_t i = 0; i < 4; ++i)
            storel(a + i * kLanes, fold_sym(loadl(a + i * kLanes), vload(d + i * 64), osum, s[i], as));
        } else {
          const float ams = r.ms[row * G + gi];
          for (int64_t i = 0; i < 4; ++i)
            storel(a + i * kLanes, fold_asym(loadl(a + i * kLanes), vload(d + i * 64), s[i], as, m[i], ams));
        }
      }
    }
  }
}

// Rows [r0, r1) (up to kRowBlock) of panel p on the tiles.
template <typename T>
void run_rows_amx(const PackedLinear& w, int64_t g, const QRows& r, int64_t p, int64_t r0, int64_t r1, T* out,
                  int64_t ldo) {
  alignas(64) float acc[kRowBlock][kPanel] = {};
  const int64_t bits = bits_of(w);
  const uint8_t* codes = static_cast<const uint8_t*>(w.data.data_ptr()) + p * panel_code_bytes(bits, w.k);
  with_panel_scales(w, p, w.k / g, [&](auto sym, const auto* sc, const auto* mn, int32_t off) {
    group_amx_rows<decltype(sym)::value>(codes, bits, sc, mn, off, g, r, r0, r1, &acc[0][0]);
  });
  const PanelStore<T> st(w, p);
  for (int64_t row = r0; row < r1; ++row) {
    vfl v[4];
    for (int64_t i = 0; i < 4; ++i) v[i] = loadl(&acc[row - r0][i * kLanes]);
    st.store(v, out + row * ldo);
  }
}
#else
inline bool group_amx_runs(const PackedLinear&, int64_t, int64_t) { return false; }
template <typename T>
void run_rows_amx(const PackedLinear&, int64_t, const QRows&, int64_t, int64_t, int64_t, T*, int64_t) {}
#endif

template <typename T>
void run_rows(const PackedLinear& w, int64_t g, const QRows& r, int64_t p, int64_t r0, int64_t r1, T* out,
              int64_t ldo) {
  if (group_amx_runs(w, g, r1 - r0)) return run_rows_amx<T>(w, g, r, p, r0, r1, out, ldo);
  // The first tile of a block reads the panel from memory (with prefetches), the others from cache.
  int64_t row = r0;
  bool first = true;
  if (kQTile != kGTile && bits_of(w) != 8) {
    for (; row + kQTile <= r1; row += kQTile, first = false) {
      first ? run_tile<T, kQTile, true>(w, g, r, p, row, out, ldo)
            : run_tile<T, kQTile, false>(w, g, r, p, row, out, ldo);
    }
  }
  for (; row + kGTile <= r1; row += kGTile, first = false) {
    first ? run_tile<T, kGTile, true>(w, g, r, p, row, out, ldo)
          : run_tile<T, kGTile, false>(w, g, r, p, row, out, ldo);
  }
  for (; row < r1; ++row, first = false) {
    first ? run_tile<T, 1, true>(w, g, r, p, row, out, ldo) : run_tile<T, 1, false>(w, g, r, p, row, out, ldo);
  }
}

template <typename T>
void group_linear_typed(at::Tensor& out, const at::Tensor& x, const PackedLinear& w, int64_t g) {
  const int64_t M = x.size(0);
  const QRows r = quantize_rows<T>(x, g);
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0);
  const int64_t P = panels(w.n), blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t panel_bytes = group_panel_bytes(w);
  const int64_t grain = M > kGTile ? 1 : std::max<int64_t>(1, 65536 / std::max<int64_t>(panel_bytes, 1));
  at::parallel_for(0, P * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / blocks, b = item % blocks;
      run_rows<T>(w, g, r, p, b * kRowBlock, std::min(M, (b + 1) * kRowBlock), op, ldo);
    }
  });
}

int64_t group_of(const PackedLinear& w) {
  const int64_t G = groups_of(w);
  return G > 0 ? w.k / G : 0;
}

}  // namespace

int64_t group_panel_width() { return kPanel; }
int64_t group_count(const PackedLinear& w) { return groups_of(w); }
int64_t group_code_bits(const PackedLinear& w) { return bits_of(w); }

void check_group_packed(const PackedLinear& w, const char* what) {
  TORCH_CHECK_VALUE(w.n >= 1 && w.k >= 1, what, ": expected N >= 1 and K >= 1, got N=", w.n, " K=", w.k);
  const int64_t n_pad = panels(w.n) * kPanel;
  TORCH_CHECK_VALUE(w.scales.has_value() && w.colsum.has_value(), what,
                    ": a group weight needs its scales and mins");
  const at::Tensor& s = *w.scales;
  const at::Tensor& m = *w.colsum;
  const bool sub = s.scalar_type() == at::kChar;
  const bool dtype_ok = s.scalar_type() == at::kFloat || s.scalar_type() == at::kHalf || sub;
  TORCH_CHECK_VALUE(s.is_contiguous() && dtype_ok && s.numel() > 0 &&
                        s.numel() % (sub ? 5 * n_pad : n_pad) == 0,
                    what, ": scales must be a contiguous float32 or float16 [", n_pad, " x groups] (or int8: "
                    "per panel [groups][", kPanel, "] sub-scales, then [groups / 16][", kPanel, "] float32)");
  const int64_t G = groups_of(w);
  TORCH_CHECK_VALUE(!sub || (G % kSubGroups == 0 && m.numel() == 1 && m.scalar_type() == at::kInt), what,
                    ": int8 sub-scales need a symmetric weight and a multiple of 16 groups, got ", G);
  TORCH_CHECK_VALUE(w.k % G == 0 && (w.k / G) % 16 == 0, what, ": ", G, " groups of K=", w.k,
                    " inputs: the group must divide K and be a multiple of 16");
  if (m.numel() == 1 && m.scalar_type() == at::kInt) {
    const int32_t off = m.data_ptr<int32_t>()[0];
    TORCH_CHECK_VALUE(off >= 0 && off <= kMaxOffset, what, ": the offset of a symmetric weight (mins = "
                      "-offset * scales) must be within 0..", kMaxOffset, ", got ", off);
  } else {
    TORCH_CHECK_VALUE(m.is_contiguous() && m.scalar_type() == s.scalar_type() && m.numel() == s.numel(), what,
                      ": mins must be contiguous, of the scales' dtype and size (or one int32: the offset of "
                      "a symmetric weight)");
  }
  const int64_t bits = w.kind == kGroup4 ? 4 : 8;
  const int64_t bytes = panels(w.n) * panel_code_bytes(bits, w.k);
  const bool six = w.kind == kGroup8 && w.data.numel() == panels(w.n) * panel_code_bytes(6, w.k);
  const bool size_ok = w.data.numel() == bytes || six;
  TORCH_CHECK_VALUE(w.data.is_contiguous() && w.data.scalar_type() == at::kByte && size_ok,
                    what, ": packed codes must be a contiguous uint8 tensor of ", bytes, " bytes (",
                    bits, "-bit codes, ", panels(w.n), " panels of ", kPanel, " x ", w.k, ")",
                    bits == 8 ? ", or of 3/4 of that (codes below 64 in 6 bits)" : "");
  if (w.bias.has_value()) {
    TORCH_CHECK_VALUE(w.bias->is_contiguous() && w.bias->dim() == 1 && w.bias->size(0) == w.n, what,
                      ": bias must be a contiguous [", w.n, "]");
  }
}

int64_t group_panel_bytes(const PackedLinear& w) {
  const int64_t G = groups_of(w);
  const int64_t scale_bytes = has_sub_scales(w) ? G * kPanel * 5 / 4
                                                : G * kPanel * w.scales->element_size() * (is_symmetric(w) ? 1 : 2);
  return panel_code_bytes(bits_of(w), w.k) + scale_bytes;
}

int64_t group_size(const PackedLinear& w) {
  const int64_t g = group_of(w);
  TORCH_CHECK_VALUE(g > 0 && g <= 256, "group weight: group size ", g, " is not supported (16..256)");
  return g;
}

void group_linear_into(at::Tensor& out, const at::Tensor& x, const PackedLinear& w) {
  const int64_t g = group_size(w);
  if (x.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat) {
    group_linear_typed<float>(out, x, w, g);
  } else {
    group_linear_typed<at::BFloat16>(out, x, w, g);
  }
}

GroupRows group_prepare_rows(const at::Tensor& x, int64_t g, GroupRowBuffers& buf) {
  const auto dt = x.scalar_type();
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && (dt == at::kFloat || dt == at::kBFloat16),
                    "x: expected float32/bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK_VALUE(g >= 16 && g % 16 == 0 && x.size(1) % g == 0, "x: K=", x.size(1),
                    " is not a whole number of groups of ", g);
  return dt == at::kFloat ? quantize_rows<float>(x, g, buf) : quantize_rows<at::BFloat16>(x, g, buf);
}

void group_block(void* out, int64_t ldo, at::ScalarType dt, const GroupRows& rows, const PackedLinear& w,
                 int64_t p, int64_t r0, int64_t r1) {
  const int64_t g = rows.K / rows.G;
  for (int64_t r = r0; r < r1; r += kRowBlock) {  // run_rows takes up to a row block
    const int64_t end = std::min(r1, r + kRowBlock);
    if (dt == at::kFloat) {
      run_rows<float>(w, g, rows, p, r, end, static_cast<float*>(out), ldo);
    } else {
      run_rows<at::BFloat16>(w, g, rows, p, r, end, static_cast<at::BFloat16*>(out), ldo);
    }
  }
}

namespace {
// The integer path of this build: 0 scalar, 1 AVX2 (vpmaddubsw), 2 AVX512-VNNI (vpdpbusd).
int64_t group_linear_path() { return kPath; }
}  // namespace
}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) { m.def("group_linear_path() -> int", &tpserve::group_linear_path); }
