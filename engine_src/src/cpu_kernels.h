// cpu_kernels.h: the inner loops of the CPU backend, shared by its ops so that a row computed
// by matmul_f32, matmul_w4a16 or moe_ffn goes through exactly the same arithmetic.
#pragma once

#include <cstdint>
#include <cstring>

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

// W4A16 dot products without materialising the dequantised row. Activations are regrouped once
// per row so that a 16-byte load of four weight words lines up with four contiguous activations:
// for group g (32 inputs, words 4g..4g+3), xt[32g + 4k + j] = x[32g + 8j + k], k = nibble index.
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

inline void regroup_for_w4(float* xt, const float* x, int K) {
    for (int g = 0; g < K / 32; ++g)
        for (int k = 0; k < 8; ++k)
            for (int j = 0; j < 4; ++j) xt[32 * g + 4 * k + j] = x[32 * g + 8 * j + k];
}

// sum_i x[i] * (nibble_i - 8) * scale_(i/32), with xt from regroup_for_w4: per group a 4-lane
// fp32 sum over the nibble positions, scaled, added lane-wise; lanes combined at the end.
inline float dot_w4(const float* xt, const int32_t* qw, const float* sc, int K) {
    f32x4 acc = {0, 0, 0, 0};
    for (int g = 0; g < K / 32; ++g) {
        i32x4 words;
        std::memcpy(&words, qw + 4 * g, 16);
        f32x4 part = {0, 0, 0, 0};
        for (int k = 0; k < 8; ++k) {
            const i32x4 level = ((words >> (4 * k)) & 15) - 8;
            f32x4 xv;
            std::memcpy(&xv, xt + 32 * g + 4 * k, 16);
            part += __builtin_convertvector(level, f32x4) * xv;
        }
        acc += part * sc[g];
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// y[N] = W[N][K] x[K].
inline void matvec_f32(float* y, const float* x, const float* W, int N, int K) {
    for (int n = 0; n < N; ++n) y[n] = dot(x, W + static_cast<long>(n) * K, K);
}

}  // namespace kd::cpu
