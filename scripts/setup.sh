#!/usr/bin/env bash
# Installs whatever is missing for CosyVoice3 Studio on a bare Debian + Python 3.10+ machine.
# Safe to re-run (installed packages are kept; the editable install is refreshed). Used by scripts/test.sh, scripts/webui.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi

# System packages: ffmpeg decodes browser uploads (mp3/m4a/webm) that libsndfile cannot.
if ! command -v ffmpeg >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    echo "[setup] installing ffmpeg (apt)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends ffmpeg >/dev/null
  else
    echo "[setup] WARNING: ffmpeg not found and cannot be installed here (no apt-get or no root);" \
         "mp3/m4a/webm prompts will be refused and the web UI cannot stream audio" >&2
  fi
fi

# torch first and pinned: 2.13.0 is the CPU build on local disk here; any other request pulls a
# multi-GB CUDA build. A machine that already has a torch satisfying our range keeps it (GPU boxes).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi

extras=${COSYVOICE_EXTRAS:-dev}
echo "[setup] installing the project (editable, extras: $extras)"
"$PY" -m pip install -q -e ".[${extras}]"
