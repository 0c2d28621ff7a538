// Scalar math the CPU kernels share, in forms GCC/Clang vectorise under `omp simd`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// e^x for x <= 0 in a form the compiler vectorises: x = n ln2 + r (Cody-Waite), |r| <= ln2/2,
// e^r by its degree-7 Taylor polynomial (relative error < 1e-7), 2^n through the exponent bits.
// Loops over it vectorise only under -fno-trapping-math (cpu_build.py's flags): otherwise GCC
// keeps the clamp a branch, as the float-to-int conversion after it might trap.
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
