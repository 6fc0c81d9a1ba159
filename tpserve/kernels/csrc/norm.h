// RMSNorm over rows, shared by the CPU operators: rms_norm (cpu_ops.cpp, also inside the fused
// decode) and gemma_rms_norm (gemma_ops.cpp). Two roundings, as transformers computes them:
//
//   Llama/Qwen (kGemma false):  out = w * round(x / rms(x))
//   Gemma      (kGemma true):   out = round(x / rms(x) * (1 + w)), all in fp32, rounded once
//
// Statistics in fp32; the sum of squares in vector partial sums (a few ulp from torch's order).
// With a residual, residual_out = round(x + residual) is formed first and normalised instead of x.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace tpserve {

// Rows per at::parallel_for chunk: waking the pool costs more than ~256k elements of this work.
inline int64_t norm_grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, 262144 / std::max<int64_t>(1, elems_per_row));
}

// One row, a vector at a time (H % 16 == 0, T fp32 or bf16). rr/ro: the residual and the
// row's new residual (both null without one).
template <typename T, bool kGemma>
inline void rms_norm_row_vec(const T* xr, const T* rr, T* ro, T* orow, const T* wp, int64_t H, float eps) {
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
  if constexpr (kGemma) {
    const vfl one = vfl{} + 1.f;
    for (int64_t i = 0; i < H; i += kLanes) storel(orow + i, (loadl(xr + i) * inv) * (one + loadl(wp + i)));
  } else {
    for (int64_t i = 0; i < H; i += kLanes) {
      storel(orow + i, loadl(wp + i) * roundl(loadl(xr + i) * inv, static_cast<T*>(nullptr)));
    }
  }
}

// One row of any dtype and width, a scalar at a time; `row` is scratch of H floats.
template <typename T, bool kGemma>
inline void rms_norm_row_scalar(const T* xr, const T* rr, T* ro, T* orow, const T* wp, int64_t H, float eps,
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
  for (int64_t i = 0; i < H; ++i) {
    if constexpr (kGemma) {
      orow[i] = from_f<T>((row[i] * inv) * (1.f + to_f(wp[i])));
    } else {
      orow[i] = from_f<T>(to_f(wp[i]) * round_to<T>(row[i] * inv));
    }
  }
}

// The operator: x is [N, H] or [N, M, H] with a contiguous last dim and any other strides (the q/k
// heads sliced out of the fused QKV output); out contiguous; residual_out may be residual itself
// (each element is read before it is written). Argument errors raise ValueError.
template <bool kGemma>
void rms_norm_rows(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                   c10::optional<at::Tensor> residual_out, const at::Tensor& weight, double eps) {
  const auto st = x.scalar_type();
  check_value(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "x: expected float32, bfloat16 or float16");
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.has_value() ? res2.data_ptr<scalar_t>() : nullptr;
    scalar_t* rop = residual.has_value() ? res_out2.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    constexpr bool kVector = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>;
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, N, norm_grain_rows(H), [&](int64_t begin, int64_t end) {
      std::vector<float> row;
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* xr = xp + (n / M) * s0 + (n % M) * s1;
        const scalar_t* rr = rp ? rp + n * H : nullptr;
        scalar_t* ro = rop ? rop + n * H : nullptr;
        if constexpr (kVector) {
          if (H % 16 == 0) {
            rms_norm_row_vec<scalar_t, kGemma>(xr, rr, ro, op + n * H, wp, H, feps);
            continue;
          }
        }
        row.resize(H);
        rms_norm_row_scalar<scalar_t, kGemma>(xr, rr, ro, op + n * H, wp, H, feps, row);
      }
    });
  });
}

}  // namespace tpserve
