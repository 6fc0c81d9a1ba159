// The packed linear layers of tpserve's CPU operators (linear_ops.cpp), for the fused decode
// layer (decode_layer.cpp) to call without going through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace tpserve {

// How a weight is stored; the values are the ``kind`` argument of the ops (packed_gemm.py).
enum WeightKind : int64_t {
  kFloat32 = 0,      // fp32 weights, fp32 activations
  kBFloat16 = 1,     // bf16 weights, bf16 activations, fp32 sums
  kInt8 = 2,         // int8 weights with a scale per output channel; fp32/bf16 activations
  kInt8Dynamic = 3,  // the same weights; activations quantized to int8 per row at each call
  kGroup4 = 4,       // 4-bit codes, a scale and a min per group (quant_ops.cpp); int8 activations
  kGroup8 = 5,       // the same with 8-bit codes
};

// A weight packed in panels of linear_panel_width() output channels (see linear_ops.cpp), with
// what its kind needs beside the data. Tensors are borrowed: the caller keeps them alive.
struct PackedLinear {
  at::Tensor data;
  int64_t kind = kFloat32;
  int64_t n = 0, k = 0;  // output and input features
  std::optional<at::Tensor> scales;  // fp32 [N_pad]: int8 kinds
  std::optional<at::Tensor> colsum;  // int32 [N_pad]: kInt8Dynamic, the sums of each channel;
                                     // kGroup4/8: the mins, fp32 like the scales (quant_ops.h)
  std::optional<at::Tensor> bias;    // [N] of the activations' dtype
};

// Checks that `w` is consistent (shapes, dtypes, sizes of the packed data); raises ValueError
// naming `what`.
void check_packed(const PackedLinear& w, const char* what);

// out [M, N] = x [M, K] W^T (+ bias), in x's dtype. x's rows may be strided (stride(1) == 1).
void linear_into(at::Tensor& out, const at::Tensor& x, const PackedLinear& w);

int64_t linear_panel_width();

// ---- the pieces of linear_into, for callers that schedule several weights' panels themselves
// (the grouped experts of moe_ops.cpp): rows prepared once, then (panel, rows) blocks run on the
// calling thread, with the very kernels (and so the bits) of linear_into.

// x's rows as the kernels of one weight kind read them: x itself, or rows widened to fp32, or
// rows quantized to int8 with a scale per row (kInt8Dynamic).
struct LinearRows {
  const void* data = nullptr;
  int64_t ld = 0;                 // elements between rows
  const float* scales = nullptr;  // kInt8Dynamic: per row
};

// The buffers prepare_rows fills; kept by the caller from call to call.
struct RowBuffers {
  std::vector<float> widened;
  std::vector<int8_t> quantized;
  std::vector<float> scales;
};

// x [M, K] (fp32 or bf16, contiguous rows) prepared for weights of `kind` with K input
// features; the result points into x or into `buf`. Checks x's dtype against the kind.
LinearRows prepare_rows(const at::Tensor& x, int64_t kind, RowBuffers& buf);

// Rows [r0, r1) of out = x W^T (+ bias) over the output channels of panels [p0, p1) of w, on
// the calling thread. out: the [M, N] result's first element, of x's dtype `dt`, rows ldo apart.
void linear_block(void* out, int64_t ldo, at::ScalarType dt, const LinearRows& rows, const PackedLinear& w,
                  int64_t p0, int64_t p1, int64_t r0, int64_t r1);

// Bytes of packed data in one panel of w (what a (panel, rows) block reads of the weight; a
// group weight's codes, scales and mins).
int64_t linear_panel_bytes(const PackedLinear& w);

// Rows of x per block that linear_into schedules (its work items are (panel, block of rows)).
int64_t linear_row_block();

}  // namespace tpserve
