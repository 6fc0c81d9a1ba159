// The routed experts of a mixture-of-experts layer on CPU, in one call: the step's (token,
// choice) pairs grouped by expert, each selected expert's gate/up, SiLU-and-mul and down over
// its rows, then each token's weighted sum. Only the selected experts' weights are read, each
// once per call (at batch 1 with 8 of 128 experts chosen, 1/16 of the layer's expert weights).
//
// The matmuls are the packed linear layers' own kernels (linear_ops.cpp: fp32, bf16, int8
// weight-only and int8 x int8; quant_ops.cpp: 4-, 6- and 8-bit group codes; AVX-512 or AVX2 as
// the build's instruction set gives), driven through linear_block (group_block) over per-expert
// views of the stacked packed weights. A group-quantized projection's rows are quantized once
// per call, for all its experts. Rather than one
// linear_into per expert (two parallel regions per expert, each split across the threads on
// its own: 16 regions at top-8, and 24 panels of a gate/up projection do not divide evenly
// among 16 threads), all the selected experts' (panel, rows) pieces of the gate/up projections
// form one parallel loop, and those of the down projections another. So a call wakes the thread
// pool twice (plus once each for the rows' conversion when they are many), whatever the number
// of experts it runs.
//
// Numbers: an expert's rows go through exactly the kernels linear_into runs (sums in the order of
// k whatever the rows beside them), and SiLU-and-mul is silu_and_mul's row function, so a token's
// result does not depend on the other tokens of the call; the intermediate activations are
// rounded to x's dtype as the module path's separate ops round them. The weighted sum of a token's
// expert outputs (each in x's dtype) is taken in fp32, in the order of its choices, and rounded once.
//
// gpt-oss's experts (MoeExperts::set_swiglu_oai): each projection's bias is added by the linear
// kernels (PackedLinear::bias, as linear_into adds one), and the clamped SwiGLU replaces
// SiLU-and-mul, computed in fp32 and rounded once to x's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "linear_ops.h"
#include "moe_ops.h"
#include "vec.h"

namespace tpserve {
namespace {

at::ScalarType data_dtype(int64_t kind) {
  if (is_group_kind(kind)) return at::kByte;
  return kind == kFloat32 ? at::kFloat : kind == kBFloat16 ? at::kBFloat16 : at::kChar;
}

// Expert e's view of one stacked [E, ...] tensor (absent stays absent).
c10::optional<at::Tensor> row_of(const c10::optional<at::Tensor>& t, int64_t e) {
  if (!t.has_value()) return c10::nullopt;
  return t->select(0, e);
}

void check_stacked(const at::Tensor& data, int64_t kind, const c10::optional<at::Tensor>& scales,
                   const c10::optional<at::Tensor>& colsum, int64_t E, const char* what) {
  TORCH_CHECK_VALUE(data.dim() == 2 && data.size(0) == E && data.is_contiguous() &&
                        data.scalar_type() == data_dtype(kind),
                    what, ": expected contiguous ", c10::toString(data_dtype(kind)),
                    " packed data [num_local_experts=", E, ", panels], got ", data.scalar_type(), " ",
                    data.sizes());
  for (const c10::optional<at::Tensor>* t : {&scales, &colsum}) {
    if (t->has_value()) {
      TORCH_CHECK_VALUE((*t)->dim() == 2 && (*t)->size(0) == E && (*t)->is_contiguous(), what,
                        ": scales/colsum must be contiguous [num_local_experts, N_pad]");
    }
  }
}

PackedLinear expert_view(const at::Tensor& data, int64_t kind, const c10::optional<at::Tensor>& scales,
                         const c10::optional<at::Tensor>& colsum, int64_t e, int64_t n, int64_t k,
                         const char* what) {
  PackedLinear w;
  w.data = data.select(0, e);
  w.kind = kind;
  w.n = n;
  w.k = k;
  w.scales = row_of(scales, e);
  w.colsum = row_of(colsum, e);
  check_packed(w, what);
  return w;
}

int64_t index_of(const at::Tensor& ids, int64_t i) {
  return ids.scalar_type() == at::kLong ? ids.data_ptr<int64_t>()[i] : ids.data_ptr<int32_t>()[i];
}

// Scratch of more bytes than this is not kept after a call: a prompt's rows (up to the step's
// tokens times top-k) would otherwise stay allocated for the process's life.
constexpr int64_t kKeepBytes = 8 << 20;

// `t` viewed as [rows, width] of dtype `dt`, reallocated only when its capacity is short; a
// large one is a temporary, not kept in `t`.
at::Tensor rows_of(at::Tensor& t, int64_t rows, int64_t width, at::ScalarType dt) {
  const auto opt = at::TensorOptions().dtype(dt);
  if (rows * width * static_cast<int64_t>(c10::elementSize(dt)) > kKeepBytes) {
    return at::empty({rows, width}, opt);
  }
  if (!t.defined() || t.size(0) < rows || t.size(1) != width || t.scalar_type() != dt) {
    t = at::empty({rows, width}, opt);
  }
  return t.narrow(0, 0, rows);
}

template <typename V>
void trim(std::vector<V>& v) {
  if (v.capacity() * sizeof(V) > static_cast<size_t>(kKeepBytes)) std::vector<V>().swap(v);
}

// The (expert, panel, rows) items of one grouped matmul: per selected expert, its panels in
// order, each over its rows in blocks of linear_row_block() (panel-major, as linear_into: a
// thread's consecutive items reuse a panel across row blocks).
void build_items(std::vector<MoeItem>& items, const MoeScratch& s, const std::vector<PackedLinear>& w) {
  items.clear();
  const int64_t block = linear_row_block(), P = linear_panel_width();
  for (int32_t e : s.active) {
    const int64_t r0 = s.offset[e], r1 = s.offset[e + 1];
    const int64_t panels = (w[e].n + P - 1) / P;
    for (int64_t p = 0; p < panels; ++p) {
      for (int64_t r = r0; r < r1; r += block) {
        items.push_back(MoeItem{e, static_cast<int32_t>(p), static_cast<int32_t>(r),
                                static_cast<int32_t>(std::min(r1, r + block))});
      }
    }
  }
}

// out = x W_e^T for every item's expert, rows and panel, in one parallel loop; block(op, ldo,
// dt, weight, panel, r0, r1) runs one item with the kernels of the weights' kind.
template <typename Block>
void grouped_matmul(at::Tensor& out, const std::vector<PackedLinear>& w, const std::vector<MoeItem>& items,
                    int64_t max_rows, const Block& block) {
  if (items.empty()) return;
  void* op = out.data_ptr();
  const int64_t ldo = out.stride(0);
  const at::ScalarType dt = out.scalar_type();
  // As linear_into: with few rows, at least ~64 KB of weights per thread's share.
  const int64_t panel_bytes = linear_panel_bytes(w[items[0].expert]);
  const int64_t grain = max_rows > 4 ? 1 : std::max<int64_t>(1, 65536 / std::max<int64_t>(panel_bytes, 1));
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const MoeItem& it = items[i];
      block(op, ldo, dt, w[it.expert], it.panel, it.r0, it.r1);
    }
  });
}

// out = x W_e^T for the selected experts of one projection (x: the grouped rows): x prepared
// once for the weights' kind (group weights: quantized per group, quant_ops.cpp), then the
// grouped matmul.
void project(at::Tensor& out, const at::Tensor& x, const std::vector<PackedLinear>& w, MoeScratch& s,
             RowBuffers& rows_buf, GroupRowBuffers& group_buf, int64_t max_rows) {
  build_items(s.items, s, w);
  const PackedLinear& first = w[0];
  if (is_group_kind(first.kind)) {
    const GroupRows rows = group_prepare_rows(x, group_size(first), group_buf);
    grouped_matmul(out, w, s.items, max_rows,
                   [&](void* op, int64_t ldo, at::ScalarType dt, const PackedLinear& we, int64_t p, int64_t r0,
                       int64_t r1) { group_block(op, ldo, dt, rows, we, p, r0, r1); });
    return;
  }
  const LinearRows rows = prepare_rows(x, first.kind, rows_buf);
  grouped_matmul(out, w, s.items, max_rows,
                 [&](void* op, int64_t ldo, at::ScalarType dt, const PackedLinear& we, int64_t p, int64_t r0,
                     int64_t r1) { linear_block(op, ldo, dt, rows, we, p, p + 1, r0, r1); });
}

template <typename T>
void silu_rows(const at::Tensor& gate_up, at::Tensor& act, int64_t I) {
  const int64_t S = gate_up.size(0);
  const T* gp = gate_up.data_ptr<T>();
  T* ap = act.data_ptr<T>();
  const int64_t lg = gate_up.stride(0), la = act.stride(0);
  at::parallel_for(0, S, std::max<int64_t>(1, 262144 / std::max<int64_t>(I, 1)), [&](int64_t b, int64_t e) {
    thread_local std::vector<float> row;
    row.resize(static_cast<size_t>(I));
    for (int64_t r = b; r < e; ++r) silu_mul_row(gp + r * lg, gp + r * lg + I, ap + r * la, I, row);
  });
}

inline float sigmoid(float g) { return 1.f / (1.f + std::exp(-g)); }

// gpt-oss's clamped SwiGLU of each row (gate columns, then up), in fp32, rounded once.
template <typename T>
void swiglu_oai_rows(const at::Tensor& gate_up, at::Tensor& act, int64_t I, float alpha, float limit) {
  const int64_t S = gate_up.size(0);
  const T* gp = gate_up.data_ptr<T>();
  T* ap = act.data_ptr<T>();
  const int64_t lg = gate_up.stride(0), la = act.stride(0);
  at::parallel_for(0, S, std::max<int64_t>(1, 262144 / std::max<int64_t>(I, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gp + r * lg;
      const T* u = g + I;
      T* o = ap + r * la;
      for (int64_t i = 0; i < I; ++i) {
        const float gate = std::min(to_f<T>(g[i]), limit);
        const float up = std::min(std::max(to_f<T>(u[i]), -limit), limit);
        o[i] = from_f<T>((up + 1.f) * (gate * sigmoid(gate * alpha)));
      }
    }
  });
}

// out[t] = sum_j w[t, j] * y[slot_row[t * k + j]] (+ sigmoid(gate[t]) * shared[t]) in fp32.
template <typename T>
void combine(at::Tensor& out, const at::Tensor& y, const at::Tensor& topk_weights, const MoeScratch& s,
             int64_t k, const at::Tensor* shared, const at::Tensor* shared_gate) {
  const int64_t Tn = out.size(0), H = out.size(1);
  T* op = out.data_ptr<T>();
  const T* yp = y.defined() ? y.data_ptr<T>() : nullptr;
  const float* wp = topk_weights.data_ptr<float>();
  const T* sp = shared != nullptr ? shared->data_ptr<T>() : nullptr;
  const T* gp = shared_gate != nullptr ? shared_gate->data_ptr<T>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(H * k, 1));
  at::parallel_for(0, Tn, grain, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> acc;
    acc.resize(static_cast<size_t>(H));
    for (int64_t t = b; t < e; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      float* a = acc.data();
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = s.slot_row[t * k + j];
        if (r < 0) continue;
        const float w = wp[t * k + j];
        const T* yr = yp + r * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) a[h] += w * to_f<T>(yr[h]);
      }
      if (sp != nullptr) {
        const float g = gp != nullptr ? sigmoid(to_f<T>(gp[t])) : 1.f;
        const T* sr = sp + t * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) a[h] += g * to_f<T>(sr[h]);
      }
      T* orow = op + t * H;
      for (int64_t h = 0; h < H; ++h) orow[h] = from_f<T>(a[h]);
    }
  });
}

template <typename T>
void gather_rows(at::Tensor& xg, const at::Tensor& x, const MoeScratch& s) {
  const int64_t S = xg.size(0), H = x.size(1);
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(xg.data_ptr());
  const int64_t row_bytes = H * static_cast<int64_t>(sizeof(T));
  const int64_t xs = x.stride(0) * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, S, std::max<int64_t>(1, 262144 / std::max<int64_t>(H, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) std::memcpy(dst + r * row_bytes, src + s.row_token[r] * xs, row_bytes);
  });
}

}  // namespace

MoeWeights make_moe_weights(const at::Tensor& w13_data, int64_t w13_kind,
                            const c10::optional<at::Tensor>& w13_scales,
                            const c10::optional<at::Tensor>& w13_colsum, const at::Tensor& w2_data,
                            int64_t w2_kind, const c10::optional<at::Tensor>& w2_scales,
                            const c10::optional<at::Tensor>& w2_colsum, int64_t hidden, int64_t inter,
                            int64_t num_experts, int64_t expert_start) {
  TORCH_CHECK_VALUE(hidden >= 1 && inter >= 1, "hidden/intermediate: expected >= 1");
  const int64_t E = w13_data.dim() >= 1 ? w13_data.size(0) : 0;
  TORCH_CHECK_VALUE(E >= 1 && expert_start >= 0 && expert_start + E <= num_experts,
                    "num_local_experts: the experts held here [", expert_start, ", ", expert_start + E,
                    ") must lie within [0, num_experts=", num_experts, ")");
  check_stacked(w13_data, w13_kind, w13_scales, w13_colsum, E, "w13");
  check_stacked(w2_data, w2_kind, w2_scales, w2_colsum, E, "w2");
  MoeWeights m;
  m.num_experts = num_experts;
  m.num_local = E;
  m.expert_start = expert_start;
  m.hidden = hidden;
  m.inter = inter;
  m.w13.reserve(E);
  m.w2.reserve(E);
  for (int64_t e = 0; e < E; ++e) {
    m.w13.push_back(expert_view(w13_data, w13_kind, w13_scales, w13_colsum, e, 2 * inter, hidden, "w13"));
    m.w2.push_back(expert_view(w2_data, w2_kind, w2_scales, w2_colsum, e, hidden, inter, "w2"));
  }
  return m;
}

void moe_experts_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_ids,
                      const at::Tensor& topk_weights, const MoeWeights& m, MoeScratch& s,
                      const at::Tensor* shared, const at::Tensor* shared_gate) {
  const auto dt = x.scalar_type();
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == m.hidden && x.stride(1) == 1 &&
                        (dt == at::kFloat || dt == at::kBFloat16),
                    "x: expected float32/bfloat16 [T, hidden=", m.hidden, "] with contiguous rows, got ",
                    x.scalar_type(), " ", x.sizes());
  const int64_t Tn = x.size(0);
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == Tn && topk_ids.is_contiguous() &&
                        (topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt),
                    "topk_ids: expected contiguous int64 [T=", Tn, ", k], got ", topk_ids.scalar_type(), " ",
                    topk_ids.sizes());
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                        topk_weights.scalar_type() == at::kFloat,
                    "topk_weights: expected contiguous float32 [T, k] like topk_ids, got ",
                    topk_weights.scalar_type(), " ", topk_weights.sizes());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == Tn && out.size(1) == m.hidden && out.is_contiguous() &&
                        out.scalar_type() == dt,
                    "out: expected a contiguous [T, hidden] tensor of x's dtype");
  if (shared != nullptr) {
    TORCH_CHECK_VALUE(shared->sizes() == out.sizes() && shared->is_contiguous() &&
                          shared->scalar_type() == dt,
                      "shared: expected a contiguous [T, hidden] tensor of x's dtype");
  }
  if (shared_gate != nullptr) {
    TORCH_CHECK_VALUE(shared != nullptr, "shared_gate: given without shared");
    TORCH_CHECK_VALUE(shared_gate->dim() == 2 && shared_gate->size(0) == Tn && shared_gate->size(1) == 1 &&
                          shared_gate->is_contiguous() && shared_gate->scalar_type() == dt,
                      "shared_gate: expected a contiguous [T, 1] tensor of x's dtype");
  }
  if (Tn == 0) return;

  // Group the (token, choice) pairs of the experts held here by expert (a counting sort; within
  // an expert, in token order).
  const int64_t E = m.num_local;
  s.count.assign(E + 1, 0);
  s.slot_row.resize(Tn * k);
  for (int64_t i = 0; i < Tn * k; ++i) {
    const int64_t id = index_of(topk_ids, i);
    TORCH_CHECK_INDEX(id >= 0 && id < m.num_experts, "topk_ids: expert id ", id, " is outside [0, ",
                      m.num_experts, ")");
    const int64_t e = id - m.expert_start;
    const bool here = e >= 0 && e < E;
    s.slot_row[i] = here ? e : -1;
    if (here) ++s.count[e];
  }
  s.offset.assign(E + 1, 0);
  s.active.clear();
  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    s.offset[e + 1] = s.offset[e] + s.count[e];
    if (s.count[e] > 0) s.active.push_back(static_cast<int32_t>(e));
    max_rows = std::max(max_rows, s.count[e]);
  }
  const int64_t S = s.offset[E];
  s.row_token.resize(S);
  std::copy(s.offset.begin(), s.offset.end() - 1, s.count.begin());  // count: the next free row
  for (int64_t i = 0; i < Tn * k; ++i) {
    const int64_t e = s.slot_row[i];
    if (e < 0) continue;
    const int64_t r = s.count[e]++;
    s.row_token[r] = i / k;
    s.slot_row[i] = r;
  }

  at::Tensor y;
  if (S > 0) {
    const int64_t H = m.hidden, I = m.inter;
    at::Tensor xg = rows_of(s.xg, S, H, dt);
    at::Tensor gate_up = rows_of(s.gate_up, S, 2 * I, dt);
    at::Tensor act = rows_of(s.act, S, I, dt);
    y = rows_of(s.y, S, H, dt);
    if (dt == at::kFloat) {
      gather_rows<float>(xg, x, s);
    } else {
      gather_rows<at::BFloat16>(xg, x, s);
    }
    project(gate_up, xg, m.w13, s, s.rows13, s.group13, max_rows);
    if (m.swiglu_oai) {
      if (dt == at::kFloat) {
        swiglu_oai_rows<float>(gate_up, act, I, m.swiglu_alpha, m.swiglu_limit);
      } else {
        swiglu_oai_rows<at::BFloat16>(gate_up, act, I, m.swiglu_alpha, m.swiglu_limit);
      }
    } else if (dt == at::kFloat) {
      silu_rows<float>(gate_up, act, I);
    } else {
      silu_rows<at::BFloat16>(gate_up, act, I);
    }
    project(y, act, m.w2, s, s.rows2, s.group2, max_rows);
  }
  if (dt == at::kFloat) {
    combine<float>(out, y, topk_weights, s, k, shared, shared_gate);
  } else {
    combine<at::BFloat16>(out, y, topk_weights, s, k, shared, shared_gate);
  }
  for (RowBuffers* b : {&s.rows13, &s.rows2}) {
    trim(b->widened);
    trim(b->quantized);
  }
  for (GroupRowBuffers* b : {&s.group13, &s.group2}) {
    trim(b->q);
    trim(b->s);
    trim(b->ms);
    trim(b->sum);
  }
}

void moe_route_into(at::Tensor& topk_ids, at::Tensor& topk_weights, const at::Tensor& logits,
                    bool renormalize, bool round_bf16) {
  const auto dt = logits.scalar_type();
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1 && (dt == at::kFloat || dt == at::kBFloat16),
                    "router_logits: expected float32/bfloat16 [T, num_experts] with contiguous rows");
  const int64_t Tn = logits.size(0), E = logits.size(1);
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == Tn && topk_ids.is_contiguous() &&
                        topk_ids.scalar_type() == at::kLong,
                    "topk_ids: expected a contiguous int64 [T, k]");
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK_VALUE(k >= 1 && k <= E, "top_k: expected 1 <= k <= num_experts=", E, ", got ", k);
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                        topk_weights.scalar_type() == at::kFloat,
                    "topk_weights: expected a contiguous float32 [T, k]");
  const int64_t ls = logits.stride(0);
  const float* lf = dt == at::kFloat ? logits.data_ptr<float>() : nullptr;
  const at::BFloat16* lb = dt == at::kBFloat16 ? logits.data_ptr<at::BFloat16>() : nullptr;
  int64_t* ip = topk_ids.data_ptr<int64_t>();
  float* wp = topk_weights.data_ptr<float>();
  at::parallel_for(0, Tn, std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1)), [&](int64_t b, int64_t e) {
    thread_local std::vector<float> prob;
    thread_local std::vector<int64_t> order;
    prob.resize(static_cast<size_t>(E));
    order.resize(static_cast<size_t>(E));
    for (int64_t t = b; t < e; ++t) {
      for (int64_t i = 0; i < E; ++i) {
        prob[i] = lf != nullptr ? lf[t * ls + i] : to_f(lb[t * ls + i]);
      }
      const float mx = *std::max_element(prob.begin(), prob.end());
      float sum = 0.f;
      for (int64_t i = 0; i < E; ++i) sum += (prob[i] = std::exp(prob[i] - mx));
      for (int64_t i = 0; i < E; ++i) prob[i] /= sum;
      std::iota(order.begin(), order.end(), int64_t{0});
      // NaN (a broken model's logits) ranks last, so that the order stays a strict weak one.
      auto key = [&](int64_t i) { return std::isnan(prob[i]) ? -1.f : prob[i]; };
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t c) {
        return key(a) > key(c) || (key(a) == key(c) && a < c);
      });
      float top = 0.f;
      for (int64_t j = 0; j < k; ++j) top += prob[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        float w = prob[order[j]];
        if (renormalize) w /= top;
        if (round_bf16) w = round_to<at::BFloat16>(w);
        ip[t * k + j] = order[j];
        wp[t * k + j] = w;
      }
    }
  });
}

namespace {

// The scratch of every MoeExperts' forward on a thread: the layers run one after another, so
// one set of buffers serves them all (48 layers' own would each keep their largest call's rows).
thread_local MoeScratch t_scratch;

// One rank's experts of one layer as a torch class (built once by moe_kernel.pack_experts):
// the per-expert views are made once.
struct MoeExperts : torch::CustomClassHolder {
  MoeWeights weights;
  std::vector<at::Tensor> biases;  // set_swiglu_oai's, kept alive

  MoeExperts(at::Tensor w13_data, int64_t w13_kind, c10::optional<at::Tensor> w13_scales,
             c10::optional<at::Tensor> w13_colsum, at::Tensor w2_data, int64_t w2_kind,
             c10::optional<at::Tensor> w2_scales, c10::optional<at::Tensor> w2_colsum, int64_t hidden,
             int64_t inter, int64_t num_experts, int64_t expert_start)
      : weights(make_moe_weights(w13_data, w13_kind, w13_scales, w13_colsum, w2_data, w2_kind, w2_scales,
                                 w2_colsum, hidden, inter, num_experts, expert_start)) {}

  // gpt-oss's experts: each expert's gate/up bias (w13_bias [E, 2I], gate then up), its down
  // bias (w2_bias [E, H]; absent on the ranks that must not add it) and the clamped SwiGLU.
  // The biases are of the activations' dtype and stay alive here.
  void set_swiglu_oai(at::Tensor w13_bias, c10::optional<at::Tensor> w2_bias, double alpha, double limit) {
    MoeWeights& m = weights;
    TORCH_CHECK_VALUE(w13_bias.dim() == 2 && w13_bias.size(0) == m.num_local &&
                          w13_bias.size(1) == 2 * m.inter && w13_bias.is_contiguous(),
                      "w13_bias: expected a contiguous [num_local_experts=", m.num_local, ", ", 2 * m.inter,
                      "], got ", w13_bias.sizes());
    if (w2_bias.has_value()) {
      TORCH_CHECK_VALUE(w2_bias->dim() == 2 && w2_bias->size(0) == m.num_local &&
                            w2_bias->size(1) == m.hidden && w2_bias->is_contiguous() &&
                            w2_bias->scalar_type() == w13_bias.scalar_type(),
                        "w2_bias: expected a contiguous [num_local_experts=", m.num_local, ", ", m.hidden,
                        "] of w13_bias's dtype, got ", w2_bias->sizes());
    }
    TORCH_CHECK_VALUE(alpha > 0 && limit > 0, "swiglu alpha and limit: expected > 0");
    biases = {w13_bias};
    if (w2_bias.has_value()) biases.push_back(*w2_bias);
    for (int64_t e = 0; e < m.num_local; ++e) {
      m.w13[e].bias = w13_bias.select(0, e);
      if (w2_bias.has_value()) m.w2[e].bias = w2_bias->select(0, e);
    }
    m.swiglu_oai = true;
    m.swiglu_alpha = static_cast<float>(alpha);
    m.swiglu_limit = static_cast<float>(limit);
  }

  void forward(at::Tensor out, at::Tensor x, at::Tensor topk_ids, at::Tensor topk_weights,
               c10::optional<at::Tensor> shared, c10::optional<at::Tensor> shared_gate) {
    moe_experts_into(out, x, topk_ids, topk_weights, weights, t_scratch, shared ? &*shared : nullptr,
                     shared_gate ? &*shared_gate : nullptr);
  }
};

void moe_route(at::Tensor topk_ids, at::Tensor topk_weights, const at::Tensor& logits, bool renormalize,
               bool round_bf16) {
  moe_route_into(topk_ids, topk_weights, logits, renormalize, round_bf16);
}

}  // namespace
}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.class_<tpserve::MoeExperts>("MoeExperts")
      .def(torch::init<at::Tensor, int64_t, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                       at::Tensor, int64_t, c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t,
                       int64_t, int64_t, int64_t>())
      .def("forward", &tpserve::MoeExperts::forward)
      .def("set_swiglu_oai", &tpserve::MoeExperts::set_swiglu_oai);
  m.def("moe_route(Tensor(a!) topk_ids, Tensor(b!) topk_weights, Tensor router_logits, bool renormalize, "
        "bool round_bf16) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("moe_route", &tpserve::moe_route); }
