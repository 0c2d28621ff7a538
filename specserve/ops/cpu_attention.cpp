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
// Two implementations of an item: run_item_fast (cpu_attention_avx512.h: AVX-512 intrinsics;
// block_size 16, head_dim 64 or 128: the engine's shapes) and run_item (portable C++ the
// compiler vectorises; any shape, and the only one under -DSPECSERVE_PORTABLE or without
// AVX-512F).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "cpu_attention_args.h"
#include "cpu_math.h"

// The decode / short-verify path below is AVX-512 intrinsics; -DSPECSERVE_PORTABLE (or a CPU
// without AVX-512F) leaves only the portable path, which the tests build and check too.
#if defined(__AVX512F__) && !defined(SPECSERVE_PORTABLE)
#include <immintrin.h>
#define SPECSERVE_AVX512 1
#endif

namespace {

constexpr int kRowsPerItem = 16;

using Args = SpecserveAttentionArgs;  // cpu_attention_args.h

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
#include "cpu_attention_avx512.h"
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
