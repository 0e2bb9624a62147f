"""DDTree (diffusion draft tree) greedy decoding, reference form (engine_src/README.md, "DDTree").

One round: the drafter gives per-depth log-probabilities; a best-first heap over rank tuples
picks the top-B prefixes; the tree (root = bonus token) is verified in one target forward
under an ancestor-only mask; the greedy walk accepts the longest path the target agrees with,
and the accepted latent-cache rows are compacted in place. Output equals greedy AR decoding.
"""

import heapq
from dataclasses import dataclass

import numpy as np

from .drafter import AnyDrafter
from .model import KVCache, Transformer, log_softmax, prefill


@dataclass
class Tree:
    """A compiled draft tree: node 0 is the root (the bonus token), then nodes in pop order."""

    tokens: np.ndarray   # [1+B] token ids
    parents: np.ndarray  # [1+B] parent index, -1 for the root; parents[i] < i
    depths: np.ndarray   # [1+B] 0 for the root
    ranks: list          # rank tuple of each node (() for the root)


def rank_order(lq: np.ndarray, k: int) -> np.ndarray:
    """Token ids of the k best entries per depth of lq [L][V]; ties: lower token id first."""
    return np.argsort(-lq, axis=-1, kind="stable")[:, :k]


def top_prefixes(lq: np.ndarray, budget: int) -> list[tuple]:
    """The top-`budget` rank tuples (prefixes) under the factorised draft distribution, in pop order.

    A tuple's score is sum_d lq[d][order[d][rank_d]], summed from depth 1 down; the heap pops the
    highest score first, ties to the lexicographically smaller rank tuple.
    """
    depth_max, vocab = lq.shape
    k = min(budget, vocab)
    if k < 1 or depth_max < 1:
        return []
    order = rank_order(lq, k)
    terms = [[float(lq[d, order[d, r]]) for r in range(k)] for d in range(depth_max)]
    heap = [(-terms[0][0], (0,), 0.0)]     # (-score, ranks, score of ranks[:-1])
    popped = []
    while heap and len(popped) < budget:
        neg, ranks, prefix_score = heapq.heappop(heap)
        popped.append(ranks)
        depth, last = len(ranks), ranks[-1]
        if last + 1 < k:
            heapq.heappush(heap, (-(prefix_score + terms[depth - 1][last + 1]),
                                  ranks[:-1] + (last + 1,), prefix_score))
        if depth < depth_max:
            heapq.heappush(heap, (-(-neg + terms[depth][0]), ranks + (0,), -neg))
    return popped


def build_tree(bonus: int, lq: np.ndarray, budget: int) -> Tree:
    """Compile the top-`budget` prefixes of lq [L][V] into a tree rooted at `bonus`."""
    k = min(budget, lq.shape[1])
    order = rank_order(lq, k)
    prefixes = top_prefixes(lq, budget)
    index = {(): 0}
    tokens, parents, depths = [bonus], [-1], [0]
    for ranks in prefixes:
        index[ranks] = len(tokens)
        tokens.append(int(order[len(ranks) - 1, ranks[-1]]))
        parents.append(index[ranks[:-1]])
        depths.append(len(ranks))
    return Tree(np.array(tokens), np.array(parents), np.array(depths), [()] + prefixes)


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[n][n] bool: node i sees node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]      # parents come first, so their rows are complete
    return mask


def verify_mask(tree: Tree, start: int) -> np.ndarray:
    """[1+B][start+1+B] visibility for a verify forward: the committed cache plus ancestors and self."""
    n = len(tree.tokens)
    return np.concatenate([np.ones((n, start), dtype=bool), ancestor_mask(tree.parents)], axis=1)


def accept_path(tree: Tree, post: np.ndarray) -> list[int]:
    """Greedy walk: from the root, move to the child whose token is post[cur] while there is one."""
    children = {}
    for i in range(1, len(tree.tokens)):
        children.setdefault(int(tree.parents[i]), {})[int(tree.tokens[i])] = i
    path = [0]
    while (nxt := children.get(path[-1], {}).get(int(post[path[-1]]))) is not None:
        path.append(nxt)
    return path


def compact(cache: KVCache, start: int, path: list[int]) -> None:
    """Move the accepted rows start+path[j] to start+j (ascending, in place) and commit them."""
    for j, idx in enumerate(path):
        # idx >= j, so row start+idx has not been overwritten yet
        cache.c[:, :, start + j] = cache.c[:, :, start + idx]
        cache.k[:, :, start + j] = cache.k[:, :, start + idx]
    cache.length = start + len(path)


@dataclass
class DecodeResult:
    tokens: list[int]    # the n generated tokens
    accepted: list[int]  # acceptance length of each round (accepted nodes + 1)

    @property
    def accept_mean(self) -> float:
        return float(np.mean(self.accepted)) if self.accepted else 0.0


def decode(model: Transformer, drafter: AnyDrafter, prompt, n: int, budget: int,
           block: int | None = None) -> DecodeResult:
    """Greedy DDTree decode of n tokens after `prompt` with node budget B and block size <= L
    (the drafter's first `block` positions; budget 0 is plain AR decoding)."""
    block = block or drafter.block_size
    if not 1 <= block <= drafter.block_size:
        raise ValueError(f"block size {block} outside 1..{drafter.block_size} (the drafter's)")
    prompt = np.asarray(prompt)
    cache = KVCache(model.args, 1, capacity=len(prompt) + n + budget + 1, dtype=model.dtype)
    out = prefill(model, prompt[None], cache)
    bonus, hidden = int(np.argmax(out.logits[0, -1])), out.hidden[0, -1]
    tokens, accepted = [bonus], []
    while len(tokens) < n:
        lq = log_softmax(drafter.logits(hidden, model.embed_rows(bonus))[:block])
        tree = build_tree(bonus, lq, budget)
        start = cache.length
        out = model.forward(tree.tokens[None], start + tree.depths, verify_mask(tree, start), cache)
        post = np.argmax(out.logits[0], axis=-1)
        path = accept_path(tree, post)
        compact(cache, start, path)
        last = path[-1]
        tokens += [int(tree.tokens[i]) for i in path[1:]] + [int(post[last])]
        bonus, hidden = int(post[last]), out.hidden[0, last]
        accepted.append(len(path))
    return DecodeResult(tokens[:n], accepted)
