#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), builds the Rust servers and the Rust engine's Python module
# (scripts/build_rust.sh), then runs the whole test suite in the project's virtual environment: exactly the
# command CI runs and the README shows.
# Arguments go to pytest (e.g. -x -k voices). Where the Rust build fails the suite still runs and its Rust
# tests skip, saying why; CI sets COSYVOICE_REQUIRE_RUST=1, which makes a failed build (and a skip) fatal.
#
# On a fresh machine three builds are needed, each mostly one core's work: the project's venv (pip), the Rust
# server (cargo) and `.venv-webui`, the web UI's own install that tests/test_webui_install.py serves from
# (`scripts/webui.sh --install`, made again from nothing whenever setup.sh would reinstall it). After the
# system packages (apt runs one at a time) they run at once; each one's output follows when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COSYVOICE_VENV:-.venv}
bash scripts/setup.sh --system
bash scripts/build_rust.sh --packages || true  # where apt cannot, the build below fails and says why
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null || true; rm -rf "$logs"' EXIT  # a failed install stops the other builds

# Two torch installs at once (PyPI's CUDA build where no CPU index is reachable) need ~17 GB at their peak, the
# Rust target ~2 GB more: with less free, the web UI's install waits for the project's (setup.sh refuses, saying
# so, an install its disk cannot hold at all).
free_gb=$(df -P -BG . | awk 'NR == 2 { print $4 + 0 }')
echo "[test] $free_gb GB free on the checkout's disk ($(df -P . | awk 'NR == 2 { print $6 }'))" >&2
bash scripts/build_rust.sh --build > "$logs/rust.log" 2>&1 &
rust=$!
ui=""
ui_env=(env -u VIRTUAL_ENV -u PYTHONPATH -u COSYVOICE_EXTRAS COSYVOICE_VENV=.venv-webui)
ui_install() {
  rm -rf .venv-webui  # not upgraded in place: what `ui` no longer declares must be gone
  "${ui_env[@]}" bash scripts/webui.sh --install > "$logs/webui.log" 2>&1
}
ui_wanted=0
"${ui_env[@]}" COSYVOICE_EXTRAS=ui bash scripts/setup.sh --check > /dev/null 2>&1 || ui_wanted=1
if [ "$ui_wanted" = 1 ] && [ "$free_gb" -ge 20 ]; then ui_install & ui=$!; ui_wanted=0; fi
bash scripts/setup.sh
if [ "$ui_wanted" = 1 ]; then ui_install & ui=$!; fi

built=0
# the module's install and the crates' tests need the venv's packages (onnxruntime): after setup.sh
wait "$rust" && bash scripts/build_rust.sh --finish >> "$logs/rust.log" 2>&1 && built=1
cat "$logs/rust.log"
if [ "$built" = 0 ]; then
  [ "${COSYVOICE_REQUIRE_RUST:-0}" = 1 ] && { echo "[test] the Rust server did not build" >&2; exit 1; }
  echo "[test] WARNING: the Rust server did not build; its contract tests will be skipped" >&2
fi
# the Rust engine's parity tests (tests/test_rust_backend_parity.py, verify_flow_rust.py) import the module
# build_rust.sh installed into the venv
if ! "$VENV/bin/python" -c 'import cosyvoice_rust_backend' 2> /dev/null; then
  [ "${COSYVOICE_REQUIRE_RUST:-0}" = 1 ] && { echo "[test] cosyvoice_rust_backend is not in $VENV" >&2; exit 1; }
  echo "[test] WARNING: cosyvoice_rust_backend is not in $VENV; the Rust engine's parity tests will be skipped" >&2
fi
if [ -n "$ui" ]; then
  # a failure here is not fatal: tests/test_webui_install.py builds it again and shows why it fails
  wait "$ui" || echo "[test] WARNING: the web UI's own venv (.venv-webui) did not install" >&2
  cat "$logs/webui.log"
fi
trap - EXIT
rm -rf "$logs"
# a worker per core, each test file on one worker (its module's server and browser are started once); the
# slowest tests are listed at the end, so that a slow run says where its time went
exec "$VENV/bin/python" -m pytest -q -n auto --dist loadfile --durations=25 "$@"
