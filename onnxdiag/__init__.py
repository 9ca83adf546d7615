"""onnxdiag: diagnose, prune and repair trained ONNX classifiers.

The public API mirrors the CLI verbs: each takes the model, then records —
:class:`DataRequest` per data role (``data=``, ``eval_data=``; a plain path works too),
the verb's own options record (``options=``), :class:`HeadChoice` (``head=``),
:class:`Runtime` (``runtime=``) and :class:`ReportTarget` (``report=``) — and returns a
:class:`onnxdiag.commands.base.CommandResult` with ``.report`` (the JSON dict),
``.summary``, ``.text``, ``.csv`` and ``.folder``; ``report=ReportTarget(write=False)``
skips the report folder::

    import onnxdiag
    from onnxdiag import DataRequest, ReportTarget

    result = onnxdiag.analyze("model.onnx", data=DataRequest("calib.npz", limit=256),
                              eval_data="eval.npz", report=ReportTarget(write=False))

==========================  ===========================
CLI                         Python
==========================  ===========================
``onnxdiag analyze``        :func:`analyze`
``onnxdiag inspect``        :func:`inspect_model`
``onnxdiag readouts``       :func:`readouts_report`
``onnxdiag select``         :func:`select_report`
``onnxdiag channels``       :func:`channels_report`
``onnxdiag lesion``         :func:`lesion_report`
``onnxdiag prune-channels`` :func:`prune_channels_report`
``onnxdiag prune-sweep``    :func:`prune_sweep_report`
``onnxdiag rr``             :func:`rr_report`
``onnxdiag prune``          :func:`prune_report_sparse`
``onnxdiag sweep``          :func:`sweep_report`
==========================  ===========================

Importing this package does not import onnxruntime (the runner imports it lazily).
"""

__version__ = "0.1.0"

#: public name -> module that defines it (imported on first use).
_VERBS = {
    "analyze": "commands.analyze",
    "inspect_model": "commands.analyze",
    "readouts_report": "commands.analyze",
    "select_report": "commands.select",
    "channels_report": "commands.channels",
    "lesion_report": "commands.lesion",
    "orthogonality_report": "commands.orthogonality",
    "prune_channels_report": "commands.prune_channels",
    "prune_sweep_report": "commands.prune_sweep",
    "rr_report": "commands.rr",
    "prune_report_sparse": "commands.prune",
    "sweep_report": "commands.sweep",
}

#: The records the verbs take: the shared ones (commands/base.py: standard library only)
#: and each verb's options record (in its verb's module).
_RECORDS = {name: "commands.base" for name in ("DataRequest", "HeadChoice", "Runtime",
                                                "ReportTarget")}
_RECORDS.update({
    "ReadoutOptions": "commands.analyze", "SelectOptions": "commands.select",
    "PruneSelectOptions": "commands.select_prune_unit",
    "ChannelsOptions": "commands.channels", "LesionOptions": "commands.lesion",
    "OrthogonalityOptions": "commands.orthogonality",
    "RROptions": "commands.rr", "PruneOptions": "commands.prune",
    "SweepOptions": "commands.sweep", "PrunerOptions": "commands.pruning",
    "ChannelPruneOptions": "commands.prune_channels",
    "PruneSweepOptions": "commands.prune_sweep", "Recovery": "commands.channel_pruning",
})

#: CLI command -> the Python function it calls.
CLI_VERBS = {
    "analyze": "analyze",
    "inspect": "inspect_model",
    "readouts": "readouts_report",
    "select": "select_report",
    "channels": "channels_report",
    "lesion": "lesion_report",
    "orthogonality": "orthogonality_report",
    "prune-channels": "prune_channels_report",
    "prune-sweep": "prune_sweep_report",
    "rr": "rr_report",
    "prune": "prune_report_sparse",
    "sweep": "sweep_report",
}

__all__ = [*_VERBS, *_RECORDS, "CLI_VERBS", "__version__"]


def __getattr__(name):
    # Lazy: `import onnxdiag` stays cheap; each verb lives in its module.
    module = _VERBS.get(name) or _RECORDS.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxdiag' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return sorted([*globals(), *_VERBS, *_RECORDS])
