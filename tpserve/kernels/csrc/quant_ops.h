// Group-quantized linear layers (quant_ops.cpp): 4- or 8-bit codes with a scale and a min per
// group of input features, activations quantized to int8 per row and group at each call. They
// are PackedLinear weights of kinds kGroup4 / kGroup8, so linear_into (and with it the fused
// decode stack) runs them like any packed weight.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace tpserve
