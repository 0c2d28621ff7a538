// A stack of Llama decoder layers on the CPU in one call (built and called by cpu_layer.py).
//
// Each layer is the sequence the model's Python runs (model/llama.py): add + RMSNorm, the qkv
// panel GEMM, rotary + KV write, paged attention, o_proj, add + RMSNorm, gate_up, silu-and-mul,
// down. This file does no arithmetic of its own beyond the hidden-state capture's add: it calls
// the kernels of cpu_gemm.cpp, cpu_fused.cpp and cpu_attention.cpp through function pointers
// taken from their loaded libraries, with the pointers, strides and thread counts the per-op
// path passes them. The same machine code on the same inputs in the same order: the stack's
// outputs are the per-op path's bit for bit. What goes away is the Python between the calls
// (~150 ctypes / torch calls a decode step, each a few microseconds of dispatch).
#include <cstdint>
#include <cstring>

#include "cpu_attention_args.h"

extern "C" {
// cpu_gemm.cpp: specserve_cpu_gemm (fp32 panels), specserve_cpu_gemm_bf16 (bf16 panels);
// cpu_qgemm.cpp: specserve_cpu_qgemm (integer blocks)
typedef int (*GemmFn)(const float* x, int64_t ldx, const void* panels, const float* bias,
                      float* y, int64_t ldy, int M, int N, int K, int threads);
// cpu_fused.cpp: specserve_add_rms_norm, specserve_silu_and_mul, specserve_rope_write_kv
typedef void (*AddNormFn)(const float* x, int64_t ldx, const float* res, int64_t ldr,
                          const float* w, float* out, float* new_res, int T, int N, float eps,
                          int threads);
typedef void (*SiluMulFn)(const float* gu, int64_t ld, float* out, int T, int I, int threads);
typedef int (*RopeKvFn)(float* qkv, int64_t ld, int NQ, int NKV, int D, const float* cos_sin,
                        int64_t cs_ld, int64_t cs_part, void* k_cache, void* v_cache,
                        int kv_bf16, const int64_t* slots, int T, int threads);
// cpu_attention.cpp: specserve_cpu_attention
typedef int (*AttentionFn)(const SpecserveAttentionArgs* a, int kv_dtype);
}

namespace {

// One decoder layer's weights and caches (cpu_layer.py's _Layer mirrors it).
struct Layer {
    const float* input_norm;  // [hidden]
    const float* post_norm;   // [hidden]
    const void* qkv;          // panels of [(H + 2 Hkv) D, hidden]
    const float* qkv_bias;    // [(H + 2 Hkv) D] or null
    const void* o;            // panels of [hidden, H D]
    const void* gate_up;      // panels of [2 I, hidden]
    const void* down;         // panels of [hidden, I]
    void* k_cache;            // [blocks, block_size, Hkv, D], fp32 or bf16
    void* v_cache;
    float input_eps;
    float post_eps;
    int32_t window;           // sliding window, 0 = none
    int32_t kinds;            // bits 2i..2i+1: linear i's (qkv, o, gate_up, down) weights,
                              // 0 fp32 panels, 1 bf16 panels, 2 integer blocks
};

// The whole call (cpu_layer.py's _Stack mirrors it).
struct Stack {
    GemmFn gemm;
    GemmFn gemm_bf16;
    GemmFn gemm_q;            // null where cpu_qgemm is not loaded (no layer has kind 2)
    AddNormFn add_rms_norm;
    SiluMulFn silu_and_mul;
    RopeKvFn rope_write_kv;
    AttentionFn attention;
    const Layer* layers;
    int32_t num_layers;
    int32_t rows;             // T
    int32_t hidden;
    int32_t heads;
    int32_t kv_heads;
    int32_t head_dim;
    int32_t intermediate;     // I
    int32_t kv_dtype;         // 0 fp32, 1 bf16
    int32_t threads;
    int32_t pad;
    const float* cos_sin;     // [T, 2, 1, D]
    int64_t cs_ld;
    int64_t cs_part;
    const int64_t* slots;     // [T], negative = padding row
    float* const* captures;   // [num_layers] or null: where layer l's input stream goes
    int64_t capture_ld;       // ([T, hidden] row stride capture_ld; null entry: no capture)
    SpecserveAttentionArgs attention_args;  // q, k, v, out, window filled per layer
    const float* x;           // [T, hidden] the embeddings (read only)
    // scratch, each contiguous
    float* out_x;             // [T, hidden] the last layer's MLP output (returned)
    float* out_res;           // [T, hidden] the residual stream before it (returned)
    float* normed;            // [T, hidden]
    float* qkv_out;           // [T, (H + 2 Hkv) D]
    float* attn_out;          // [T, H D]
    float* o_out;             // [T, hidden]
    float* gate_up_out;       // [T, 2 I]
    float* act;               // [T, I]
};

// The stream entering a layer, as AuxCapture.record writes it: x + residual (x at layer 0).
void capture(float* dst, int64_t ld, const float* x, const float* res, int T, int N) {
    for (int t = 0; t < T; ++t) {
        float* d = dst + t * ld;
        const float* xr = x + static_cast<int64_t>(t) * N;
        if (!res) {
            std::memcpy(d, xr, N * sizeof(float));
            continue;
        }
        const float* rr = res + static_cast<int64_t>(t) * N;
        for (int i = 0; i < N; ++i) d[i] = xr[i] + rr[i];
    }
}

}  // namespace

extern "C" {

int specserve_cpu_layer_version() { return 3; }
int64_t specserve_cpu_layer_sizeof_stack() { return sizeof(Stack); }
int64_t specserve_cpu_layer_sizeof_layer() { return sizeof(Layer); }

// Runs s->num_layers layers over s->rows rows. On return out_x and out_res hold what the
// per-op path's last layer returns (MLP output, residual stream). 0, or the rotary's error.
int specserve_cpu_layer_stack(const Stack* s) {
    const int T = s->rows, N = s->hidden, th = s->threads;
    const int H = s->heads, HKV = s->kv_heads, D = s->head_dim, I = s->intermediate;
    const int NQKV = (H + 2 * HKV) * D;
    SpecserveAttentionArgs a = s->attention_args;
    a.q = s->qkv_out;  // q heads: the first H of each row, rotated in place
    a.q_row_stride = NQKV;
    a.q_head_stride = D;
    a.num_rows = T;
    a.out = s->attn_out;
    const float* x = s->x;
    const float* res = nullptr;  // layer 0 has no residual yet
    for (int l = 0; l < s->num_layers; ++l) {
        const Layer& L = s->layers[l];
        // linear i's GEMM: its weights' kind picks the entry point, as PackedLinear does
        auto gemm = [&](int i) {
            const int kind = (L.kinds >> (2 * i)) & 3;
            return kind == 2 ? s->gemm_q : kind == 1 ? s->gemm_bf16 : s->gemm;
        };
        if (s->captures && s->captures[l]) capture(s->captures[l], s->capture_ld, x, res, T, N);
        // new residual = x + res (at layer 0: x itself, out_res untouched), normed = norm(it)
        s->add_rms_norm(x, N, res, N, L.input_norm, s->normed, s->out_res, T, N, L.input_eps,
                        th);
        res = res ? s->out_res : x;
        gemm(0)(s->normed, N, L.qkv, L.qkv_bias, s->qkv_out, NQKV, T, NQKV, N, th);
        const int rc = s->rope_write_kv(s->qkv_out, NQKV, H, HKV, D, s->cos_sin, s->cs_ld,
                                        s->cs_part, L.k_cache, L.v_cache, s->kv_dtype,
                                        s->slots, T, th);
        if (rc != 0) return rc;
        a.k = L.k_cache;
        a.v = L.v_cache;
        a.window = L.window;
        if (s->attention(&a, s->kv_dtype) != 0) return -2;
        gemm(1)(s->attn_out, H * D, L.o, nullptr, s->o_out, N, T, N, H * D, th);
        // residual += attention output (in place from layer 0's second norm on)
        s->add_rms_norm(s->o_out, N, res, N, L.post_norm, s->normed, s->out_res, T, N,
                        L.post_eps, th);
        res = s->out_res;
        gemm(2)(s->normed, N, L.gate_up, nullptr, s->gate_up_out, 2 * I, T, 2 * I, N, th);
        s->silu_and_mul(s->gate_up_out, 2 * I, s->act, T, I, th);
        gemm(3)(s->act, I, L.down, nullptr, s->out_x, N, T, N, I, th);
        x = s->out_x;
    }
    return 0;
}

}  // extern "C"
