"""The text of a ``prune-channels`` report section (docs/METHODS.md §B6) and its notes."""

from __future__ import annotations

from ..report import render_table
from ..report.text import fmt3


def width_notes(record, pruned_structure, round_to) -> list[str]:
    """A hint when narrowed convs keep widths off ONNX Runtime's CPU channel block."""
    from ..runtime.latency import cpu_conv_block

    block = cpu_conv_block()
    if not block or (round_to and round_to % block == 0):
        return []
    convs = {la.node_name for la in pruned_structure.layers if la.op_type == "Conv"}
    off = sorted(name for name, (_, after) in record.widths.items()
                 if name in convs and after % block)
    if not off:
        return []
    return [f"{len(off)} of the {len(record.widths)} narrowed layers keep a width that is "
            f"not a multiple of {block} (e.g. {off[0]}: {record.widths[off[0]][1]}); ONNX "
            f"Runtime's blocked CPU convolutions (block {block} on this CPU) run such widths "
            f"at the cost of the next multiple or slower: a plan made with --round-to {block} "
            "keeps multiples (benchmarks/RESULTS.md, channel alignment)."]


def render_prune(info: dict) -> str:
    """The text of a prune-channels section (the sidecar dict)."""
    plan, lat, acc = info["plan"], info["latency_ms"], info["accuracy"]
    rows = [{"": name, "params": info[key]["params"], "FLOPs": info[key]["flops"],
             "file bytes": info[key]["file_bytes"], "ms b=1": lat[key]["1"],
             "ms b=32": lat[key]["32"],
             "top-1 %": None if not acc[key] else 100 * acc[key]["accuracy"]}
            for name, key in (("source", "source"), ("pruned", "emitted"))]
    removed = (f"{sum(len(v) for v in plan['removed'].values())} of "
               f"{sum(plan['n_channels'].values())} channels removed")
    lines = ["== Structured pruning (docs/METHODS.md §B6) ==",
             f"score {plan['score']}, budget {plan['budget']}, ratio {plan['ratio']}: "
             f"{removed} -> {info['emitted']['path']}",
             render_table(rows).rstrip(),
             f"FLOPs ratio {fmt3(info['flops_ratio'])}, params ratio "
             f"{fmt3(info['params_ratio'])}, file-size ratio {fmt3(info.get('file_size_ratio'))}"
             f", CPU speed-up {_speedups(lat)}"]
    topo = (plan.get("settings") or {}).get("topology_hash")
    if topo:
        lines.append(f"plan topology hash {topo[:16]}… (applies to every checkpoint of this "
                     "architecture, docs/METHODS.md §A5)")
    lines += _optimization_lines(info.get("optimization"))
    lines += _recovery_lines(info)
    cmp_ = info.get("comparison")
    if cmp_:
        lines.append(f"top-1 agreement with the source {100 * cmp_['top1_agreement']:.1f} % on "
                     f"{cmp_['n_samples']} {cmp_['data']} samples, max |Δlogit| "
                     f"{cmp_['max_abs_logit_diff']:.3g}")
    lines += [f"note: {n}" for n in info.get("notes", [])]
    return "\n".join(lines) + "\n"


def _speedups(lat: dict) -> str:
    """"b=1 1.2x, b=32 1.4x" with the interquartile range of the per-round ratios."""
    parts = []
    for b in ("1", "32"):
        iqr = (lat.get("speedup_iqr") or {}).get(b)
        spread = f" (IQR {iqr[0]:.2f}-{iqr[1]:.2f})" if iqr else ""
        parts.append(f"b={b} {fmt3(lat['speedup'][b])}x{spread}")
    return ", ".join(parts) + latency_setting(lat)


def latency_setting(lat: dict) -> str:
    """" (1 thread, 21 / 5 interleaved rounds)": the threads and the rounds timed at
    batch 1 / 32 (or the most asked for, in a report written before rounds_run)."""
    if not lat.get("rounds"):
        return ""
    threads = lat.get("threads")
    run = lat.get("rounds_run") or {}
    rounds = " / ".join(str(run[b]) for b in ("1", "32") if b in run) or lat["rounds"]
    return (f" ({threads or 'default'} thread{'s' if threads != 1 else ''}, {rounds} "
            "interleaved rounds)")


def _optimization_lines(opt: dict | None) -> list[str]:
    if opt is None:
        return []
    if not opt["fold_bn"]:
        return ["emitted graph as pruned (--no-fold-bn): BatchNormalization kept"]
    diff = opt.get("max_abs_output_diff")
    return [f"emitted graph: {len(opt['folded'])} Conv+BatchNormalization pairs folded, "
            f"{len(opt['removed'])} redundant nodes removed"
            + ("" if diff is None else f"; max |Δoutput| vs the unfolded pruned model "
                                       f"{diff:.3g}")]


def _recovery_lines(info: dict) -> list[str]:
    lines = []
    before, after = info["accuracy"].get("before_recovery"), info["accuracy"].get("emitted")
    if before and after:
        steps = " + ".join(name for name, on in (("reconstruction", info.get("reconstruction")),
                                                 ("BN recalibration", info.get("recalibration")),
                                                 ("fine-tuning", info.get("finetune"))) if on)
        lines.append(f"top-1 of the pruned model {100 * before['accuracy']:.2f} % before "
                     f"recovery, {100 * after['accuracy']:.2f} % after {steps}")
    lines += reconstruction_lines(info.get("reconstruction"))
    rcl = info.get("recalibration")
    if rcl:
        lines.append(f"BN recalibration: {len(rcl['bns'])} BatchNormalization nodes"
                     + (f" and {len(rcl['layers'])} convs without BN re-standardised"
                        if rcl["layers"] else "")
                     + f" on {rcl['n_images']} calibration images"
                     + "".join(f"; {n}" for n in rcl.get("notes", [])))
    return lines


def reconstruction_lines(rec: dict | None) -> list[str]:
    """The reconstruction's per-layer output errors (relative to the dense output power)."""
    if not rec:
        return []
    done = [la for la in rec["layers"] if la["skipped"] is None]
    lines = [f"reconstruction (ridge {rec['ridge']:g}): {len(done)} consumer layers, mean "
             f"relative output error {fmt_pct(rec['mean_error_before'])} unrepaired -> "
             f"{fmt_pct(rec['mean_error_after'])} reconstructed"
             + "".join(f"; {n}" for n in rec.get("notes", []))]
    lines += [f"  {la['node_name']}: -{la['n_removed']} inputs, error "
              f"{fmt_pct(la['error_before'])} -> {fmt_pct(la['error_after'])}"
              for la in done[:12]]
    if len(done) > 12:
        lines.append(f"  … {len(done) - 12} more in the JSON report")
    return lines


def fmt_pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f} %"
