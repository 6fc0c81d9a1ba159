// Prompt attention for bf16 queries against a bf16 paged cache, on blocks of key pairs: on the AMX
// tile unit, or with AVX512-BF16 dot products (vdpbf16ps) on CPUs without it (AMD Zen 4 and 5,
// Cooper Lake).
//
// The vector prompt path (cpu_ops.cpp, prompt_item) widens keys and values to fp32 and spends two
// fp32 FMAs per query element and key, one for the score and one for the value; at a few hundred
// keys and more that is most of a prompt's attention time. Here both products take bf16 pairs:
// on the tiles 16 x 16 x 32 multiply-adds an instruction, with vdpbf16ps two products a lane (twice
// an fp32 FMA's), and the vector unit keeps only the softmax:
//
//   * a work item is the vector path's (query rows of one sequence with every query head of one KV
//     head, cpu_ops.cpp) with more rows (prompt_pairs_rows): its query vectors, bf16, in tiles of
//     16;
//   * keys come in blocks of 32 at absolute positions 0, 32, 64, ...: the block's keys are
//     transposed into pairs of features ([D/2][32][2], the B operand of Q K^T) and its values
//     into pairs of keys ([16][D][2], the B operand of P V), zeros for keys the item never sees;
//   * per tile of 16 query vectors: the scores S = Q K^T (on the tiles: two C tiles, D/32 steps;
//     with dot products: 8 query vectors at a time, a pair of features a step) go to memory in
//     fp32, each row's softmax runs online in fp32 on the vector unit (scale, soft-cap, window and
//     causal mask, running maximum and sum), its weights are rounded to bf16 as the A operand of
//     P V, and P V accumulates into the row's fp32 output, which is first rescaled by exp(old max -
//     new max) where the maximum moved (with dot products: a row's own visible key pairs only).
//
// A query row's bits depend only on its query, its position and its keys: either engine computes
// each row of a product from that row alone, the blocks are aligned to absolute positions, a row
// takes no part in a block it sees no key of, and a key it cannot see adds exact zeros. So, as on
// the vector path, a prompt computes the same bits whether its prefix was computed in this step or
// read from the prefix cache, whichever rows share its item. The bits differ from the vector
// path's (bf16 softmax weights, the scale applied to the sums, the engine's order of sums), and
// between the two engines.
#include "prompt_bf16.h"

#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "amx.h"
#include "vec.h"

namespace tpserve {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
namespace {

constexpr int64_t kKeys = 32;  // keys per block: two score tiles, one P V step
constexpr int64_t kVecs = 16;  // query vectors per tile

#if TPSERVE_AMX
void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  load_tile_config(c);
}

// P V into N <= 4 output column tiles: C tiles 0..N-1 are the rows' fp32 outputs (ldc bytes
// apart), A tile 4 holds P, B tiles 5-7 the values' pairs (ldb bytes apart).
template <int N>
inline void pv_columns(float* c, int64_t ldc, const uint16_t* b, int64_t ldb) {
  _tile_loadd(0, c, ldc);
  _tile_loadd(5, b, ldb);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(1, c + 16, ldc);
  _tile_loadd(6, b + 32, ldb);
  _tile_dpbf16ps(1, 4, 6);
  if constexpr (N == 4) {
    _tile_loadd(2, c + 32, ldc);
    _tile_loadd(7, b + 64, ldb);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(3, c + 48, ldc);
    _tile_loadd(5, b + 96, ldb);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
  if constexpr (N == 4) {
    _tile_stored(2, c + 32, ldc);
    _tile_stored(3, c + 48, ldc);
  }
}
#endif

// Scores of query vectors q [8][D] (bf16) against a block's keys kt [D/2][32] (feature pairs) by
// dot products: sb [8][32] in fp32, a pair of features a step, two products a lane.
inline void dot_scores8(const uint16_t* q, const uint32_t* kt, int64_t D, float* sb) {
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
  const int64_t pairs = D / 2;
  __m512 s[8][2];
  for (int u = 0; u < 8; ++u) s[u][0] = s[u][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + i * kKeys);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + i * kKeys + 16);
    for (int u = 0; u < 8; ++u) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q32[u * pairs + i]));
      s[u][0] = _mm512_dpbf16_ps(s[u][0], k0, qp);
      s[u][1] = _mm512_dpbf16_ps(s[u][1], k1, qp);
    }
  }
  for (int u = 0; u < 8; ++u) {
    _mm512_storeu_ps(sb + u * kKeys, s[u][0]);
    _mm512_storeu_ps(sb + u * kKeys + 16, s[u][1]);
  }
}

// NC vectors of one row's output (av) plus its weights' key pairs j0..j1-1 (bf16, prow) times
// those columns of the values' key pairs (vv, a pair's row D * 2 apart): the sums stay in
// registers across the pairs.
template <int NC>
inline void dot_value_columns(float* av, const uint32_t* p32, int64_t j0, int64_t j1, const uint16_t* vv,
                              int64_t D) {
  __m512 a[NC];
  for (int c = 0; c < NC; ++c) a[c] = _mm512_loadu_ps(av + c * 16);
  for (int64_t jp = j0; jp < j1; ++jp) {
    const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(p32[jp]));
    const uint16_t* vp = vv + jp * D * 2;
    for (int c = 0; c < NC; ++c) a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)_mm512_loadu_si512(vp + c * 32), pp);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(av + c * 16, a[c]);
}

// One row's P V by dot products: its weights' key pairs j0..j1-1 (bf16, prow) times the values'
// key pairs vv [16][D][2], into the row's fp32 output av [D] (D a multiple of 32).
inline void dot_values(float* av, const uint16_t* prow, int64_t j0, int64_t j1, const uint16_t* vv,
                       int64_t D) {
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(prow);
  int64_t c0 = 0;
  for (; c0 + 128 <= D; c0 += 128) dot_value_columns<8>(av + c0, p32, j0, j1, vv + c0 * 2, D);
  for (; c0 < D; c0 += 32) dot_value_columns<2>(av + c0, p32, j0, j1, vv + c0 * 2, D);
}

// Transposes 16 rows of 16 32-bit words in place (r[i] word j -> r[j] word i).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each 128-bit lane of r[i] now holds a 4 x 4 block; gather the lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// exp(x) for x <= 0, 16 lanes: vec.h's exp_nonpos (the same reduction and polynomial) in AVX-512.
inline __m512 exp_nonpos16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                        _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 softmax weights rounded to bf16 (nearest even; they are finite and >= 0): their bits into
// dst, and their sum as rounded.
inline float round_weights(__m512 e, uint16_t* dst) {
  const __m512i bits = _mm512_castps_si512(e);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  const __m512i rounded = _mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  return _mm512_reduce_add_ps(_mm512_castsi512_ps(rounded));
}

// Bytes carved from one float vector, each piece 64-byte aligned.
struct Carver {
  char* at;
  template <typename U>
  U* take(int64_t n) {
    U* p = reinterpret_cast<U*>(at);
    at += (n * static_cast<int64_t>(sizeof(U)) + 63) / 64 * 64;
    return p;
  }
};

// Item w on the tiles (kTiles) or by dot products.
template <bool kTiles>
void prompt_item_pairs(const PromptItem& w, const at::BFloat16* q, int64_t q_s0, int64_t q_s1,
                       at::BFloat16* out, const PagedKv& kv, int64_t group, int64_t head_dim,
                       int64_t q_begin, int64_t offset, float scale, std::vector<float>& scratch,
                       const AttnOpts& o) {
  const int64_t D = head_dim, rows = w.row_end - w.row_begin, nq = rows * group;
  const int64_t tiles = (nq + kVecs - 1) / kVecs, nqp = tiles * kVecs, pairs = D / 2;
  const int64_t hkv = kv.num_kv_heads, hq = hkv * group, row_stride = hkv * D;
  const int64_t bytes = nqp * D * 2 + nqp * D * 4 + nqp * 16 + D * kKeys * 4 + kKeys * kVecs * 6 + 7 * 64;
  scratch.resize(static_cast<size_t>(bytes / 4 + 16));
  Carver cv{reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) / 64 * 64)};
  uint16_t* qb = cv.take<uint16_t>(nqp * D);   // [nqp][D] the item's query vectors
  float* acc = cv.take<float>(nqp * D);        // [nqp][D] their unnormalised outputs
  float* mx = cv.take<float>(nqp);             // running maxima
  float* sum = cv.take<float>(nqp);            // running sums
  int64_t* qpos = cv.take<int64_t>(nqp);       // absolute positions
  uint32_t* kt = cv.take<uint32_t>(pairs * kKeys);  // [D/2][32] the block's keys, feature pairs
  uint16_t* vv = cv.take<uint16_t>(kKeys * D);      // [16][D][2] its values, key pairs
  float* sb = cv.take<float>(kVecs * kKeys);        // [16][32] a tile's scores
  uint16_t* pb = cv.take<uint16_t>(kVecs * kKeys);  // [16][32] their softmax weights, bf16

  for (int64_t v = 0; v < nqp; ++v) {
    uint16_t* dst = qb + v * D;
    if (v >= nq) {
      std::memset(dst, 0, static_cast<size_t>(D) * 2);
      qpos[v] = -1;
      continue;
    }
    const int64_t r = v / group, g = v % group;
    std::memcpy(dst, q + (q_begin + w.row_begin + r) * q_s0 + (w.kv_head * group + g) * q_s1,
                static_cast<size_t>(D) * 2);
    qpos[v] = offset + w.row_begin + r;
    mx[v] = o.start_max(w.kv_head * group + g);
    sum[v] = o.start_sum();
  }
  std::fill(acc, acc + nqp * D, 0.f);
#if TPSERVE_AMX
  if constexpr (kTiles) configure_tiles();
#endif

  const int64_t first_pos = offset + w.row_begin, k_end = offset + w.row_end;
  const int64_t k_lo = o.first_key(first_pos);
  for (int64_t p0 = k_lo / kKeys * kKeys; p0 < k_end; p0 += kKeys) {
    // The block's key and value rows (null: a key the item never sees, read as zeros).
    const uint16_t* krow[kKeys];
    const uint16_t* vrow[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t pos = p0 + j;
      if (pos < k_lo || pos >= k_end) {
        krow[j] = vrow[j] = nullptr;
        continue;
      }
      const int64_t slot = static_cast<int64_t>(kv.table[pos / kv.block_size]) * kv.block_size +
                           pos % kv.block_size;
      const int64_t off = slot * row_stride + w.kv_head * D;
      krow[j] = reinterpret_cast<const uint16_t*>(kv.k + off);
      vrow[j] = reinterpret_cast<const uint16_t*>(kv.v + off);
    }
    // Keys: 16 x 16 blocks of feature pairs transposed into kt [D/2][32].
    for (int64_t h = 0; h < kKeys; h += 16) {
      for (int64_t i0 = 0; i0 < pairs; i0 += 16) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j) {
          r[j] = krow[h + j] ? _mm512_loadu_si512(krow[h + j] + i0 * 2) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (i0 + i) * kKeys + h, r[i]);
      }
    }
    // Values: each pair of keys' rows interleaved into vv [16][D][2].
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < kKeys; j += 2) {
      uint16_t* dst = vv + (j / 2) * D * 2;
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const __m512i a = vrow[j] ? _mm512_loadu_si512(vrow[j] + d0) : _mm512_setzero_si512();
        const __m512i b = vrow[j + 1] ? _mm512_loadu_si512(vrow[j + 1] + d0) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d0 * 2, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(dst + d0 * 2 + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t vb = t * kVecs;
      bool any = false;
      for (int64_t u = 0; u < kVecs && !any; ++u) {
        const int64_t p = qpos[vb + u];
        any = p >= p0 && o.first_key(p) < p0 + kKeys;
      }
      if (!any) continue;
      if constexpr (kTiles) {
#if TPSERVE_AMX
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < D / 32; ++s) {
          _tile_loadd(2, qb + vb * D + s * 32, D * 2);
          _tile_loadd(3, kt + s * 16 * kKeys, kKeys * 4);
          _tile_loadd(4, kt + s * 16 * kKeys + 16, kKeys * 4);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, sb, kKeys * 4);
        _tile_stored(1, sb + 16, kKeys * 4);
#endif
      } else {
        for (int64_t h = 0; h < kVecs; h += 8) dot_scores8(qb + (vb + h) * D, kt, D, sb + h * kKeys);
      }
      for (int64_t u = 0; u < kVecs; ++u) {
        const int64_t v = vb + u, p = qpos[v];
        uint16_t* prow = pb + u * kKeys;
        const int64_t lo = std::max<int64_t>(0, o.first_key(p) - p0);
        const int64_t hi = std::min<int64_t>(kKeys, p - p0 + 1);
        if (p < 0 || lo >= hi) {  // sees no key of this block: weights 0, output untouched
          std::memset(prow, 0, kKeys * 2);
          continue;
        }
        float* srow = sb + u * kKeys;
        const __m512 sc = _mm512_set1_ps(scale);
        __m512 s0 = _mm512_mul_ps(_mm512_load_ps(srow), sc);
        __m512 s1 = _mm512_mul_ps(_mm512_load_ps(srow + 16), sc);
        if (o.softcap > 0.f) {
          _mm512_store_ps(srow, s0);
          _mm512_store_ps(srow + 16, s1);
          o.cap(srow, kKeys);
          s0 = _mm512_load_ps(srow);
          s1 = _mm512_load_ps(srow + 16);
        }
        // Keys lo..hi-1 of the block are visible: the largest of their scores, their weights.
        const uint32_t seen = (hi == 32 ? ~0u : (1u << hi) - 1) & ~((1u << lo) - 1);
        const __mmask16 k0 = static_cast<__mmask16>(seen), k1 = static_cast<__mmask16>(seen >> 16);
        const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        const float block_max = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_mask_mov_ps(none, k0, s0), _mm512_mask_mov_ps(none, k1, s1)));
        const float new_max = std::max(mx[v], block_max);
        const __m512 nm = _mm512_set1_ps(new_max);
        const __m512 e0 = _mm512_maskz_mov_ps(k0, exp_nonpos16(_mm512_sub_ps(s0, nm)));
        const __m512 e1 = _mm512_maskz_mov_ps(k1, exp_nonpos16(_mm512_sub_ps(s1, nm)));
        const float psum = round_weights(e0, prow) + round_weights(e1, prow + 16);
        if (new_max == mx[v]) {  // the running maximum stands: nothing to rescale
          sum[v] += psum;
        } else {
          const float alpha = exp_nonpos(mx[v] - new_max);  // ~0 on the row's first keys
          mx[v] = new_max;
          sum[v] = sum[v] * alpha + psum;
          float* av = acc + v * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) av[d] *= alpha;
        }
        if constexpr (!kTiles) dot_values(acc + v * D, prow, lo / 2, (hi + 1) / 2, vv, D);
      }
      if constexpr (kTiles) {
#if TPSERVE_AMX
        _tile_loadd(4, pb, kKeys * 2);
        float* ot = acc + vb * D;
        int64_t c = 0;
        for (; c + 64 <= D; c += 64) pv_columns<4>(ot + c, D * 4, vv + c * 2, D * 4);
        if (c < D) pv_columns<2>(ot + c, D * 4, vv + c * 2, D * 4);
#endif
      }
    }
  }
  for (int64_t v = 0; v < nq; ++v) {
    const int64_t r = v / group, g = v % group;
    at::BFloat16* dst = out + ((q_begin + w.row_begin + r) * hq + w.kv_head * group + g) * D;
    const float inv = 1.f / sum[v];
    const float* av = acc + v * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = from_f<at::BFloat16>(av[d] * inv);
  }
}

}  // namespace

bool prompt_amx_runs(int64_t head_dim) {
  return TPSERVE_AMX && head_dim % 32 == 0 && head_dim <= 256 && amx_granted();
}

bool prompt_pairs_runs(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= 256; }

void prompt_item_bf16(const PromptItem& w, const at::BFloat16* q, int64_t q_s0, int64_t q_s1,
                      at::BFloat16* out, const PagedKv& kv, int64_t group, int64_t head_dim,
                      int64_t q_begin, int64_t offset, float scale, std::vector<float>& scratch,
                      const AttnOpts& o, bool tiles) {
#if TPSERVE_AMX
  if (tiles) {
    return prompt_item_pairs<true>(w, q, q_s0, q_s1, out, kv, group, head_dim, q_begin, offset, scale,
                                   scratch, o);
  }
#endif
  (void)tiles;
  prompt_item_pairs<false>(w, q, q_s0, q_s1, out, kv, group, head_dim, q_begin, offset, scale, scratch, o);
}

#else

bool prompt_amx_runs(int64_t) { return false; }
bool prompt_pairs_runs(int64_t) { return false; }

void prompt_item_bf16(const PromptItem&, const at::BFloat16*, int64_t, int64_t, at::BFloat16*,
                      const PagedKv&, int64_t, int64_t, int64_t, int64_t, float, std::vector<float>&,
                      const AttnOpts&, bool) {}

#endif

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  // Whether bf16 prompt rows of this head size run on the tile unit, or on blocks of key pairs at
  // all (tiles or AVX512-BF16 dot products), for tests and benchmarks.
  m.def("prompt_attention_amx(int head_dim) -> bool", &tpserve::prompt_amx_runs);
  m.def("prompt_attention_pairs(int head_dim) -> bool", &tpserve::prompt_pairs_runs);
}
