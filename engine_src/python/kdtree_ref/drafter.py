"""DFlash-style block drafters (engine_src/README.md, "The drafter") and the linear one's ridge fit.

A drafter reads the bonus token b and the target's final hidden state h_T (after the final
RMSNorm) at the position that produced b, as the feature f = [h_T ; embed[b]], and returns in one
pass the logits of the L block positions (position j is depth j+1). Two kinds, the header's
`drafter.kind`:

- "linear" (or no kind; the tiny configs'): logits_j = w[j] f + b[j], w [L][V][2h], b [L][V].
- "lowrank_head" (big configs, where [L][V][2h] would take gigabytes): logits_j =
  head (u[j] (v f)) + b[j], v [r][2h], u [L][h][r], b [L][V], `head` the model's own lm head
  [V][h], no extra norm; at k2wide's width 19 MB instead of 15 GB.

The fit is a ridge regression of one-hot targets (the target's own next L greedy tokens) on f,
scaled by a fixed temperature so its softmax is a usable distribution, and rounded to a 2^-GRID_BITS
grid before it is stored: a float64 solve differs across BLAS libraries in the last bits, and
the rounding makes the stored weights (and the bundle bytes) the same everywhere.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .model import Trajectory

GRID_BITS = 12          # stored weights are multiples of 2^-12
LOGIT_SCALE = 16.0      # ridge outputs (about 0..1) times this become the drafter's logits
RIDGE = 1.0             # lambda = RIDGE / 100 x the mean diagonal of the Gram matrix
SAFE_MARGIN = 1e-6      # trajectory steps closer than this to an argmax or routing tie are not used


@dataclass
class Drafter:
    """Drafter weights as stored: w [L][V][2h] and b [L][V], float32."""

    w: np.ndarray
    b: np.ndarray

    def __post_init__(self):
        self._w64 = np.asarray(self.w, dtype=np.float64)
        self._b64 = np.asarray(self.b, dtype=np.float64)

    @property
    def block_size(self) -> int:
        return self.w.shape[0]

    def logits(self, hidden: np.ndarray, embed_row: np.ndarray) -> np.ndarray:
        """Block logits [L][V] for h_T [h] and embed[b] [h], in float64."""
        return self._w64 @ np.concatenate([hidden, embed_row]) + self._b64


@dataclass
class LowRankDrafter:
    """A lowrank_head drafter: v [r][2h], u [L][h][r], b [L][V] (float32, as stored) and the model's
    head as a function of states [..., h] -> logits [..., V] (Transformer.head_logits)."""

    v: np.ndarray
    u: np.ndarray
    b: np.ndarray
    head: Callable[[np.ndarray], np.ndarray]

    def __post_init__(self):
        self._v64, self._u64 = np.asarray(self.v, dtype=np.float64), np.asarray(self.u, dtype=np.float64)
        self._b64 = np.asarray(self.b, dtype=np.float64)

    @property
    def block_size(self) -> int:
        return self.u.shape[0]

    @property
    def rank(self) -> int:
        return self.v.shape[0]

    def logits(self, hidden: np.ndarray, embed_row: np.ndarray) -> np.ndarray:
        """Block logits [L][V] for h_T [h] and embed[b] [h], in float64."""
        z = self._v64 @ np.concatenate([hidden, embed_row])            # [r]
        return self.head(self._u64 @ z) + self._b64                      # head([L][h]) + b


AnyDrafter = Drafter | LowRankDrafter


def training_pairs(traj: Trajectory, embed: np.ndarray, block: int):
    """Features [M][2h] and targets [M][L] (token ids) from greedy trajectories.

    A sample at step t uses f = [hidden_t ; embed[token_t]] and the next L tokens. Each
    trajectory is cut at its first near-tie (logit or routing margin below SAFE_MARGIN), so
    the data, and hence the fit, is the same on every machine.
    """
    margins = np.minimum(np.minimum(traj.logit_margin, traj.route_margin), traj.group_margin)
    safe = np.cumprod(margins >= SAFE_MARGIN, axis=1).astype(bool)
    feats, targets = [], []
    batch, n = traj.tokens.shape
    for s in range(batch):
        usable = int(np.sum(safe[s]))
        for t in range(usable - block):
            feats.append(np.concatenate([traj.hidden[s, t], embed[traj.tokens[s, t]]]))
            targets.append(traj.tokens[s, t + 1:t + 1 + block])
    return np.array(feats), np.array(targets)


def fit(features: np.ndarray, targets: np.ndarray, vocab: int) -> Drafter:
    """Ridge fit of one-hot targets on [f ; 1], scaled by LOGIT_SCALE and rounded to the grid."""
    m, dim = features.shape
    block = targets.shape[1]
    x = np.concatenate([features, np.ones((m, 1))], axis=1)
    gram = x.T @ x
    lam = RIDGE * np.trace(gram) / (dim + 1) / 100.0
    gram[np.diag_indices(dim + 1)] += lam
    # x.T @ onehot(targets), column (j, v) = sum of the samples whose depth-j target is v
    rhs = np.zeros((block * vocab, dim + 1))
    np.add.at(rhs, (np.arange(block) * vocab + targets).ravel(), np.repeat(x, block, axis=0))
    sol = np.linalg.solve(gram, rhs.T) * LOGIT_SCALE            # [dim+1][L*V]
    sol = np.round(sol * 2.0**GRID_BITS) * 2.0**-GRID_BITS
    w = sol[:dim].T.reshape(block, vocab, dim)
    b = sol[dim].reshape(block, vocab)
    return Drafter(w.astype(np.float32), b.astype(np.float32))
