"""A KDTR bundle loaded as a runnable reference: model, drafter and golden data."""

from dataclasses import dataclass

import numpy as np

from . import kdtr
from .drafter import AnyDrafter, Drafter, LowRankDrafter
from .model import ModelArgs, Transformer
from .quant import dequantize


@dataclass
class Loaded:
    """A bundle ready to run: the target model (dequantized for int4), its drafter and header."""

    args: ModelArgs
    model: Transformer
    drafter: AnyDrafter
    header: dict

    @property
    def prompt(self) -> np.ndarray:
        return np.array(self.header["prompt"])

    @property
    def golden(self) -> list[int]:
        return list(self.header["golden"])


def load(path) -> Loaded:
    """Read a bundle and build its model; a KdtrError names the file if a tensor is missing."""
    b = kdtr.read(path)
    args = ModelArgs.from_json(b.header["config"])
    group = b.header["quant"].get("group_size", 32)
    weights = {}
    for name in b.tensors:
        if name.startswith("drafter.") or name.endswith(".sc"):
            continue
        if name.endswith(".qw"):
            base = name[:-3]
            weights[base] = dequantize(b.tensors[name], b.tensor(base + ".sc"), group)
        else:
            weights[name] = b.tensors[name]
    model = Transformer(args, weights)
    return Loaded(args, model, drafter_of(b, model), b.header)


def drafter_of(b: kdtr.Bundle, model: Transformer) -> AnyDrafter:
    """The drafter of a bundle's header kind ("linear" when absent, or "lowrank_head" over the model's head)."""
    kind = b.header["drafter"].get("kind", "linear")
    if kind == "lowrank_head":
        return LowRankDrafter(b.tensor("drafter.v"), b.tensor("drafter.u"), b.tensor("drafter.b"), model.head_logits)
    if kind == "linear":
        return Drafter(b.tensor("drafter.w"), b.tensor("drafter.b"))
    raise kdtr.KdtrError(b.path, f"drafter.kind: unknown kind {kind!r} (linear or lowrank_head)")
