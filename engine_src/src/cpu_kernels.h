// cpu_kernels.h: the inner loops of the CPU backend, shared by its ops so that a row computed
// by matmul_f32, matmul_w4a16 or moe_ffn goes through exactly the same arithmetic.
#pragma once

#include <cstdint>

namespace kd::cpu {

// Dot product with eight fixed partial sums (lane k % 8), combined in a fixed tree. The order
// depends only on n, never on the batch, which keeps every row's result independent of M;
// the eight lanes let the compiler vectorise without -ffast-math.
inline float dot(const float* a, const float* b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int k = 0;
    for (; k + 8 <= n; k += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[k + l] * b[k + l];
    for (int l = 0; l < 8 && k + l < n; ++l) acc[l] += a[k + l] * b[k + l];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Dequantises one W4A16 row of K inputs into out[K]: (nibble - 8) * scale (layout: backend.h).
inline void dequant_row(float* out, const int32_t* qw, const float* sc, int K) {
    for (int j = 0; j < K / 8; ++j) {
        const uint32_t word = static_cast<uint32_t>(qw[j]);
        const float s = sc[(8 * j) / 32];
        for (int k = 0; k < 8; ++k)
            out[8 * j + k] = static_cast<float>(static_cast<int>((word >> (4 * k)) & 15u) - 8) * s;
    }
}

// y[N] = W[N][K] x[K].
inline void matvec_f32(float* y, const float* x, const float* W, int N, int K) {
    for (int n = 0; n < N; ++n) y[n] = dot(x, W + static_cast<long>(n) * K, K);
}

}  // namespace kd::cpu
