// tpserve's CPU sampling operators: the exponential race and the grammar bitmask of
// tpserve/workers/sampler.py and the penalties of tpserve/workers/penalties.py, each in one pass
// over a row.
//
//   out[r] = argmax_i  x[r, i] - log(-log(u(seed[r], step[r], i)))
//
// u is the counter-based uniform of sampler.uniform (splitmix64's finalizer over the seed, the
// step and the index; 23 random bits, so u is in (0, 1) and k + 0.5 is exact in float32). The
// torch version makes ~20 passes over [S, V] int64/float32 tensors; here each row is read once,
// in chunks: the hash and the two logarithms of a chunk vectorise, and a chunk whose best logit
// plus the largest possible noise (16.64: u <= 1 - 2^-24) cannot beat the running best is
// skipped, which skips most of a row once top-k or top-p masked it to -inf.
//
// Registered into torch.ops.tpserve_cpu beside cpu_ops.cpp's operators.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kC1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kC2 = 0x94D049BB133111EBull;
constexpr int kUniformBits = 23;
// Largest value of -log(-log(u)) for u <= 1 - 2^-24 (the largest uniform), rounded up.
constexpr float kMaxNoise = 16.7f;
constexpr int64_t kChunk = 256;

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= kC1;
  x ^= x >> 27;
  x *= kC2;
  return x ^ (x >> 31);
}

// Natural logarithm of a positive, finite, normal float, accurate to about one ulp; written with
// plain arithmetic and bit operations so that the loops calling it vectorise (libm's logf does
// not without -ffast-math). x = m * 2^e with m in [sqrt(1/2), sqrt(2)); log m = 2 atanh(s),
// s = (m - 1) / (m + 1), |s| <= 0.1716, as an odd series to s^9 (next term < 4e-10).
inline float log_pos(float x) {
  uint32_t b = std::bit_cast<uint32_t>(x);
  // Shift the mantissa range so that m lands in [sqrt(1/2), sqrt(2)).
  b += 0x3f800000u - 0x3f3504f3u;
  const int32_t e = static_cast<int32_t>(b >> 23) - 127;
  b = (b & 0x007fffffu) + 0x3f3504f3u;
  const float m = std::bit_cast<float>(b);
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  const float p = 2.0f + s2 * (2.0f / 3 + s2 * (2.0f / 5 + s2 * (2.0f / 7 + s2 * (2.0f / 9))));
  return static_cast<float>(e) * 0.693147180559945f + s * p;
}

// The noise key of a row drawing under (seed, step): sampler.uniform's ``base``.
inline uint64_t row_base(int64_t seed, int64_t step) {
  return mix64(mix64(static_cast<uint64_t>(seed) * kGolden + static_cast<uint64_t>(step)) + 1);
}

// -log(-log u) for the counter-based uniform u of token j under base (row_base).
inline float race_noise(uint64_t base, uint64_t j) {
  const uint64_t bits = mix64(base ^ (j * kGolden));
  const float u = (static_cast<float>(bits >> (64 - kUniformBits)) + 0.5f) *
                  (1.0f / static_cast<float>(1 << kUniformBits));
  return log_pos(-log_pos(u));
}

int64_t race_row(const float* x, int64_t V, uint64_t base) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = -1;
  float score[kChunk];
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t n = std::min(kChunk, V - c);
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) top = std::max(top, x[c + j]);
    if (!(top + kMaxNoise > best)) continue;  // also skips an all -inf (or NaN) chunk
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) score[j] = x[c + j] - race_noise(base, static_cast<uint64_t>(c + j));
    for (int64_t j = 0; j < n; ++j) {
      if (score[j] > best) {
        best = score[j];
        best_i = c + j;
      }
    }
  }
  // A row without a finite logit: index 0, as torch's argmax of an all -inf row gives (the
  // sampler reports such rows itself).
  return best_i < 0 ? 0 : best_i;
}

void race_argmax(at::Tensor out, const at::Tensor& x, const at::Tensor& seeds, const at::Tensor& steps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
                    "x: expected float32 [S, V] with contiguous rows");
  const int64_t S = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK_VALUE(out.dim() == 1 && out.size(0) == S && out.is_contiguous() && out.scalar_type() == at::kLong,
                    "out: expected a contiguous int64 [S]");
  TORCH_CHECK_VALUE(seeds.dim() == 1 && seeds.size(0) == S && seeds.is_contiguous() &&
                        seeds.scalar_type() == at::kLong,
                    "seeds: expected a contiguous int64 [S]");
  TORCH_CHECK_VALUE(steps.dim() == 1 && steps.size(0) == S && steps.is_contiguous() &&
                        steps.scalar_type() == at::kLong,
                    "steps: expected a contiguous int64 [S]");
  const float* xp = x.data_ptr<float>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* tp = steps.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  // Rows of a few thousand tokens cost less than waking a thread.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1));
  at::parallel_for(0, S, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      op[r] = V ? race_row(xp + r * xs, V, row_base(sp[r], tp[r])) : 0;
    }
  });
}

// ---- sampling with top-k / top-p, without sorting or scanning candidates over the vocabulary ----
//
// One row: v = x / temperature, then the token race (race_row) over the tokens that survive
// top-k and top-p, as sampler.apply_top_k_top_p defines them: the k largest (k <= 0: all),
// then the shortest run of the largest whose mass (softmax over the survivors of top-k, or over
// the whole row without it) reaches top_p; the largest always survives; top_p >= 1 keeps all.
// Instead of sorting the row, one pass takes each finite v's distance below the row's max in
// bins of kBinWidth (the last bin holds everything further down) with the count and mass of
// each bin; the bins that must hold the survivors are read from those sums, and only their
// tokens are collected and sorted (by value, then index; top-k ties go to the lower index). The
// race over the survivors draws the same noise as over the whole row (a function of the token's
// index), so it picks the token race_argmax picks on the row apply_top_k_top_p masks, except
// where a token's mass before it is within rounding of top_p (sums in double here, float32
// there): tests/test_sampler.py draws the same tokens both ways on 768 rows.
constexpr int kBins = 256;
constexpr float kBinWidth = 0.125f;  // logit units: kBins bins span 32 below the max

struct Candidate {
  float v;
  int32_t i;
};

struct RowScratch {
  std::vector<float> v, e;
  std::vector<int32_t> bin;
  std::vector<Candidate> cand;
};

int64_t filtered_race_row(const float* x, int64_t V, float temp, int64_t k, float top_p, uint64_t base,
                          RowScratch& w) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  w.v.resize(static_cast<size_t>(V));
  float* v = w.v.data();
  for (int64_t j = 0; j < V; ++j) v[j] = x[j] / temp;
  float lane_max[8];
  std::fill(lane_max, lane_max + 8, kNegInf);
  int64_t j0 = 0;
  for (; j0 + 8 <= V; j0 += 8) {
    for (int l = 0; l < 8; ++l) lane_max[l] = v[j0 + l] > lane_max[l] ? v[j0 + l] : lane_max[l];
  }
  float m = *std::max_element(lane_max, lane_max + 8);
  for (; j0 < V; ++j0) m = v[j0] > m ? v[j0] : m;
  if (!(m > kNegInf)) return 0;  // no finite logit (as race_row)
  const bool limited = k < V, nucleus = top_p < 1.0f;
  if (!limited && !nucleus) return race_row(v, V, base);
  // Each token's bin (distance below the max in kBinWidth steps; -1: -inf) and exp(v - m).
  w.e.resize(static_cast<size_t>(V));
  w.bin.resize(static_cast<size_t>(V));
  float* e = w.e.data();
  int32_t* bin = w.bin.data();
  const float inv_w = 1.0f / kBinWidth;
  for (int64_t j = 0; j < V; ++j) {
    const bool finite = v[j] > kNegInf;
    const float d = std::min((m - v[j]) * inv_w, static_cast<float>(kBins - 1));
    bin[j] = finite ? static_cast<int32_t>(d) : -1;
    e[j] = finite ? tpserve::exp_nonpos(v[j] - m) : 0.f;
  }
  int64_t count[kBins] = {};
  double mass[kBins] = {};
  for (int64_t j = 0; j < V; ++j) {
    const int32_t b = bin[j];
    if (b < 0) continue;
    ++count[b];
    mass[b] += e[j];
  }
  double total = 0;
  for (int b = 0; b < kBins; ++b) total += mass[b];
  // The last bin the survivors can reach: top-k's k-th largest, or where the mass reaches top_p
  // (one bin further, so that rounding in these sums never cuts the nucleus short).
  int last = kBins - 1;
  if (limited) {
    int64_t c = 0;
    for (int b = 0; b < kBins; ++b) {
      c += count[b];
      if (c >= k) { last = b; break; }
    }
  } else {
    double acc = 0;
    for (int b = 0; b < kBins; ++b) {
      acc += mass[b];
      if (acc >= static_cast<double>(top_p) * total) { last = std::min(kBins - 1, b + 1); break; }
    }
  }
  std::vector<Candidate>& cand = w.cand;
  cand.clear();
  for (int64_t j = 0; j < V; ++j) {
    if (bin[j] >= 0 && bin[j] <= last) cand.push_back({v[j], static_cast<int32_t>(j)});
  }
  std::sort(cand.begin(), cand.end(), [](const Candidate& a, const Candidate& b) {
    return a.v > b.v || (a.v == b.v && a.i < b.i);
  });
  size_t keep = limited ? std::min<size_t>(cand.size(), static_cast<size_t>(k)) : cand.size();
  if (nucleus) {
    double denom = total;
    if (limited) {
      denom = 0;
      for (size_t i = 0; i < keep; ++i) denom += tpserve::exp_nonpos(cand[i].v - m);
    }
    double before = 0;
    size_t n = 0;
    while (n < keep && (n == 0 || before < static_cast<double>(top_p) * denom)) {
      before += tpserve::exp_nonpos(cand[n].v - m);
      ++n;
    }
    keep = n;
  }
  float best = kNegInf;
  int64_t best_i = -1;
  for (size_t n = 0; n < keep; ++n) {
    const int64_t j = cand[n].i;
    const float score = cand[n].v - race_noise(base, static_cast<uint64_t>(j));
    if (score > best || (score == best && j < best_i)) {
      best = score;
      best_i = j;
    }
  }
  return best_i < 0 ? 0 : best_i;
}

// out [S] = the race over each row of x [S, V] (float32, processed logits, temperature not yet
// applied) divided by temps [S] (> 0), among the tokens its top_ks [S] (int32; <= 0: none) and
// top_ps [S] (float32; >= 1: none) keep.
void filtered_race(at::Tensor out, const at::Tensor& x, const at::Tensor& temps, const at::Tensor& top_ks,
                   const at::Tensor& top_ps, const at::Tensor& seeds, const at::Tensor& steps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
                    "x: expected float32 [S, V] with contiguous rows");
  const int64_t S = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK_VALUE(V < (int64_t{1} << 31), "x: at most 2^31 - 1 columns");
  TORCH_CHECK_VALUE(out.dim() == 1 && out.size(0) == S && out.is_contiguous() && out.scalar_type() == at::kLong,
                    "out: expected a contiguous int64 [S]");
  auto check_row = [&](const at::Tensor& t, at::ScalarType dt, const char* what) {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == S && t.is_contiguous() && t.scalar_type() == dt, what);
  };
  check_row(temps, at::kFloat, "temps: expected a contiguous float32 [S]");
  check_row(top_ks, at::kInt, "top_ks: expected a contiguous int32 [S]");
  check_row(top_ps, at::kFloat, "top_ps: expected a contiguous float32 [S]");
  check_row(seeds, at::kLong, "seeds: expected a contiguous int64 [S]");
  check_row(steps, at::kLong, "steps: expected a contiguous int64 [S]");
  const float* xp = x.data_ptr<float>();
  const float* tp = temps.data_ptr<float>();
  const int32_t* kp = top_ks.data_ptr<int32_t>();
  const float* pp = top_ps.data_ptr<float>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* st = steps.data_ptr<int64_t>();
  for (int64_t r = 0; r < S; ++r) {
    TORCH_CHECK_VALUE(tp[r] > 0.f, "temps: expected > 0 (greedy rows take the argmax)");
  }
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1));
  at::parallel_for(0, S, grain, [&](int64_t begin, int64_t end) {
    thread_local RowScratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t k = kp[r] > 0 ? std::min<int64_t>(kp[r], V) : V;
      op[r] = V ? filtered_race_row(xp + r * xs, V, tp[r], k, pp[r], row_base(sp[r], st[r]), scratch) : 0;
    }
  });
}

// Repetition, frequency and presence penalties (workers/penalties.py) on rows ``rows`` of the
// float32 logits x [S, V], in one pass per row: for token t of row r (slot s = slots[i]) with
// output count c = counts[s, t] and prompt flag p = prompt[s, t],
//   if p or c > 0:  x *= (x > 0 ? 1 / rep : rep)         then  x -= freq * c + pres * (c > 0)
// exactly as the torch version computes it (same operations, same order, in float32).
void check_penalty_args(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& slots,
                        const at::Tensor& counts, const at::Tensor& rep, const at::Tensor& freq,
                        const at::Tensor& pres) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
                    "x: expected float32 [S, V] with contiguous rows");
  const int64_t S = x.size(0), V = x.size(1), P = rows.numel();
  TORCH_CHECK_VALUE(counts.dim() == 2 && counts.size(1) == V && counts.is_contiguous() &&
                        counts.scalar_type() == at::kInt,
                    "counts: expected a contiguous int32 [slots, V]");
  for (const auto* t : {&rows, &slots}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() == P && t->is_contiguous() && t->scalar_type() == at::kLong,
                      "rows, slots: expected contiguous int64 [P]");
  }
  for (const auto* t : {&rep, &freq, &pres}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() == P && t->is_contiguous() && t->scalar_type() == at::kFloat,
                      "rep, freq, pres: expected contiguous float32 [P]");
  }
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK_VALUE(0 <= rp[i] && rp[i] < S && 0 <= sp[i] && sp[i] < counts.size(0),
                      "rows/slots: index out of range");
  }
}

void check_prompt_flags(const at::Tensor& prompt, const at::Tensor& counts) {
  TORCH_CHECK_VALUE(prompt.sizes() == counts.sizes() && prompt.is_contiguous() && prompt.scalar_type() == at::kBool,
                    "prompt: expected a contiguous bool tensor shaped as counts");
}

void check_seen_lists(const at::Tensor& seen, const at::Tensor& seen_len, const at::Tensor& counts) {
  TORCH_CHECK_VALUE(seen.sizes() == counts.sizes() && seen.is_contiguous() && seen.scalar_type() == at::kInt,
                    "seen: expected a contiguous int32 tensor shaped as counts");
  TORCH_CHECK_VALUE(seen_len.dim() == 1 && seen_len.numel() == counts.size(0) && seen_len.is_contiguous() &&
                        seen_len.scalar_type() == at::kInt,
                    "seen_len: expected contiguous int32 [slots]");
}

// One logit's penalties (seen: the token is in the prompt or the output; c: its output count).
inline float penalized(float v, bool seen, int32_t c, float r, float inv, float f, float q) {
  if (seen) v = v * (v > 0.0f ? inv : r);
  v = v - f * static_cast<float>(c);
  return v - q * (c > 0 ? 1.0f : 0.0f);
}

void apply_penalties(at::Tensor x, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& counts,
                     const at::Tensor& prompt, const at::Tensor& rep, const at::Tensor& freq,
                     const at::Tensor& pres) {
  check_penalty_args(x, rows, slots, counts, rep, freq, pres);
  check_prompt_flags(prompt, counts);
  const int64_t V = x.size(1), P = rows.numel();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  const int32_t* cp = counts.data_ptr<int32_t>();
  const bool* pp = prompt.data_ptr<bool>();
  const float *rep_p = rep.data_ptr<float>(), *freq_p = freq.data_ptr<float>(), *pres_p = pres.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1));
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xr = xp + rp[i] * xs;
      const int32_t* c = cp + sp[i] * V;
      const bool* p = pp + sp[i] * V;
      const float r = rep_p[i], inv = 1.0f / r, f = freq_p[i], q = pres_p[i];
#pragma omp simd
      for (int64_t t = 0; t < V; ++t) {
        xr[t] = penalized(xr[t], p[t] || c[t] > 0, c[t], r, inv, f, q);
      }
    }
  });
}

// The same penalties over each row's seen tokens only: seen[slot, :seen_len[slot]] lists, once
// each, every token of the slot's prompt or output (count_tokens keeps it current), and a token
// outside it is left as it is by the dense pass too (no repetition factor, 0 * f, no presence),
// so the result is the dense pass's, bit for bit, in O(tokens seen) per row instead of O(V).
void apply_penalties_seen(at::Tensor x, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& counts,
                          const at::Tensor& seen, const at::Tensor& seen_len, const at::Tensor& rep,
                          const at::Tensor& freq, const at::Tensor& pres) {
  check_penalty_args(x, rows, slots, counts, rep, freq, pres);
  check_seen_lists(seen, seen_len, counts);
  const int64_t V = x.size(1), P = rows.numel();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int32_t* lp = seen_len.data_ptr<int32_t>();
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK_VALUE(0 <= lp[sp[i]] && lp[sp[i]] <= V, "seen_len: out of range");
  }
  float* xp = x.data_ptr<float>();
  const int32_t* cp = counts.data_ptr<int32_t>();
  const int32_t* seenp = seen.data_ptr<int32_t>();
  const float *rep_p = rep.data_ptr<float>(), *freq_p = freq.data_ptr<float>(), *pres_p = pres.data_ptr<float>();
  const int64_t xs = x.stride(0);
  for (int64_t i = 0; i < P; ++i) {
    float* xr = xp + rp[i] * xs;
    const int32_t* c = cp + sp[i] * V;
    const int32_t* list = seenp + sp[i] * V;
    const float r = rep_p[i], inv = 1.0f / r, f = freq_p[i], q = pres_p[i];
    for (int32_t j = 0, n = lp[sp[i]]; j < n; ++j) {
      const int32_t t = list[j];
      TORCH_CHECK_VALUE(0 <= t && t < V, "seen: token out of range");
      xr[t] = penalized(xr[t], true, c[t], r, inv, f, q);
    }
  }
}

// One more occurrence of tokens[i] in the output counts of slots[i], in order; a token new to the
// slot (not in its prompt, not yet in its output) is appended to its seen list.
void count_tokens(at::Tensor counts, const at::Tensor& prompt, at::Tensor seen, at::Tensor seen_len,
                  const at::Tensor& slots, const at::Tensor& tokens) {
  TORCH_CHECK_VALUE(counts.dim() == 2 && counts.is_contiguous() && counts.scalar_type() == at::kInt,
                    "counts: expected a contiguous int32 [slots, V]");
  const int64_t R = counts.size(0), V = counts.size(1), N = slots.numel();
  check_prompt_flags(prompt, counts);
  check_seen_lists(seen, seen_len, counts);
  for (const auto* t : {&slots, &tokens}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() == N && t->is_contiguous() && t->scalar_type() == at::kLong,
                      "slots, tokens: expected contiguous int64 [N]");
  }
  int32_t* cp = counts.data_ptr<int32_t>();
  const bool* pp = prompt.data_ptr<bool>();
  int32_t* seenp = seen.data_ptr<int32_t>();
  int32_t* lp = seen_len.data_ptr<int32_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t s = sp[i], t = tp[i];
    TORCH_CHECK_VALUE(0 <= s && s < R && 0 <= t && t < V, "slots/tokens: index out of range");
    int32_t& c = cp[s * V + t];
    if (c == 0 && !pp[s * V + t]) {
      TORCH_CHECK_VALUE(lp[s] < V, "seen: list full");
      seenp[s * V + lp[s]++] = static_cast<int32_t>(t);
    }
    ++c;
  }
}

// The grammar bitmask (structured output) on rows ``rows`` of the float32 logits x [S, V]: token t
// of row rows[g] keeps its logit when bit t % 32 of word t / 32 of bitmask[g] is set and becomes
// -inf otherwise, as sampler.unpack_bitmask + masked_fill do, in one pass per row. A grammar
// allows few tokens at a time, so most words are 0: a run of 32 -infs.
void apply_token_bitmask(at::Tensor x, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
                    "x: expected float32 [S, V] with contiguous rows");
  const int64_t S = x.size(0), V = x.size(1), G = rows.numel();
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong,
                    "rows: expected contiguous int64 [G]");
  TORCH_CHECK_VALUE(bitmask.dim() == 2 && bitmask.size(0) == G && bitmask.size(1) * 32 >= V &&
                        bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
                    "bitmask: expected a contiguous int32 [G, >= ceil(V / 32)]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK_VALUE(0 <= rp[g] && rp[g] < S, "rows: index out of range");
  }
  float* xp = x.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t xs = x.stride(0), W = bitmask.size(1);
  const float ninf = -std::numeric_limits<float>::infinity();
  // A row is a few microseconds of work: threads only pay off for millions of logits (waking
  // them took 4-7 ms on a loaded 2-core machine, against 0.16 ms for 64 x 32k on one).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(V, 1));
  at::parallel_for(0, G, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      float* xr = xp + rp[g] * xs;
      const uint32_t* w = bp + g * W;
      for (int64_t k = 0; k * 32 < V; ++k) {
        const uint32_t word = w[k];
        if (word == 0xFFFFFFFFu) continue;
        float* chunk = xr + k * 32;
        const int n = static_cast<int>(std::min<int64_t>(32, V - k * 32));
        if (word == 0) {
          std::fill(chunk, chunk + n, ninf);
          continue;
        }
        for (int j = 0; j < n; ++j) {
          if (!((word >> j) & 1u)) chunk[j] = ninf;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("race_argmax(Tensor(a!) out, Tensor x, Tensor seeds, Tensor steps) -> ()");
  m.def("filtered_race(Tensor(a!) out, Tensor x, Tensor temps, Tensor top_ks, Tensor top_ps, Tensor seeds, "
        "Tensor steps) -> ()");
  m.def("apply_penalties(Tensor(a!) x, Tensor rows, Tensor slots, Tensor counts, Tensor prompt, "
        "Tensor rep, Tensor freq, Tensor pres) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) x, Tensor rows, Tensor bitmask) -> ()");
  m.def("apply_penalties_seen(Tensor(a!) x, Tensor rows, Tensor slots, Tensor counts, Tensor seen, "
        "Tensor seen_len, Tensor rep, Tensor freq, Tensor pres) -> ()");
  m.def("count_tokens(Tensor(a!) counts, Tensor prompt, Tensor(b!) seen, Tensor(c!) seen_len, Tensor slots, "
        "Tensor tokens) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("race_argmax", &race_argmax);
  m.impl("filtered_race", &filtered_race);
  m.impl("apply_penalties", &apply_penalties);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("apply_penalties_seen", &apply_penalties_seen);
  m.impl("count_tokens", &count_tokens);
}
