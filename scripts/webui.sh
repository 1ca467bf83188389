#!/usr/bin/env bash
# Installs what is missing (with the web UI's extra), then starts the web UI on http://localhost:8000.
# Arguments go to webui.py, e.g. `bash scripts/webui.sh --model-dir DIR --host 0.0.0.0 --port 8000`.
set -euo pipefail
cd "$(dirname "$0")/.."
COSYVOICE_EXTRAS="ui${COSYVOICE_EXTRAS:+,$COSYVOICE_EXTRAS}" bash scripts/setup.sh
exec "${PYTHON:-python3}" webui.py "$@"
