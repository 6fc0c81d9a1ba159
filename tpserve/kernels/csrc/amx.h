// The AMX tile unit, shared by the kernels that use it (linear_ops.cpp's matmuls, prompt_bf16.cpp's
// prompt attention): whether this build has it, the tile configuration, and the kernel's grant of
// the tile state.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define TPSERVE_AMX 1
#include <immintrin.h>
#else
#define TPSERVE_AMX 0
#endif

namespace tpserve {

// Whether the tiles may run here: built with AMX, the kernel granted the tile state (arch_prctl,
// asked once per process) and TPSERVE_AMX is not 0. Always false in a build without AMX.
bool amx_granted();

#if TPSERVE_AMX
// The layout _tile_loadconfig reads (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of the whole configuration. GCC's _tile_loadconfig tells the compiler that it reads
// only the first 8 bytes of its argument, so the stores of the rows and widths may be dropped as
// dead (they were, once amx_configure grew a branch: the tiles were left unconfigured). Here the
// asm operand is the whole struct.
inline void load_tile_config(const TileConfig& c) { asm volatile("ldtilecfg %0" : : "m"(c)); }
#endif

}  // namespace tpserve
