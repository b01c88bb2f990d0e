"""Compressors and their name registry (``COMPRESSORS``: each name ``compressor=`` accepts, to its class).

A new compressor subclasses :class:`Compressor` and joins with ``@register_compressor``."""

from lightning_sparse.compressors.base import (
    COMPRESSORS,
    CompressContext,
    Compressor,
    Pattern,
    compressors_of_pattern,
    get_compressor,
    k_for,
    register_compressor,
)
from lightning_sparse.compressors.chunktopk import ChunkTopK
from lightning_sparse.compressors.countsketch import CountSketch
from lightning_sparse.compressors.dgc import DGC
from lightning_sparse.compressors.gaussiank import GaussianK
from lightning_sparse.compressors.randomblock import RandomBlock
from lightning_sparse.compressors.randomk import RandomK, random_subset
from lightning_sparse.compressors.rtopk import RTopK
from lightning_sparse.compressors.topk import TopK, exact_topk_indices

__all__ = [
    "COMPRESSORS",
    "ChunkTopK",
    "CompressContext",
    "Compressor",
    "CountSketch",
    "DGC",
    "GaussianK",
    "Pattern",
    "RTopK",
    "RandomBlock",
    "RandomK",
    "TopK",
    "compressors_of_pattern",
    "exact_topk_indices",
    "get_compressor",
    "k_for",
    "random_subset",
    "register_compressor",
]
