// Gemma's element-wise ops (gemma_ops.cpp), for the fused decode of cpu_ops.cpp.
#pragma once

#include <ATen/ATen.h>

namespace tpserve {

// out = round(x / rms(x) * (1 + w)); with a residual, residual_out = round(x + residual) is
// normalised instead (rms_norm's arguments).
void gemma_rms_norm(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                    c10::optional<at::Tensor> residual_out, const at::Tensor& weight, double eps);

// out [N, I] = round(round(gelu_tanh(gate)) * up) for x [N, 2I] laid out [gate | up].
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x);

}  // namespace tpserve
