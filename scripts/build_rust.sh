#!/usr/bin/env bash
# Builds the Rust bridge server, rust/target/release/cosyvoice-server, offline from Debian's packaged crates
# (rust/.cargo/config.toml replaces crates.io with /usr/share/cargo/registry), installing the apt packages
# that are missing (as root or through sudo).
#
# The toolchain is Debian's /usr/bin/cargo (rustc 1.63, the compiler those crates are packaged for), even where
# a rustup cargo comes first on PATH. PyO3 links the Python of the project's venv (COSYVOICE_VENV, default
# .venv: run scripts/setup.sh first) and records its library folder as the binary's run path, so the binary
# starts from any folder without a wrapper. Used by scripts/test.sh (and so .ci/run). `--packages` only installs
# the missing apt packages (apt cannot run twice at once: scripts/test.sh installs them before its parallel builds).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${COSYVOICE_VENV:-.venv}
PACKAGES=(cargo rustc librust-hyper-dev librust-tokio-dev librust-pyo3-dev librust-pyo3-build-config-dev
          librust-serde-json-dev librust-prometheus-dev librust-tracing-dev librust-tracing-subscriber-dev)
log() { echo "[build_rust] $*" >&2; }

missing=()
for package in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'ok installed' || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi
  log "installing (apt): ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ "${1:-}" = "--packages" ] && exit 0
[ -x "$VENV/bin/python" ] || { log "ERROR: no virtual environment at $VENV (run scripts/setup.sh)"; exit 1; }

log "building rust/target/release/cosyvoice-server with $(/usr/bin/cargo --version), Python $("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])')"
PY="$(cd "$VENV" && pwd)/bin/python"
cd rust  # cargo reads .cargo/config.toml (the offline Debian source) from the folder it runs in
PYO3_PYTHON="$PY" /usr/bin/cargo build --release --offline
