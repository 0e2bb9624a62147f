// rope.cu: RoPE on adjacent pairs, in place; one thread per (row, vector, pair). The angle is
// computed in double and its cos/sin rounded to float, as backend.h specifies.
#include "ops.cuh"

namespace kd::cuda {

namespace {

__global__ void rope_kernel(float* x, int M, int row_stride, int n_vec, int vec_stride, int offset, int d_r,
                            const int32_t* pos, float theta) {
    const int half = d_r / 2;
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if (i >= static_cast<long>(M) * n_vec * half) return;
    const int pair = static_cast<int>(i % half);
    const int v = static_cast<int>((i / half) % n_vec);
    const int m = static_cast<int>(i / (static_cast<long>(half) * n_vec));
    const double angle = pos[m] * pow(static_cast<double>(theta), -2.0 * pair / d_r);
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
    float* p = x + static_cast<long>(m) * row_stride + static_cast<long>(v) * vec_stride + offset + 2 * pair;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
}

}  // namespace

void rope(Context& ctx, float* x, int M, int row_stride, int n_vec, int vec_stride, int offset, int d_r,
          const int32_t* pos, float theta) {
    const long n = static_cast<long>(M) * n_vec * (d_r / 2);
    if (n <= 0) return;
    rope_kernel<<<ceil_div(n, 256), 256, 0, ctx.stream>>>(x, M, row_stride, n_vec, vec_stride, offset, d_r, pos,
                                                         theta);
    KD_CUDA_LAUNCH_CHECK("rope_kernel");
}

}  // namespace kd::cuda
