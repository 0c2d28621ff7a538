// Paged attention on the CPU, reading the KV cache in place (built and called by cpu_attention.py).
//
// Plain C ABI (no torch headers): it compiles in about a second with any g++/clang++ and loads
// with ctypes; `-fopenmp` links libgomp.so.1, which resolves to the copy torch already loaded,
// so the kernel shares torch's OpenMP thread pool instead of starting a second one.
//
// Work item = (request, chunk of up to kRowsPerItem of its rows, KV head). An item walks the
// request's blocks once; every query vector of the item (rows x the G query heads of the KV
// head) reads each K/V block while it is in L1, with an online softmax (running max m, sum l,
// accumulator acc) so no score matrix is ever materialised.
//
// Two implementations of an item: run_item_fast (AVX-512 intrinsics; block_size 16, head_dim 64
// or 128: the engine's shapes) and run_item (portable C++ the compiler vectorises; any shape,
// and the only one under -DSPECSERVE_PORTABLE or without AVX-512F).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "cpu_math.h"

// The decode / short-verify path below is AVX-512 intrinsics; -DSPECSERVE_PORTABLE (or a CPU
// without AVX-512F) leaves only the portable path, which the tests build and check too.
#if defined(__AVX512F__) && !defined(SPECSERVE_PORTABLE)
#include <immintrin.h>
#define SPECSERVE_AVX512 1
#endif

namespace {

constexpr int kRowsPerItem = 16;

struct Args {
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

struct Scratch {
    std::vector<float> q, acc, m, l, scores, kf, vf;
};

inline void to_f32(const float* src, float* dst, int d) { std::memcpy(dst, src, d * sizeof(float)); }

inline void to_f32(const uint16_t* src, float* dst, int d) {
#pragma omp simd
    for (int i = 0; i < d; ++i) {
        const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        dst[i] = f;
    }
}

inline float load_f32(float x) { return x; }
inline float load_f32(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Query vectors at or above this count score a block against a transposed copy of its keys
// (K^T [D][BS]: one FMA per d gives BS scores, no horizontal sums), which costs one transpose
// per block; fewer vectors (decode: G of them) take one dot product per key instead.
constexpr int kTransposeMin = 6;

// DT / BST: head_dim / block_size fixed at compile time for the common shapes (full unrolling,
// the accumulator stays in registers); 0 = read from Args.
template <typename KV, int DT, int BST>
void run_item(const Args& a, int req, int row0, int row1, int kvh, Scratch& s) {
    const int d = DT ? DT : a.head_dim, bs = BST ? BST : a.block_size;
    const int g_per = a.heads / a.kv_heads;
    const int nrows = row1 - row0, nq = nrows * g_per;
    const int ql = a.q_lens[req], cl = a.ctx_lens[req], start = a.starts[req];
    const int first_pos = cl - ql + row0;  // KV position of the item's first row
    const int64_t tok_stride = static_cast<int64_t>(a.kv_heads) * d;
    const int64_t blk_stride = tok_stride * bs;
    const bool transpose = nq >= kTransposeMin;

    s.q.resize(static_cast<size_t>(nq) * d);
    s.acc.assign(static_cast<size_t>(nq) * d, 0.0f);
    s.m.assign(nq, -FLT_MAX);
    s.l.assign(nq, 0.0f);
    s.scores.resize(static_cast<size_t>(nq) * bs);
    s.kf.resize(static_cast<size_t>(bs) * d);
    s.vf.resize(static_cast<size_t>(bs) * d);
    for (int r = 0; r < nrows; ++r) {
        for (int g = 0; g < g_per; ++g) {
            const float* src = a.q + (start + row0 + r) * a.q_row_stride +
                               (kvh * g_per + g) * a.q_head_stride;
            float* dst = s.q.data() + static_cast<size_t>(r * g_per + g) * d;
            for (int i = 0; i < d; ++i) dst[i] = src[i] * a.scale;
        }
    }

    const int klo = a.window ? std::max(0, first_pos - a.window + 1) : 0;
    const int khi = first_pos + nrows;  // exclusive: the last row sees itself
    const int32_t* table = a.block_tables + req * a.bt_stride;
    const KV* kbase = static_cast<const KV*>(a.k) + kvh * d;
    const KV* vbase = static_cast<const KV*>(a.v) + kvh * d;
    float* kt = s.kf.data();  // transposed path: K^T [d][bs]
    for (int b0 = klo / bs * bs; b0 < khi; b0 += bs) {
        const int64_t blk = table[b0 / bs];
        const int t_lo = std::max(klo, b0), t_hi = std::min(khi, b0 + bs);
        const KV* kb = kbase + blk * blk_stride;
        const KV* vb = vbase + blk * blk_stride;
        // V rows of this block as fp32, row t at vr + (t - b0) * vstride
        const float* vr;
        int64_t vstride;
        if constexpr (sizeof(KV) == sizeof(float)) {
            vr = reinterpret_cast<const float*>(vb);
            vstride = tok_stride;
        } else {
            for (int t = t_lo; t < t_hi; ++t)
                to_f32(vb + (t - b0) * tok_stride, s.vf.data() + static_cast<size_t>(t - b0) * d, d);
            vr = s.vf.data();
            vstride = d;
        }
        const float* kr = nullptr;  // direct path: K rows as fp32, stride kstride
        int64_t kstride = d;
        if (transpose) {
            // keys outside [t_lo, t_hi) may be unwritten memory (NaN): zeros in their place
            if (t_lo > b0 || t_hi < b0 + bs) std::fill(kt, kt + static_cast<size_t>(bs) * d, 0.0f);
            for (int t = t_lo; t < t_hi; ++t) {
                const KV* row = kb + (t - b0) * tok_stride;
                for (int i = 0; i < d; ++i) kt[i * bs + (t - b0)] = load_f32(row[i]);
            }
        } else if constexpr (sizeof(KV) == sizeof(float)) {
            kr = reinterpret_cast<const float*>(kb);
            kstride = tok_stride;
        } else {
            for (int t = t_lo; t < t_hi; ++t)
                to_f32(kb + (t - b0) * tok_stride, s.kf.data() + static_cast<size_t>(t - b0) * d, d);
            kr = s.kf.data();
        }
        // scores of every query vector against the block's keys: sc[n * bs + (t - b0)]
        float* sc = s.scores.data();
        if (transpose) {
            // four vectors at a time: four independent FMA chains sharing each K^T row load
            int n = 0;
            for (; n + 4 <= nq; n += 4) {
                float acc4[4][BST ? BST : 16];
                if (BST) {
                    for (int j = 0; j < 4; ++j)
                        for (int t = 0; t < bs; ++t) acc4[j][t] = 0.0f;
                    const float* q0 = s.q.data() + static_cast<size_t>(n) * d;
                    for (int i = 0; i < d; ++i) {
                        const float* col = kt + i * bs;
                        for (int j = 0; j < 4; ++j) {
                            const float qi = q0[j * d + i];
#pragma omp simd
                            for (int t = 0; t < bs; ++t) acc4[j][t] += qi * col[t];
                        }
                    }
                    for (int j = 0; j < 4; ++j)
                        std::memcpy(sc + static_cast<size_t>(n + j) * bs, acc4[j], bs * sizeof(float));
                } else {
                    break;
                }
            }
            for (; n < nq; ++n) {
                float* out = sc + static_cast<size_t>(n) * bs;
                const float* qv = s.q.data() + static_cast<size_t>(n) * d;
                for (int t = 0; t < bs; ++t) out[t] = 0.0f;
                for (int i = 0; i < d; ++i) {
                    const float qi = qv[i];
                    const float* col = kt + i * bs;
#pragma omp simd
                    for (int t = 0; t < bs; ++t) out[t] += qi * col[t];
                }
            }
        } else {
            for (int t = t_lo; t < t_hi; ++t) {
                const float* kv = kr + (t - b0) * kstride;
                for (int n = 0; n < nq; ++n) {
                    const float* qv = s.q.data() + static_cast<size_t>(n) * d;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int i = 0; i < d; ++i) dot += qv[i] * kv[i];
                    sc[static_cast<size_t>(n) * bs + (t - b0)] = dot;
                }
            }
        }
        for (int r = 0; r < nrows; ++r) {
            const int p = first_pos + r;
            const int rlo = a.window ? std::max(0, p - a.window + 1) : 0;
            const int lo = std::max(t_lo, rlo), hi = std::min(t_hi, p + 1);
            if (lo >= hi) continue;
            const int cnt = hi - lo;
            for (int g = 0; g < g_per; ++g) {
                const int n = r * g_per + g;
                float* w = sc + static_cast<size_t>(n) * bs + (lo - b0);  // [cnt]
                float mx = s.m[n];
#pragma omp simd reduction(max : mx)
                for (int t = 0; t < cnt; ++t) mx = std::max(mx, w[t]);
                const float corr = exp_nonpos(s.m[n] - mx);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < cnt; ++t) {
                    w[t] = exp_nonpos(w[t] - mx);
                    sum += w[t];
                }
                s.l[n] = s.l[n] * corr + sum;
                s.m[n] = mx;
                float* acc_mem = s.acc.data() + static_cast<size_t>(n) * d;
                float acc[DT ? DT : 1];  // registers when d is known
                float* ac = DT ? acc : acc_mem;
#pragma omp simd
                for (int i = 0; i < d; ++i) ac[i] = acc_mem[i] * corr;
                for (int t = 0; t < cnt; ++t) {
                    const float wt = w[t];
                    const float* vv = vr + (lo + t - b0) * vstride;
#pragma omp simd
                    for (int i = 0; i < d; ++i) ac[i] += wt * vv[i];
                }
                if (DT) std::memcpy(acc_mem, ac, d * sizeof(float));
            }
        }
    }
    for (int r = 0; r < nrows; ++r) {
        for (int g = 0; g < g_per; ++g) {
            const int n = r * g_per + g;
            const float inv = 1.0f / s.l[n];  // l > 0: every row sees at least itself
            const float* acc = s.acc.data() + static_cast<size_t>(n) * d;
            float* dst = a.out + (static_cast<int64_t>(start + row0 + r) * a.heads +
                                  kvh * g_per + g) * d;
            for (int i = 0; i < d; ++i) dst[i] = acc[i] * inv;
        }
    }
}

#ifdef SPECSERVE_AVX512
// Every query vector scores the block's 16 keys as 16 lane-wise partial dot products, and one
// transpose-and-add tree turns those 16 vectors into one vector of 16 scores (15 adds, 30
// shuffles) instead of 16 horizontal sums. A block's softmax is then a few vector ops, and V is
// read once per 4 query vectors. Measured against run_item (64 requests x ~200 keys, SmolLM2
// shapes, fp32 KV): 2x at 1 row a request (decode), 2x at 4 and 8, 1.9x at 16 (prefill chunks).

// exp_nonpos on 16 lanes: the same reduction and polynomial, 2^n by vscalefps.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16 -> fp32: the 16 bits become the high half
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane 4k+e of the result = the sum of v[4e+k]'s lanes (callers put key 4k+e in slot 4e+k).
// Each add only combines partials of one input, so a NaN key stays in its own lane.
inline __m512 sum16(__m512* v) {
    __m512 w[8], x[4], y[2];
    for (int j = 0; j < 8; ++j)  // 256-bit halves: [v2j (8 partials) | v2j+1]
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; ++j)  // 128-bit lane k: 4 partials of v[4j+k]
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; ++j)  // lane k: 2 partials of v[8j+k], 2 of v[8j+4+k]
        y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// acc[j] = acc[j] * corr[j] + sum_t p[j][t] V[t] for NQ vectors over keys [lo, hi) of a block.
template <typename KV, int DT, int NQ>
inline void pv_block(float* acc, const float* p, const float* corr, const KV* vb,
                     int64_t tok_stride, int lo, int hi) {
    constexpr int C = DT / 16;
    __m512 ac[NQ][C];
    for (int j = 0; j < NQ; ++j) {
        const __m512 cj = _mm512_set1_ps(corr[j]);
        for (int c = 0; c < C; ++c)
            ac[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * DT + c * 16), cj);
    }
    for (int t = lo; t < hi; ++t) {
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = load16(vb + t * tok_stride + c * 16);
        for (int j = 0; j < NQ; ++j) {
            const __m512 w = _mm512_set1_ps(p[j * 16 + t]);
            for (int c = 0; c < C; ++c) ac[j][c] = _mm512_fmadd_ps(w, v[c], ac[j][c]);
        }
    }
    for (int j = 0; j < NQ; ++j)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * DT + c * 16, ac[j][c]);
}

// Start loading one key's K and V rows of a later block into L1.
template <typename KV, int DT>
inline void prefetch_row(const KV* k, const KV* v) {
    for (int off = 0; off < DT * static_cast<int>(sizeof(KV)); off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k) + off, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v) + off, _MM_HINT_T0);
    }
}

// run_item for block_size 16 and head_dim DT.
template <typename KV, int DT>
void run_item_fast(const Args& a, int req, int row0, int row1, int kvh, Scratch& s) {
    constexpr int BS = 16, C = DT / 16, QG = C <= 4 ? 4 : 2;  // QG: vectors per V pass
    const int g_per = a.heads / a.kv_heads;
    const int nrows = row1 - row0, nq = nrows * g_per;
    const int ql = a.q_lens[req], cl = a.ctx_lens[req], start = a.starts[req];
    const int first_pos = cl - ql + row0;
    const int64_t tok_stride = static_cast<int64_t>(a.kv_heads) * DT, blk_stride = tok_stride * BS;
    s.q.resize(static_cast<size_t>(nq) * DT);
    s.acc.assign(static_cast<size_t>(nq) * DT, 0.0f);
    s.m.assign(nq, -FLT_MAX);
    s.l.assign(nq, 0.0f);
    s.scores.resize(static_cast<size_t>(nq) * (BS + 1));
    float* prob = s.scores.data();  // [nq][16] this block's softmax numerators
    float* corr = prob + nq * BS;   // [nq] rescale of the accumulators for this block
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int n = 0; n < nq; ++n) {
        const float* src = a.q + (start + row0 + n / g_per) * a.q_row_stride +
                           (kvh * g_per + n % g_per) * a.q_head_stride;
        for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(s.q.data() + n * DT + c * 16,
                             _mm512_mul_ps(_mm512_loadu_ps(src + c * 16), scale));
    }
    const int klo = a.window ? std::max(0, first_pos - a.window + 1) : 0;
    const int khi = first_pos + nrows;
    const int32_t* table = a.block_tables + req * a.bt_stride;
    const KV* kbase = static_cast<const KV*>(a.k) + kvh * DT;
    const KV* vbase = static_cast<const KV*>(a.v) + kvh * DT;
    for (int b0 = klo / BS * BS; b0 < khi; b0 += BS) {
        const int64_t blk = table[b0 / BS];
        const KV* kb = kbase + blk * blk_stride;
        const KV* vb = vbase + blk * blk_stride;
        // The next block lies anywhere (no hardware prefetcher guesses it): its rows are
        // prefetched one key at a time, spread over this block's scoring (1.5x at decode). A
        // burst of them at the block's start gained nothing (likely stalled on the miss buffers).
        const bool has_next = b0 + BS < khi;
        const int64_t nxt = has_next ? table[b0 / BS + 1] : blk;
        const KV* kn = kbase + nxt * blk_stride;
        const KV* vn = vbase + nxt * blk_stride;
        const int t_lo = std::max(klo, b0) - b0, t_hi = std::min(khi, b0 + BS) - b0;
        for (int n = 0; n < nq; ++n) {
            const int p = first_pos + n / g_per;
            const int lo = std::max(t_lo, (a.window ? p - a.window + 1 : 0) - b0);
            const int hi = std::min(t_hi, p + 1 - b0);
            float* pr = prob + n * BS;
            corr[n] = 1.0f;
            if (lo >= hi) {  // the row sees none of this block: its state stays
                _mm512_storeu_ps(pr, _mm512_setzero_ps());
                continue;
            }
            __m512 qr[C], part[16];
            for (int c = 0; c < C; ++c) qr[c] = _mm512_loadu_ps(s.q.data() + n * DT + c * 16);
            for (int slot = 0; slot < 16; ++slot) {
                if (has_next && n == 0)
                    prefetch_row<KV, DT>(kn + slot * tok_stride, vn + slot * tok_stride);
                const KV* kr = kb + ((slot & 3) * 4 + (slot >> 2)) * tok_stride;  // see sum16
                __m512 dot = _mm512_mul_ps(qr[0], load16(kr));
                for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qr[c], load16(kr + c * 16), dot);
                part[slot] = dot;
            }
            // keys outside [lo, hi) may be unwritten memory (NaN): masked out of the max and
            // the sum, and their V rows are not read
            const __mmask16 mask = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
            const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask, sum16(part));
            const float m = s.m[n], mx = std::max(m, _mm512_reduce_max_ps(sc));
            const __m512 e =
                _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
            corr[n] = exp_nonpos(m - mx);
            s.l[n] = s.l[n] * corr[n] + _mm512_reduce_add_ps(e);
            s.m[n] = mx;
            _mm512_storeu_ps(pr, e);
        }
        for (int n = 0; n < nq; n += QG) {
            float* an = s.acc.data() + static_cast<size_t>(n) * DT;
            const float *pn = prob + n * BS, *cn = corr + n;
            switch (std::min(QG, nq - n)) {
                case 4: pv_block<KV, DT, 4>(an, pn, cn, vb, tok_stride, t_lo, t_hi); break;
                case 3: pv_block<KV, DT, 3>(an, pn, cn, vb, tok_stride, t_lo, t_hi); break;
                case 2: pv_block<KV, DT, 2>(an, pn, cn, vb, tok_stride, t_lo, t_hi); break;
                default: pv_block<KV, DT, 1>(an, pn, cn, vb, tok_stride, t_lo, t_hi);
            }
        }
    }
    for (int n = 0; n < nq; ++n) {
        const __m512 inv = _mm512_set1_ps(1.0f / s.l[n]);  // l > 0: every row sees itself
        float* dst = a.out + (static_cast<int64_t>(start + row0 + n / g_per) * a.heads +
                              kvh * g_per + n % g_per) * DT;
        for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(dst + c * 16,
                             _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + n * DT + c * 16), inv));
    }
}
#endif

template <typename KV>
void run(const Args& a) {
    // chunks of rows, the costliest first so the dynamic schedule does not end on a big one
    struct Chunk {
        int req, row0, row1;
        int64_t cost;
    };
    std::vector<Chunk> chunks;
    int num_real = 0;
    for (int i = 0; i < a.num_reqs; ++i) {
        const int ql = a.q_lens[i], cl = a.ctx_lens[i];
        num_real = std::max(num_real, a.starts[i] + ql);
        for (int r0 = 0; r0 < ql; r0 += kRowsPerItem) {
            const int r1 = std::min(ql, r0 + kRowsPerItem);
            const int last = cl - ql + r1;  // keys seen by the chunk's last row
            const int span = a.window ? std::min(last, a.window + r1 - r0) : last;
            chunks.push_back({i, r0, r1, static_cast<int64_t>(r1 - r0) * span});
        }
    }
    std::stable_sort(chunks.begin(), chunks.end(),
                     [](const Chunk& x, const Chunk& y) { return x.cost > y.cost; });
    const int64_t row_elems = static_cast<int64_t>(a.heads) * a.head_dim;
    if (a.num_rows > num_real)
        std::memset(a.out + num_real * row_elems, 0,
                    (a.num_rows - num_real) * row_elems * sizeof(float));
    // Items of (chunk, all KV heads), whose blocks [16, Hkv, D] are contiguous, measured no
    // faster than (chunk, one KV head), which splits a long request over more threads.
    const int64_t items = static_cast<int64_t>(chunks.size()) * a.kv_heads;
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(a.num_threads, items)));
#ifdef SPECSERVE_AVX512
    const bool fast_shape = a.block_size == 16 && (a.head_dim == 64 || a.head_dim == 128);
#endif
#pragma omp parallel num_threads(threads)
    {
        Scratch s;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const Chunk& c = chunks[it / a.kv_heads];
            const int kvh = static_cast<int>(it % a.kv_heads);
#ifdef SPECSERVE_AVX512
            if (fast_shape) {
                if (a.head_dim == 64)
                    run_item_fast<KV, 64>(a, c.req, c.row0, c.row1, kvh, s);
                else
                    run_item_fast<KV, 128>(a, c.req, c.row0, c.row1, kvh, s);
                continue;
            }
#endif
            if (a.head_dim == 64 && a.block_size == 16)
                run_item<KV, 64, 16>(a, c.req, c.row0, c.row1, kvh, s);
            else if (a.head_dim == 128 && a.block_size == 16)
                run_item<KV, 128, 16>(a, c.req, c.row0, c.row1, kvh, s);
            else
                run_item<KV, 0, 0>(a, c.req, c.row0, c.row1, kvh, s);
        }
    }
}

}  // namespace

extern "C" {

// Version of this ABI: bumped whenever Args or the semantics change.
int specserve_cpu_attention_version() { return 1; }

// kv_dtype: 0 = float32, 1 = bfloat16. Returns 0, or -1 for an unsupported dtype.
int specserve_cpu_attention(const Args* a, int kv_dtype) {
    if (kv_dtype == 0) {
        run<float>(*a);
    } else if (kv_dtype == 1) {
        run<uint16_t>(*a);
    } else {
        return -1;
    }
    return 0;
}

}  // extern "C"
