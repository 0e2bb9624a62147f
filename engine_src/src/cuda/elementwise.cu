// elementwise.cu: silu_mul, the residual add, the embedding and row gathers, KV compaction and append.
#include "ops.cuh"

namespace kd::cuda {

namespace {

__global__ void silu_mul_kernel(float* out, const float* a, const float* b, size_t n) {
    chain_acquire();
    chain_release();
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < n) out[i] = silu_mul_f(a[i], b[i]);
}

__global__ void add_kernel(float* out, const float* a, const float* b, size_t n) {
    chain_acquire();
    chain_release();
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// One block per row: out[m][:dim] = table[tokens[m]][:dim].
__global__ void embedding_kernel(float* out, int out_stride, const float* table, int dim, const int32_t* tokens) {
    chain_acquire();
    chain_release();
    const float* src = table + static_cast<long>(tokens[blockIdx.x]) * dim;
    float* dst = out + static_cast<long>(blockIdx.x) * out_stride;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = src[j];
}

// Row i of dst = row index[i] of src, one block per row.
__global__ void gather_rows_kernel(float* dst, int dst_stride, const float* src, int width, const int32_t* index) {
    chain_acquire();
    chain_release();
    const float* s = src + static_cast<long>(index[blockIdx.x]) * width;
    float* d = dst + static_cast<long>(blockIdx.x) * dst_stride;
    for (int j = threadIdx.x; j < width; j += blockDim.x) d[j] = s[j];
}

// One block per (layer, column slice): each thread owns columns and copies rows in ascending j,
// so a row is read (path[j] >= j) before any later j of the same column overwrites it.
__global__ void kv_compact_kernel(float* caches, long layer_stride, int width, const int32_t* committed,
                                  const int32_t* accepted) {
    chain_acquire();
    chain_release();
    const int n = accepted[AcceptedPath::kCount];
    const int32_t* path = accepted + AcceptedPath::kPath;
    float* base = caches + blockIdx.y * layer_stride + static_cast<long>(*committed) * width;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    for (int j = 1; j < n; ++j)  // path[0] is the root, always row 0
        if (path[j] != j) base[static_cast<long>(j) * width + c] = base[static_cast<long>(path[j]) * width + c];
}

// Row blockIdx.x of rows goes to cache row *committed + blockIdx.x.
__global__ void kv_append_kernel(float* cache, int width, const int32_t* committed, const float* rows) {
    chain_acquire();
    chain_release();
    const float* s = rows + static_cast<long>(blockIdx.x) * width;
    float* d = cache + (static_cast<long>(*committed) + blockIdx.x) * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) d[j] = s[j];
}

}  // namespace

void silu_mul(Context& ctx, float* out, const float* a, const float* b, size_t n) {
    if (n == 0) return;
    launch_op("silu_mul_kernel launch", silu_mul_kernel, dim3(ceil_div(static_cast<long>(n), 256)), dim3(256), 0,
              ctx.stream, out, a, b, n);
}

void add(Context& ctx, float* out, const float* a, const float* b, size_t n) {
    if (n == 0) return;
    launch_op("add_kernel launch", add_kernel, dim3(ceil_div(static_cast<long>(n), 256)), dim3(256), 0, ctx.stream, out, a,
              b, n);
}

void embedding(Context& ctx, float* out, int out_stride, const float* table, int dim, const int32_t* tokens, int M) {
    if (M <= 0) return;
    launch_op("embedding_kernel launch", embedding_kernel, dim3(M), dim3(128), 0, ctx.stream, out, out_stride, table, dim,
              tokens);
}

void kv_compact(Context& ctx, float* caches, long layer_stride, int layers, int row_width, const int32_t* committed,
                const int32_t* accepted) {
    if (layers <= 0) return;
    constexpr int kThreads = 128;
    launch_op("kv_compact_kernel launch", kv_compact_kernel, dim3(ceil_div(row_width, kThreads), layers), dim3(kThreads), 0,
              ctx.stream, caches, layer_stride, row_width, committed, accepted);
}

void gather_rows(Context& ctx, float* dst, int dst_stride, const float* src, int width, const int32_t* index, int n) {
    if (n <= 0) return;
    launch_op("gather_rows_kernel launch", gather_rows_kernel, dim3(n), dim3(128), 0, ctx.stream, dst, dst_stride, src,
              width, index);
}

void kv_append(Context& ctx, float* cache, int row_width, const int32_t* committed, const float* rows, int M) {
    if (M <= 0) return;
    launch_op("kv_append_kernel launch", kv_append_kernel, dim3(M), dim3(128), 0, ctx.stream, cache, row_width, committed,
              rows);
}

}  // namespace kd::cuda
