"""Text sections of reports, rendered from the JSON-ready report dicts."""

from __future__ import annotations

from .text import format_value, render_table


def render_structure(s: dict, *, max_layers: int = 60) -> str:
    """Head, layer table and channel groups of a Structure dict."""
    head = s["head"]
    lines = [
        "== Structure ==",
        f"inputs: {', '.join(_io(i) for i in s.get('inputs', []))}",
        f"outputs: {', '.join(_io(o) for o in s.get('outputs', []))}",
        f"opset: {s.get('opset')}   parameters: {format_value(s.get('n_params'))}   "
        f"FLOPs/sample: {format_value(s.get('flops'))}",
        f"head: {head['node_name']} ({head['op_type']}) classes={head['n_classes']} "
        f"features={head['n_features']} from '{head['features']}' ({head['features_reduce']})"
        f" -> '{head['logits']}' -> output '{head.get('output')}'",
    ]
    if head.get("note"):
        lines.append(f"head note: {head['note']}")
    if s.get("topology_hash"):
        lines.append(f"topology hash (architecture without weights, docs/METHODS.md §A5): "
                     f"{s['topology_hash']}")
    rows = []
    for layer in s["layers"]:
        rows.append({
            "layer": layer["node_name"], "op": layer["op_type"],
            "in>out": f"{layer['n_in']}>{layer['n_out']}",
            "kernel": _dims(layer.get("kernel")), "stride": _dims(layer.get("stride")),
            "groups": layer.get("groups"), "params": layer.get("n_params"),
            "FLOPs": layer.get("flops"),
            "BN": _bn(layer), "act": layer.get("activation") or "-",
        })
    lines.append("")
    lines.append(render_table(rows, title=f"layers ({len(rows)})", max_rows=max_layers).rstrip())
    groups = s.get("groups", [])
    if groups:
        grows = [{"group": i, "channels": g.get("n_channels"),
                  "kinds": ",".join(g.get("kinds", [])),
                  "prunable": g.get("prunable"),
                  "members": _first(g.get("members", []), 4),
                  "reason": g.get("reason") or ""}
                 for i, g in enumerate(groups)]
        lines.append("")
        lines.append(render_table(grows, title=f"channel groups ({len(grows)})",
                                  max_rows=max_layers).rstrip())
    return "\n".join(lines) + "\n"


def _io(v: dict) -> str:
    shape = "x".join("?" if d is None else str(d) for d in v.get("shape") or [])
    return f"{v['name']} ({v.get('dtype', '?')} [{shape}])"


def _dims(v) -> str:
    if not v:
        return "-"
    return "x".join(str(x) for x in v)


def _bn(layer: dict) -> str:
    if layer.get("bn_node"):
        return "yes" if layer.get("bn_position", "after") == "after" else "pre"
    return "folded" if layer.get("bn_folded") else "-"


def _first(items, k: int) -> str:
    items = list(items)
    text = ",".join(items[:k])
    return text + (f",... ({len(items)})" if len(items) > k else "")


def render_readouts(r: dict) -> str:
    """One model's readouts (ProbeResult dict)."""
    ro = r["readouts"]
    lines = ["== Readouts (docs/METHODS.md §A) ==",
             f"probe: {ro['n_samples']} samples, targets={ro['targets']}, norm={ro['norm']}, "
             f"head check rel. error {r['head_rel_error']:.2e}"]
    from ..selection.readouts import READOUTS

    rows = [{"readout": k, "value": v, "better": READOUTS[k].direction if k in READOUTS else ""}
            for k, v in ro["values"].items()]
    lines.append(render_table(rows).rstrip())
    if ro.get("degenerate"):
        lines.append("WARNING: degenerate checkpoint (never selected): "
                     + "; ".join(ro.get("degenerate_reasons", [])))
    ev = r.get("evaluation")
    if ev:
        lines.append(f"evaluation: top-1 {100 * ev['accuracy']:.2f} % and loss {ev['loss']:.4f} "
                     f"on {ev['n_samples']} labelled samples")
    return "\n".join(lines) + "\n"
