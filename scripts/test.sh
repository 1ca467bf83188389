#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (exactly what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
