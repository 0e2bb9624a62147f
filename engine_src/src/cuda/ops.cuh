// ops.cuh: the CUDA op launchers, one .cu file each. backend_cuda.cu maps backend.h onto them;
// the GPU benchmarks call them directly. Contracts are those of the same-named ops in backend.h.
// All pointers are device pointers unless named *_host; everything runs on ctx.stream.
#pragma once

#include "../backend.h"
#include "context.cuh"

namespace kd::cuda {

// matmul_w4a16.cu (W in the tiled layout of w4a16_core.cuh, which upload_w4a16 writes)
void matmul_w4a16(Context& ctx, float* y, const float* x, const int32_t* qw, const float* sc, int M, int N, int K);
// Words and scales of an N x K INT4 matrix in the tiled layout (N padded to 8 rows, K to 256 inputs).
size_t w4a16_tiled_words(int N, int K);
size_t w4a16_tiled_scales(int N, int K);
// Writes W (device memory, the bundle's layout: qw [N][K/8], sc [N][K/32]) in the tiled layout
// at q_out, s_out.
void w4a16_tile(Context& ctx, uint32_t* q_out, float* s_out, const uint32_t* qw, const float* sc, int N, int K);

// matmul_f32.cu: cuBLAS SGEMM (no TF32) when ctx.use_cublas (wide, large shapes), else
// matmul_f32_kernel. W is a weight: the kernel may read it before the kernel queued just before
// it has finished (MmParams::weights_early), so that kernel must not write W.
void matmul_f32(Context& ctx, float* y, const float* x, const float* W, const float* bias, int M, int N, int K);
void matmul_f32_kernel(Context& ctx, float* y, const float* x, const float* W, const float* bias, int M, int N,
                       int K);
// Creates the cuBLAS handle on ctx.stream (no-op and false in builds without cuBLAS).
bool cublas_init(Context& ctx);
void cublas_destroy(Context& ctx);

// moe_ffn.cu
void moe_ffn(Context& ctx, float* out, const float* x, const int32_t* idx, const float* weight, int M, int top_k,
             const ExpertWeights& experts);
// moe_gate, then moe_ffn on its idx and weight (backend.h's moe_gate_ffn): at one row the gate's
// kernel also writes moe_ffn's routing lists, one launch less.
void moe_gate_ffn(Context& ctx, float* out, const float* x, int32_t* idx, float* weight, const float* logits,
                  const float* bias, int M, const MoeRouting& routing, const ExpertWeights& experts);

// The routing lists of moe_ffn's grouped launches (device memory; moe_ffn.cu says what they
// hold): slot s < *n_active is expert set slot_expert[s] (ascending) with the pairs
// [slot_start[s], slot_start[s + 1]), pair p being row pair_token[p] and pair id pair_id[p].
struct MoeLists {
    int* slot_expert = nullptr;
    int* slot_start = nullptr;
    int* n_active = nullptr;
    int* pair_token = nullptr;
    int* pair_id = nullptr;
    int n_sets = 0;   // expert sets: the routed ones, + the shared one when it is a slot (the last)
    int n_pairs = 0;  // the routed pairs (M x top_k), + one per row when the shared set is a slot
};

// moe_gate.cu. lists (one row only): also writes them for the gate's experts.
void moe_gate(Context& ctx, int32_t* idx, float* weight, const float* logits, const float* bias, int M,
              const MoeRouting& routing, const MoeLists* lists = nullptr);

// mla_attention.cu (committed, parent: device copies of Visibility::committed and parent_host;
// max_rows: the most cache rows the call may see, committed + M at most, for its shared memory)
void mla_attention(Context& ctx, float* out, const float* q, const float* wkv_b, const float* cache,
                   const int32_t* committed, const int32_t* parent, int M, int max_rows, const MlaDims& dims);

// rmsnorm.cu
void rmsnorm(Context& ctx, float* out, int out_stride, const float* x, int x_stride, const float* w, int M, int n,
             float eps);

// rope.cu (pos: device)
void rope(Context& ctx, float* x, int M, int row_stride, int n_vec, int vec_stride, int offset, int d_r,
          const int32_t* pos, const RopeTable& table);

// elementwise.cu (tokens, committed, accepted, index: device)
void silu_mul(Context& ctx, float* out, const float* a, const float* b, size_t n);
void add(Context& ctx, float* out, const float* a, const float* b, size_t n);
void embedding(Context& ctx, float* out, int out_stride, const float* table, int dim, const int32_t* tokens, int M);
void kv_compact(Context& ctx, float* caches, long layer_stride, int layers, int row_width, const int32_t* committed,
                const int32_t* accepted);
void gather_rows(Context& ctx, float* dst, int dst_stride, const float* src, int width, const int32_t* index, int n);
// cache rows [*committed, *committed + M) = rows (committed: device)
void kv_append(Context& ctx, float* cache, int row_width, const int32_t* committed, const float* rows, int M);

// argmax.cu (results in device memory)
void argmax(Context& ctx, int32_t* out, const float* x, int M, int N);
void log_softmax_topk(Context& ctx, int32_t* tokens, float* logprob, const float* x, int M, int N, int K);
void tree_accept(Context& ctx, int32_t* accepted, const float* logits, int V, const int32_t* tokens,
                 const int32_t* parents, int M);

}  // namespace kd::cuda
