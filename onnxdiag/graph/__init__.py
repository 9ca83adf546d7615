"""The structure of a classifier graph: head, layers, channel groups, FLOPs.

All results are frozen dataclasses of builtins / NumPy arrays keyed by ONNX names
(node, tensor, initializer) with ``to_dict()``; no function modifies its model.

- :func:`find_head` — METHODS §A1 head discovery (Gemm / MatMul(+Add) / 1×1 Conv ± pooling).
- :func:`find_layers` — Conv / ConvTranspose / Gemm / MatMul with geometry, FLOPs, BN pairing.
- :func:`find_channel_groups` — coupled output channels for structured pruning (METHODS §B6).
- :func:`analyze_structure` — all of it in one :class:`Structure`.
- :class:`GraphIndex` — producers / consumers / topological order / constant folding.
"""

from .groups import ChannelConsumer, ChannelGroup, ChannelParam, find_channel_groups, get_group
from .head import Head, find_head, find_head_candidates
from .index import GraphIndex
from .layers import Layer, find_activation, find_layers, get_layer
from .structure import Structure, TensorInfo, analyze_structure

__all__ = [
    "ChannelConsumer", "ChannelGroup", "ChannelParam", "GraphIndex", "Head", "Layer",
    "Structure", "TensorInfo", "analyze_structure", "find_activation", "find_channel_groups",
    "find_head", "find_head_candidates", "find_layers", "get_group", "get_layer",
]
