"""Every verb on every real converter export: works, or refuses with one line.

Builds the exports of tests/exports.py (torch.onnx ResNet and ViT, Hugging Face BERT /
GPT-2 / Llama classifiers, skl2onnx MLP, a tf/jax-style graph with Constant-node weights,
an int8 QDQ model), writes small random calibration / evaluation data (labels in [0, C))
and a 3-checkpoint series per model (the export and two seeded perturbations of its float
weights), then runs each verb of ``onnxdiag --help`` on each model through the real command
line, one fresh ``python -m onnxdiag`` process per cell, and classifies the cell:

- ``ok``: exit 0, no "Traceback" on stdout/stderr, the model of prune / prune-channels
  ``-o`` written, and every ``.onnx`` the command wrote passes
  ``onnx.checker.check_model(full_check=True)`` (a model with sparse initializers: the
  structural checker, and the full one on its densified copy) and loads in ONNX Runtime;
- ``refused``: exit 1, stderr exactly one non-empty line (``error: …``), no "Traceback",
  no model written;
- ``FAIL``: anything else (an internal error, a traceback, a bad emitted model, a timeout).

Writes a Markdown table model x verb (docs/CORPUS.md by default) with each refusal's
reason and the exact command of every verb, and exits 1 when a cell FAILs.
``--smoke`` runs a few models x a few verbs (tests/test_corpus_matrix.py runs it).

    python tools/export_corpus.py                 # full matrix -> docs/CORPUS.md
    python tools/export_corpus.py --smoke --doc /tmp/corpus.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the export builders live with the tests

VERBS = ("inspect", "readouts", "analyze", "select", "channels", "lesion", "orthogonality",
         "rr", "prune", "sweep", "prune-channels", "prune-sweep")
#: extra columns: a verb with options that take other code paths (added to its settings)
VARIANTS = ("prune --sparse-initializers", "prune-channels --recalibrate-bn --no-fold-bn",
            "prune --repair ls", "sweep --repairs ls+bn,ls",
            "prune-channels --reconstruct --score recon", "prune-channels --score wanda",
            "prune-sweep --scores recon,wanda --reconstruct", "select --prune 0.5",
            "select --prune-channels 0.25 --repair reconstruct+bn")
SMOKE_MODELS = ("torch_resnet", "hf_gpt2", "qdq_int8")
SMOKE_VERBS = ("inspect", "prune", "prune-channels")
EMITS = {"prune": "pruned.onnx", "prune-channels": "narrow.onnx"}  # the -o of each verb
N_SAMPLES = 24  # calibration and evaluation samples per model
DATE, MACHINE = "2026-12-02", "2-core CPU (project machine)"


@dataclass
class Model:
    """One built export with its data: the model, its checkpoint series, calib / eval."""

    name: str
    path: Path
    checkpoints: Path
    calib: Path
    eval: Path
    layer: str  # the first non-head layer (for lesion)
    n_classes: int


@dataclass
class Cell:
    model: str
    verb: str
    status: str = "FAIL"
    reason: str = ""
    seconds: float = 0.0
    argv: list = field(default_factory=list)


# -- building the corpus ------------------------------------------------------------------------
def _random_feeds(export, n: int, rng) -> dict:
    """``n`` random samples shaped like the export's own batch (token ids keep their range
    and right padding; images / vectors keep their value range)."""
    import numpy as np

    feeds = {}
    for key, value in export.feeds.items():
        shape = (n, *value.shape[1:])
        if key == "attention_mask":
            lengths = rng.integers(2, value.shape[1] + 1, n)
            feeds[key] = (np.arange(value.shape[1])[None, :] < lengths[:, None]).astype(
                value.dtype)
        elif value.dtype.kind in "iu":
            feeds[key] = rng.integers(max(int(value.min()), 1), int(value.max()) + 1,
                                      shape).astype(value.dtype)
        else:
            lo, hi = float(value.min()), float(value.max())
            feeds[key] = rng.uniform(lo, hi, shape).astype(value.dtype)
    if "attention_mask" in feeds and "input_ids" in feeds:
        feeds["input_ids"] = feeds["input_ids"] * feeds["attention_mask"]
    return feeds


def _perturbed(path: Path, out: Path, seed: int) -> None:
    """A copy of ``path`` with seeded 1 % noise on every float initializer and Constant."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    rng = np.random.default_rng(seed)
    tensors = list(model.graph.initializer) + [
        a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute
        if a.name == "value"]
    for tensor in tensors:
        value = numpy_helper.to_array(tensor)
        if value.dtype.kind == "f" and value.size > 1:
            noisy = value * (1 + 0.01 * rng.standard_normal(value.shape))
            tensor.CopyFrom(numpy_helper.from_array(noisy.astype(value.dtype), tensor.name))
    onnx.save(model, out)


def _structure(path: Path) -> tuple[int, str]:
    """(number of classes, first non-head layer), as ``onnxdiag inspect`` finds them."""
    from onnxdiag.graph import find_head, find_layers
    from onnxdiag.model.io import load_model

    model = load_model(path)
    head = find_head(model)
    layers = [la.node_name for la in find_layers(model, head) if not la.is_head]
    return int(head.n_classes), layers[0]


def build_model(name: str, work: Path) -> Model:
    import exports
    import numpy as np

    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export = exports.BUILDERS[name](folder)
    n_classes, layer = _structure(export.path)
    rng = np.random.default_rng(0)
    paths = {}
    for split in ("calib", "eval"):
        feeds = _random_feeds(export, N_SAMPLES, rng)
        paths[split] = folder / f"{split}.npz"
        np.savez(paths[split], **feeds, labels=rng.integers(0, n_classes, N_SAMPLES))
    ckpts = folder / "checkpoints"
    ckpts.mkdir(exist_ok=True)
    (ckpts / "ckpt_1.onnx").write_bytes(export.path.read_bytes())
    for step in (2, 3):
        _perturbed(export.path, ckpts / f"ckpt_{step}.onnx", seed=step)
    return Model(name, export.path, ckpts, paths["calib"], paths["eval"], layer, n_classes)


# -- one cell -----------------------------------------------------------------------------------
def _slug(column: str) -> str:
    return column.replace(" --", "+")


def command(column: str, m: Model, out: Path) -> list[str]:
    """The arguments of ``onnxdiag VERB [OPTIONS]`` (a column) on model ``m``, small
    settings, outputs in ``out``."""
    verb, *extra = column.split()
    data = ["--data", m.calib, "--limit", "16"]
    both = [*data, "--eval-data", m.eval]
    report = ["--out", out / "report"]
    args = {
        "inspect": [m.path],
        "readouts": [m.path, *data, *report],
        "analyze": [m.path, *both, *report],
        "select": [m.checkpoints, *both, "--jobs", "1", *report],
        "channels": [m.path, *data, "--positions", "4", *report],
        "lesion": [m.path, "--layer", m.layer, "--sample", "2", *both, *report],
        "orthogonality": [m.checkpoints, *data, "--positions", "4", *report],
        "rr": [m.path, *data, "--grid", "0.5,0.9", "--band-sparsity", "0.5",
               "--rr-images", "8", *report],
        "prune": [m.path, "--sparsity", "0.5", *both, "--rr-images", "8",
                  "-o", out / EMITS["prune"], *report],
        "sweep": [m.path, "--sparsity", "0.5", "--allocations", "global,rr",
                  "--repairs", "cr+bn,none", *both, "--rr-images", "8", *report],
        "prune-channels": [m.path, "--ratio", "0.5", *both, "-o", out / EMITS["prune-channels"],
                           *report],
        "prune-sweep": [m.path, "--ratios", "0.5", "--scores", "magnitude,two_axis", *both,
                        *report],
    }[verb]
    if verb == "select" and {"--prune", "--prune-channels"} & set(extra):
        extra = [*extra, "--write-pruned", str(out / "pruned")]  # its models get checked
    return [verb, *map(str, args), *extra]


def _densified(model):
    """A copy of ``model`` with every sparse_initializer stored as a dense initializer."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    dense = onnx.ModelProto()
    dense.CopyFrom(model)
    for sparse in dense.graph.sparse_initializer:
        values, indices = (numpy_helper.to_array(t) for t in (sparse.values, sparse.indices))
        flat = np.zeros(int(np.prod(sparse.dims)), values.dtype)
        if indices.ndim == 1:
            flat[indices] = values
        else:  # (nnz, rank) coordinates
            flat[np.ravel_multi_index(tuple(indices.T), tuple(sparse.dims))] = values
        dense.graph.initializer.append(numpy_helper.from_array(
            flat.reshape(tuple(sparse.dims)), sparse.values.name))
    del dense.graph.sparse_initializer[:]
    return dense


def check_emitted(paths: list[Path]) -> str:
    """'' when every model passes the full checker and loads in ONNX Runtime, else why.

    ONNX's shape inference cannot type a sparse_initializer read by a Conv or MatMul
    (docs/PRUNING.md), so a sparse-stored model gets the structural checker and its
    densified copy the full one."""
    import onnx
    import onnxruntime as ort

    for path in paths:
        try:
            model = onnx.load(str(path))
            if model.graph.sparse_initializer:
                onnx.checker.check_model(model)
                onnx.checker.check_model(_densified(model), full_check=True)
            else:
                onnx.checker.check_model(str(path), full_check=True)
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            return f"emitted {path.name}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return ""


def classify(rc: int, stdout: str, stderr: str, emitted: list[Path]) -> tuple[str, str]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    if "Traceback" in stdout + stderr:
        return "FAIL", f"exit {rc}, traceback: {(lines or ['?'])[-1]}"
    if rc == 0:
        bad = check_emitted(emitted)
        return ("FAIL", bad) if bad else ("ok", _nothing_done(stdout))
    if rc == 1 and len(lines) == 1 and lines[0].startswith("error: "):
        return "refused", lines[0][len("error: "):]
    return "FAIL", f"exit {rc}: " + " | ".join(lines[-3:])


def _nothing_done(stdout: str) -> str:
    """The note of a command that succeeded without changing anything (prune-channels when
    no channel group can be pruned), shortened; '' otherwise."""
    for line in stdout.splitlines():
        if line.startswith("note: nothing removed"):
            return line[len("note: "):].split(" (first")[0]
    return ""


def run_cell(m: Model, column: str, work: Path, timeout: float) -> Cell:
    out = work / m.name / f"out-{_slug(column)}"
    out.mkdir(parents=True, exist_ok=True)
    argv = command(column, m, out)
    verb = argv[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "onnxdiag", *argv], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=out)
        (out / "stdout.txt").write_text(proc.stdout)
        (out / "stderr.txt").write_text(proc.stderr)
        status, reason = classify(proc.returncode, proc.stdout, proc.stderr,
                                  sorted(out.rglob("*.onnx")))
        written = verb in EMITS and (out / EMITS[verb]).exists()
        if status == "ok" and verb in EMITS and not written:
            status, reason = "FAIL", f"exit 0 but {EMITS[verb]} was not written"
        elif status == "refused" and written:
            status, reason = "FAIL", f"refused but left {EMITS[verb]} behind: {reason}"
    except subprocess.TimeoutExpired:
        status, reason = "FAIL", f"timed out after {timeout:.0f} s"
    return Cell(m.name, column, status, reason, time.perf_counter() - start, argv)


# -- the table ----------------------------------------------------------------------------------
def _template(cell: Cell, work: Path) -> str:
    """The cell's command with this run's paths replaced by placeholders."""
    text = " ".join(cell.argv).replace(str(work / cell.model / f"out-{_slug(cell.verb)}"),
                                       "OUT")
    text = text.replace(str(work / cell.model), "MODEL_DIR")
    return "onnxdiag " + text.replace(cell.model, "MODEL")


def markdown(cells: list[Cell], models: list[str], verbs: list[str], work: Path,
             invocation: str, seconds: float) -> str:
    reasons: dict[str, int] = {}
    grid = {(c.model, c.verb): c for c in cells}
    head = "| model | " + " | ".join(verbs) + " |"
    rows = [head, "|" + "---|" * (len(verbs) + 1)]
    for name in models:
        marks = []
        for verb in verbs:
            c = grid[name, verb]
            if c.status == "ok" and not c.reason:
                marks.append("ok")
            else:
                note = reasons.setdefault(c.reason, len(reasons) + 1)
                marks.append(f"{c.status} ({note})")
        rows.append(f"| {name} | " + " | ".join(marks) + " |")
    counts = {s: sum(c.status == s for c in cells) for s in ("ok", "refused", "FAIL")}
    example = {c.verb: c for c in cells}
    parts = [
        "# Corpus matrix: every verb on every real converter export", "",
        "Every command either works (exit 0; the model asked for with `-o` is written, and "
        "every model it writes passes `onnx.checker.check_model(full_check=True)` and loads "
        "in ONNX Runtime) or refuses with one line (exit 1, one `error: …` line on stderr, "
        "no traceback, no model left behind). A model stored with sparse initializers gets the "
        "structural checker and its densified copy the full one (ONNX's shape inference "
        "cannot type a sparse initializer read by a Conv or MatMul). FAIL is anything else. "
        "The models are the "
        "converter exports of `tests/exports.py` with "
        f"random weights; data: {N_SAMPLES} random samples shaped like each model's input, "
        "labels uniform in [0, C); checkpoint series: the export and two perturbed copies.",
        "", f"Generated by `{invocation}` on {DATE}, {MACHINE}, in {seconds:.0f} s "
        f"({len(cells)} cells, one fresh process each).", "",
        f"**{counts['ok']} ok, {counts['refused']} refused, {counts['FAIL']} FAIL.**", "",
        *rows, "", "## Reasons", "",
        "Why a cell refused (or, for an `ok (n)`, what it did not do); the text is the "
        "command's own one-line message.", "",
        *[f"{n}. {text}" for text, n in reasons.items()], "",
        "## Commands", "",
        "MODEL is the export, MODEL_DIR its folder (calib.npz, eval.npz, checkpoints/), "
        "OUT the cell's output folder; lesion's `--layer` is the model's first non-head "
        "layer.", "",
        *[f"- `{_template(example[v], work)}`" for v in verbs if v in example], "",
    ]
    return "\n".join(parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few models x a few verbs")
    p.add_argument("--models", help="comma-separated export names (default: all)")
    p.add_argument("--verbs", help="comma-separated columns: verbs, or a verb and options "
                   "(default: every verb and VARIANTS)")
    p.add_argument("--doc", default=str(ROOT / "docs" / "CORPUS.md"),
                   help="Markdown table to write (default docs/CORPUS.md)")
    p.add_argument("--work", help="folder for the exports and outputs (default: a temp dir)")
    p.add_argument("--jobs", type=int, default=2, help="cells run at once")
    p.add_argument("--timeout", type=float, default=300, help="seconds per cell")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import exports

    args = parse_args(argv)
    models = (args.models.split(",") if args.models else
              list(SMOKE_MODELS if args.smoke else exports.BUILDERS))
    verbs = args.verbs.split(",") if args.verbs else list(
        SMOKE_VERBS if args.smoke else VERBS + VARIANTS)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onnxdiag-corpus-") as tmp:
        work = Path(args.work or tmp).resolve()
        built = [build_model(name, work) for name in models]
        jobs = [(m, v) for m in built for v in verbs]
        cells = []
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for c in pool.map(lambda mv: run_cell(*mv, work, args.timeout), jobs):
                print(f"{c.model:22s} {c.verb:45s} {c.status:8s} {c.seconds:6.1f}s  {c.reason}",
                      flush=True)
                cells.append(c)
        invocation = "python tools/export_corpus.py" + (" --smoke" if args.smoke else "")
        doc = markdown(cells, models, verbs, work, invocation, time.perf_counter() - start)
    Path(args.doc).write_text(doc)
    fails = [c for c in cells if c.status == "FAIL"]
    print(f"{len(cells) - len(fails)}/{len(cells)} cells ok or refused; wrote {args.doc}")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
