#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh, the web UI's extra), then starts the web UI on
# http://localhost:8000 from the project's virtual environment. Once installed, it starts with no pip call
# and no network. Arguments go to webui.py, e.g. `bash scripts/webui.sh --model-dir DIR --host 0.0.0.0`;
# `--install` only installs (scripts/test.sh makes the install test's venv that way).
set -euo pipefail
cd "$(dirname "$0")/.."
COSYVOICE_EXTRAS=${COSYVOICE_EXTRAS:-ui} bash scripts/setup.sh
[ "${1:-}" = "--install" ] && exit 0
exec "${COSYVOICE_VENV:-.venv}/bin/python" webui.py "$@"
