"""A KDTR bundle loaded as a runnable reference: model, drafter and golden data."""

from dataclasses import dataclass

import numpy as np

from . import kdtr
from .drafter import Drafter
from .model import ModelArgs, Transformer
from .quant import dequantize


@dataclass
class Loaded:
    """A bundle ready to run: the target model (dequantized for int4), its drafter and header."""

    args: ModelArgs
    model: Transformer
    drafter: Drafter
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
    return Loaded(args, Transformer(args, weights), Drafter(b.tensor("drafter.w"), b.tensor("drafter.b")),
                  b.header)
