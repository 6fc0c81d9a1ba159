// Gemma's element-wise ops on CPU (Gemma 2 and 3): its RMSNorm and its GELU-tanh-and-mul, each
// one pass over the rows instead of the ~8 torch ops (and their fp32 temporaries) of the module
// path. The roundings are transformers' (models/norm.py GemmaRMSNorm, models/activation.py):
//
//   gemma_rms_norm:     out = round(x / rms(x) * (1 + w)), all in fp32, rounded once; with a
//                       residual, residual_out = round(x + residual) is normalised instead.
//   gelu_tanh_and_mul:  out = round(round(gelu_tanh(gate)) * up) for x laid out [gate | up].
//
// The norm's rows are norm.h's (shared with rms_norm); tanh comes from the vectorised exp of vec.h:
// both within a few ulp of torch's, not bit-equal to them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "gemma_ops.h"
#include "norm.h"
#include "vec.h"

namespace tpserve {
namespace {

// gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), tanh from e = exp(-2|z|) <= 1:
// tanh(|z|) = (1 - e) / (1 + e), the sign put back; no overflow, and the loop vectorises.
inline float gelu_tanh(float x) {
  const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float e = exp_nonpos(-2.f * std::fabs(z));
  const float t = (1.f - e) / (1.f + e);
  return 0.5f * x * (1.f + (z >= 0.f ? t : -t));
}

}  // namespace

// Gemma's RMSNorm: norm.h's rows with the (1 + w) scaling, in fp32, rounded once.
void gemma_rms_norm(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                    c10::optional<at::Tensor> residual_out, const at::Tensor& weight, double eps) {
  rms_norm_rows<true>(out, x, residual, residual_out, weight, eps);
}

// out [N, I] for x [N, 2I] laid out [gate | up].
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) {
  gated_and_mul(out, x, [](const auto* g, const auto* u, auto* o, int64_t I, std::vector<float>& row) {
    gated_mul_row(g, u, o, I, row, [](float v) { return gelu_tanh(v); });
  });
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("gemma_rms_norm(Tensor(a!) out, Tensor x, Tensor? residual, Tensor(b!)? residual_out, "
        "Tensor weight, float eps) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("gemma_rms_norm", &tpserve::gemma_rms_norm);
  m.impl("gelu_tanh_and_mul", &tpserve::gelu_tanh_and_mul);
}
