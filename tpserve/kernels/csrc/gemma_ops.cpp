// Gemma's element-wise ops on CPU (Gemma 2 and 3): its RMSNorm and its GELU-tanh-and-mul, each
// one pass over the rows instead of the ~8 torch ops (and their fp32 temporaries) of the module
// path. The roundings are transformers' (models/norm.py GemmaRMSNorm, models/activation.py):
//
//   gemma_rms_norm:     out = round(x / rms(x) * (1 + w)), all in fp32, rounded once; with a
//                       residual, residual_out = round(x + residual) is normalised instead.
//   gelu_tanh_and_mul:  out = round(round(gelu_tanh(gate)) * up) for x laid out [gate | up].
//
// The sum of squares is taken in vector partial sums (as rms_norm of cpu_ops.cpp does), tanh from
// the vectorised exp of vec.h: both within a few ulp of torch's, not bit-equal to them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace tpserve {
namespace {

inline int64_t gemma_grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, 262144 / std::max<int64_t>(1, elems_per_row));
}

void check_floating(const at::Tensor& x, const char* what) {
  check_value(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf, what);
}

// One row, H % kLanes == 0 and T float or bf16.
template <typename T>
void gemma_norm_row_vec(const T* xr, const T* rr, T* ro, T* orow, const T* wp, int64_t H, float eps) {
  vfl ss = {};
  if (rr != nullptr) {
    for (int64_t i = 0; i < H; i += kLanes) {
      const vfl v = roundl(loadl(xr + i) + loadl(rr + i), static_cast<T*>(nullptr));
      storel(ro + i, v);
      ss += v * v;
    }
    xr = ro;
  } else {
    for (int64_t i = 0; i < H; i += kLanes) {
      const vfl v = loadl(xr + i);
      ss += v * v;
    }
  }
  const float inv = 1.f / std::sqrt(hsuml(ss) / static_cast<float>(H) + eps);
  const vfl one = vfl{} + 1.f;
  for (int64_t i = 0; i < H; i += kLanes) {
    storel(orow + i, (loadl(xr + i) * inv) * (one + loadl(wp + i)));
  }
}

// Any dtype and width: the same sums, a scalar at a time.
template <typename T>
void gemma_norm_row_scalar(const T* xr, const T* rr, T* ro, T* orow, const T* wp, int64_t H, float eps,
                           std::vector<float>& row) {
  if (rr != nullptr) {
    for (int64_t i = 0; i < H; ++i) {
      const T sum = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
      ro[i] = sum;
      row[i] = to_f(sum);
    }
  } else {
    load_row(xr, row.data(), H);
  }
  const float inv = 1.f / std::sqrt(sum_squares(row.data(), H) / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) orow[i] = from_f<T>((row[i] * inv) * (1.f + to_f(wp[i])));
}

// x is [N, H] or [N, M, H] with a contiguous last dim and any other strides (q/k heads sliced out
// of the fused QKV output); residual_out may be residual itself (read before written).
void gemma_rms_norm(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                    c10::optional<at::Tensor> residual_out, const at::Tensor& weight, double eps) {
  check_floating(x, "x: expected float32, bfloat16 or float16");
  check_value((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
              "x: expected [N, H] or [N, M, H] with a contiguous last dimension");
  check_value(out.is_contiguous() && out.sizes() == x.sizes() && out.dtype() == x.dtype(),
              "out: expected a contiguous tensor of x's shape and dtype");
  const int64_t H = x.size(-1);
  check_value(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
                  weight.dtype() == x.dtype(),
              "weight: expected a contiguous [hidden] tensor of x's dtype");
  check_value(residual.has_value() == residual_out.has_value(),
              "residual_out: given exactly when residual is");
  const int64_t M = x.dim() == 3 ? x.size(1) : 1;
  const int64_t N = x.size(0) * M;
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : 0;
  at::Tensor res2, res_out2;
  if (residual.has_value()) {
    for (const at::Tensor* r : {&residual.value(), static_cast<const at::Tensor*>(&residual_out.value())}) {
      check_value(r->is_contiguous() && r->sizes() == x.sizes() && r->dtype() == x.dtype(),
                  "residual/residual_out: expected contiguous tensors of x's shape and dtype");
    }
    res2 = residual->view({-1, H});
    res_out2 = residual_out->view({-1, H});
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemma_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.has_value() ? res2.data_ptr<scalar_t>() : nullptr;
    scalar_t* rop = residual.has_value() ? res_out2.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    constexpr bool kVector = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>;
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, N, gemma_grain_rows(H), [&](int64_t begin, int64_t end) {
      std::vector<float> row;
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* xr = xp + (n / M) * s0 + (n % M) * s1;
        const scalar_t* rr = rp ? rp + n * H : nullptr;
        scalar_t* ro = rop ? rop + n * H : nullptr;
        if constexpr (kVector) {
          if (H % kLanes == 0) {
            gemma_norm_row_vec(xr, rr, ro, op + n * H, wp, H, feps);
            continue;
          }
        }
        row.resize(H);
        gemma_norm_row_scalar(xr, rr, ro, op + n * H, wp, H, feps, row);
      }
    });
  });
}

// gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), tanh from e = exp(-2|z|) <= 1:
// tanh(|z|) = (1 - e) / (1 + e), the sign put back; no overflow, and the loop vectorises.
template <typename T>
inline void gelu_tanh_mul_row(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t I,
                              std::vector<float>& row) {
  float* r = row.data();
  load_row(g, r, I);
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float x = r[i];
    const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float e = exp_nonpos(-2.f * std::fabs(z));
    const float t = (1.f - e) / (1.f + e);
    r[i] = 0.5f * x * (1.f + (z >= 0.f ? t : -t));
  }
  for (int64_t i = 0; i < I; ++i) o[i] = from_f<T>(round_to<T>(r[i]) * to_f<T>(u[i]));
}

// out [N, I] for x [N, 2I] laid out [gate | up] (rows of any stride, contiguous within).
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) {
  check_floating(x, "x: expected float32, bfloat16 or float16");
  check_value(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x: expected [N, 2I] with a contiguous last dimension");
  const int64_t N = x.size(0), I = x.size(1) / 2;
  check_value(out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == I &&
                  out.dtype() == x.dtype(),
              "out: expected a contiguous [N, I] tensor of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_tanh_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, N, gemma_grain_rows(I), [&](int64_t begin, int64_t end) {
      std::vector<float> row(I);
      for (int64_t n = begin; n < end; ++n) {
        gelu_tanh_mul_row(xp + n * xs, xp + n * xs + I, op + n * I, I, row);
      }
    });
  });
}

}  // namespace
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
