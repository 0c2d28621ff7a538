// y[M, N] = x[M, K] @ W^T (+ bias) over weights stored as integer blocks, in integer
// arithmetic that is exact and an fp32 fold (built and called by cpu_qgemm.py):
//   W[n][k] = d[n][b] q[n][k] + m[n][b],  b = k / 32,  q an int8
// (a GGUF Q4_1 block: q in 0..15; Q8_0: q in -127..127 and m = 0). The weights are read at one
// byte each where their fp32 copy takes four, and the products are integer dot products:
// AVX512-VNNI's vpdpbusd, or AMX's int8 tiles where many rows share a call.
//
// Activations: per row and block, x is put on a grid of 2^(e - 23) where |x| < 2^e (block
// floating point with a 24-bit significand: the error is <= 2^-23 of the block's largest
// |x|; fp32 rounds each product to 2^-24 of itself), X = round(x 2^(23 - e)) in
// [-2^23, 2^23), and X + 2^23 is written as three unsigned bytes h, m, l.
// Per row, output and block the dot products of the bytes with q are exact int32 sums, so the
// vector path and AMX (and any order of the sums) give the same integers:
//   Ph = sum h q - 128 sum q,   lo = 256 sum m q + sum l q      (sum X q = 65536 Ph + lo)
// then one fold, the same code on both paths:
//   c = float(Ph) 65536 + float(lo);   acc += m s;   acc += d (c 2^(e - 23))
// with s = float(sum X) 2^(e - 23), over the blocks in order. A row's result depends only on
// its own inputs, whatever rows share the call and whichever path runs. Blocks whose largest
// |x| is below 2^-100 count as zeros; a NaN or inf input makes its row's outputs NaN.
//
// Layout (cpu_qgemm.py packs it): for 16 outputs t and block b, one 512-byte tile
//   Q[t][b][i][4 j + e] = q[16 t + j][32 b + 4 i + e]    (i < 8 groups of 4 inputs, j < 16)
// (AMX's B-tile layout; a 64-byte row is vpdpbusd's signed operand), then per (t, b) 16 fp32
// d, 16 fp32 m and 16 int32 -128 sum q (Ph's start). N % 16 == 0, K % 32 == 0.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) || (defined(__AMX_TILE__) && defined(__AMX_INT8__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define SPECSERVE_AMX 1
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16 __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kBlock = 32;
constexpr int kTileBytes = kLanes * kBlock;
constexpr int kParts = 3;
constexpr int kBits = 23;  // X in [-2^23, 2^23): the high byte of X + 2^23 carries 128 of it
constexpr float kTiny = 7.888609052210118e-31f;  // 2^-100

template <typename V>
inline V loadv(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

struct Packed {
    const int8_t* q;      // [N / 16][K / 32][512]
    const float* d;       // [N / 16][K / 32][16]
    const float* m;       // [N / 16][K / 32][16]
    const int32_t* start;  // [N / 16][K / 32][16]: -128 sum q, where Ph starts
};

Packed unpack(const void* packed, int N, int K) {
    const int64_t tiles = static_cast<int64_t>(N / kLanes) * (K / kBlock);
    const auto* q = static_cast<const int8_t*>(packed);
    const auto* d = reinterpret_cast<const float*>(q + tiles * kTileBytes);
    const float* m = d + tiles * kLanes;
    return {q, d, m, reinterpret_cast<const int32_t*>(m + tiles * kLanes)};
}

// The activations of one call, shared by its threads: the bytes of 16 rows and one block, h,
// m and l, as three AMX tiles side by side, [ceil(M / 16)][K / 32][3][16][32] (rows past M
// are zeros); per row and block, s and the grid step 2^(e - 23).
struct Split {
    const uint8_t* bytes;
    const float* sums;   // [M][K / 32]
    const float* steps;  // [M][K / 32]
    int nb;              // K / 32
};

constexpr int kUnitBytes = kParts * kLanes * kBlock;  // one unit: 16 rows x one block

inline int64_t unit(int nb, int r, int b) {  // where row r's bytes of block b start (part h)
    return ((static_cast<int64_t>(r / kLanes) * nb + b) * kParts) * kLanes * kBlock +
           (r % kLanes) * kBlock;
}

typedef uint8_t b16 __attribute__((vector_size(16)));

void split_rows(const float* x, int64_t ldx, int r0, int r1, int K, uint8_t* bytes, float* sums,
                float* steps) {
    const int nb = K / kBlock;
    constexpr int64_t part = kLanes * kBlock;
    for (int r = r0; r < r1; ++r) {
        const float* xr = x + r * ldx;
        for (int b = 0; b < nb; ++b) {
            uint8_t* h = bytes + unit(nb, r, b);
            const v16 x0 = loadv<v16>(xr + b * kBlock), x1 = loadv<v16>(xr + b * kBlock + kLanes);
            const v16 a0 = x0 < 0 ? -x0 : x0, a1 = x1 < 0 ? -x1 : x1;
            const v16 a = a0 > a1 ? a0 : a1;
            const v16 z = x0 * 0.0f + x1 * 0.0f;  // 0, or NaN where an input is NaN or inf
            float amax = 0.0f, zs = 0.0f;
            for (int j = 0; j < kLanes; ++j) {
                amax = amax > a[j] ? amax : a[j];
                zs += z[j];
            }
            int e = 0;
            const bool finite = zs == 0.0f;
            if (finite && amax >= kTiny) std::frexp(amax, &e);  // amax < 2^e
            const float scale = finite && amax >= kTiny ? std::ldexp(1.0f, kBits - e) : 0.0f;
            i16 sum = {};
            for (int half = 0; half < 2; ++half) {
                // x scale is exact (a power of two) and below 2^23 in size, so adding 1/2 is
                // exact too: rounding half away from zero, then the clamp at 2^23 - 1
                const v16 v = (half ? x1 : x0) * scale;
                i16 X = __builtin_convertvector(v + (v < 0 ? -0.5f : 0.5f), i16);
                X = X > (1 << kBits) - 1 ? (1 << kBits) - 1 : X;
                sum += X;
                const u16 u = (u16)(X + (1 << kBits));
                const int at = half * kLanes;
                const b16 hb = __builtin_convertvector(u >> 16, b16);
                const b16 mb = __builtin_convertvector((u >> 8) & 0xFF, b16);
                const b16 lb = __builtin_convertvector(u & 0xFF, b16);
                std::memcpy(h + at, &hb, sizeof hb);
                std::memcpy(h + at + part, &mb, sizeof mb);
                std::memcpy(h + at + 2 * part, &lb, sizeof lb);
            }
            int32_t total = 0;
            for (int j = 0; j < kLanes; ++j) total += sum[j];
            // a NaN or inf input makes the row's outputs NaN, as fp32 products would
            const float step = finite ? std::ldexp(1.0f, e - kBits) : NAN;
            sums[r * nb + b] = static_cast<float>(total) * step;
            steps[r * nb + b] = step;
        }
    }
}

// The fold of one row, block and 16 outputs (the same code for both paths; see the top).
inline void fold(v16& acc, i16 ph, i16 lo, const Packed& w, int64_t at, float s, float step) {
    const v16 c = __builtin_convertvector(ph, v16) * 65536.0f + __builtin_convertvector(lo, v16);
    acc += loadv<v16>(w.m + at) * s;
    acc += loadv<v16>(w.d + at) * (c * step);
}

// sum over 4 inputs of u8 bytes (x) times s8 weights, 16 outputs
inline i16 dot4(i16 acc, const int8_t* wq, uint32_t x4) {
#ifdef __AVX512VNNI__
    const __m512i w = _mm512_loadu_si512(wq);
    const __m512i r = _mm512_dpbusd_epi32(loadv<__m512i>(&acc), _mm512_set1_epi32(x4), w);
    return loadv<i16>(&r);
#else
    const i16 w = loadv<i16>(wq);
    for (int e = 0; e < 4; ++e) {
        const i16 we = (w << (24 - 8 * e)) >> 24;  // byte e, sign-extended
        acc += we * static_cast<int32_t>((x4 >> (8 * e)) & 0xFF);
    }
    return acc;
#endif
}

// ROWS rows x NP tiles of 16 outputs on vectors.
template <int ROWS, int NP>
void vec_tile(const Split& a, int r0, const Packed& w, int t0, int K, v16* out) {
    const int nb = K / kBlock;
    v16 acc[ROWS][NP] = {};
    for (int b = 0; b < nb; ++b) {
        i16 ph[ROWS][NP], lo[ROWS][NP] = {};
        for (int p = 0; p < NP; ++p) {
            const i16 start = loadv<i16>(w.start + (static_cast<int64_t>(t0 + p) * nb + b) * kLanes);
            for (int r = 0; r < ROWS; ++r) ph[r][p] = start;
        }
        const uint8_t* xb = a.bytes + unit(nb, r0, b);  // ROWS <= 4 rows: one unit
        for (int part = 0; part < kParts; ++part) {
            const uint8_t* xp = xb + part * kLanes * kBlock;
            if (part == 2)
                for (int r = 0; r < ROWS; ++r)
                    for (int p = 0; p < NP; ++p) lo[r][p] <<= 8;  // 256 sum m q, then + sum l q
            for (int i = 0; i < kBlock / 4; ++i) {
                for (int r = 0; r < ROWS; ++r) {
                    const uint32_t x4 = loadv<uint32_t>(xp + r * kBlock + 4 * i);
                    for (int p = 0; p < NP; ++p) {
                        const int8_t* wq =
                            w.q + (static_cast<int64_t>(t0 + p) * nb + b) * kTileBytes + i * 64;
                        if (part == 0) {
                            ph[r][p] = dot4(ph[r][p], wq, x4);
                        } else {
                            lo[r][p] = dot4(lo[r][p], wq, x4);
                        }
                    }
                }
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            const int64_t rb = static_cast<int64_t>(r0 + r) * nb + b;
            for (int p = 0; p < NP; ++p)
                fold(acc[r][p], ph[r][p], lo[r][p], w, (static_cast<int64_t>(t0 + p) * nb + b) * kLanes,
                     a.sums[rb], a.steps[rb]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int p = 0; p < NP; ++p) out[r * NP + p] = acc[r][p];
}

constexpr int kVecRows = 4;
constexpr int kGroup = 2;  // tiles per work item

template <int NP>
void vec_rows(const Split& a, int r0, int rows, const Packed& w, int t0, int K, v16* out) {
    switch (rows) {
        case 1: return vec_tile<1, NP>(a, r0, w, t0, K, out);
        case 2: return vec_tile<2, NP>(a, r0, w, t0, K, out);
        case 3: return vec_tile<3, NP>(a, r0, w, t0, K, out);
        default: return vec_tile<4, NP>(a, r0, w, t0, K, out);
    }
}

void store(const v16* acc, int rows, int np, int t0, const float* bias, float* y, int64_t ldy,
           int r0) {
    for (int r = 0; r < rows; ++r) {
        for (int p = 0; p < np; ++p) {
            v16 v = acc[r * np + p];
            const int n0 = (t0 + p) * kLanes;
            if (bias) v += loadv<v16>(bias + n0);
            std::memcpy(y + (r0 + r) * ldy + n0, &v, sizeof v);
        }
    }
}

// rows [begin, M) (begin a multiple of 16) against tiles t0 .. t0 + np
void vec_group(const Split& a, int begin, int M, const Packed& w, int t0, int np, int K,
               const float* bias, float* y, int64_t ldy) {
    v16 acc[kVecRows * kGroup];
    for (int r0 = begin; r0 < M; r0 += kVecRows) {
        const int rows = M - r0 < kVecRows ? M - r0 : kVecRows;
        if (np == kGroup) {
            vec_rows<kGroup>(a, r0, rows, w, t0, K, acc);
        } else {
            vec_rows<1>(a, r0, rows, w, t0, K, acc);
        }
        store(acc, rows, np, t0, bias, y, ldy, r0);
    }
}

#ifdef SPECSERVE_AMX
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0..2: the int32 sums of h, m, l (rows x 16); 3..5: the bytes h, m, l (rows x 32); 6: q
// (8 rows of 4 inputs x 16 outputs). A chunk of fewer than 16 rows gets tiles of its own height:
// the tile work, its stores and the fold then scale with the rows there are, not with 16.
void configure(int rows) {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int i = 0; i < 3; ++i) {
        cfg.rows[i] = static_cast<uint8_t>(rows);
        cfg.colsb[i] = 64;
        cfg.rows[3 + i] = static_cast<uint8_t>(rows);
        cfg.colsb[3 + i] = 32;
    }
    cfg.rows[6] = 8;
    cfg.colsb[6] = 64;
    _tile_loadconfig(&cfg);
}

// Block b's tile work: the three int32 sums of 16 rows x 16 outputs, into tiles 0..2.
inline void amx_issue(const Split& a, int r0, const Packed& w, int t, int b) {
    const int64_t at = (static_cast<int64_t>(t) * a.nb + b) * kLanes;
    const uint8_t* xb = a.bytes + unit(a.nb, r0, b);
    _tile_loadd(0, w.start + at, 0);  // every row starts at -128 sum q
    _tile_zero(1);
    _tile_zero(2);
    _tile_loadd(6, w.q + at * kBlock, 64);
    _tile_loadd(3, xb, kBlock);
    _tile_loadd(4, xb + kLanes * kBlock, kBlock);
    _tile_loadd(5, xb + 2 * kLanes * kBlock, kBlock);
    _tile_dpbusd(0, 3, 6);
    _tile_dpbusd(1, 4, 6);
    _tile_dpbusd(2, 5, 6);
}

// Blocks of weights fetched ahead of the tile work: a tile load that misses waits for DRAM (the
// vector path's loads overlap it out of order). Paired, 9 repeats over the default model's 121
// linears (the Xeon): no fetching is 1.09-1.35x slower at 1-16 rows; 2 ahead 1.08-1.16x and 8
// ahead 1.06-1.07x slower than 4 at 1, 5 and 16 rows.
constexpr int kAhead = 4;

inline void fetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// One tile of 16 outputs against ROWS rows (the tiles configured to ROWS rows). The
// accumulators stay in registers; block b + 1's tile work runs while block b is folded.
template <int ROWS>
void amx_tile(const Split& a, int r0, const Packed& w, int t, const float* bias, float* y,
              int64_t ldy) {
    const int nb = a.nb;
    alignas(64) int32_t c[2][kParts][kLanes * kLanes];
    v16 acc[ROWS] = {};
    amx_issue(a, r0, w, t, 0);
    for (int b = 0; b < nb; ++b) {
        int32_t (*cb)[kLanes * kLanes] = c[b & 1];
        _tile_stored(0, cb[0], 64);
        _tile_stored(1, cb[1], 64);
        _tile_stored(2, cb[2], 64);
        if (b + 1 < nb) amx_issue(a, r0, w, t, b + 1);
        const int64_t at = (static_cast<int64_t>(t) * nb + b) * kLanes;
        if (b + kAhead < nb) {
            const int64_t ahead = at + kAhead * kLanes;
            for (int line = 0; line < kTileBytes; line += 64) fetch(w.q + ahead * kBlock + line);
            fetch(w.d + ahead);
            fetch(w.m + ahead);
            fetch(w.start + ahead);
        }
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
            const int64_t rb = static_cast<int64_t>(r0 + r) * nb + b;
            const i16 lo = loadv<i16>(cb[1] + r * kLanes) * 256 + loadv<i16>(cb[2] + r * kLanes);
            fold(acc[r], loadv<i16>(cb[0] + r * kLanes), lo, w, at, a.sums[rb], a.steps[rb]);
        }
    }
    store(acc, ROWS, 1, t, bias, y, ldy, r0);
}

typedef void (*AmxTile)(const Split&, int, const Packed&, int, const float*, float*, int64_t);

template <int... R>
constexpr std::array<AmxTile, sizeof...(R)> amx_tiles(std::integer_sequence<int, R...>) {
    return {&amx_tile<R + 1>...};
}

// amx_tile<rows> for rows 1..16
constexpr auto kAmxTile = amx_tiles(std::make_integer_sequence<int, kLanes>{});

// Rows [r0, r1) of the call (one chunk of at most 16, or whole chunks) against every tile, on
// AMX: the chunks of this thread's share of the tiles.
void amx_rows_range(const Split& a, int r0, int r1, const Packed& w, int tiles,
                    const float* bias, float* y, int64_t ldy) {
    if (r0 >= r1) return;
    const int rows = r1 - r0 < kLanes ? r1 - r0 : kLanes;
    configure(rows);
    const AmxTile tile = kAmxTile[rows - 1];
#pragma omp for schedule(static) nowait
    for (int t = 0; t < tiles; ++t)
        for (int c = r0; c < r1; c += kLanes) tile(a, c, w, t, bias, y, ldy);
}

bool amx_permitted() {
    // Linux hands out AMX's tile state on request, once a process (ARCH_REQ_XCOMP_PERM,
    // XFEATURE_XTILEDATA)
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}
#endif

int amx_min_rows = 0;  // 0: vectors only; set by specserve_cpu_qgemm_use_amx

// The rows AMX takes: every whole chunk of 16, and the last one if it has amx_min_rows rows
// (below that, the vectors take them faster). Both paths give a row the same bits, so the
// split changes no result.
int amx_rows(int M) {
    if (amx_min_rows <= 0) return 0;
    const int whole = M / kLanes * kLanes;
    return M - whole >= amx_min_rows ? M : whole;
}

template <typename T>
T* scratch(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
}

}  // namespace

extern "C" {

int specserve_cpu_qgemm_version() { return 1; }

// Whether the integer dot products are instructions here (AVX512-VNNI): without them the
// vector path emulates vpdpbusd, correct but slower than the fp32 panels it would replace.
int specserve_cpu_qgemm_native() {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

// Whether this build and this process can use AMX (compiled for it, tile state granted).
int specserve_cpu_qgemm_amx_available() {
#ifdef SPECSERVE_AMX
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// Chunks of 16 rows with at least `min_rows` rows use AMX (0: never; 1..16). Returns the value
// in force.
int specserve_cpu_qgemm_use_amx(int min_rows) {
    amx_min_rows = specserve_cpu_qgemm_amx_available() ? min_rows : 0;
    return amx_min_rows;
}

// x [M, K] (row stride ldx), packed (layout above), bias [N] or null, y [M, N] (row stride
// ldy). N % 16 == 0, K % 32 == 0. Returns 0.
int specserve_cpu_qgemm(const float* x, int64_t ldx, const void* packed, const float* bias,
                        float* y, int64_t ldy, int M, int N, int K, int num_threads) {
    if (M <= 0) return 0;
    const Packed w = unpack(packed, N, K);
    const int amx_end = amx_rows(M);  // rows [0, amx_end) on AMX, the rest on vectors
    const int whole = M / kLanes * kLanes;
    const int chunks = (M + kLanes - 1) / kLanes;
    const int nb = K / kBlock;
    const int64_t blocks = static_cast<int64_t>(M) * nb;
    thread_local std::vector<uint8_t> byte_buf;
    thread_local std::vector<float> sum_buf, step_buf;
    uint8_t* bytes = scratch(byte_buf, static_cast<int64_t>(chunks) * nb * kUnitBytes);
    float* sums = scratch(sum_buf, blocks);
    float* steps = scratch(step_buf, blocks);
    const Split a{bytes, sums, steps, nb};
    const int tiles = N / kLanes;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int nt = 1, id = 0;
#endif
        const int per = (M + nt - 1) / nt;
        const int lo = id * per < M ? id * per : M, hi = lo + per < M ? lo + per : M;
        split_rows(x, ldx, lo, hi, K, bytes, sums, steps);
#pragma omp barrier
#ifdef SPECSERVE_AMX
        if (amx_end > 0) {
            // whole chunks, then a partial one in tiles of its own height
            amx_rows_range(a, 0, amx_end < whole ? amx_end : whole, w, tiles, bias, y, ldy);
            amx_rows_range(a, whole, amx_end, w, tiles, bias, y, ldy);
            _tile_release();
        }
#endif
        if (amx_end < M) {
            const int groups = (tiles + kGroup - 1) / kGroup;
#pragma omp for schedule(static)
            for (int g = 0; g < groups; ++g) {
                const int t0 = g * kGroup;
                vec_group(a, amx_end, M, w, t0, tiles - t0 < kGroup ? tiles - t0 : kGroup, K,
                          bias, y, ldy);
            }
        }
    }
    return 0;
}

}  // extern "C"
