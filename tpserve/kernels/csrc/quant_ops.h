// Group-quantized linear layers (quant_ops.cpp): 4- or 8-bit codes with a scale and a min per
// group of input features, activations quantized to int8 per row and group at each call. They
// are PackedLinear weights of kinds kGroup4 / kGroup8, so linear_into (and with it the fused
// decode stack) runs them like any packed weight.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "linear_ops.h"

namespace tpserve {

inline bool is_group_kind(int64_t kind) { return kind == kGroup4 || kind == kGroup8; }

// Checks a group weight: data uint8 (codes in the layout of quant_ops.cpp), scales and mins
// (PackedLinear::colsum) float32 or float16 [N/P][G][P] with G = K / group, or for a symmetric
// weight one int32 offset in place of the mins; raises ValueError naming `what`.
void check_group_packed(const PackedLinear& w, const char* what);

// Of a checked group weight: output channels per panel, groups per channel (K / group), and
// the bits held per code (4, 6 or 8).
int64_t group_panel_width();
int64_t group_count(const PackedLinear& w);
int64_t group_code_bits(const PackedLinear& w);

// out [M, N] = x [M, K] W^T (+ bias) for a group weight; x fp32 or bf16 with contiguous rows.
void group_linear_into(at::Tensor& out, const at::Tensor& x, const PackedLinear& w);

// ---- the pieces of group_linear_into, for callers that schedule several weights' panels
// themselves (the grouped experts of moe_ops.cpp), with its very kernels and so its bits.

// x's rows quantized to int8 per row and group (the activations every group kernel reads).
struct GroupRows {
  const int8_t* q = nullptr;     // [M, K]
  const float* s = nullptr;      // [M, G]: a_scale
  const float* ms = nullptr;     // [M, G]: a_scale * sum(a_q)
  const int32_t* sum = nullptr;  // [M, G]: sum(a_q)
  int64_t K = 0, G = 0;
};

// The buffers group_prepare_rows fills; kept by the caller from call to call.
struct GroupRowBuffers {
  std::vector<int8_t> q;
  std::vector<float> s, ms;
  std::vector<int32_t> sum;
};

// The group size of a checked group weight (K / group_count).
int64_t group_size(const PackedLinear& w);

// x [M, K] (fp32 or bf16, contiguous rows) quantized for group weights of group g; the result
// points into `buf`.
GroupRows group_prepare_rows(const at::Tensor& x, int64_t g, GroupRowBuffers& buf);

// Rows [r0, r1) of out = x W^T (+ bias) over the output channels of panel p of the group weight
// w (group size of the rows'), on the calling thread; out as linear_block's.
void group_block(void* out, int64_t ldo, at::ScalarType dt, const GroupRows& rows, const PackedLinear& w,
                 int64_t p, int64_t r0, int64_t r1);

// Bytes one panel of a group weight reads: its codes, scales and mins.
int64_t group_panel_bytes(const PackedLinear& w);

}  // namespace tpserve
