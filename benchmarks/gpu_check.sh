#!/usr/bin/env bash
# The GPU path in one prepared run (issue 20): on a CUDA machine, in <= 8 minutes,
#   1. a fresh venv with the [gpu] extra (pip install -e ".[gpu,test]"),
#   2. the tests marked gpu (python -m pytest -m gpu: CUDA vs CPU numbers, no silent
#      fallback; ONNXDIAG_REQUIRE_CUDA=1 turns their skip into a failure),
#   3. benchmarks/bench_gpu.py: every pass's ratio to plain inference, CUDA next to CPU.
#
#   bash benchmarks/gpu_check.sh
#
# Without CUDA (no working nvidia-smi, or GPU_CHECK_CPU_ONLY=1) it runs degraded: the venv
# gets the [cpu] extra, the gpu tests skip, and the CUDA column reads "not measured".
# Environment:
#   GPU_CHECK_CPU_ONLY=1     degraded mode even where a GPU is present
#   GPU_CHECK_PYTHON=PATH    use this interpreter (onnxdiag importable) instead of a fresh
#                            venv: no install step (what tests/test_benchmarks.py does)
#   GPU_CHECK_VENV=DIR       where to make the venv (default: a new temporary folder)
#   GPU_CHECK_WHEELS=DIR     install offline from these wheels (pip --no-index --find-links)
#   GPU_CHECK_SYSTEM_SITE=1  the venv sees the system's packages (--system-site-packages):
#                            offline, only what the system lacks needs a wheel
#   GPU_CHECK_PIP_EXTRA=...  more requirements for the venv, e.g. "onnxruntime-gpu[cuda,cudnn]"
#                            where the machine has a driver but no CUDA 12 / cuDNN 9 libraries
#   GPU_CHECK_SMOKE=1        bench_gpu.py --smoke (seconds instead of about a minute)
#   GPU_CHECK_OUT=DIR        also write gpu_check.log and bench_gpu.json there
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - start )) s] $*"; }

mode=cuda
if [[ "${GPU_CHECK_CPU_ONLY:-0}" == 1 ]]; then
    mode=cpu; why="GPU_CHECK_CPU_ONLY=1"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    mode=cpu; why="no working nvidia-smi (no NVIDIA driver or GPU)"
fi
out="${GPU_CHECK_OUT:-}"
if [[ -n "$out" ]]; then
    mkdir -p "$out"
    exec > >(tee "$out/gpu_check.log") 2>&1
fi
if [[ $mode == cuda ]]; then
    step "CUDA machine"; nvidia-smi -L
else
    step "degraded mode, CPU only: $why; the CUDA column will read 'not measured'"
fi

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
    py="$GPU_CHECK_PYTHON"
    step "using $py as it is (GPU_CHECK_PYTHON): no venv, no install"
else
    venv="${GPU_CHECK_VENV:-$(mktemp -d)/venv}"
    extra=$([[ $mode == cuda ]] && echo gpu || echo cpu)
    step "fresh venv $venv with the [$extra,test] extras"
    venv_args=()
    if [[ "${GPU_CHECK_SYSTEM_SITE:-0}" == 1 ]]; then venv_args+=(--system-site-packages); fi
    "${PYTHON:-python3}" -m venv "${venv_args[@]}" "$venv"
    py="$venv/bin/python"
    pip_args=(-q --disable-pip-version-check)
    if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
        pip_args+=(--no-index --find-links "$GPU_CHECK_WHEELS")
    fi
    # shellcheck disable=SC2086  # GPU_CHECK_PIP_EXTRA: a list of requirements
    "$py" -m pip install "${pip_args[@]}" -e ".[$extra,test]" ${GPU_CHECK_PIP_EXTRA:-}
    # CUDA / cuDNN installed as pip wheels (nvidia-*-cu12) live in the venv: the dynamic
    # loader reads LD_LIBRARY_PATH at process start, so it is set here for what follows.
    nv=$("$py" -c "import glob, os, site; print(':'.join(sorted(glob.glob(os.path.join(
        site.getsitepackages()[0], 'nvidia', '*', 'lib')))))")
    if [[ -n "$nv" ]]; then export LD_LIBRARY_PATH="$nv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
fi
"$py" - <<'EOF'
import importlib.metadata as md
import onnxruntime as ort
have = []
for d in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnxruntime-training-cpu"):
    try:
        have.append(f"{d} {md.version(d)}")
    except md.PackageNotFoundError:
        pass
print(f"installed: {', '.join(have)}; providers available: {ort.get_available_providers()}")
EOF

if [[ $mode == cuda ]]; then
    step "preflight: a CUDA session must run on CUDA (not fall back to CPU)"
    "$py" - <<'EOF'
import sys
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                      opset_imports=[helper.make_opsetid("", 17)])
m.ir_version = 8
s = ort.InferenceSession(m.SerializeToString(),
                         providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
if s.get_providers()[0] != "CUDAExecutionProvider":
    sys.exit("CUDAExecutionProvider did not load (ONNX Runtime's warning above says which "
             "library is missing): install CUDA 12 and cuDNN 9, or rerun with "
             "GPU_CHECK_PIP_EXTRA='onnxruntime-gpu[cuda,cudnn]'")
print("CUDA session providers:", s.get_providers())
EOF
fi

step "tests marked gpu: python -m pytest -m gpu"
ONNXDIAG_REQUIRE_CUDA=$([[ $mode == cuda ]] && echo 1 || echo 0) \
    "$py" -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_gpu.py

step "every pass's ratio to plain inference: benchmarks/bench_gpu.py"
bench=(benchmarks/bench_gpu.py --providers "$([[ $mode == cuda ]] && echo cpu,cuda || echo cpu)")
if [[ "${GPU_CHECK_SMOKE:-0}" == 1 ]]; then bench+=(--smoke); fi
if [[ -n "$out" ]]; then bench+=(--json "$out/bench_gpu.json"); fi
"$py" "${bench[@]}"

took=$(( $(date +%s) - start ))
step "done in $took s (budget 480 s; mode $mode)"
if (( took > 480 )); then echo "WARNING: over the 8-minute budget"; fi
