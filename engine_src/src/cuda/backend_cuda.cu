// backend_cuda.cu: backend.h on one CUDA device. Ops are queued on one stream in call order;
// host-side inputs (*_host) are copied to device scratch before the op returns (a unit's at once,
// through pinned memory); ops with host outputs wait for their result. With KD_CUDA_GRAPH=1 a
// unit with a record key is captured into a CUDA graph and launched as one (see begin_unit).
// The kernels live in the other files of this folder.
#include "../backend.h"
#include "ops.cuh"

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

namespace kd {

namespace {

using cuda::Context;

class CudaBackend final : public Backend {
public:
    CudaBackend() {
        int count = 0;
        const cudaError_t err = cudaGetDeviceCount(&count);
        if (err != cudaSuccess || count == 0)
            throw std::runtime_error(std::string("cuda backend: no usable CUDA device (") +
                                     (err != cudaSuccess ? cudaGetErrorString(err) : "none found") + ")");
        KD_CUDA_CHECK(cudaGetDevice(&device_));
        KD_CUDA_CHECK(cudaDeviceGetAttribute(&ctx_.num_sms, cudaDevAttrMultiProcessorCount, device_));
        KD_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
        // KD_CUDA_MATMUL=kernel keeps matmul_f32 on our kernel even where cuBLAS was built in.
        const char* mode = std::getenv("KD_CUDA_MATMUL");
        ctx_.use_cublas = cuda::cublas_init(ctx_) && !(mode && std::string(mode) == "kernel");
        // KD_CUDA_GRAPH=1 records units into graphs; KD_CUDA_UNITS=0 ignores units (every op
        // copies its own host inputs, as before units existed: for comparison).
        const char* graph = std::getenv("KD_CUDA_GRAPH");
        const char* units = std::getenv("KD_CUDA_UNITS");
        units_ = !(units && std::string(units) == "0");
        graphs_ = units_ && graph && std::string(graph) == "1";
        KD_CUDA_CHECK(cudaEventCreateWithFlags(&staged_read_, cudaEventDisableTiming));
    }
    ~CudaBackend() override {
        cudaStreamSynchronize(ctx_.stream);
        for (auto& kv : graphs_by_key_) cudaGraphExecDestroy(kv.second.exec);
        cudaEventDestroy(staged_read_);
        if (pinned_) cudaFreeHost(pinned_);
        cuda::cublas_destroy(ctx_);
        cudaStreamDestroy(ctx_.stream);
    }

    std::string name() const override { return "cuda"; }

    std::string device_description() const override {
        cudaDeviceProp prop{};
        KD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
        int driver = 0, runtime = 0;
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        const auto ver = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
        return std::string(prop.name) + ", sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
               std::to_string(prop.multiProcessorCount) + " SMs, " +
               std::to_string(prop.totalGlobalMem >> 20) + " MiB, driver CUDA " + ver(driver) + ", runtime " +
               ver(runtime) + ", matmul_f32 via " + (ctx_.use_cublas ? "cuBLAS" : "kernel");
    }

    void* alloc(size_t nbytes) override {
        void* p = nullptr;
        const cudaError_t err = cudaMalloc(&p, std::max<size_t>(nbytes, 1));
        if (err != cudaSuccess)
            throw std::runtime_error("cuda alloc: " + std::to_string(nbytes) + " bytes: " + cudaGetErrorString(err));
        KD_CUDA_CHECK(cudaMemsetAsync(p, 0, nbytes, ctx_.stream));
        return p;
    }
    void release(void* buf) override {
        if (!buf) return;
        synchronize();
        KD_CUDA_CHECK(cudaFree(buf));
    }
    void upload(void* dst, const void* src_host, size_t nbytes) override {
        // From pageable memory the call returns once src_host has been staged.
        cuda::count_copy(cudaMemcpyHostToDevice);
        KD_CUDA_CHECK(cudaMemcpyAsync(dst, src_host, nbytes, cudaMemcpyHostToDevice, ctx_.stream));
    }
    void download(void* dst_host, const void* src, size_t nbytes) override {
        cuda::count_copy(cudaMemcpyDeviceToHost);
        KD_CUDA_CHECK(cudaMemcpyAsync(dst_host, src, nbytes, cudaMemcpyDeviceToHost, ctx_.stream));
        synchronize();
    }
    void copy(void* dst, const void* src, size_t nbytes) override {
        cuda::count_copy(cudaMemcpyDeviceToDevice);
        KD_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, ctx_.stream));
    }
    void synchronize() override {
        cuda::count_sync();
        KD_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    }

    // The unit's host inputs go into one pinned buffer and to the device in one copy (the ops
    // find them in ctx_.staged). With KD_CUDA_GRAPH=1 and a record key, the first unit of a key
    // runs eagerly (it sizes every scratch buffer: a capture must not grow one), the second is
    // captured and launched as a graph at end_unit, and later ones replay that graph (their ops
    // return at once) until a scratch buffer moves: then the key is captured again and its
    // executable graph updated in place (cudaGraphExecUpdate) or made anew when that fails.
    void begin_unit(std::initializer_list<HostInts> inputs, int record_key) override {
        if (!units_) return;
        if (unit_open_) throw std::runtime_error("cuda begin_unit: a unit is already open");
        size_t total = 0;
        for (const HostInts& a : inputs) total += static_cast<size_t>(std::max(a.n, 0));
        if (staged_pending_) {  // the previous unit's copy must have read the pinned buffer
            const cudaError_t done = cudaEventQuery(staged_read_);
            if (done == cudaErrorNotReady) {
                cuda::count_sync();
                KD_CUDA_CHECK(cudaEventSynchronize(staged_read_));
            } else {
                KD_CUDA_CHECK(done);
            }
            staged_pending_ = false;
        }
        if (total > pinned_cap_) {
            if (pinned_) KD_CUDA_CHECK(cudaFreeHost(pinned_));
            pinned_ = nullptr;
            pinned_cap_ = std::max(total, 2 * pinned_cap_);
            KD_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&pinned_), sizeof(int32_t) * pinned_cap_,
                                        cudaHostAllocDefault));
        }
        int32_t* dev = ctx_.staged_dev.get<int32_t>(std::max<size_t>(total, 1));
        size_t at = 0;
        ctx_.staged.clear();
        for (const HostInts& a : inputs) {
            const size_t n = static_cast<size_t>(std::max(a.n, 0));
            if (n) std::memcpy(pinned_ + at, a.data, sizeof(int32_t) * n);
            ctx_.staged.push_back({a.data, n, pinned_ + at, dev + at});
            at += n;
        }
        if (total) {
            cuda::count_copy(cudaMemcpyHostToDevice);
            KD_CUDA_CHECK(cudaMemcpyAsync(dev, pinned_, sizeof(int32_t) * total, cudaMemcpyHostToDevice, ctx_.stream));
            KD_CUDA_CHECK(cudaEventRecord(staged_read_, ctx_.stream));
            staged_pending_ = true;
        }
        unit_open_ = true;
        if (!graphs_ || record_key < 0 || warmed_.insert(record_key).second) return;
        const auto it = graphs_by_key_.find(record_key);
        if (it != graphs_by_key_.end() && it->second.exec && it->second.scratch_moves == cuda::counters().scratch_moves) {
            replaying_ = true;  // the ops return at once; end_unit launches the graph
            capture_key_ = record_key;
            return;
        }
        KD_CUDA_CHECK(cudaStreamBeginCapture(ctx_.stream, cudaStreamCaptureModeThreadLocal));
        cuda::counters().capturing = true;
        capture_key_ = record_key;
        captured_before_ = cuda::counters().captured;
    }
    void end_unit(bool completed) override {
        if (!units_) return;
        unit_open_ = false;
        ctx_.staged.clear();
        if (capture_key_ < 0) return;
        const int key = capture_key_;
        capture_key_ = -1;
        if (replaying_) {
            replaying_ = false;
            if (!completed) return;
            const Recorded& r = graphs_by_key_.at(key);
            cuda::counters().graph_launches++;
            cuda::counters().replayed += r.kernels;
            KD_CUDA_CHECK(cudaGraphLaunch(r.exec, ctx_.stream));
            return;
        }
        cuda::counters().capturing = false;
        cudaGraph_t graph = nullptr;
        const cudaError_t ended = cudaStreamEndCapture(ctx_.stream, &graph);
        if (!completed) {  // an op threw: drop what was captured, the op's error goes on
            if (graph) cudaGraphDestroy(graph);
            cudaGetLastError();
            return;
        }
        KD_CUDA_CHECK(ended);
        if (!graphs_by_key_.count(key) && graphs_by_key_.size() >= kMaxGraphs) {  // keys of models long gone
            for (auto& kv : graphs_by_key_) cudaGraphExecDestroy(kv.second.exec);
            graphs_by_key_.clear();
        }
        Recorded& rec = graphs_by_key_[key];
        rec.kernels = cuda::counters().captured - captured_before_;
        rec.scratch_moves = cuda::counters().scratch_moves;
        cudaGraphExec_t& exec = rec.exec;
        if (exec) {
            cudaGraphExecUpdateResultInfo info{};
            if (cudaGraphExecUpdate(exec, graph, &info) != cudaSuccess) {
                cudaGetLastError();  // not an error: the graph is made anew
                cudaGraphExecDestroy(exec);
                exec = nullptr;
            }
        }
        cudaError_t made = cudaSuccess;
        if (!exec) made = cudaGraphInstantiate(&exec, graph, 0);
        cudaGraphDestroy(graph);
        KD_CUDA_CHECK(made);
        cuda::counters().graph_launches++;
        KD_CUDA_CHECK(cudaGraphLaunch(exec, ctx_.stream));
    }
    BackendCounters counters() const override {
        const cuda::LaunchCounters& c = cuda::counters();
        BackendCounters b;
        b.kernels = c.launches + c.captured + c.replayed;
        b.launches = c.launches + c.graph_launches;
        b.graph_launches = c.graph_launches;
        b.h2d = c.h2d;
        b.d2h = c.d2h;
        b.d2d = c.d2d;
        b.syncs = c.syncs;
        return b;
    }
    size_t w4a16_words(int N, int K) const override { return cuda::w4a16_tiled_words(N, K); }
    size_t w4a16_scales(int N, int K) const override { return cuda::w4a16_tiled_scales(N, K); }
    void upload_w4a16(int32_t* qw, float* sc, const int32_t* qw_host, const float* sc_host, int N, int K) override {
        if (N <= 0 || K <= 0 || K % 32 != 0)
            throw std::runtime_error("upload_w4a16: N = " + std::to_string(N) + ", K = " + std::to_string(K) +
                                     " (K must be a positive multiple of 32)");
        // The bundle's layout to device scratch, then tiled there.
        const size_t words = static_cast<size_t>(N) * K / 8, scales = static_cast<size_t>(N) * K / 32;
        auto* raw = ctx_.w4_staging.get<uint32_t>(words + scales);
        upload(raw, qw_host, sizeof(uint32_t) * words);
        upload(raw + words, sc_host, sizeof(float) * scales);
        cuda::w4a16_tile(ctx_, reinterpret_cast<uint32_t*>(qw), sc, raw, reinterpret_cast<const float*>(raw + words), N, K);
    }

    void embedding(float* out, int out_stride, const float* table, int dim, const int32_t* tokens_host,
                   int M) override {
        if (replaying_) return;
        cuda::embedding(ctx_, out, out_stride, table, dim, ctx_.upload_ints(tokens_host, M), M);
    }
    void rmsnorm(float* out, int out_stride, const float* x, int x_stride, const float* w, int M, int n,
                 float eps) override {
        if (replaying_) return;
        cuda::rmsnorm(ctx_, out, out_stride, x, x_stride, w, M, n, eps);
    }
    void rope(float* x, int M, int row_stride, int n_vec, int vec_stride, int offset, int d_r,
              const int32_t* pos_host, const RopeTable& table) override {
        if (replaying_) return;
        cuda::rope(ctx_, x, M, row_stride, n_vec, vec_stride, offset, d_r, ctx_.upload_ints(pos_host, M), table);
    }
    void silu_mul(float* out, const float* a, const float* b, size_t n) override {
        if (replaying_) return;
        cuda::silu_mul(ctx_, out, a, b, n);
    }
    void add(float* out, const float* a, const float* b, size_t n) override {
        if (replaying_) return;
        cuda::add(ctx_, out, a, b, n);
    }

    void matmul_f32(float* y, const float* x, const float* W, const float* bias, int M, int N, int K) override {
        if (replaying_) return;
        cuda::matmul_f32(ctx_, y, x, W, bias, M, N, K);
    }
    void matmul_w4a16(float* y, const float* x, const int32_t* qw, const float* sc, int M, int N, int K) override {
        if (replaying_) return;
        cuda::matmul_w4a16(ctx_, y, x, qw, sc, M, N, K);
    }

    void mla_attention(float* out, const float* q, const float* wkv_b, const float* cache, const Visibility& vis,
                       int M, const MlaDims& dims) override {
        if (replaying_) return;
        for (int i = 0; i < M; ++i)
            if (vis.parent_host[i] >= i || vis.parent_host[i] < -1)
                throw std::runtime_error("mla_attention: parent of row " + std::to_string(i) + " is not below it");
        if (vis.capacity > 0 && vis.committed + M > vis.capacity)
            throw std::runtime_error("mla_attention: " + std::to_string(vis.committed + M) + " rows past the capacity " +
                                     std::to_string(vis.capacity));
        cuda::mla_attention(ctx_, out, q, wkv_b, cache, ctx_.upload_ints(&vis.committed, 1, &ctx_.host_committed),
                            ctx_.upload_ints(vis.parent_host, M), M, vis.capacity > 0 ? vis.capacity : vis.committed + M,
                            dims);
    }
    void kv_append(float* cache, int row_width, const Visibility& vis, const float* rows, int M) override {
        if (replaying_) return;
        cuda::kv_append(ctx_, cache, row_width, ctx_.upload_ints(&vis.committed, 1, &ctx_.host_committed), rows, M);
    }
    void kv_compact(float* caches, long layer_stride, int layers, int row_width, const Visibility& vis,
                    const int32_t* accepted) override {
        if (replaying_) return;
        cuda::kv_compact(ctx_, caches, layer_stride, layers, row_width,
                         ctx_.upload_ints(&vis.committed, 1, &ctx_.host_committed), accepted);
    }
    void gather_rows(float* dst, int dst_stride, const float* src, int width, const int32_t* index, int n) override {
        if (replaying_) return;
        cuda::gather_rows(ctx_, dst, dst_stride, src, width, index, n);
    }

    void moe_gate(int32_t* idx, float* weight, const float* logits, const float* bias, int M,
                  const MoeRouting& routing) override {
        if (replaying_) return;
        cuda::moe_gate(ctx_, idx, weight, logits, bias, M, routing);
    }
    void moe_ffn(float* out, const float* x, const int32_t* idx, const float* weight, int M, int top_k,
                 const ExpertWeights& experts) override {
        if (replaying_) return;
        cuda::moe_ffn(ctx_, out, x, idx, weight, M, top_k, experts);
    }
    void moe_gate_ffn(float* out, const float* x, int32_t* idx, float* weight, const float* logits, const float* bias,
                      int M, const MoeRouting& routing, const ExpertWeights& experts) override {
        if (replaying_) return;
        cuda::moe_gate_ffn(ctx_, out, x, idx, weight, logits, bias, M, routing, experts);
    }

    void argmax(int32_t* out_host, const float* x, int M, int N) override {
        if (M <= 0) return;
        int32_t* d = ctx_.small.get<int32_t>(static_cast<size_t>(M));
        cuda::argmax(ctx_, d, x, M, N);
        download(out_host, d, sizeof(int32_t) * M);
    }
    void log_softmax_topk(int32_t* tokens, float* logprob, const float* x, int M, int N, int K) override {
        if (replaying_) return;
        cuda::log_softmax_topk(ctx_, tokens, logprob, x, M, N, K);
    }
    void tree_accept(int32_t* accepted, const float* logits, int V, const int32_t* tokens_host,
                     const int32_t* parents_host, int M) override {
        if (replaying_) return;
        cuda::tree_accept(ctx_, accepted, logits, V, ctx_.upload_ints(tokens_host, M),
                          ctx_.upload_ints(parents_host, M, &ctx_.host_parents), M);
    }

private:
    int device_ = 0;
    Context ctx_;
    // Units (begin_unit): the pinned buffer of their host inputs and the event after its copy.
    int32_t* pinned_ = nullptr;
    size_t pinned_cap_ = 0;  // ints
    cudaEvent_t staged_read_ = nullptr;
    bool staged_pending_ = false, unit_open_ = false;
    // KD_CUDA_GRAPH=1: the keys run once eagerly, the key being captured, each key's graph
    // (at most kMaxGraphs kept).
    static constexpr size_t kMaxGraphs = 64;
    bool units_ = true, graphs_ = false;
    std::set<int> warmed_;
    int capture_key_ = -1;      // the key being captured or replayed
    bool replaying_ = false;    // the open unit's ops are in a recorded graph: they do nothing
    long captured_before_ = 0;  // the kernel counter when the capture began
    struct Recorded {
        cudaGraphExec_t exec = nullptr;
        long kernels = 0;        // kernels in the graph
        long scratch_moves = 0;  // the scratch moves counter when it was captured
    };
    std::map<int, Recorded> graphs_by_key_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace kd
