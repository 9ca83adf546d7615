"""METHODS §C1's sequential pass: every pruned layer's repair and every BN's recalibration
measured with the upstream repairs in place, in topological order, in one forward pass
run segment by segment (:class:`~onnxdiag.sparsity.segments.SegmentedPass`).

After a layer's fold the cached output is patched to the repaired layer's (α·y + shift),
except where a conv's output is read by its BatchNormalization alone: that cache stays
as measured and the BN's segment runs :func:`~onnxdiag.sparsity.recal.bn_stand_in`
(the BN, its final statistics, α folded in), which spares a pass over the cache.
A widening 1×1 conv (:func:`~onnxdiag.sparsity.derived.derivable`) is measured on its
input instead: the pass stops before the conv, its output moments come from the input's,
its weights and bias take the fold, and the conv (and a BN reading it, recalibrated from
the scaled moments) run in the next segment, so its wide output never leaves ONNX Runtime.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

from ..runtime.progress import progress
from .derived import derivable, derived_moments, input_moments
from .fold import fold_repair, merged, output_moments
from .recal import bn_stand_in, deferred_bn, recalibrate_bn, scaled_moments
from .segments import SegmentedPass


def sequential_repair(editor, batches, layers, dense, bns, cr_kind, affine, alpha_cap,
                      providers, threads, label=None, outputs: tuple = ()
                      ) -> tuple[dict, dict, int, dict]:
    """Repair ``layers`` (to ``dense`` moments; ``affine`` {name: bool}) and recalibrate
    ``bns`` of the model in ``editor`` in topological order, each measured with the
    upstream repairs in place, then run on to ``outputs``; returns (LayerRepair per
    layer, BNRepair per BN, sessions, {output: per-batch arrays})."""
    # threads sleep between segments: the NumPy work there needs the cores
    seg = SegmentedPass(editor.model, batches, providers=providers, threads=threads,
                        spinning=False)
    derived, items = _schedule(seg, layers, bns, affine, outputs)
    done_layers, done_bns, scaled, inputs = {}, {}, {}, {}  # inputs: see _derived_step
    # a scaled conv read by its BN alone keeps its cached output as measured: the BN runs a
    # stand-in with α folded in once its statistics (the conv's scaled moments) are final
    deferred: list = []
    # each measured batch folded on two threads while the segment runs on (merged in order)
    early = ThreadPoolExecutor(max_workers=2)

    def run_to(pos, keep, watch=None):
        if pos > seg.done:
            seg.stand_ins.update((bn.name, bn_stand_in(editor, bn, a))
                                 for bn, a in deferred)
            deferred.clear()
        folds: list = []
        seg.run_to(pos, keep=keep,
                   on_output=None if watch is None else _fold_early(early, *watch, folds))
        return folds

    with early:
        for pos, kind, i in progress(items, len(items), label) if label else items:
            tensor = layers[i].output if kind == 0 else bns[i].input[0]
            if tensor in derived:
                _derived_step(seg, editor, layers[i] if kind == 0 else bns[i], kind,
                              inputs, scaled, done_layers, done_bns, run_to, outputs,
                              (dense, cr_kind, alpha_cap, affine))
                continue
            # one batch: nothing to overlap with, the fold stays on this thread
            folds = run_to(pos, [tensor, *outputs], (tensor, partial(output_moments, layers[i]))
                           if kind == 0 and len(batches) > 1 else None)
            if kind == 0:
                la = layers[i]
                bn = (None if affine[la.node_name] or la.op_type != "Conv"
                      else deferred_bn(editor, la.output, outputs))
                # folded during the run when this segment measured every batch of it
                pruned = (merged([f.result() for f in folds])
                          if folds and len(folds) == len(seg.frontier[la.output]) else None)
                rep = done_layers[la.node_name] = fold_repair(
                    seg.frontier, editor, la, dense[la.node_name], cr_kind,
                    affine[la.node_name], alpha_cap, patch=bn is None, pruned=pruned)
                if rep.kind == "scale" and la.op_type == "Conv":  # its BN's input moments
                    scaled[la.output] = scaled_moments(rep)
                if bn is not None:
                    deferred.append((bn, rep.alpha))
            else:
                done_bns[bns[i].name] = recalibrate_bn(seg.frontier, editor, bns[i],
                                                       scaled.get(tensor))
        if outputs:  # every repair is in place: the rest of the graph sees them all
            run_to(max(seg.position(t) for t in outputs), outputs)
    values = {t: seg.frontier[t] for t in outputs if t in seg.frontier}
    return done_layers, done_bns, seg.n_segments, values


def _schedule(seg, layers, bns, affine, outputs) -> tuple[dict, list]:
    """({output: input} of the layers measured on their input, the (position, kind, index)
    items in pass order: kind 0 a layer, 1 a BN). A derived layer and the BN reading its
    output (recalibrated from its scaled moments, so never after an affine fold, which has
    no BN) come at its input's position."""
    read_by_bn = {b.input[0] for b in bns}
    derived = {la.output: la.input for la in layers
               if derivable(la) and la.output not in outputs
               and not (affine[la.node_name] and la.output in read_by_bn)}
    at = {t: seg.position(derived.get(t, t)) for t in
          [*(la.output for la in layers), *(b.input[0] for b in bns)]}
    return derived, sorted([(at[la.output], 0, i) for i, la in enumerate(layers)]
                           + [(at[b.input[0]], 1, i) for i, b in enumerate(bns)])


def _fold_early(pool, watched: str, fold, folds: list):
    """An ``on_output`` of :meth:`SegmentedPass.run_to`: each batch of the tensor
    ``watched``, as the segment produces it, folded on ``pool`` into its own moments by
    ``fold`` (a function of a list of batches; futures appended to ``folds`` in batch
    order)."""
    def on_output(tensor, i, y):
        if tensor == watched:
            folds.append(pool.submit(fold, [y]))
    return on_output


def _derived_step(seg, editor, item, kind, inputs, scaled, done_layers, done_bns, run_to,
                  outputs, repair) -> None:
    """A derived layer (``kind`` 0: the pass runs to its input, its pruned output moments
    come from the input's moments, ``inputs`` {tensor: Moments}, shared by the layers
    reading one input; the fold (α, an affine shift) goes into its weights and bias;
    nothing is cached or patched: the layer runs in a later segment) or the BN that reads
    its output (``kind`` 1: recalibrated to the scaled moments)."""
    if kind == 1:
        done_bns[item.name] = recalibrate_bn(seg.frontier, editor, item, scaled[item.input[0]])
        return
    dense, cr_kind, alpha_cap, affine = repair
    source = item.input
    # the input's batches folded while the segment producing them runs on
    folds = run_to(seg.position(source), [source, *outputs],
                   None if source in inputs else (source, input_moments))
    if source not in inputs:
        inputs[source] = (merged([f.result() for f in folds])
                          if folds and len(folds) == len(seg.frontier[source])
                          else input_moments(seg.frontier[source]))
    node = editor.index.get_node(item.node_name)
    bias = editor.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    pruned = derived_moments(editor.value(node.input[1]), bias, inputs[source])
    rep = done_layers[item.node_name] = fold_repair(
        seg.frontier, editor, item, dense[item.node_name], cr_kind, affine[item.node_name],
        alpha_cap, patch=False, pruned=pruned)
    if rep.kind == "scale":  # its BN's input moments
        scaled[item.output] = scaled_moments(rep)
