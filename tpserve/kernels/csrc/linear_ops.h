// The packed linear layers of tpserve's CPU operators (linear_ops.cpp), for the fused decode
// layer (decode_layer.cpp) to call without going through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tpserve {

// How a weight is stored; the values are the ``kind`` argument of the ops (packed_gemm.py).
enum WeightKind : int64_t {
  kFloat32 = 0,      // fp32 weights, fp32 activations
  kBFloat16 = 1,     // bf16 weights, bf16 activations, fp32 sums
  kInt8 = 2,         // int8 weights with a scale per output channel; fp32/bf16 activations
  kInt8Dynamic = 3,  // the same weights; activations quantized to int8 per row at each call
};

// A weight packed in panels of linear_panel_width() output channels (see linear_ops.cpp), with
// what its kind needs beside the data. Tensors are borrowed: the caller keeps them alive.
struct PackedLinear {
  at::Tensor data;
  int64_t kind = kFloat32;
  int64_t n = 0, k = 0;  // output and input features
  std::optional<at::Tensor> scales;  // fp32 [N_pad]: int8 kinds
  std::optional<at::Tensor> colsum;  // int32 [N_pad]: kInt8Dynamic, the sums of each channel
  std::optional<at::Tensor> bias;    // [N] of the activations' dtype
};

// Checks that `w` is consistent (shapes, dtypes, sizes of the packed data); raises ValueError
// naming `what`.
void check_packed(const PackedLinear& w, const char* what);

// out [M, N] = x [M, K] W^T (+ bias), in x's dtype. x's rows may be strided (stride(1) == 1).
void linear_into(at::Tensor& out, const at::Tensor& x, const PackedLinear& w);

int64_t linear_panel_width();

}  // namespace tpserve
