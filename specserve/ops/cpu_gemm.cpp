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

namespace {

typedef float v16 __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kGroup = 3;  // panels per work item: 48 outputs, 3 independent chains per row

inline v16 load(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// ROWS input rows x NP panels: ROWS * NP accumulators in registers.
template <int ROWS, int NP>
inline void tile(const float* x, int64_t ldx, const float* panels, int64_t panel_stride, int K,
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

template <int NP>
void rows_chunk(const float* x, int64_t ldx, int rows, const float* panels, int64_t panel_stride,
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

}  // namespace

extern "C" {

int specserve_cpu_gemm_version() { return 1; }

// x [M, K] (row stride ldx), panels [ceil(N/16), K, 16], bias [N] or null, y [M, N] (row stride
// ldy). Returns 0.
int specserve_cpu_gemm(const float* x, int64_t ldx, const float* panels, const float* bias,
                       float* y, int64_t ldy, int M, int N, int K, int num_threads) {
    const int num_panels = (N + kLanes - 1) / kLanes;
    const int num_groups = (num_panels + kGroup - 1) / kGroup;
    const int64_t panel_stride = static_cast<int64_t>(K) * kLanes;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int g = 0; g < num_groups; ++g) {
        const int p0 = g * kGroup, np = num_panels - p0 < kGroup ? num_panels - p0 : kGroup;
        const float* gp = panels + p0 * panel_stride;
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
    return 0;
}

}  // extern "C"
