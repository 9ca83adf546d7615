"""Channel plans that transfer between checkpoints of one architecture
(docs/METHODS.md §A5, §B6).

A plan made by ``prune-channels`` records the source model's topology hash
(:func:`onnxdiag.model.topology.topology_hash`, in ``settings.topology_hash``). Replayed
on its own model it is hash-checked as before; replayed on another checkpoint with the
same topology hash it removes the same channels (same group ids, same indices) there, so
one fixed plan can be compared across a training series.
"""

from __future__ import annotations

import dataclasses

from ..errors import OnnxDiagError


def stamp_plan(plan, model):
    """``plan`` with the topology hash of ``model`` (the model it was made on) in its
    settings."""
    from ..model.topology import topology_hash

    return dataclasses.replace(plan, settings={**plan.settings,
                                               "topology_hash": topology_hash(model)})


def plan_target(model, plan) -> tuple:
    """(the structure of ``model`` the plan applies to, the transfer record or None when
    ``model`` is the plan's own model).

    Raises:
        OnnxDiagError: another model whose topology differs from the plan's, or a plan
            that records no topology hash (made before plans transferred).
    """
    from ..graph import analyze_structure
    from ..model.io import model_hash
    from ..model.topology import topology_hash
    from ..structured.plan import plan_structure

    if model_hash(model) == plan.model_hash:
        return plan_structure(model, plan), None
    want, have = (plan.settings or {}).get("topology_hash"), topology_hash(model)
    if want is None:
        raise OnnxDiagError(f"The plan was made for model {plan.model_hash[:12]}…, not this one, "
                            "and records no topology hash; make it again with this onnxdiag "
                            "to apply it to other checkpoints of the architecture.")
    if want != have:
        raise OnnxDiagError(f"The plan was made for another architecture (topology hash "
                            f"{want[:12]}…, this model {have[:12]}…); a plan applies only to "
                            "checkpoints of the architecture it was made on.")
    structure = analyze_structure(model, head=plan.head, features=plan.features,
                                  require_head=plan.head is not None)
    for gid, n in plan.n_channels.items():
        if gid >= len(structure.groups) or structure.groups[gid].n_channels != n:
            raise OnnxDiagError(f"Channel group {gid} of this model does not match the plan "
                                f"({n} channels); the plan was made by another version.")
    return structure, {"plan_model_sha256": plan.model_hash, "topology_hash": have}


def transfer_note(transfer: dict | None) -> list[str]:
    """The report note of a transferred plan (none for the plan's own model)."""
    if transfer is None:
        return []
    return [f"plan transferred from model {transfer['plan_model_sha256'][:12]}… (same "
            f"topology hash {transfer['topology_hash'][:12]}…): the same channels removed"]
