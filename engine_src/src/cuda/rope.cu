// rope.cu: RoPE on adjacent pairs, in place; one thread per (row, vector, pair). The frequency
// table (plain or YaRN, built on the host by rope.h) travels by value in the kernel's parameters;
// the angle and cos/sin times the table's magnitude are computed in double and rounded to float,
// as backend.h specifies.
#include "ops.cuh"

namespace kd::cuda {

namespace {

__global__ void rope_kernel(float* x, int M, int row_stride, int n_vec, int vec_stride, int offset, int d_r,
                            const int32_t* pos, const RopeTable table) {
    chain_acquire();
    chain_release();
    const int half = d_r / 2;
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if (i >= static_cast<long>(M) * n_vec * half) return;
    const int pair = static_cast<int>(i % half);
    const int v = static_cast<int>((i / half) % n_vec);
    const int m = static_cast<int>(i / (static_cast<long>(half) * n_vec));
    const double angle = pos[m] * table.inv_freq[pair];
    const float c = static_cast<float>(cos(angle) * table.magnitude), s = static_cast<float>(sin(angle) * table.magnitude);
    float* p = x + static_cast<long>(m) * row_stride + static_cast<long>(v) * vec_stride + offset + 2 * pair;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
}

}  // namespace

void rope(Context& ctx, float* x, int M, int row_stride, int n_vec, int vec_stride, int offset, int d_r,
          const int32_t* pos, const RopeTable& table) {
    if (d_r / 2 > RopeTable::kMaxPairs) throw std::runtime_error("rope: d_r = " + std::to_string(d_r) + " exceeds the table");
    const long n = static_cast<long>(M) * n_vec * (d_r / 2);
    if (n <= 0) return;
    launch_op("rope_kernel launch", rope_kernel, dim3(ceil_div(n, 256)), dim3(256), 0, ctx.stream, x, M, row_stride, n_vec,
              vec_stride, offset, d_r, pos, table);
}

}  // namespace kd::cuda
