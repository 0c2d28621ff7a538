// The decoder layer's elementwise ops on the CPU, one call each (built and called by
// cpu_fused.py): residual add + RMSNorm, rotary over q and k + the KV cache write, silu-and-mul.
//
// In torch each of them is 4-8 ops of ~1-3 us host time apiece, which at batch-1 decode of a
// small model is a tenth of the step. Built with -ffp-contract=off: the rotary keeps torch's
// roundings (x*cos, rotated*sin, their sum) bit for bit; the norm's sum of squares and the
// silu's exponential differ from torch in the last bits only.
//
// Rows are independent: a row's result never depends on the rows beside it. Work is split over
// threads by rows only when there are enough of them to pay for waking the pool.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace {

constexpr int kParallelRows = 32;  // below this a call stays on the calling thread
constexpr int kMaxHeadDim = 512;

// fp32 -> bf16 bits as torch rounds (c10::BFloat16: nearest even, NaN -> 0x7FC0)
inline uint16_t to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if (std::isnan(f)) return 0x7FC0;
    return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// n values of src into the cache at dst: fp32 as is, or rounded to bf16
inline void store(void* dst, int64_t at, const float* src, int n, bool bf16) {
    if (!bf16) {
        std::memcpy(static_cast<float*>(dst) + at, src, n * sizeof(float));
        return;
    }
    uint16_t* out = static_cast<uint16_t*>(dst) + at;
    for (int i = 0; i < n; ++i) out[i] = to_bf16(src[i]);
}

}  // namespace

extern "C" {

int specserve_cpu_fused_version() { return 3; }

// new_res = x + res (res may be null: new_res is not written), out = rms_norm(new_res) * w.
// x [T, N] row stride ldx, res [T, N] row stride ldr, out and new_res [T, N] contiguous.
void specserve_add_rms_norm(const float* x, int64_t ldx, const float* res, int64_t ldr,
                            const float* w, float* out, float* new_res, int T, int N, float eps,
                            int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= kParallelRows && threads > 1)
    for (int t = 0; t < T; ++t) {
        const float* xr = x + t * ldx;
        const float* s = xr;
        if (res) {
            const float* rr = res + t * ldr;
            float* nr = new_res + static_cast<int64_t>(t) * N;
#pragma omp simd
            for (int i = 0; i < N; ++i) nr[i] = xr[i] + rr[i];
            s = nr;
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int i = 0; i < N; ++i) sq += s[i] * s[i];
        const float r = 1.0f / std::sqrt(sq / static_cast<float>(N) + eps);
        float* o = out + static_cast<int64_t>(t) * N;
#pragma omp simd
        for (int i = 0; i < N; ++i) o[i] = (s[i] * r) * w[i];
    }
}

// out [T, I] = silu(gu[:, :I]) * gu[:, I:], gu row stride ld, out contiguous.
void specserve_silu_and_mul(const float* gu, int64_t ld, float* out, int T, int I, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= kParallelRows && threads > 1)
    for (int t = 0; t < T; ++t) {
        const float* g = gu + t * ld;  // gate, then up at g + I
        float* o = out + static_cast<int64_t>(t) * I;
#pragma omp simd
        for (int i = 0; i < I; ++i) {
            // e^-|g| <= 1 never overflows: silu(g) = g / (1 + e^-g) on either side of zero
            const float gi = g[i];
            const float e = exp_nonpos(-std::fabs(gi));
            const float num = gi >= 0.0f ? gi : gi * e;
            o[i] = num / (1.0f + e) * g[I + i];
        }
    }
}

// Neox rotary over the NQ + NKV first heads of each row of qkv [T, NQ + 2 NKV, D] (row stride
// ld, heads contiguous): q heads rotated in place, k heads rotated into k_cache[slot], v heads
// copied into v_cache[slot] (caches [slots, NKV, D], fp32, or bf16 when kv_bf16: rounded as
// torch's .to(bfloat16)); slot < 0 (padding) writes nothing.
// cos_sin [T, 2, D] (row stride cs_ld, sin part at + cs_part) holds cos and the signed sin:
// rotated = x * cos + roll(x, D / 2) * sin, as ops/fused.py's apply_rope.
int specserve_rope_write_kv(float* qkv, int64_t ld, int NQ, int NKV, int D, const float* cos_sin,
                            int64_t cs_ld, int64_t cs_part, void* k_cache, void* v_cache,
                            int kv_bf16, const int64_t* slots, int T, int threads) {
    if (D > kMaxHeadDim || D % 2) return -1;
    const int half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= kParallelRows && threads > 1)
    for (int t = 0; t < T; ++t) {
        float* row = qkv + t * ld;
        const float* c = cos_sin + t * cs_ld;
        const float* s = c + cs_part;
        const int64_t slot = slots[t];
        for (int h = 0; h < NQ + NKV; ++h) {
            float* x = row + static_cast<int64_t>(h) * D;
            if (h >= NQ && slot < 0) continue;
            float rot[kMaxHeadDim];
#pragma omp simd
            for (int i = 0; i < half; ++i) rot[i] = x[i] * c[i] + x[i + half] * s[i];
#pragma omp simd
            for (int i = half; i < D; ++i) rot[i] = x[i] * c[i] + x[i - half] * s[i];
            if (h < NQ)
                std::memcpy(x, rot, D * sizeof(float));  // q: in place
            else
                store(k_cache, (slot * NKV + (h - NQ)) * D, rot, D, kv_bf16);
        }
        if (slot >= 0)
            store(v_cache, slot * NKV * D, row + static_cast<int64_t>(NQ + NKV) * D, NKV * D,
                  kv_bf16);
    }
    return 0;
}

// out[t] = torch.argmax(x[t]): the first index of the row's maximum; a row holding NaN gives its
// first NaN. x [T, V] row stride ld.
void specserve_argmax_rows(const float* x, int64_t ld, int T, int V, int64_t* out, int threads) {
    constexpr int L = 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= 4 && threads > 1)
    for (int t = 0; t < T; ++t) {
        const float* r = x + t * ld;
        // per lane: its largest value and where it first occurs (strict >: earlier wins ties)
        float best[L];
        int32_t at[L];
        int32_t nan = 0;
        for (int l = 0; l < L; ++l) best[l] = -INFINITY, at[l] = 0;
        const int body = V / L * L;
        for (int i = 0; i < body; i += L) {
#pragma omp simd reduction(| : nan)
            for (int l = 0; l < L; ++l) {
                const float v = r[i + l];
                const bool more = v > best[l];
                best[l] = more ? v : best[l];
                at[l] = more ? i + l : at[l];
                nan |= v != v;
            }
        }
        float mx = -INFINITY;
        int64_t idx = 0;
        for (int l = 0; l < L; ++l)
            if (best[l] > mx || (best[l] == mx && at[l] < idx)) mx = best[l], idx = at[l];
        for (int i = body; i < V; ++i) {
            nan |= r[i] != r[i];
            if (r[i] > mx) mx = r[i], idx = i;
        }
        if (nan) {
            for (int i = 0; i < V; ++i)
                if (r[i] != r[i]) {
                    idx = i;
                    break;
                }
        }
        out[t] = idx;
    }
}

}  // extern "C"
