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
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

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

// e^x for x <= 0 in a form the compiler vectorises: x = n ln2 + r (Cody-Waite), |r| <= ln2/2,
// e^r by its degree-7 Taylor polynomial (relative error < 1e-7), 2^n through the exponent bits.
#pragma omp declare simd notinbranch
inline float exp_nonpos(float x) {
    x = std::max(x, -87.0f);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

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

template <typename KV>
void run_item(const Args& a, int req, int row0, int row1, int kvh, Scratch& s) {
    const int g_per = a.heads / a.kv_heads, d = a.head_dim, bs = a.block_size;
    const int nrows = row1 - row0, nq = nrows * g_per;
    const int ql = a.q_lens[req], cl = a.ctx_lens[req], start = a.starts[req];
    const int first_pos = cl - ql + row0;  // KV position of the item's first row
    const int64_t tok_stride = static_cast<int64_t>(a.kv_heads) * d;
    const int64_t blk_stride = tok_stride * bs;

    s.q.resize(static_cast<size_t>(nq) * d);
    s.acc.assign(static_cast<size_t>(nq) * d, 0.0f);
    s.m.assign(nq, -FLT_MAX);
    s.l.assign(nq, 0.0f);
    s.scores.resize(bs);
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
    for (int b0 = klo / bs * bs; b0 < khi; b0 += bs) {
        const int64_t blk = table[b0 / bs];
        const int t_lo = std::max(klo, b0), t_hi = std::min(khi, b0 + bs);
        // K/V rows of this block as fp32, row t at kr + (t - b0) * kstride
        const float* kr;
        const float* vr;
        int64_t kstride;
        if constexpr (sizeof(KV) == sizeof(float)) {
            kr = reinterpret_cast<const float*>(kbase + blk * blk_stride);
            vr = reinterpret_cast<const float*>(vbase + blk * blk_stride);
            kstride = tok_stride;
        } else {
            for (int t = t_lo; t < t_hi; ++t) {
                const int64_t off = blk * blk_stride + (t - b0) * tok_stride;
                to_f32(kbase + off, s.kf.data() + static_cast<size_t>(t - b0) * d, d);
                to_f32(vbase + off, s.vf.data() + static_cast<size_t>(t - b0) * d, d);
            }
            kr = s.kf.data();
            vr = s.vf.data();
            kstride = d;
        }
        for (int r = 0; r < nrows; ++r) {
            const int p = first_pos + r;
            const int rlo = a.window ? std::max(0, p - a.window + 1) : 0;
            const int lo = std::max(t_lo, rlo), hi = std::min(t_hi, p + 1);
            if (lo >= hi) continue;
            for (int g = 0; g < g_per; ++g) {
                const int n = r * g_per + g;
                const float* qv = s.q.data() + static_cast<size_t>(n) * d;
                float* sc = s.scores.data();
                float mx = s.m[n];
                for (int t = lo; t < hi; ++t) {
                    const float* kv = kr + (t - b0) * kstride;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int i = 0; i < d; ++i) dot += qv[i] * kv[i];
                    sc[t - lo] = dot;
                    mx = std::max(mx, dot);
                }
                const float corr = exp_nonpos(s.m[n] - mx);
                float sum = 0.0f;
                const int cnt = hi - lo;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < cnt; ++t) {
                    sc[t] = exp_nonpos(sc[t] - mx);
                    sum += sc[t];
                }
                s.l[n] = s.l[n] * corr + sum;
                s.m[n] = mx;
                float* acc = s.acc.data() + static_cast<size_t>(n) * d;
#pragma omp simd
                for (int i = 0; i < d; ++i) acc[i] *= corr;
                for (int t = 0; t < cnt; ++t) {
                    const float w = sc[t];
                    const float* vv = vr + (lo + t - b0) * kstride;
#pragma omp simd
                    for (int i = 0; i < d; ++i) acc[i] += w * vv[i];
                }
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
    const int64_t items = static_cast<int64_t>(chunks.size()) * a.kv_heads;
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(a.num_threads, items)));
#pragma omp parallel num_threads(threads)
    {
        Scratch s;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const Chunk& c = chunks[it / a.kv_heads];
            run_item<KV>(a, c.req, c.row0, c.row1, static_cast<int>(it % a.kv_heads), s);
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
