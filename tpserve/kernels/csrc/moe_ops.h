// The grouped experts of a mixture-of-experts layer (moe_ops.cpp), for the fused decode stack
// (cpu_ops.cpp) to call without going through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "linear_ops.h"
#include "quant_ops.h"

namespace tpserve {

// One rank's experts of one layer, packed: the stacked tensors hold expert e's panels (scales,
// colsums) in their row e, and w13[e] / w2[e] view them as the linear layers
// [2I, H] (gate rows, then up rows) and [H, I].
struct MoeWeights {
  int64_t num_experts = 0;   // global: ids outside [0, num_experts) are refused
  int64_t num_local = 0;     // experts held here: global ids [expert_start, expert_start + num_local)
  int64_t expert_start = 0;
  int64_t hidden = 0, inter = 0;
  std::vector<PackedLinear> w13, w2;  // their bias (gpt-oss's experts) is added by the kernels
  // The gated activation: SiLU-and-mul, or gpt-oss's clamped SwiGLU
  // (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
  bool swiglu_oai = false;
  float swiglu_alpha = 0.f, swiglu_limit = 0.f;
};

// Checks the stacked tensors ([E_local, panel data] data, [E_local, N_pad] fp32 scales and int32
// colsums as the kinds need them) and builds the per-expert views; ValueError names the field.
MoeWeights make_moe_weights(const at::Tensor& w13_data, int64_t w13_kind,
                            const c10::optional<at::Tensor>& w13_scales,
                            const c10::optional<at::Tensor>& w13_colsum, const at::Tensor& w2_data,
                            int64_t w2_kind, const c10::optional<at::Tensor>& w2_scales,
                            const c10::optional<at::Tensor>& w2_colsum, int64_t hidden, int64_t inter,
                            int64_t num_experts, int64_t expert_start);

// One (expert, panel, rows) piece of a grouped matmul.
struct MoeItem {
  int32_t expert, panel, r0, r1;
};

// What a call keeps from call to call (no allocation once the sizes have been seen): the
// grouping of the step's (token, choice) pairs by expert and the grouped intermediate rows
// (those above 8 MB are temporaries: a prompt's are not kept). One serves any number of layers.
struct MoeScratch {
  std::vector<int64_t> count, offset, slot_row, row_token;
  std::vector<int32_t> active;
  std::vector<MoeItem> items;
  RowBuffers rows13, rows2;
  GroupRowBuffers group13, group2;  // group-quantized experts' rows (quant_ops.h)
  at::Tensor xg, gate_up, act, y;  // capacity rows; viewed at the step's row count
};

// out [T, H] (x's dtype) = sum over each token's choices j whose expert is held here of
// topk_weights[t, j] * down(silu(gate(x[t])) * up(x[t])), summed in fp32 and rounded once; plus
// sigmoid(shared_gate[t]) * shared[t] when shared [T, H] is given (shared_gate [T, 1] of x's
// dtype; absent: a weight of 1). Tokens with no expert here get zeros (or the shared term).
void moe_experts_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_ids,
                      const at::Tensor& topk_weights, const MoeWeights& m, MoeScratch& s,
                      const at::Tensor* shared = nullptr, const at::Tensor* shared_gate = nullptr);

// Routing: router logits [T, E] (fp32/bf16) -> topk_ids int64 [T, k], topk_weights fp32 [T, k]:
// softmax in fp32, the k largest (ties: the lower id first), renormalised to sum to 1 when asked,
// rounded to bf16 and back when round_bf16 (transformers' Qwen routers in bf16).
void moe_route_into(at::Tensor& topk_ids, at::Tensor& topk_weights, const at::Tensor& logits,
                    bool renormalize, bool round_bf16);

}  // namespace tpserve
