// tree.cpp: best-first heap over rank tuples, O(B log B) for a budget of B nodes.
#include "tree.h"

#include <cstddef>
#include <queue>

namespace kd {
namespace {

struct Entry {
    double score;                // sum of log-probabilities along the ranks
    double prefix_score;         // score of ranks without the last element
    std::vector<int32_t> ranks;  // rank per depth, depth = ranks.size()
    int32_t parent;              // tree index of the node with ranks[:-1] (0 = root)
};

// std::priority_queue pops the largest: "larger" = higher score, then smaller rank tuple.
struct PopsFirst {
    bool operator()(const Entry& a, const Entry& b) const {
        if (a.score != b.score) return a.score < b.score;
        return a.ranks > b.ranks;
    }
};

}  // namespace

DraftTree build_tree(int32_t bonus, const std::vector<int32_t>& tokens, const std::vector<float>& logprobs,
                     int depth, int K, int budget) {
    DraftTree t;
    t.tokens.push_back(bonus);
    t.parents.push_back(-1);
    t.depths.push_back(0);
    if (budget <= 0 || depth <= 0 || K <= 0) return t;
    const auto lq = [&](int d, int r) { return static_cast<double>(logprobs[static_cast<size_t>(d) * K + r]); };
    std::priority_queue<Entry, std::vector<Entry>, PopsFirst> heap;
    heap.push(Entry{lq(0, 0), 0.0, std::vector<int32_t>{0}, 0});
    while (!heap.empty() && static_cast<int>(t.tokens.size()) - 1 < budget) {
        Entry e = heap.top();
        heap.pop();
        const int d = static_cast<int>(e.ranks.size()), last = e.ranks.back();
        const int32_t index = static_cast<int32_t>(t.tokens.size());
        t.tokens.push_back(tokens[static_cast<size_t>(d - 1) * K + last]);
        t.parents.push_back(e.parent);
        t.depths.push_back(d);
        if (last + 1 < K) {
            Entry sibling{e.prefix_score + lq(d - 1, last + 1), e.prefix_score, e.ranks, e.parent};
            sibling.ranks.back() = last + 1;
            heap.push(std::move(sibling));
        }
        if (d < depth) {
            Entry child{e.score + lq(d, 0), e.score, e.ranks, index};
            child.ranks.push_back(0);
            heap.push(std::move(child));
        }
    }
    return t;
}

std::vector<int32_t> accept_path(const int32_t* tokens, const int32_t* parents, int M, const int32_t* post) {
    std::vector<int32_t> path{0};
    for (;;) {
        const int32_t cur = path.back();
        int32_t next = -1;
        // Children come after their parent; siblings carry distinct tokens, so at most one matches.
        for (int32_t i = cur + 1; i < M && next < 0; ++i)
            if (parents[i] == cur && tokens[i] == post[cur]) next = i;
        if (next < 0) return path;
        path.push_back(next);
    }
}

}  // namespace kd
