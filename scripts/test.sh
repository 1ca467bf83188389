#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then runs the whole test suite in the project's virtual
# environment: exactly the command CI runs and the README shows. Arguments go to pytest (e.g. -x -k voices).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${COSYVOICE_VENV:-.venv}/bin/python" -m pytest -q "$@"
