// decode.cpp: the decode loops. They talk to the model (and through it to the backend) only.
#include "decode.h"
#include "tree.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <numeric>
#include <stdexcept>

namespace kd {
namespace {

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void check_request(const Model& model, const std::vector<int32_t>& prompt, int n) {
    if (prompt.empty()) throw std::runtime_error("generate: the prompt is empty");
    if (n < 1) throw std::runtime_error("generate: asked for " + std::to_string(n) + " tokens");
    for (size_t i = 0; i < prompt.size(); ++i)
        if (prompt[i] < 0 || prompt[i] >= model.config().vocab_size)
            throw std::runtime_error("generate: prompt token " + std::to_string(i) + " = " + std::to_string(prompt[i]) +
                                     " is outside the vocabulary [0, " + std::to_string(model.config().vocab_size) + ")");
    if (prompt.size() + static_cast<size_t>(n) > static_cast<size_t>(model.config().max_seq_len))
        throw std::runtime_error("generate: prompt (" + std::to_string(prompt.size()) + ") + n (" + std::to_string(n) +
                                 ") exceeds max_seq_len " + std::to_string(model.config().max_seq_len));
}

// Runs the prompt causally from an empty cache; returns the first generated token.
int32_t prefill(Model& model, const std::vector<int32_t>& prompt) {
    const int P = static_cast<int>(prompt.size());
    std::vector<int32_t> pos(static_cast<size_t>(P)), parent(static_cast<size_t>(P));
    std::iota(pos.begin(), pos.end(), 0);
    std::iota(parent.begin(), parent.end(), -1);  // a chain: row i sees rows 0..i
    Visibility vis;
    vis.parent_host = parent.data();
    model.forward(prompt.data(), pos.data(), P, vis);
    int32_t next = 0;
    model.backend().argmax(&next, model.logits() + static_cast<long>(P - 1) * model.config().vocab_size, 1,
                           model.config().vocab_size);
    return next;
}

}  // namespace

double Generation::accept_mean() const {
    if (accepted.empty()) return 0.0;
    return std::accumulate(accepted.begin(), accepted.end(), 0.0) / static_cast<double>(accepted.size());
}

double Generation::tokens_per_second() const {
    const double t = prefill_seconds + decode_seconds;
    return t > 0 ? static_cast<double>(tokens.size()) / t : 0.0;
}

double Generation::decode_tokens_per_second() const {
    return decode_seconds > 0 && tokens.size() > 1 ? static_cast<double>(tokens.size() - 1) / decode_seconds : 0.0;
}

double Generation::prefill_tokens_per_second(size_t prompt_tokens) const {
    return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
}

double Generation::tokens_per_cpu_second() const {
    const double t = prefill_cpu_seconds + decode_cpu_seconds;
    return t > 0 ? static_cast<double>(tokens.size()) / t : 0.0;
}

double Generation::decode_tokens_per_cpu_second() const {
    return decode_cpu_seconds > 0 && tokens.size() > 1 ? static_cast<double>(tokens.size() - 1) / decode_cpu_seconds : 0.0;
}

double Generation::prefill_tokens_per_cpu_second(size_t prompt_tokens) const {
    return prefill_cpu_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_cpu_seconds : 0.0;
}

double Generation::cpu_share() const {
    const double wall = prefill_seconds + decode_seconds;
    return wall > 0 ? (prefill_cpu_seconds + decode_cpu_seconds) / wall : 0.0;
}

double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

int batch_rows_needed(size_t prompt_len, int budget) {
    const int64_t rows = std::max<int64_t>(static_cast<int64_t>(std::min<size_t>(prompt_len, INT32_MAX)), 1 + int64_t{std::max(budget, 0)});
    if (rows > INT32_MAX) throw std::runtime_error("generate: " + std::to_string(rows) + " rows per forward do not fit in an int");
    return static_cast<int>(rows);
}

Generation generate_ar(Model& model, const std::vector<int32_t>& prompt, int n) {
    check_request(model, prompt, n);
    Generation g;
    const double t0 = now_seconds(), c0 = cpu_seconds();
    g.tokens.push_back(prefill(model, prompt));
    model.backend().synchronize();
    const double t1 = now_seconds(), c1 = cpu_seconds();
    const BackendCounters k1 = model.backend().counters();
    const int32_t no_parent = -1;
    while (static_cast<int>(g.tokens.size()) < n) {
        int32_t token = g.tokens.back();
        const int32_t pos = static_cast<int32_t>(prompt.size() + g.tokens.size() - 1);
        Visibility vis;
        vis.committed = pos;
        vis.parent_host = &no_parent;
        model.forward(&token, &pos, 1, vis);
        ++g.forwards;
        model.backend().argmax(&token, model.logits(), 1, model.config().vocab_size);
        g.tokens.push_back(token);
    }
    g.decode_counters = model.backend().counters() - k1;
    g.prefill_seconds = t1 - t0;
    g.decode_seconds = now_seconds() - t1;
    g.prefill_cpu_seconds = c1 - c0;
    g.decode_cpu_seconds = cpu_seconds() - c1;
    return g;
}

Generation generate_ddtree(Model& model, const std::vector<int32_t>& prompt, int n, int budget, int block) {
    check_request(model, prompt, n);
    if (budget < 1) throw std::runtime_error("ddtree: the budget must be at least 1");
    if (budget >= model.max_batch())
        throw std::runtime_error("ddtree: budget " + std::to_string(budget) + " needs " + std::to_string(1 + budget) +
                                 " rows per forward; the model was sized for " + std::to_string(model.max_batch()));
    Backend& be = model.backend();
    const int D = model.config().dim, V = model.config().vocab_size;
    const int K = std::min(budget, V);
    Generation g;
    const double t0 = now_seconds(), c0 = cpu_seconds();
    g.tokens.push_back(prefill(model, prompt));
    be.synchronize();
    const double t1 = now_seconds(), c1 = cpu_seconds();
    const BackendCounters k1 = be.counters();
    // The first draft starts from the prompt's last state; every round ends with the next one.
    Model::Round r;
    r.bonus = g.tokens.back();
    model.draft(model.hidden() + static_cast<long>(prompt.size() - 1) * D, r.bonus, block, K, r.draft_tokens,
                r.draft_logprobs);
    std::vector<int32_t> pos;
    int start = static_cast<int>(prompt.size());
    while (static_cast<int>(g.tokens.size()) < n) {
        const DraftTree tree = build_tree(r.bonus, r.draft_tokens, r.draft_logprobs, block, K, budget);
        const int M = static_cast<int>(tree.tokens.size());
        pos.resize(static_cast<size_t>(M));
        for (int i = 0; i < M; ++i) pos[i] = start + tree.depths[i];
        Visibility vis;
        vis.committed = start;
        vis.parent_host = tree.parents.data();
        model.round(tree.tokens.data(), pos.data(), M, vis, block, K, r);
        ++g.forwards;
        for (size_t j = 1; j < r.path.size(); ++j) g.tokens.push_back(tree.tokens[r.path[j]]);
        g.tokens.push_back(r.bonus);
        g.accepted.push_back(static_cast<int32_t>(r.path.size()));
        start += static_cast<int>(r.path.size());
    }
    be.synchronize();
    g.decode_counters = be.counters() - k1;
    g.tokens.resize(static_cast<size_t>(n));
    g.prefill_seconds = t1 - t0;
    g.decode_seconds = now_seconds() - t1;
    g.prefill_cpu_seconds = c1 - c0;
    g.decode_cpu_seconds = cpu_seconds() - c1;
    return g;
}

}  // namespace kd
