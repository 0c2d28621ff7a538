// The argument block of the CPU paged attention kernel (cpu_attention.cpp), shared with the fused
// decoder stack (cpu_layer.cpp), which fills one per layer and calls the kernel through a
// function pointer. cpu_attention.py mirrors it as a ctypes Structure (same order, same widths).
#pragma once

#include <cstdint>

struct SpecserveAttentionArgs {
    const float* q;          // [T, H, D], last dim contiguous
    int64_t q_row_stride;    // elements
    int64_t q_head_stride;
    const void* k;           // [num_blocks, block_size, Hkv, D] contiguous, fp32 or bf16
    const void* v;
    const int32_t* block_tables;  // [B, bt_stride]
    int64_t bt_stride;
    const int32_t* q_lens;   // [B]
    const int32_t* ctx_lens; // [B]
    const int32_t* starts;   // [B] first row of each request
    int32_t num_reqs;
    int32_t num_rows;        // T: rows past the last request's are padding (zeros)
    int32_t heads;
    int32_t kv_heads;
    int32_t head_dim;
    int32_t block_size;
    int32_t window;          // 0 = none; else row at p sees keys (p - window, p]
    int32_t num_threads;
    float scale;
    float* out;              // [T, H, D] contiguous
};
