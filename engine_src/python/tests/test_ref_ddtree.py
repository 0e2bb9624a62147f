"""Tree construction, masks, acceptance and compaction, checked against brute force."""

import itertools

import numpy as np
import pytest

from kdtree_ref import ddtree, prng
from kdtree_ref.model import KVCache, ModelArgs, log_softmax


def draft_logprobs(seed, depth, vocab, ties=False):
    """Per-depth log-probabilities; with ties, logits on a coarse grid so equal scores occur."""
    logits = prng.uniform(prng.stream_key("ddtree-test", seed), (depth, vocab)) * 3
    if ties:
        logits = np.round(logits)
    return log_softmax(logits)


def brute_force(lq, budget):
    """All rank tuples up to depth L with ranks < K, sorted by (-score, tuple); the first `budget`."""
    depth, vocab = lq.shape
    k = min(budget, vocab)
    order = ddtree.rank_order(lq, k)
    terms = [[float(lq[d, order[d, r]]) for r in range(k)] for d in range(depth)]
    scored = []
    for n in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=n):
            score = 0.0
            for d, r in enumerate(ranks):        # the heap sums depth by depth too
                score += terms[d][r]
            scored.append((-score, ranks))
    return [ranks for _, ranks in sorted(scored)[:budget]]


@pytest.mark.parametrize("seed,depth,vocab,budget,ties", [
    (0, 1, 5, 3, False), (1, 2, 4, 4, False), (2, 3, 5, 9, False), (3, 4, 3, 20, False),
    (4, 3, 6, 6, True), (5, 4, 4, 15, True), (6, 2, 7, 7, True), (7, 3, 3, 27, False),
])
def test_heap_equals_brute_force_top_prefixes(seed, depth, vocab, budget, ties):
    lq = draft_logprobs(seed, depth, vocab, ties)
    assert ddtree.top_prefixes(lq, budget) == brute_force(lq, budget)


def test_rank_order_breaks_ties_by_lower_token_id():
    lq = np.log(np.array([[0.1, 0.3, 0.1, 0.3, 0.2]]))
    assert list(ddtree.rank_order(lq, 5)[0]) == [1, 3, 4, 0, 2]


def test_budget_larger_than_the_tree_stops_early():
    lq = draft_logprobs(9, 2, 2)
    assert len(ddtree.top_prefixes(lq, 100)) == 2 + 4


def test_zero_budget_is_an_empty_tree():
    assert ddtree.top_prefixes(draft_logprobs(10, 3, 5), 0) == []
    assert list(ddtree.build_tree(7, draft_logprobs(10, 3, 5), 0).tokens) == [7]


def test_compiled_tree_is_consistent():
    lq = draft_logprobs(11, 4, 9)
    tree = ddtree.build_tree(42, lq, 25)
    assert tree.tokens[0] == 42 and tree.parents[0] == -1 and tree.depths[0] == 0
    order = ddtree.rank_order(lq, 9)
    for i in range(1, len(tree.tokens)):
        ranks = tree.ranks[i]
        assert tree.parents[i] < i
        assert tree.ranks[tree.parents[i]] == ranks[:-1]
        assert tree.depths[i] == len(ranks) == tree.depths[tree.parents[i]] + 1
        assert tree.tokens[i] == order[len(ranks) - 1, ranks[-1]]


def closure(parents):
    """Ancestor-or-self relation by repeated squaring of the parent relation."""
    n = len(parents)
    rel = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            rel[i, p] = True
    while True:
        nxt = (rel.astype(int) @ rel.astype(int)) > 0
        if np.array_equal(nxt, rel):
            return rel
        rel = nxt


@pytest.mark.parametrize("seed", range(4))
def test_mask_equals_ancestor_closure(seed):
    tree = ddtree.build_tree(0, draft_logprobs(seed, 5, 6), 30)
    np.testing.assert_array_equal(ddtree.ancestor_mask(tree.parents), closure(tree.parents))
    full = ddtree.verify_mask(tree, 7)
    assert full.shape == (31, 7 + 31) and full[:, :7].all()
    np.testing.assert_array_equal(full[:, 7:], closure(tree.parents))


def test_accept_walk_follows_target_argmax():
    # root 5 -> children 1 (idx 1), 2 (idx 2); 1 -> 3 (idx 3); 3 -> 4 (idx 4)
    tree = ddtree.Tree(np.array([5, 1, 2, 3, 4]), np.array([-1, 0, 0, 1, 3]), np.array([0, 1, 1, 2, 3]),
                       [(), (0,), (1,), (0, 0), (0, 0, 0)])
    assert ddtree.accept_path(tree, np.array([1, 3, 0, 9, 0])) == [0, 1, 3]
    assert ddtree.accept_path(tree, np.array([2, 0, 0, 0, 0])) == [0, 2]
    assert ddtree.accept_path(tree, np.array([7, 0, 0, 0, 0])) == [0]
    assert ddtree.accept_path(tree, np.array([1, 3, 0, 4, 8])) == [0, 1, 3, 4]


@pytest.mark.parametrize("path", [[0], [0, 1], [0, 2, 5], [0, 3, 4, 9], list(range(10))])
def test_compaction_equals_gather(path):
    args = ModelArgs(n_layers=2, kv_lora_rank=4, qk_rope_head_dim=2)
    cache = KVCache(args, batch=1, capacity=20)
    cache.c[:] = prng.uniform(1, cache.c.shape)
    cache.k[:] = prng.uniform(2, cache.k.shape)
    start = 6
    rows = [start + i for i in path]
    want_c, want_k = cache.c[:, :, rows].copy(), cache.k[:, :, rows].copy()
    committed = cache.c[:, :, :start].copy()
    ddtree.compact(cache, start, path)
    assert cache.length == start + len(path)
    np.testing.assert_array_equal(cache.c[:, :, start:start + len(path)], want_c)
    np.testing.assert_array_equal(cache.k[:, :, start:start + len(path)], want_k)
    np.testing.assert_array_equal(cache.c[:, :, :start], committed)
