"""METHODS §C1's sequential pass: every pruned layer's repair and every BN's recalibration
measured with the upstream repairs in place, in topological order, in one forward pass
run segment by segment (:class:`~onnxdiag.sparsity.segments.SegmentedPass`).

After a layer's fold the cached output is patched to the repaired layer's (α·y + shift),
except where a conv's output is read by its BatchNormalization alone: that cache stays
as measured and the BN's segment runs :func:`~onnxdiag.sparsity.recal.bn_stand_in`
(the BN, its final statistics, α folded in), which spares a pass over the cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..runtime.progress import progress
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
    items = sorted([(seg.position(la.output), 0, i) for i, la in enumerate(layers)]
                   + [(seg.position(b.input[0]), 1, i) for i, b in enumerate(bns)])
    done_layers, done_bns, scaled = {}, {}, {}
    # a scaled conv read by its BN alone keeps its cached output as measured: the BN's
    # segment runs a stand-in with α folded in, once the BN's own statistics are final
    # (taken from the conv's scaled moments, never from the unpatched cache)
    deferred: list = []
    # a measured layer's batches are folded into its pruned moments on two threads while
    # the segment runs on to the next batch (fold_repair then merges them in order)
    early = ThreadPoolExecutor(max_workers=2)

    def run_to(pos, keep, watch=None):
        if pos > seg.done:
            seg.stand_ins.update((bn.name, bn_stand_in(editor, bn, a))
                                 for bn, a in deferred)
            deferred.clear()
        folds: list = []
        seg.run_to(pos, keep=keep,
                   on_output=None if watch is None else _fold_early(early, watch, folds))
        return folds

    with early:
        for pos, kind, i in progress(items, len(items), label) if label else items:
            tensor = layers[i].output if kind == 0 else bns[i].input[0]
            # one batch: nothing to overlap with, the fold stays on this thread
            folds = run_to(pos, [tensor, *outputs],
                           layers[i] if kind == 0 and len(batches) > 1 else None)
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


def _fold_early(pool, layer, folds: list):
    """An ``on_output`` of :meth:`SegmentedPass.run_to`: each batch of ``layer``'s output,
    as the segment produces it, folded into its own moments on ``pool`` (futures appended
    to ``folds`` in batch order)."""
    def on_output(tensor, i, y):
        if tensor == layer.output:
            folds.append(pool.submit(output_moments, layer, [y]))
    return on_output
