#!/usr/bin/env bash
# Builds the Rust workspace (rust/): the bridge server rust/target/release/cosyvoice-server, the HTTP front
# its servers share (rust/http-front), the native engine with its server rust/target/release/
# cosyvoice-native-server (rust/native-server: candle, and ONNX Runtime opened at run time) and its PyO3
# module `cosyvoice_rust_backend` (rust/python-backend, installed into the venv's site-packages), then runs the crates'
# tests, among them the native engine's parity tests against the golden fixtures (../shared/golden beside the
# repository, or COSYVOICE_GOLDEN_DIR; where absent they pass without checking, and this script says so).
#
# The toolchain is rustup's cargo (1.92 or newer: ort 2.0.0-rc.15, the native engine's ONNX Runtime binding,
# needs 1.92; Debian's /usr/bin/cargo 1.63 is too old). ONNX Runtime itself is not downloaded: the native
# engine opens libonnxruntime.so of the venv's onnxruntime wheel (ORT_DYLIB_PATH, set here for its tests). Crates come from crates.io at the
# versions rust/Cargo.lock pins: `cargo fetch` downloads what the local cache (~/.cargo/registry) lacks, once;
# the build itself runs offline, so a machine that fetched once builds without a network. PyO3 links the
# Python of the project's venv (COSYVOICE_VENV, default .venv: run scripts/setup.sh first) and records its
# library folder as the binary's run path, so the binary starts from any folder without a wrapper. Used by
# scripts/test.sh (and so .ci/run). `--packages` only installs the missing apt packages (a C linker, and the
# venv Python's shared library where its base lacks it; apt cannot run twice at once: scripts/test.sh
# installs them before its parallel builds). `--build` only compiles (the servers, the module and the tests'
# binaries: it needs the venv's Python, not its packages) and `--finish` only installs the module and runs the
# tests (they need the venv's onnxruntime): scripts/test.sh compiles while pip installs, then finishes.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${COSYVOICE_VENV:-.venv}
MIN_RUST=1.92
log() { echo "[build_rust] $*" >&2; }

# the venv's base Python: its shared library is what PyO3 links
PY=""
[ -x "$VENV/bin/python" ] && PY="$(cd "$VENV" && pwd)/bin/python"
packages=()
command -v cc >/dev/null 2>&1 || packages+=(gcc libc6-dev)
if [ -n "$PY" ]; then
  libpython=$("$PY" -c 'import sysconfig as s, os; print(os.path.join(s.get_config_var("LIBDIR") or "", s.get_config_var("LDLIBRARY") or ""))')
  if [ ! -e "$libpython" ] && command -v dpkg-query >/dev/null 2>&1; then
    packages+=("lib$("$PY" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')-dev")
  fi
fi
if [ ${#packages[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi
  log "installing (apt): ${packages[*]}"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi
[ "${1:-}" = "--packages" ] && exit 0
build=1 finish=1
[ "${1:-}" = "--build" ] && finish=0
[ "${1:-}" = "--finish" ] && build=0
[ -n "$PY" ] || { log "ERROR: no virtual environment at $VENV (run scripts/setup.sh)"; exit 1; }

# rustup's cargo: on PATH, else where rustup installs it
CARGO=$(command -v cargo || true)
[ -x "$HOME/.cargo/bin/cargo" ] && CARGO="$HOME/.cargo/bin/cargo"
version=$([ -n "$CARGO" ] && "$CARGO" --version 2>/dev/null | awk '{print $2}' || true)
if [ -z "$version" ] || [ "$(printf '%s\n%s\n' "$MIN_RUST" "$version" | sort -V | head -1)" != "$MIN_RUST" ]; then
  log "ERROR: cargo ${version:-not found} (${CARGO:-no cargo on PATH}); the Rust servers need $MIN_RUST or newer:" \
      "install rustup (https://rustup.rs) and run 'rustup default stable'"
  exit 1
fi

log "building rust/ with $("$CARGO" --version), Python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
cd rust
export PYO3_PYTHON="$PY"
if [ "$build" = 1 ]; then
  # downloads only what the cache lacks; without a network the offline build below says what is missing
  "$CARGO" fetch --locked || log "WARNING: cargo fetch failed (no network?): building from the local crate cache"
  "$CARGO" build --release --offline --locked
  "$CARGO" test --release --offline --locked --no-run --quiet
fi
[ "$finish" = 1 ] || exit 0
# the PyO3 module cosyvoice_rust_backend (rust/python-backend: the native engine's stages, for the parity tests
# from Python), installed into the venv
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
module="cosyvoice_rust_backend$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
install -m 755 target/release/libcosyvoice_rust_backend.so "$site/$module"
(cd / && "$PY" -c 'import cosyvoice_rust_backend') || { log "ERROR: $site/$module does not import"; exit 1; }
log "installed $site/$module"
# the native engine's ONNX Runtime: the wheel's library, unless ORT_DYLIB_PATH names one
if [ -z "${ORT_DYLIB_PATH:-}" ]; then
  ORT_DYLIB_PATH=$("$PY" -c 'import glob, os, onnxruntime as o; print(sorted(glob.glob(os.path.join(os.path.dirname(o.__file__), "capi", "libonnxruntime.so*")))[-1])' 2>/dev/null || true)
  [ -n "$ORT_DYLIB_PATH" ] || log "WARNING: no onnxruntime in $VENV: the native engine's ONNX tests fail (pip install onnxruntime)"
  export ORT_DYLIB_PATH
fi
golden=${COSYVOICE_GOLDEN_DIR:-../../shared/golden}
[ -f "$golden/manifest.json" ] || log "WARNING: no golden fixtures at $golden: the native engine's parity tests check nothing"
"$CARGO" test --release --offline --locked --quiet
