// Prompt attention on blocks of key pairs (prompt_bf16.cpp: the AMX tile unit, or AVX512-BF16 dot
// products): the prompt path's work item for bf16 queries and a bf16 cache.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention.h"

namespace tpserve {

// Whether prompt_item_bf16 runs a head size here on the tiles: a multiple of 32 up to 256, and the
// tile unit granted (amx.h).
bool prompt_amx_runs(int64_t head_dim);

// Whether it runs a head size here at all (on the tiles or by dot products): a multiple of 32 up
// to 256, and a build with AVX512-BF16.
bool prompt_pairs_runs(int64_t head_dim);

// Query rows per work item on key pairs: ~256 query vectors (rows x the group's heads), 32 to 128
// rows, so that each block of keys and values, read and rearranged once per item, serves 16 tiles.
inline int64_t prompt_pairs_rows(int64_t group) {
  return std::clamp<int64_t>(256 / std::max<int64_t>(group, 1), kPromptRows, 4 * kPromptRows);
}

// The keys and values of one KV head, read from a paged cache [num_blocks, block_size, Hkv, D].
struct PagedKv {
  const at::BFloat16* k;
  const at::BFloat16* v;
  const int32_t* table;  // the sequence's block-table row
  int64_t block_size, num_kv_heads;
};

// Item w's query rows (every query head of KV head w.kv_head) against their visible keys, as
// cpu_ops.cpp's prompt_item computes them, into out [T, Hq, D], on the tiles (tiles: where
// prompt_amx_runs) or by dot products (where prompt_pairs_runs). q_begin: the sequence's first row
// in q and out; offset: the absolute position of its first row.
void prompt_item_bf16(const PromptItem& w, const at::BFloat16* q, int64_t q_s0, int64_t q_s1,
                      at::BFloat16* out, const PagedKv& kv, int64_t group, int64_t head_dim,
                      int64_t q_begin, int64_t offset, float scale, std::vector<float>& scratch,
                      const AttnOpts& o, bool tiles);

}  // namespace tpserve
