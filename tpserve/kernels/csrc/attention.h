// What the paged attention kernels share (cpu_ops.cpp and prompt_bf16.cpp): a layer's attention
// options and the prompt path's work item.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tpserve {

// A layer's attention options (tpserve/kernels/attention_options.py), as transformers defines them:
// a query at position p sees keys p - window + 1 .. p (window 0: every earlier key); each query
// head h's softmax has one more logit sinks[h] with no value (null: none); scaled scores become
// softcap * tanh(score / softcap) (0: none). Keys outside a window are never read: the key loops
// start at first_key, so a window's cost follows the window, not the context, and blocks that left
// every query's window are not touched (a cache may have freed them).
struct AttnOpts {
  int64_t window = 0;
  const float* sinks = nullptr;
  float softcap = 0.f;
  int64_t first_key(int64_t qpos) const {
    return window > 0 ? std::max<int64_t>(0, qpos - window + 1) : 0;
  }
  // The running maximum and sum a query head's softmax starts from: its sink's logit, e^0.
  float start_max(int64_t head) const {
    return sinks ? sinks[head] : -std::numeric_limits<float>::infinity();
  }
  float start_sum() const { return sinks ? 1.f : 0.f; }
  void cap(float* s, int64_t n) const {
    if (softcap > 0.f) {
      const float inv = 1.f / softcap;
      for (int64_t j = 0; j < n; ++j) s[j] = softcap * std::tanh(s[j] * inv);
    }
  }
};

// Prompt rows per work item of the vector prompt path.
constexpr int64_t kPromptRows = 32;

// One work item of the prompt path: query rows of one sequence (kPromptRows on the vector path,
// prompt_pairs_rows on key pairs), every query head of one KV head.
struct PromptItem {
  int32_t seq, row_begin, row_end, kv_head;
  int64_t cost;  // scores computed: rows x keys up to the item's last row
};

}  // namespace tpserve
