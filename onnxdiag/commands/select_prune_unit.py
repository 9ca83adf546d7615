"""One unit of ``select --prune`` / ``--prune-channels``: a checkpoint scored dense, pruned
and repaired with the pruning verbs' own steps, and scored again (docs/METHODS.md §A5).

The pruned model is exactly what ``onnxdiag prune`` (``prune_inputs``) or
``onnxdiag prune-channels --no-fold-bn`` (``new_plan`` / ``replay_plan_file`` and
``prune_and_recover``) emit for that checkpoint alone on the same calibration data and
options; its sha256 is in the result (and, with ``write_pruned``, the file itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OnnxDiagError
from .base import HeadChoice, Runtime
from .pruning import PrunerOptions

#: Channel repairs of the structured form (all label-free): BN recalibration, the
#: reconstruction of docs/METHODS.md §E2, both (reconstruction first), or none.
CHANNEL_REPAIRS = ("bn", "reconstruct", "reconstruct+bn", "none")


@dataclass(frozen=True)
class PruneSelectOptions:
    """How each checkpoint of ``select`` is pruned (docs/METHODS.md §A5).

    Unstructured (``sparsity`` S): ``allocation``, ``repair`` (default cr+bn) and
    ``pruner`` as for ``onnxdiag prune``. Structured (``channels`` R, the fraction of each
    group's channels removed, or a ``plan`` JSON applied to every checkpoint of its
    architecture): ``score``, ``budget`` as for ``prune-channels``; ``repair`` bn
    (default: BN recalibration), reconstruct, reconstruct+bn or none. ``seed``: the RR
    draw / ties. ``write_pruned``: a folder where each pruned model is written
    (``<index>-<stem>.onnx`` + sidecar);
    ``overwrite`` replaces existing files there. ``rank_by``: the criterion of the headline
    choice and ranking (docs/METHODS.md §A5: ``agreement``, our default from study 5 of
    docs/STUDIES.md; ``combined``; ``dense:<readout>`` or ``pruned:<readout>``).
    """

    sparsity: float | None = None
    allocation: str = "rr"
    repair: str | None = None
    channels: float | None = None
    score: str = "two_axis"
    budget: str = "uniform"
    plan: str | None = None
    seed: int = 0
    write_pruned: str | None = None
    overwrite: bool = False
    rank_by: str = "agreement"
    pruner: PrunerOptions = field(default_factory=PrunerOptions)

    @property
    def structured(self) -> bool:
        return self.channels is not None or self.plan is not None

    def check(self) -> None:
        """Raise OnnxDiagError for options no checkpoint can use (before any work)."""
        prefix, _, name = self.rank_by.partition(":")
        from ..selection.readouts import READOUTS

        if self.rank_by not in ("combined", "agreement") and not (
                prefix in ("dense", "pruned") and name in READOUTS):
            raise OnnxDiagError(f"Unknown --rank-by {self.rank_by!r}; use combined, agreement, "
                                "dense:<readout> or pruned:<readout> (e.g. pruned:confidence).")
        if (self.sparsity is None) == (not self.structured):
            raise OnnxDiagError("Give one of --prune S (unstructured sparsity) or "
                                "--prune-channels R / --plan FILE (channels), not both.")
        if self.structured:
            if self.repair not in (None, *CHANNEL_REPAIRS):
                raise OnnxDiagError(f"--prune-channels takes --repair bn (BN recalibration), "
                                    f"reconstruct, reconstruct+bn or none; got --repair "
                                    f"{self.repair}.")
            if self.plan is None and not 0 < self.channels < 1:
                raise OnnxDiagError(f"--prune-channels {self.channels:g} is not a fraction of "
                                    "channels in (0, 1); e.g. --prune-channels 0.3.")
            return
        self.sparse_options().check()

    def sparse_options(self):
        """The :class:`~onnxdiag.commands.prune.PruneOptions` of the unstructured form."""
        from .prune import PruneOptions

        return PruneOptions(sparsity=self.sparsity, allocation=self.allocation,
                            repair=self.repair or "cr+bn", seed=self.seed, pruner=self.pruner)

    def channel_options(self):
        """The :class:`~onnxdiag.commands.prune_channels.ChannelPruneOptions` of the
        structured form (a new plan per checkpoint)."""
        from .prune_channels import ChannelPruneOptions

        return ChannelPruneOptions(ratio=self.channels or 0.5, score=self.score,
                                   budget=self.budget, plan=self.plan, seed=self.seed,
                                   fold_bn=False)


def prune_unit(checkpoint, probe, evaluation, scoring, options: PruneSelectOptions) -> dict:
    """Dense readouts, the pruned + repaired model, its readouts and agreement (the
    worker's unit). ``probe`` / ``evaluation``: what ``Executor.ship`` sent."""
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model, model_hash
    from ..model.topology import topology_hash
    from ..runtime.executor import receive
    from ..selection.checkpoints import architecture_signature

    m = load_model(checkpoint.path)
    structure = analyze_structure(m, head=scoring.head, features=scoring.features)
    specs = get_input_specs(m)
    calib = receive(probe, specs)
    ev = None if evaluation is None else receive(evaluation, specs)
    head = HeadChoice(scoring.head, scoring.features)
    runtime = Runtime(providers=scoring.providers, progress=False)
    if options.structured:
        pruned, p_struct, info, agreement, feeds = _channels(m, structure, (calib, ev),
                                                             options, head, runtime)
    else:
        pruned, p_struct, info, agreement, feeds = _sparse(checkpoint.path, m, structure,
                                                           (calib, ev), options, head, runtime)
    out = {"topology_hash": topology_hash(m), "n_params": structure.n_params,
           "n_stored": structure.n_stored, "architecture": architecture_signature(structure),
           "dense": _probe(m, structure, calib, ev, scoring),
           "pruned": _probe(pruned, p_struct, calib, ev, scoring),
           "agreement": agreement, "prune": info, "pruned_sha256": model_hash(pruned),
           "pruned_model": None}
    if options.write_pruned:
        out["pruned_model"] = _write(pruned, checkpoint, options, out, feeds)
    return out


def _probe(model, structure, calib, evaluation, scoring) -> dict:
    from ..selection.probe import probe_model

    return probe_model(model, structure, calib, eval_source=evaluation,
                       targets=scoring.targets, norm=scoring.norm,
                       include_bias=scoring.include_bias, providers=scoring.providers,
                       threads=scoring.threads, ignore_index=scoring.ignore_index).to_dict()


def _sparse(path, m, structure, sources, options: PruneSelectOptions, head,
            runtime) -> tuple:
    """``onnxdiag prune``'s steps on one checkpoint: (pruned, its structure, facts,
    agreement record, verification feeds)."""
    from ..graph import analyze_structure
    from ..sparsity import find_prunable
    from ..sparsity.budget import plan_model_budget
    from ..sparsity.sweep import materialize
    from .prune import no_op_reason, prune_inputs
    from .pruning import Inputs

    calib, evaluation = sources
    popts = options.sparse_options()
    inputs = Inputs(path, m, structure, None, calib, materialize(calib), evaluation,
                    find_prunable(structure, popts.pruner.keep_dense))
    budget = plan_model_budget(popts.sparsity, structure.layers, inputs.layers,
                               popts.pruner.keep_dense)
    pruned, pruner, alloc, record = prune_inputs(inputs, popts, budget, runtime)
    p_struct = analyze_structure(pruned, head=structure.head.node_name, features=head.features)
    info = {"kind": "unstructured", "sparsity_target": budget.target,
            "n_weights": budget.n_model, "n_pruned": alloc.n_pruned,
            "sparsity_achieved": alloc.n_pruned / budget.n_model if budget.n_model else None,
            "allocation": alloc.rule, "repair": None if record is None else record.method,
            "no_op": no_op_reason(budget), "layer_sparsity": dict(alloc.sparsity)}
    agreement = {"top1_agreement": pruner.agreement(pruned), "n_images": pruner.n_images,
                 "data": "calibration"}
    return pruned, p_struct, info, agreement, inputs.feeds[0]


def _channels(m, structure, sources, options: PruneSelectOptions, head, runtime) -> tuple:
    """``prune-channels``' steps on one checkpoint (new plan, or the given plan
    transferred): (pruned, its structure, facts, agreement record, feeds)."""
    from ..evaluate import compare_models, make_head_runner
    from .channel_pruning import Recovery, check_labels, needs_moments
    from .prune_channels import new_plan, prune_and_recover, replay_plan_file

    calib, evaluation = sources
    copts = options.channel_options()
    if options.plan is not None:
        plan, structure, head, notes = replay_plan_file(m, options.plan)
    else:
        check_labels(structure, calib, evaluation)
    repair = options.repair or "bn"
    recovery = Recovery(recalibrate_bn=repair.endswith("bn"),
                        reconstruct=repair.startswith("reconstruct"))
    moments = None
    if needs_moments(recovery, [] if options.plan is not None else [copts.score]):
        from ..structured.choice import consumer_moments

        moments = consumer_moments(m, structure, calib, runtime.providers)
    if options.plan is None:
        plan, notes = new_plan(m, structure, calib, copts, head, runtime, moments)
    pruned, p_struct, record, _ = prune_and_recover(
        m, structure, plan, (calib, evaluation, None), recovery,
        (options.seed, head, runtime, moments))
    cmp = compare_models(make_head_runner(m, structure.head, providers=runtime.providers),
                         make_head_runner(pruned, p_struct.head, providers=runtime.providers),
                         calib, structure.head, max_batches=10**9)
    info = {"kind": "channels", "ratio": plan.ratio, "score": plan.score, "budget": plan.budget,
            "n_removed": plan.n_removed, "params_before": record.params_before,
            "params_after": p_struct.n_params, "flops_before": record.flops_before,
            "flops_after": p_struct.flops, "repair": repair,
            "plan_model_sha256": plan.model_hash,
            "plan_topology_hash": (plan.settings or {}).get("topology_hash"), "notes": notes}
    agreement = {"top1_agreement": cmp["top1_agreement"], "n_images": cmp["n_samples"],
                 "data": "calibration"}
    return pruned, p_struct, info, agreement, next(iter(calib.batches())).feeds


def _write(pruned, checkpoint, options: PruneSelectOptions, facts: dict, feeds) -> str:
    """Emit the pruned model of ``checkpoint`` into ``options.write_pruned`` (checked,
    reloaded, compared: model/finalize.emit_model) with a sidecar of ``facts``."""
    from .. import __version__
    from ..errors import OutputError
    from ..model.finalize import emit_model

    out = Path(options.write_pruned) / f"{checkpoint.index:03d}-{Path(checkpoint.path).stem}.onnx"
    if out.exists() and not options.overwrite:
        raise OutputError(f"'{out}' already exists; pass --overwrite or another --write-pruned.")
    sidecar = {"tool": "onnxdiag select", "tool_version": __version__,
               "source": {"path": checkpoint.path}, "prune": facts["prune"],
               "agreement": facts["agreement"]}
    info = emit_model(pruned, out, source_path=checkpoint.path, sidecar=sidecar,
                      protect=[checkpoint.path], verify_feeds=feeds)
    return info["emitted"]["path"]
