// moe_ffn.cu: the experts of one MoE layer as four launches whatever the routing:
//   1. moe_lists_kernel groups the (row, slot) pairs by expert (deterministic order: experts
//      ascending, then pairs ascending), all on the device, so the layer can be graph-captured
//      (moe_gate_ffn at one row: the gate's kernel writes the same lists, and this launch goes);
//   2. one grouped launch for w1 and w3 together (fused SwiGLU epilogue) over every selected
//      expert, then one for w2: INT4 experts run on w4a16_core.cuh's kernel, fp32 experts on
//      mm_core.cuh's grouped mm_kernel; a row comes out bit-identical to matmul_w4a16 /
//      matmul_f32_kernel on one row;
//   3. moe_combine_kernel: out[m] = sum_j weight[m][j] * y[m][j], j ascending, + the shared
//      expert's row. At one row the shared expert is one more slot of the grouped launches, and
//      so it is at any row count when it is small (kSmallExpert); else at more rows it has two
//      plain launches of its own (a slot would take passes over all rows at the grouped
//      launch's small pass size). Same rows either way.
#include "mm_core.cuh"
#include "ops.cuh"
#include "w4a16_core.cuh"

namespace kd::cuda {

namespace {

constexpr int kListThreads = 256;
// A shared expert with at most this many weights per projection (inter x dim) stays a slot of the
// grouped launches at any row count (issue 21, fifth pass): its second pass over weights this
// small costs less than the two launches of its own it would take (a tiny bundle's DDTree round
// lost 10 launches; K2's 2048 x 7168 keeps its own launches above one row).
constexpr long kSmallExpert = 1L << 20;

// Pair i = m * top_k + j (i < n_routed) routes row m to expert idx[i]; pair n_routed + m
// (m < n_pairs - n_routed) row m to expert E - 1, the shared one. Outputs: for each slot
// s < *n_active, slot_expert[s] (ascending) and its pairs [slot_start[s], slot_start[s + 1]) in
// pair_token (the row m) and pair_id (i).
__global__ void moe_lists_kernel(const int32_t* idx, int n_routed, int n_pairs, int top_k, int E, int* slot_expert,
                                 int* slot_start, int* n_active, int* pair_token, int* pair_id) {
    extern __shared__ int sm[];
    chain_acquire();
    chain_release();
    int* cnt = sm;               // [E]
    int* start = sm + E;         // [E]
    int* slot = sm + 2 * E;      // [E]
    int* pairs = sm + 3 * E;     // [n_pairs]
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) pairs[i] = i < n_routed ? idx[i] : E - 1;
    __syncthreads();
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int e = pairs[i];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        // Exclusive scans of the counts and of the "expert is used" flags: lane l owns a
        // contiguous range of experts.
        const int lane = threadIdx.x, per = (E + 31) / 32, e0 = lane * per, e1 = min(E, e0 + per);
        int c = 0, a = 0;
        for (int e = e0; e < e1; ++e) { c += cnt[e]; a += cnt[e] > 0; }
        int cs = c, as = a;
        for (int o = 1; o < 32; o <<= 1) {
            const int tc = __shfl_up_sync(0xffffffffu, cs, o), ta = __shfl_up_sync(0xffffffffu, as, o);
            if (lane >= o) { cs += tc; as += ta; }
        }
        cs -= c;
        as -= a;
        for (int e = e0; e < e1; ++e) {
            start[e] = cs;
            slot[e] = as;
            cs += cnt[e];
            as += cnt[e] > 0;
        }
        if (lane == 31) {
            *n_active = as;
            slot_start[as] = cs;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        if (cnt[e] == 0) continue;
        slot_expert[slot[e]] = e;
        slot_start[slot[e]] = start[e];
        int pos = start[e];
        for (int i = 0; i < n_pairs; ++i)
            if (pairs[i] == e) {
                pair_token[pos] = i < n_routed ? i / top_k : i - n_routed;
                pair_id[pos] = i;
                ++pos;
            }
    }
}

// y_shared: the shared expert's rows [M][dim], or null. B > 1 (one row): a thread's loads B pairs
// at a time and the shared row beside them, all in flight before the first addition (as
// w4_sum_kernel's); B = 1: each pair after the last, the code as it was (see w4_sum_kernel). The
// same additions in the same order.
template <int B>
__global__ void moe_combine_kernel(float* out, const float* y, const float* y_shared, const float* weight, int M,
                                   int top_k, int dim) {
    chain_acquire();
    chain_release();
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if (i >= static_cast<long>(M) * dim) return;
    const int m = static_cast<int>(i / dim), d = static_cast<int>(i % dim);
    float acc = 0.0f;
    if constexpr (B == 1) {
        for (int j = 0; j < top_k; ++j)
            acc += weight[m * top_k + j] * y[(static_cast<long>(m) * top_k + j) * dim + d];
        if (y_shared) acc += y_shared[i];
    } else {
        const float shared = y_shared ? y_shared[i] : 0.0f;
        for (int j0 = 0; j0 < top_k; j0 += B) {
            float wj[B], yj[B];
#pragma unroll
            for (int j = 0; j < B; ++j)
                if (j0 + j < top_k) {
                    wj[j] = weight[m * top_k + j0 + j];
                    yj[j] = y[(static_cast<long>(m) * top_k + j0 + j) * dim + d];
                }
#pragma unroll
            for (int j = 0; j < B; ++j)
                if (j0 + j < top_k) acc += wj[j] * yj[j];
        }
        if (y_shared) acc += shared;
    }
    out[i] = acc;
}

// The routing lists of M rows of top_k pairs, in ctx.moe_lists: the grouped launches' pairs are
// the routed ones, then at one row (or a small shared expert) the shared expert's.
MoeLists moe_lists_at(Context& ctx, int M, int top_k, const ExpertWeights& w) {
    const bool shared_slot = w.shared && (M == 1 || static_cast<long>(w.inter) * w.dim <= kSmallExpert);
    MoeLists l;
    l.n_pairs = M * top_k + (shared_slot ? M : 0);
    l.n_sets = w.n_experts + (shared_slot ? 1 : 0);
    const int max_slots = std::min(l.n_sets, l.n_pairs);
    l.slot_expert = ctx.moe_lists.get<int>(static_cast<size_t>(2 * max_slots + 2 + 2 * l.n_pairs));
    l.slot_start = l.slot_expert + max_slots;  // [max_slots + 1]
    l.n_active = l.slot_start + max_slots + 1;
    l.pair_token = l.n_active + 1;
    l.pair_id = l.pair_token + l.n_pairs;
    return l;
}

// The layer for at most KD_W4_GROUPED_ROWS rows (moe_ffn takes more rows in such passes). built:
// lists the gate's kernel wrote for idx (moe_lists_at's, one row); null: made here from idx.
void moe_ffn_rows(Context& ctx, float* out, const float* x, const int32_t* idx, const float* weight, int M, int top_k,
                  const ExpertWeights& w, const MoeLists* built = nullptr) {
    const int E = w.n_experts, D = w.dim, I = w.inter;
    const int n_routed = M * top_k;
    const MoeLists l = built ? *built : moe_lists_at(ctx, M, top_k, w);
    const int n_pairs = l.n_pairs, n_sets = l.n_sets, max_slots = std::min(n_sets, n_pairs);
    const bool shared_slot = n_sets > E;
    int* slot_expert = l.slot_expert;
    int* slot_start = l.slot_start;
    int* n_active = l.n_active;
    int* pair_token = l.pair_token;
    int* pair_id = l.pair_id;
    if (!built) {
        const size_t list_smem = sizeof(int) * (3 * static_cast<size_t>(n_sets) + n_pairs);
        if (list_smem > 48 * 1024)
            throw std::runtime_error("moe_ffn: " + std::to_string(E) + " experts x " + std::to_string(n_pairs) +
                                     " pairs exceed the routing kernel's shared memory");
        launch_chained("moe_lists_kernel launch", moe_lists_kernel, dim3(1), dim3(kListThreads), list_smem, ctx.stream,
                       idx, n_routed, n_pairs, top_k, n_sets, slot_expert, slot_start, n_active, pair_token, pair_id);
    }

    // h and y rows: one per pair, then (shared expert on its own launches) one per row.
    const int shared_rows = w.shared ? M : 0;
    float* h = ctx.moe_h.get<float>(static_cast<size_t>(n_routed + shared_rows) * I);
    float* y = ctx.moe_y.get<float>(static_cast<size_t>(n_routed + shared_rows) * D);
    float* y_shared = w.shared ? y + static_cast<long>(n_routed) * D : nullptr;
    float* h_shared = h + static_cast<long>(n_routed) * I;
    // Token rows per pass of the grouped launches: twice the mean number of rows an expert gets
    // (more rows take more passes over the same weights, which L2 still holds); spares registers
    // and staging for the common case of one or two rows per expert. The result does not depend on it.
    const int pass_rows = std::min(M, std::max(1, 2 * ceil_div(n_pairs, E)));
    // w1, w3 -> h = silu(w1 x) * (w3 x), one row per pair; w2: y[pair_id] = w2 h. The shared
    // expert (when not a slot) on launches of its own: h's last rows, then w2 into y_shared.
    if (w.int4) {
        // Projection j (1, 2, 3) of expert set e of the stacks (tiled layout: see backend.h).
        const auto words = [&](int j) { return static_cast<long>(j == 2 ? w4a16_tiled_words(D, I) : w4a16_tiled_words(I, D)); };
        const auto scales = [&](int j) { return static_cast<long>(j == 2 ? w4a16_tiled_scales(D, I) : w4a16_tiled_scales(I, D)); };
        const auto q = [&](int j, long e) {
            return reinterpret_cast<const uint32_t*>(j == 1 ? w.q1 : j == 2 ? w.q2 : w.q3) + e * words(j);
        };
        const auto s = [&](int j, long e) { return (j == 1 ? w.s1 : j == 2 ? w.s2 : w.s3) + e * scales(j); };
        const auto projection = [&](int j, long e, const float* in, int ld_in, float* o, int ld_out, int n_out, int k_in) {
            W4Params p;
            p.q = q(j, e);
            p.s = s(j, e);
            if (j == 1) {
                p.q3 = q(3, e);
                p.s3 = s(3, e);
            }
            p.q_estride = words(j);
            p.s_estride = scales(j);
            p.x = in;
            p.ldx = ld_in;
            p.y = o;
            p.ldy = ld_out;
            p.N = n_out;
            p.K = k_in;
            p.M = M;
            return p;
        };
        const auto grouped = [&](W4Params p) {
            p.slot_expert = slot_expert;
            p.slot_start = slot_start;
            p.n_active = n_active;
            p.M = n_pairs;
            return p;
        };
        W4Params up = grouped(projection(1, 0, x, D, h, I, I, D));
        up.row_in = pair_token;
        // One row: the split-K sums' loads together (W4Params::sum_together; with the combine's,
        // 87.6 -> 86.4 us at one token on an H200, issue 38's fourth MoE pass). At every row count
        // the second pass had 16 tokens slower with them, so more rows keep one after another.
        up.sum_together = M == 1;
        // One row: the shared expert is the last slot (every routed expert is below it), and its
        // blocks prefetch its w1/w3 into L2 while the router and the gate run (W4Params::prefetch_slot).
        if (M == 1 && shared_slot) {
            up.prefetch_slot = max_slots - 1;
            up.prefetch_expert = E;
        }
        W4Params down = grouped(projection(2, 0, h, I, y, D, D, I));
        down.row_out = pair_id;
        // Its weights are the model's, its lists were written before w1/w3's launch (by the gate
        // or moe_lists_kernel): its first loads may overlap w1/w3's sum (W4Params::early).
        down.early = true;
        down.sum_together = M == 1;
        w4_run<true>(ctx, up, M, pass_rows, max_slots);
        w4_run<false>(ctx, down, M, pass_rows, max_slots);
        if (w.shared && !shared_slot) {
            w4_run<true>(ctx, projection(1, E, x, D, h_shared, I, I, D), M, M, 1);
            w4_run<false>(ctx, projection(2, E, h_shared, I, y_shared, D, D, I), M, M, 1);
        }
    } else {
        const auto set = [&](int j, long e) {
            return MmWeights{(j == 1 ? w.w1 : j == 2 ? w.w2 : w.w3) + e * static_cast<long>(I) * D};
        };
        MmParams p;
        p.w_estride = static_cast<long>(I) * D;
        p.sched = ctx.sched.get<unsigned>(2 * static_cast<size_t>(max_slots));
        p.slot_expert = slot_expert;
        p.slot_start = slot_start;
        p.n_active = n_active;
        p.M = n_pairs;
        // The fields of one projection: weights a (and b, the w3 of a fused SwiGLU epilogue), input
        // rows x (ldx apart), output rows y (ldy apart), N outputs of K inputs.
        const auto projection = [](MmParams q, MmWeights a, MmWeights b, const float* in, int ld_in, float* o,
                                   int ld_out, int n_out, int k_in) {
            q.a = a;
            q.b = b;
            mm_set_rows(q, in, ld_in, o, ld_out, n_out, k_in);
            return q;
        };
        MmParams up = projection(p, set(1, 0), set(3, 0), x, D, h, I, I, D);
        up.row_in = pair_token;
        MmParams down = projection(p, set(2, 0), MmWeights{}, h, I, y, D, D, I);
        down.row_out = pair_id;
        mm_launch<true>(up, pass_rows, max_slots, ctx.num_sms, ctx.stream);
        mm_launch<false>(down, pass_rows, max_slots, ctx.num_sms, ctx.stream);
        if (w.shared && !shared_slot) {
            MmParams shared_up = projection(MmParams{}, set(1, E), set(3, E), x, D, h_shared, I, I, D);
            shared_up.M = M;
            shared_up.sched = p.sched;
            mm_launch<true>(shared_up, M, 1, ctx.num_sms, ctx.stream);
            MmParams shared_down;
            shared_down.a = set(2, E);
            mm_run_plain(ctx, shared_down, y_shared, h_shared, M, D, I);
        }
    }

    const long n = static_cast<long>(M) * D;
    const auto combine = M == 1 ? moe_combine_kernel<KD_W4_SUM_BATCH> : moe_combine_kernel<1>;
    launch_chained("moe_combine_kernel launch", combine, dim3(ceil_div(n, 256)), dim3(256), 0, ctx.stream, out,
                   static_cast<const float*>(y), static_cast<const float*>(y_shared), weight, M, top_k, D);
}

// Throws where moe_ffn cannot run these experts.
void moe_ffn_check(const ExpertWeights& w) {
    if (w.dim % 32 != 0 || w.inter % 32 != 0)
        throw std::runtime_error("moe_ffn: dim and inter must be multiples of 32 (dim " + std::to_string(w.dim) +
                                 ", inter " + std::to_string(w.inter) + ")");
    if (w.int4 ? !(w.q1 && w.q2 && w.q3 && w.s1 && w.s2 && w.s3) : !(w.w1 && w.w2 && w.w3))
        throw std::runtime_error("moe_ffn: expert weights missing for the chosen format");
}

}  // namespace

void moe_ffn(Context& ctx, float* out, const float* x, const int32_t* idx, const float* weight, int M, int top_k,
             const ExpertWeights& w) {
    if (M <= 0) return;
    moe_ffn_check(w);
    // Passes of at most KD_W4_GROUPED_ROWS rows (a row's result does not depend on its pass).
    for (int m0 = 0; m0 < M; m0 += KD_W4_GROUPED_ROWS) {
        const long d = static_cast<long>(m0) * w.dim, k = static_cast<long>(m0) * top_k;
        moe_ffn_rows(ctx, out + d, x + d, idx + k, weight + k, std::min(KD_W4_GROUPED_ROWS, M - m0), top_k, w);
    }
}

void moe_gate_ffn(Context& ctx, float* out, const float* x, int32_t* idx, float* weight, const float* logits,
                  const float* bias, int M, const MoeRouting& routing, const ExpertWeights& experts) {
    if (M != 1) {
        moe_gate(ctx, idx, weight, logits, bias, M, routing);
        moe_ffn(ctx, out, x, idx, weight, M, routing.top_k, experts);
        return;
    }
    moe_ffn_check(experts);
    const MoeLists lists = moe_lists_at(ctx, 1, routing.top_k, experts);
    moe_gate(ctx, idx, weight, logits, bias, 1, routing, &lists);
    moe_ffn_rows(ctx, out, x, idx, weight, 1, routing.top_k, experts, &lists);
}

}  // namespace kd::cuda
