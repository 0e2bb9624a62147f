"""The float64 reference with weights made on demand: a k2wide trajectory in a few GiB.

`StreamingTransformer` computes what `Transformer` computes over the weights of a bundle (its
header `quant`: fp32, int4, int4 keeping classes fp32) made by `weights.Weights`, without ever
holding them all: each routed expert is made when a forward routes rows to it, applied to those
rows and dropped (the MoE layers' weights are 94 % of k2wide); the embedding rows are made per
token; the dense FFN, the shared expert and the head are made once, kept in float32 (as the
bundle stores them, dequantized where INT4) and multiplied in float64 a block of rows at a time;
attention and router weights are kept in float64 as `Transformer` keeps them. The arithmetic is
the same as `Transformer`'s up to the order of float64 sums, so logits agree to about 1e-15.
"""

import numpy as np

from .model import Transformer, silu
from .quant import weight_class
from .weights import Weights

CHUNK_ROWS = 2048   # rows of a float32 matrix converted to float64 at a time (117 MB at h = 7168)


class StreamingTransformer(Transformer):
    """The reference model of the bundle `quant` (a header `quant` object) of `source`'s config."""

    def __init__(self, source: Weights, quant: dict, dtype=np.float64, chunk_rows: int = CHUNK_ROWS):
        super().__init__(source.args, {}, dtype)
        self.source, self.quant, self.chunk_rows = source, quant, chunk_rows
        self._scratch = np.empty(0, dtype=dtype)    # _wide's buffer, grown once and reused
        self.kept: dict[str, np.ndarray] = {}       # float32: dense FFN, shared expert, head
        for name, spec in source.specs.items():
            cls = weight_class(name)
            if name == "embed" or cls == "routed":
                continue                           # made per token / per forward
            if name == "head" or cls is not None:
                self.kept[name] = self._made_in_chunks(name, spec.shape)
                continue
            weight = source.model_weight(name, quant)
            if weight.ndim == 2:                   # used as x @ W.T (Transformer.wt); wkv_b also as W
                self.wt[name] = np.ascontiguousarray(weight.T, dtype=dtype)
            if weight.ndim == 1 or name.endswith("wkv_b"):
                self.w[name] = weight.astype(dtype)

    def _made_in_chunks(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 model weight made chunk_rows rows at a time (the PRNG's uint64 and float64
        temporaries of a whole 132M-element matrix would take 2 GB)."""
        out = np.empty(shape, dtype=np.float32)
        for r0 in range(0, shape[0], self.chunk_rows):
            r1 = min(r0 + self.chunk_rows, shape[0])
            out[r0:r1] = self.source.model_weight(name, self.quant, (r0, r1))
        return out

    def _wide(self, weight: np.ndarray) -> np.ndarray:
        """A float32 block in this model's dtype, in a buffer reused by the next call (a fresh array
        each time costs a page fault per 4 KB: a third of a decode step's time)."""
        if self._scratch.size < weight.size:
            self._scratch = np.empty(weight.size, dtype=self.dtype)
        wide = self._scratch[:weight.size].reshape(weight.shape)
        wide[...] = weight
        return wide

    def _rows(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x @ weight.T in this model's dtype, converting chunk_rows rows of the float32 weight at a time."""
        out = np.empty((*x.shape[:-1], weight.shape[0]), dtype=self.dtype)
        step = self.chunk_rows
        for r0 in range(0, weight.shape[0], step):
            out[..., r0:r0 + step] = x @ self._wide(weight[r0:r0 + step]).T
        return out

    def _swiglu(self, prefix: str, x: np.ndarray) -> np.ndarray:
        """w2 (silu(w1 x) * (w3 x)) with kept or freshly made weights, a block of the width at a time."""
        if ".ffn.experts." in prefix:
            w1, w2, w3 = (self.source.model_weight(prefix + p, self.quant) for p in ("w1", "w2", "w3"))
        else:
            w1, w2, w3 = (self.kept[prefix + p] for p in ("w1", "w2", "w3"))
        y = np.zeros((*x.shape[:-1], w2.shape[0]), dtype=self.dtype)
        for r0 in range(0, w1.shape[0], self.chunk_rows):
            r1 = r0 + self.chunk_rows
            a = silu(x @ self._wide(w1[r0:r1]).T)       # each product done before _wide's next use
            a *= x @ self._wide(w3[r0:r1]).T
            y += a @ self._wide(w2[:, r0:r1]).T
        return y

    def embed_rows(self, tokens) -> np.ndarray:
        """The embedding rows of tokens (any shape), each made on its own from the PRNG."""
        tokens = np.asarray(tokens)
        unique, inverse = np.unique(tokens, return_inverse=True)
        rows = np.stack([self.source.fp32("embed", (int(t), int(t) + 1))[0] for t in unique]).astype(self.dtype)
        return rows[inverse.reshape(tokens.shape)]

    def head_logits(self, hidden: np.ndarray) -> np.ndarray:
        """The logits [..., V] of final-normed states [..., h]."""
        return self._rows(hidden, self.kept["head"])
