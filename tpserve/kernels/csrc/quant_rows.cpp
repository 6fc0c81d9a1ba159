// Rows of a group-quantized weight read back from its packed layout (quant_ops.cpp's): the codes,
// scales and mins of output channels `ids`, as group_quant.packed_rows returns them. An embedding
// that shares a tied LM head's codes looks its tokens up here, one call per step, instead of
// holding a float table beside the head.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_ops.h"
#include "quant_ops.h"

namespace tpserve {
namespace {

// (codes uint8 [T, K], scales fp32 [T, G], mins fp32 [T, G]) of rows `ids` (int64 [T]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_rows(const at::Tensor& ids, const at::Tensor& data,
                                                          int64_t kind, int64_t n, int64_t k,
                                                          const at::Tensor& scales,
                                                          const at::Tensor& colsum) {
  TORCH_CHECK_VALUE(is_group_kind(kind), "group_rows: kind ", kind, " is not a group weight");
  PackedLinear w{data, kind, n, k, scales, colsum, std::nullopt};
  check_group_packed(w, "group_rows");
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong, "group_rows: ids must be int64 [T]");
  const at::Tensor idc = ids.contiguous();
  const int64_t T = idc.size(0);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(id[t] >= 0 && id[t] < n, "group_rows: row ", id[t], " is outside 0..", n - 1);
  }
  const int64_t P = group_panel_width(), L = P / 4, G = group_count(w);
  const int64_t bits = group_code_bits(w);
  const int64_t panel_bytes = k * P * bits / 8;
  at::Tensor codes = at::empty({T, k}, at::kByte);
  at::Tensor sc = at::empty({T, G}, at::kFloat);
  at::Tensor mn = at::empty({T, G}, at::kFloat);
  uint8_t* co = codes.data_ptr<uint8_t>();
  float* so = sc.data_ptr<float>();
  float* mo = mn.data_ptr<float>();
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const bool sym = colsum.numel() == 1 && colsum.scalar_type() == at::kInt;
  const int32_t off = sym ? colsum.data_ptr<int32_t>()[0] : 0;
  // a panel's per-group value of channel j: fp32, fp16, or an int8 sub-scale times its fp32 top
  auto group_value = [&](const at::Tensor& s, int64_t p, int64_t gi, int64_t j) -> float {
    if (s.scalar_type() == at::kChar) {
      const int8_t* base = s.data_ptr<int8_t>() + p * G * P * 5 / 4;
      float top;
      std::memcpy(&top, base + G * P + ((gi / 16) * P + j) * 4, 4);
      return static_cast<float>(base[gi * P + j]) * top;
    }
    if (s.scalar_type() == at::kHalf) return static_cast<float>(s.data_ptr<at::Half>()[(p * G + gi) * P + j]);
    return s.data_ptr<float>()[(p * G + gi) * P + j];
  };
  at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t p = id[t] / P, j = id[t] % P;
      const int64_t lane = (j / L) * L * 4 + (j % L) * 4;  // byte of the channel's quad in a step
      const uint8_t* w = dp + p * panel_bytes;
      uint8_t* c = co + t * k;
      if (bits == 4) {  // steps of 8 inputs: low nibbles 8b + q, high 8b + 4 + q
        for (int64_t b = 0; b < k / 8; ++b) {
          const uint8_t* q = w + b * P * 4 + lane;
          for (int64_t i = 0; i < 4; ++i) {
            c[8 * b + i] = q[i] & 15;
            c[8 * b + 4 + i] = q[i] >> 4;
          }
        }
      } else if (bits == 6) {  // blocks of 16: two 4-bit steps, then 2-bit fields f: 16b + 4f + q
        for (int64_t b = 0; b < k / 16; ++b) {
          const uint8_t* blk = w + b * P * 12;
          for (int64_t h = 0; h < 2; ++h) {
            const uint8_t* q = blk + h * P * 4 + lane;
            for (int64_t i = 0; i < 4; ++i) {
              c[16 * b + 8 * h + i] = q[i] & 15;
              c[16 * b + 8 * h + 4 + i] = q[i] >> 4;
            }
          }
          const uint8_t* q = blk + 2 * P * 4 + lane;
          for (int64_t f = 0; f < 4; ++f)
            for (int64_t i = 0; i < 4; ++i) c[16 * b + 4 * f + i] |= ((q[i] >> (2 * f)) & 3) << 4;
        }
      } else {  // steps of 4 inputs, one byte each
        for (int64_t b = 0; b < k / 4; ++b) std::memcpy(c + 4 * b, w + b * P * 4 + lane, 4);
      }
      for (int64_t gi = 0; gi < G; ++gi) {
        const float s = group_value(scales, p, gi, j);
        so[t * G + gi] = s;
        mo[t * G + gi] = sym ? -static_cast<float>(off) * s : group_value(colsum, p, gi, j);
      }
    }
  });
  return {codes, sc, mn};
}

}  // namespace
}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("group_rows(Tensor ids, Tensor data, int kind, int n, int k, Tensor scales, Tensor colsum) "
        "-> (Tensor, Tensor, Tensor)",
        &tpserve::group_rows);
}
