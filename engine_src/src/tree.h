// tree.h: DDTree draft-tree construction and greedy acceptance (host code, README "DDTree").
#pragma once

#include <cstdint>
#include <vector>

namespace kd {

// A compiled draft tree: node 0 is the root (the bonus token), then nodes in heap-pop order.
struct DraftTree {
    std::vector<int32_t> tokens;   // [1+B]
    std::vector<int32_t> parents;  // [1+B], -1 for the root, parents[i] < i
    std::vector<int32_t> depths;   // [1+B], 0 for the root
};

// Builds the top-`budget` prefixes under the factorised draft distribution. tokens / logprobs
// are [depth][K] per depth, best first (Backend::log_softmax_topk); K = min(budget, V).
// Heap order: highest score sum_d lq_d[rank_d] first, ties to the lexicographically smaller
// rank tuple.
DraftTree build_tree(int32_t bonus, const std::vector<int32_t>& tokens, const std::vector<float>& logprobs,
                     int depth, int K, int budget);

// Greedy walk from the root of a tree of M nodes (tokens, parents as in DraftTree; post[i] the
// target's token after node i): while a child of cur carries post[cur], move there. Returns the
// accepted node indices, root first (strictly ascending, so path[j] >= j). Backend::tree_accept's
// contract; the CPU backend runs it.
std::vector<int32_t> accept_path(const int32_t* tokens, const int32_t* parents, int M, const int32_t* post);

}  // namespace kd
