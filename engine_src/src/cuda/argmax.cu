// argmax.cu: per-row arg-max and the drafter's log-softmax top-K, one block per row, and the
// greedy walk of a verified draft tree.
#include "ops.cuh"

namespace kd::cuda {

namespace {

constexpr int kRowThreads = 256;

__global__ void argmax_kernel(int32_t* out, const float* x, int N) {
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
__global__ void tree_walk_kernel(int32_t* accepted, const int32_t* tokens, const int32_t* parents, int M) {
    int32_t* path = accepted + AcceptedPath::kPath;
    const int32_t* post = path + M;  // AcceptedPath::post(M) (a host function)
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

}  // namespace

void argmax(Context& ctx, int32_t* out, const float* x, int M, int N) {
    if (M <= 0) return;
    argmax_kernel<<<M, kRowThreads, 0, ctx.stream>>>(out, x, N);
    KD_CUDA_LAUNCH_CHECK("argmax_kernel");
}

void log_softmax_topk(Context& ctx, int32_t* tokens, float* logprob, const float* x, int M, int N, int K) {
    if (M <= 0 || K <= 0) return;
    if (K > N) throw std::runtime_error("log_softmax_topk: K = " + std::to_string(K) + " > N = " + std::to_string(N));
    log_softmax_topk_kernel<<<M, kRowThreads, 0, ctx.stream>>>(tokens, logprob, x, N, K);
    KD_CUDA_LAUNCH_CHECK("log_softmax_topk_kernel");
}

void tree_accept(Context& ctx, int32_t* accepted, const float* logits, int V, const int32_t* tokens,
                 const int32_t* parents, int M) {
    if (M <= 0) return;
    argmax(ctx, accepted + AcceptedPath::post(M), logits, M, V);
    tree_walk_kernel<<<1, 1, 0, ctx.stream>>>(accepted, tokens, parents, M);
    KD_CUDA_LAUNCH_CHECK("tree_walk_kernel");
}

}  // namespace kd::cuda
