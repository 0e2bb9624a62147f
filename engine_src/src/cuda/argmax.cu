// argmax.cu: per-row arg-max and the drafter's log-softmax top-K, one block per row, and the
// greedy walk of a verified draft tree.
#include "ops.cuh"

namespace kd::cuda {

namespace {

constexpr int kRowThreads = 256;

__global__ void argmax_kernel(int32_t* out, const float* x, int N) {
    chain_acquire();
    chain_release();
    const float* r = x + static_cast<long>(blockIdx.x) * N;
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int j = threadIdx.x; j < N; j += blockDim.x)
        if (r[j] > v || i == 0x7fffffff) { v = r[j]; i = j; }
    block_argmax(v, i);
    if (threadIdx.x == 0) out[blockIdx.x] = i;
}

// lq = x - (max + log(sum exp(x - max))); the K best lq (descending, ties: lower j). The k-th
// pick is the best entry strictly after the (k-1)-th in that order.
__global__ void log_softmax_topk_kernel(int32_t* tokens, float* logprob, const float* x, int N, int K) {
    chain_acquire();
    chain_release();
    const float* r = x + static_cast<long>(blockIdx.x) * N;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < N; j += blockDim.x) mx = fmaxf(mx, r[j]);
    mx = block_max(mx);
    float total = 0.0f;
    for (int j = threadIdx.x; j < N; j += blockDim.x) total += expf(r[j] - mx);
    total = block_sum(total);
    const float lse = mx + logf(total);
    float pv = INFINITY;
    int pi = -1;
    for (int k = 0; k < K; ++k) {
        float v = -INFINITY;
        int i = 0x7fffffff;
        for (int j = threadIdx.x; j < N; j += blockDim.x) {
            const float lq = r[j] - lse;
            const bool after = lq < pv || (lq == pv && j > pi);
            if (after && (lq > v || (lq == v && j < i))) { v = lq; i = j; }
        }
        block_argmax(v, i);
        pv = v;
        pi = i;
        if (threadIdx.x == 0) {
            tokens[static_cast<long>(blockIdx.x) * K + k] = i;
            logprob[static_cast<long>(blockIdx.x) * K + k] = v;
        }
    }
}

// One thread walks the tree (backend.h tree_accept): M is a tree's size, a few hundred at most.
// post: the rows' arg-max (volatile: other blocks of tree_accept_kernel wrote it).
__device__ void tree_walk(int32_t* accepted, const int32_t* tokens, const int32_t* parents, int M) {
    int32_t* path = accepted + AcceptedPath::kPath;
    const volatile int32_t* post = path + M;  // AcceptedPath::post(M) (a host function)
    int n = 1, cur = 0;
    path[0] = 0;
    for (;;) {
        int next = -1;
        for (int i = cur + 1; i < M && next < 0; ++i)
            if (parents[i] == cur && tokens[i] == post[cur]) next = i;
        if (next < 0) break;
        path[n++] = next;
        cur = next;
    }
    accepted[AcceptedPath::kCount] = n;
    accepted[AcceptedPath::kLast] = cur;
    accepted[AcceptedPath::kBonus] = post[cur];
}

// tree_accept in one launch (issue 21, fifth pass; it was argmax_kernel, then a one-thread walk
// kernel): a block per row writes the row's arg-max (argmax_kernel's loop and tie rule) into
// post, and the last block to finish (a count in `done`, zero between launches: that block
// resets it) walks the tree. The same integers as the two launches.
__global__ void tree_accept_kernel(int32_t* accepted, const float* x, int N, const int32_t* tokens,
                                   const int32_t* parents, int M, unsigned* done) {
    chain_acquire();
    chain_release();
    const float* r = x + static_cast<long>(blockIdx.x) * N;
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int j = threadIdx.x; j < N; j += blockDim.x)
        if (r[j] > v || i == 0x7fffffff) { v = r[j]; i = j; }
    block_argmax(v, i);
    __shared__ bool last;
    if (threadIdx.x == 0) {
        accepted[AcceptedPath::kPath + M + blockIdx.x] = i;  // post[blockIdx.x]
        __threadfence();
        last = atomicAdd(done, 1u) == static_cast<unsigned>(M - 1);
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    *done = 0;
    tree_walk(accepted, tokens, parents, M);
}

}  // namespace

void argmax(Context& ctx, int32_t* out, const float* x, int M, int N) {
    if (M <= 0) return;
    launch_op("argmax_kernel launch", argmax_kernel, dim3(M), dim3(kRowThreads), 0, ctx.stream, out, x, N);
}

void log_softmax_topk(Context& ctx, int32_t* tokens, float* logprob, const float* x, int M, int N, int K) {
    if (M <= 0 || K <= 0) return;
    if (K > N) throw std::runtime_error("log_softmax_topk: K = " + std::to_string(K) + " > N = " + std::to_string(N));
    launch_op("log_softmax_topk_kernel launch", log_softmax_topk_kernel, dim3(M), dim3(kRowThreads), 0, ctx.stream, tokens,
              logprob, x, N, K);
}

void tree_accept(Context& ctx, int32_t* accepted, const float* logits, int V, const int32_t* tokens,
                 const int32_t* parents, int M) {
    if (M <= 0) return;
    unsigned* done = ctx.accept_count.get<unsigned>(1);
    launch_op("tree_accept_kernel launch", tree_accept_kernel, dim3(M), dim3(kRowThreads), 0, ctx.stream, accepted,
              logits, V, tokens, parents, M, done);
}

}  // namespace kd::cuda
