// y[M, N] = x[M, K] @ W^T (+ bias) in fp32 over a weight stored in panels of 16 output rows
// (built and called by cpu_gemm.py).
//
// Panel layout: W[N, K] -> P[ceil(N / 16)][K][16], P[p][k][j] = W[16 p + j][k] (rows past N are
// zeros). A 16-wide vector of a panel holds one input column of 16 outputs, so each k costs one
// vector load and, per input row, one broadcast FMA: no horizontal sums, and the weight streams
// from memory in one contiguous pass per panel. Output j of row m is the FMA chain over k in
// order, whatever M is: a row's result does not depend on the rows beside it.
//
// Work: the panels in groups of kGroup, split over the OpenMP threads; within a group, the input
// rows in chunks of kRows (the group's panels stay in L1/L2 between chunks). GCC/Clang vector
// extensions give AVX-512 under -march=native and narrower vectors elsewhere.
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16 __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kGroup = 3;  // panels per work item: 48 outputs, 3 independent chains per row

inline v16 load(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// bf16 panels: 16 weights widened to fp32 exactly (a bf16 is the top half of its fp32), so the
// FMA chain is the fp32 panels' bit for bit, at half the bytes read
inline v16 load(const uint16_t* p) {
    h16 h;
    std::memcpy(&h, p, sizeof h);
    const u16 w = __builtin_convertvector(h, u16) << 16;
    v16 v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}

// ROWS input rows x NP panels: ROWS * NP accumulators in registers. W: float or bf16 bits.
template <int ROWS, int NP, typename W>
inline void tile(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int K,
                 float* acc_out) {
    v16 acc[ROWS][NP] = {};
    for (int k = 0; k < K; ++k) {
        v16 w[NP];
        for (int p = 0; p < NP; ++p) w[p] = load(panels + p * panel_stride + k * kLanes);
        for (int r = 0; r < ROWS; ++r) {
            const float xs = x[r * ldx + k];
            for (int p = 0; p < NP; ++p) acc[r][p] += xs * w[p];
        }
    }
    std::memcpy(acc_out, acc, sizeof acc);
}

template <int NP, typename W>
void rows_chunk(const float* x, int64_t ldx, int rows, const W* panels, int64_t panel_stride,
                int K, float* acc) {
    switch (rows) {
        case 1: return tile<1, NP>(x, ldx, panels, panel_stride, K, acc);
        case 2: return tile<2, NP>(x, ldx, panels, panel_stride, K, acc);
        case 3: return tile<3, NP>(x, ldx, panels, panel_stride, K, acc);
        case 4: return tile<4, NP>(x, ldx, panels, panel_stride, K, acc);
        case 5: return tile<5, NP>(x, ldx, panels, panel_stride, K, acc);
        case 6: return tile<6, NP>(x, ldx, panels, panel_stride, K, acc);
        case 7: return tile<7, NP>(x, ldx, panels, panel_stride, K, acc);
        default: return tile<8, NP>(x, ldx, panels, panel_stride, K, acc);
    }
}

// 8 x 3 accumulators + 3 weight vectors: 27 of 32 AVX-512 registers. Rather than 6 x 4 (as many
// registers): 64 rows are 8 full chunks (no short tail), and a 576-wide output is 12 groups,
// which split evenly over 2 or 4 threads (docs/cpu.md has the paired timings).
constexpr int kRows = 8;

// One work item: np panels (gp) against all M rows, in chunks of kRows.
template <typename W>
void group(const float* x, int64_t ldx, const W* gp, int np, int p0, int64_t panel_stride,
           const float* bias, float* y, int64_t ldy, int M, int N, int K) {
    alignas(64) float acc[kRows * kGroup * kLanes];
    for (int m0 = 0; m0 < M; m0 += kRows) {
        const int rows = M - m0 < kRows ? M - m0 : kRows;
        const float* xr = x + m0 * ldx;
        switch (np) {
            case 1: rows_chunk<1>(xr, ldx, rows, gp, panel_stride, K, acc); break;
            case 2: rows_chunk<2>(xr, ldx, rows, gp, panel_stride, K, acc); break;
            default: rows_chunk<kGroup>(xr, ldx, rows, gp, panel_stride, K, acc); break;
        }
        // acc is [rows][np][16]: output columns 16 (p0 + p) + j
        for (int r = 0; r < rows; ++r) {
            float* yr = y + (m0 + r) * ldy;
            for (int p = 0; p < np; ++p) {
                const int n0 = (p0 + p) * kLanes;
                const int cols = N - n0 < kLanes ? N - n0 : kLanes;
                const float* a = acc + (r * np + p) * kLanes;
                if (bias) {
                    for (int j = 0; j < cols; ++j) yr[n0 + j] = a[j] + bias[n0 + j];
                } else {
                    std::memcpy(yr + n0, a, cols * sizeof(float));
                }
            }
        }
    }
}

// bf16 panels that several chunks of rows read are widened once into a per-thread fp32 copy
// (it stays in L2 for the chunks after the first, as fp32 panels would): the widening is paid
// once a group, not once a chunk, and memory is still read at half the bytes. One chunk reads
// them directly.
const float* widened(const uint16_t* gp, int64_t n) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    for (int64_t i = 0; i < n; i += kLanes) {
        const v16 v = load(gp + i);
        std::memcpy(buf.data() + i, &v, sizeof v);
    }
    return buf.data();
}

template <typename W>
int gemm(const float* x, int64_t ldx, const W* panels, const float* bias, float* y, int64_t ldy,
         int M, int N, int K, int num_threads) {
    const int num_panels = (N + kLanes - 1) / kLanes;
    const int num_groups = (num_panels + kGroup - 1) / kGroup;
    const int64_t panel_stride = static_cast<int64_t>(K) * kLanes;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int g = 0; g < num_groups; ++g) {
        const int p0 = g * kGroup, np = num_panels - p0 < kGroup ? num_panels - p0 : kGroup;
        const W* gp = panels + p0 * panel_stride;
        if constexpr (sizeof(W) == 2) {
            if (M > kRows) {
                const float* wide = widened(gp, np * panel_stride);
                group(x, ldx, wide, np, p0, panel_stride, bias, y, ldy, M, N, K);
                continue;
            }
        }
        group(x, ldx, gp, np, p0, panel_stride, bias, y, ldy, M, N, K);
    }
    return 0;
}

}  // namespace

extern "C" {

int specserve_cpu_gemm_version() { return 2; }

// x [M, K] (row stride ldx), panels [ceil(N/16), K, 16], bias [N] or null, y [M, N] (row stride
// ldy). Returns 0.
int specserve_cpu_gemm(const float* x, int64_t ldx, const float* panels, const float* bias,
                       float* y, int64_t ldy, int M, int N, int K, int num_threads) {
    return gemm(x, ldx, panels, bias, y, ldy, M, N, K, num_threads);
}

// The same over bf16 panels (weights that are bf16 values): the fp32 panels' result exactly.
int specserve_cpu_gemm_bf16(const float* x, int64_t ldx, const uint16_t* panels,
                            const float* bias, float* y, int64_t ldy, int M, int N, int K,
                            int num_threads) {
    return gemm(x, ldx, panels, bias, y, ldy, M, N, K, num_threads);
}

}  // extern "C"
