"""Run a model segment by segment over a fixed calibration set (the sequential repair pass).

METHODS §C1 measures each layer with every upstream layer already pruned *and repaired*.
Instead of one full forward pass per layer, the graph's topological node list is
cut right after each measured tensor: segment k runs only the nodes between two
measurements, reading its inputs from a *frontier* of cached tensors (all
calibration images) and adding its outputs to it.  Between segments the caller
reads the measured tensors, edits the model (edits only reach nodes not yet run)
and patches the cached tensors to their repaired values, or has a node not yet run
stand in for the patch (``stand_ins``).  Every node is executed
once per image: the whole sequential repair costs one forward pass of compute,
split over as many ONNX Runtime sessions as there are measurement points.
Memory: the frontier's live tensors for all calibration images.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper

from ..errors import DataError
from ..graph import GraphIndex
from ..runtime.batching import batch_len  # also re-exported (repair, fold, commands)
from ..runtime.runner import OrtRunner

#: Input values per ONNX Runtime run of the repairs' passes (**our default**, 2^20: 6 images
#: at 3×224×224): a full-size net's exposed tensors then stay under glibc's 32 MiB mmap
#: threshold, so they are not page-faulted fresh on every run (measured: less system time,
#: same results to float rounding); 28×28 inputs keep batches of up to 1,337 images.
RUN_VALUES = 1 << 20
#: Whether the segments' sessions share one CPU arena (**our default** True: each new
#: session's own arena is page-faulted in anew, ~1 M faults per ResNet-50 pass).
SHARED_ARENA = True


def split_batches(batches: list[dict], max_values: int = RUN_VALUES) -> list[dict]:
    """``batches`` (feed dicts, samples on axis 0) cut into runs of at most ``max_values``
    input values each (at least one sample per run), in order; views, no copies."""
    out = []
    for feeds in batches:
        arrays = {k: np.asarray(v) for k, v in feeds.items()}
        n = batch_len(arrays)
        per = sum(int(np.prod(a.shape[1:])) for a in arrays.values())
        step = max(1, max_values // max(per, 1))
        out.extend({k: a[i:i + step] for k, a in arrays.items()} for i in range(0, n, step))
    return out


def node_reads(node: onnx.NodeProto) -> set[str]:
    """Tensors ``node`` reads: its inputs and outer-scope names its subgraphs use."""
    names = {t for t in node.input if t}
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            inner = {t.name for t in sub.initializer} | {v.name for v in sub.input}
            for n in sub.node:
                names |= node_reads(n) - inner
                inner |= set(n.output)
    return names


class SegmentedPass:
    """Execute ``model``'s nodes in topological segments over ``batches``.

    Args:
        model: the model to run; the caller may edit its initializers between segments
            (only nodes not yet executed see the edit).
        batches: a list of feed dicts (the calibration set, in memory).
        providers, threads, optimization, spinning: see :class:`~onnxdiag.runner.OrtRunner`.
        shared_arena: the segments' sessions share one CPU arena
            (:mod:`onnxdiag.runtime.arena`); None: :data:`SHARED_ARENA`.

    Edits may change initializers and rewire node inputs to new initializers (as
    :func:`~onnxdiag.sparsity.masks.set_input_constant` does); each segment reads its
    nodes' inputs when it runs.

    Attributes: ``frontier`` {tensor: [per-batch arrays]}; ``done`` position of the last
    executed node; ``n_segments`` sessions run so far; ``stand_ins`` {node name: (node,
    initializers it reads)}: what a segment runs in place of that node of the model (the
    caller's, e.g. :func:`~onnxdiag.sparsity.recal.bn_stand_in`; never in the model).
    """

    def __init__(self, model: onnx.ModelProto, batches: list[dict], *, providers=None,
                 threads: int | None = None, optimization: str = "all",
                 spinning: bool = True, shared_arena: bool | None = None):
        self.model = model
        self.index = GraphIndex(model)
        self.batches = batches
        # one arena for every segment's session (runtime/arena.py: pages touched once)
        self.options = dict(providers=providers, threads=threads, optimization=optimization,
                            spinning=spinning,
                            shared_arena=SHARED_ARENA if shared_arena is None else shared_arena)
        self.reads = [node_reads(n) for n in self.index.nodes]
        self.last_use: dict[str, int] = {}
        for pos, names in enumerate(self.reads):
            for t in names:
                self.last_use[t] = pos
        self.frontier = {name: [b[name] for b in batches] for name in self.index.inputs
                         if batches and name in batches[0]}
        self.types = {v.name: v for v in (*model.graph.value_info, *model.graph.output)}
        self.done = -1
        self.n_segments = 0
        self.stand_ins: dict[str, tuple[onnx.NodeProto, list]] = {}

    def position(self, tensor: str) -> int:
        """Topological position of ``tensor``'s producer (-1 for a graph input)."""
        node = self.index.producer.get(tensor)
        return -1 if node is None else self.index.position[id(node)]

    def run_to(self, position: int, keep: Iterable[str] = (), on_output=None) -> None:
        """Execute the nodes after ``done`` up to ``position``; ``keep`` stays in the frontier.
        ``on_output(tensor, i, array)``: called for every tensor of ``keep`` this segment
        produces, right after its run on batch i (e.g. to fold it while the next runs)."""
        keep = set(keep)
        start = self.done + 1
        if position >= start:
            nodes = self.index.nodes[start:position + 1]
            produced = {t for n in nodes for t in n.output if t}
            wanted = sorted(t for t in produced if self.last_use.get(t, -1) > position or t in keep)
            if wanted:
                self._run_segment(nodes, start, position, produced, wanted,
                                  (keep, on_output) if on_output else None)
            self.done = position
        for name in list(self.frontier):
            if self.last_use.get(name, -1) <= self.done and name not in keep:
                del self.frontier[name]

    def _run_segment(self, nodes, start, end, produced, wanted, watch=None) -> None:
        inits = {t.name: t for t in self.model.graph.initializer}
        nodes = [self.stand_ins.get(n.name, (n,))[0] for n in nodes]
        inits.update((t.name, t) for n in nodes if n.name in self.stand_ins
                     for t in self.stand_ins[n.name][1])
        # read the nodes now, not at construction: an edit between segments may rewire an
        # input (e.g. a BN statistic held by a Constant node) to a new initializer
        reads = set().union(*(node_reads(n) for n in nodes)) - produced
        # Constant nodes of earlier segments (e.g. Clip bounds) are re-emitted here rather
        # than fed: their outputs have no batch dimension (often rank 0).
        consts = [self.index.producer[t] for t in sorted(reads)
                  if t in self.index.producer and self.index.producer[t].op_type == "Constant"]
        if consts:
            nodes = [*consts, *nodes]
            reads -= {t for n in consts for t in n.output}
        feeds = sorted(t for t in reads if t not in inits)
        missing = [t for t in feeds if t not in self.frontier]
        if missing:
            raise RuntimeError(f"segment inputs not cached: {missing[:5]}")
        graph = helper.make_graph(
            list(nodes), f"segment_{start}_{end}",
            [self._input_info(t) for t in feeds],
            [self.types.get(t) or helper.make_empty_tensor_value_info(t) for t in wanted],
            [inits[t] for t in sorted(reads) if t in inits])
        sub = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        sub.ir_version = self.model.ir_version
        sub.functions.extend(self.model.functions)
        runner = OrtRunner(sub, **self.options)
        results = {t: [] for t in wanted}
        watched = [t for t in wanted if t in watch[0]] if watch else []
        for i in range(len(self.batches)):
            out = runner.run({t: self.frontier[t][i] for t in feeds}, wanted)
            for t in wanted:
                results[t].append(out[t])
            for t in watched:
                watch[1](t, i, out[t])
        self.frontier.update(results)
        self.n_segments += 1

    def _input_info(self, name: str) -> onnx.ValueInfoProto:
        arr = self.frontier[name][0]
        elem = helper.np_dtype_to_tensor_dtype(np.asarray(arr).dtype)
        shape = [] if np.ndim(arr) == 0 else ["batch", *np.shape(arr)[1:]]
        return helper.make_tensor_value_info(name, elem, shape)


def collect_batches(source, n_images: int | None) -> list[dict]:
    """The first ``n_images`` (None: all) of ``source`` (a DataSource or feed dicts) as
    feed dicts; DataError with fewer than 2."""
    batches, seen = [], 0
    for feeds in feed_dicts(source):
        take = batch_len(feeds) if n_images is None else min(n_images - seen, batch_len(feeds))
        if take <= 0:
            break
        batches.append({k: np.asarray(v)[:take] for k, v in feeds.items()})
        seen += take
    if seen < 2:
        raise DataError(f"Repair needs at least 2 calibration samples, got {seen}; pass more "
                        "calibration data.")
    return batches


def feed_dicts(source):
    """The feed dicts of ``source``: a DataSource's batches, or an iterable of feed dicts."""
    if hasattr(source, "batches"):
        for batch in source.batches():
            yield batch.feeds
    else:
        yield from source
