// The sampler's exponential race on the CPU in one pass (ops/cpu_race.py): per row, the token
// argmax_c p[c] / E_c with E_c = -log(u_c) and u_c the row's counter-based uniform at column c
// (ops/random.py: u = (2 (mix64(key + (c + 1) GAMMA) >>> 41) + 1) 2^-24, key the row's key).
// torch needs ~30 passes over [rows, V] int64 temporaries for the same; here the hash, the log
// and the score stay in registers.
//
// Numerics: u is exact; -log(u) is taken in double and rounded once to float (torch's float
// log may sit one ulp away), so a row's token can differ from torch's only where two scores
// agree to within about an ulp. The score p / E is float as torch's; ties -> the lower column
// and a NaN score wins (first NaN), as torch.argmax.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMul1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMul2 = 0x94D049BB133111EBULL;
constexpr int kChunk = 8192;  // columns per task: rows x chunks spread over the threads

// log(u) for u in (0, 1] in double, in a form the compiler vectorises: u = 2^e m with m in
// [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by its series
// to s^15 (relative error < 1e-13: far below the float rounding that follows).
#pragma omp declare simd notinbranch
inline double log_unit(double u) {
    uint64_t bits;
    std::memcpy(&bits, &u, sizeof bits);
    int64_t e = static_cast<int64_t>(bits >> 52) - 1023;
    bits = (bits & 0x000FFFFFFFFFFFFFULL) | 0x3FF0000000000000ULL;
    double m;
    std::memcpy(&m, &bits, sizeof m);
    const bool high = m > 1.4142135623730951;
    m = high ? m * 0.5 : m;
    e = high ? e + 1 : e;
    const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double p = 1.0 / 15;
    p = p * s2 + 1.0 / 13;
    p = p * s2 + 1.0 / 11;
    p = p * s2 + 1.0 / 9;
    p = p * s2 + 1.0 / 7;
    p = p * s2 + 1.0 / 5;
    p = p * s2 + 1.0 / 3;
    p = p * s2 + 1.0;
    return static_cast<double>(e) * 0.6931471805599453 + 2.0 * s * p;
}

// E_c = -log(u_c), the exponential noise at column c of a row with this key
#pragma omp declare simd notinbranch
inline float race_noise(uint64_t key, int64_t c) {
    uint64_t z = key + static_cast<uint64_t>(c + 1) * kGamma;
    z = (z ^ (z >> 30)) * kMul1;
    z = (z ^ (z >> 27)) * kMul2;
    z ^= z >> 31;
    const double u = static_cast<double>(2 * (z >> 41) + 1) * 0x1p-24;
    return static_cast<float>(-log_unit(u));
}

#pragma omp declare simd notinbranch
inline float race_score(float p, uint64_t key, int64_t c) { return p / race_noise(key, c); }

// a beats b (at a later column): larger, or the first NaN
inline bool beats(float a, float b) { return a > b || (a != a && b == b); }

void race_chunk(const float* p, uint64_t key, int64_t c0, int64_t c1, float* best, int64_t* at) {
    constexpr int L = 16;
    float b[L];
    int64_t a[L];
    for (int l = 0; l < L; ++l) b[l] = -INFINITY, a[l] = c0;
    const int64_t body = c0 + (c1 - c0) / L * L;
    for (int64_t i = c0; i < body; i += L) {
#pragma omp simd
        for (int l = 0; l < L; ++l) {
            const float s = race_score(p[i + l], key, i + l);
            const bool more = s > b[l] || (s != s && b[l] == b[l]);
            b[l] = more ? s : b[l];
            a[l] = more ? i + l : a[l];
        }
    }
    float mx = -INFINITY;
    int64_t idx = c0;
    for (int l = 0; l < L; ++l) {  // the lanes' winners: the first NaN, else max, ties earlier
        const bool take = b[l] != b[l] ? (mx == mx || a[l] < idx)
                                       : (mx == mx && (b[l] > mx || (b[l] == mx && a[l] < idx)));
        if (take) mx = b[l], idx = a[l];
    }
    for (int64_t i = body; i < c1; ++i) {
        const float s = race_score(p[i], key, i);
        if (beats(s, mx)) mx = s, idx = i;
    }
    *best = mx;
    *at = idx;
}

}  // namespace

extern "C" {

int specserve_cpu_race_version() { return 1; }

// E_c for c < V of one row: the noise the race divides by (tests check it against torch's)
void specserve_race_noise(int64_t key, int V, float* out) {
    for (int c = 0; c < V; ++c) out[c] = race_noise(static_cast<uint64_t>(key), c);
}

// probs [T, V] float32 rows ld apart, keys [T] (the rows' keys, ops/random.py row_keys) ->
// out [T] int64.
void specserve_race_rows(const float* probs, int64_t ld, int T, int V, const int64_t* keys,
                         int64_t* out, int threads) {
    const int chunks = (V + kChunk - 1) / kChunk;
    const int tasks = T * chunks;
    std::vector<float> best(tasks);
    std::vector<int64_t> at(tasks);
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1 && threads > 1)
    for (int j = 0; j < tasks; ++j) {
        const int t = j / chunks, c = j % chunks;
        const int64_t c0 = static_cast<int64_t>(c) * kChunk;
        const int64_t c1 = c0 + kChunk < V ? c0 + kChunk : V;
        race_chunk(probs + t * ld, static_cast<uint64_t>(keys[t]), c0, c1, &best[j], &at[j]);
    }
    for (int t = 0; t < T; ++t) {  // chunks in column order: a later one must beat the best
        float mx = best[t * chunks];
        int64_t idx = at[t * chunks];
        for (int c = 1; c < chunks; ++c)
            if (beats(best[t * chunks + c], mx)) mx = best[t * chunks + c], idx = at[t * chunks + c];
        out[t] = idx;
    }
}

}  // extern "C"
