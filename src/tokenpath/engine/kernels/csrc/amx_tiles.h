// The AMX tile configuration both tile kernels load (amx_bf16.cpp's GEMM, attn_amx.cpp's prompt
// attention): palette 1, every tile 16 rows x 64 bytes unless a kernel narrows its rows. Only the
// AVX-512 object's AMX files include it.
#pragma once
#include <cstdint>

namespace tp::amx {

struct TileConfig {  // palette 1: 8 tiles of up to 16 rows x 64 bytes
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

}  // namespace tp::amx
