#!/usr/bin/env bash
# Installs whatever is missing for CosyVoice3 Studio into the project's virtual environment (.venv/ in the
# repository), on a bare Debian machine with only python3, and on any machine after that.
#
# Everything Python goes into the venv, never into the system interpreter: Debian's python3 is "externally
# managed" (PEP 668) and refuses pip, and one environment per checkout gives every machine the same test
# command (scripts/test.sh). When all is installed (scripts/install_state.py: a stamp keyed on pyproject.toml,
# this script and the venv's Python, listing the extras installed) it makes no pip call and no network access
# at all.
#
# torch: a torch already in range is kept (a GPU box's own build included). Otherwise the CUDA build where an
# NVIDIA GPU is seen (nvidia-smi or /proc/driver/nvidia), else the ~200 MB CPU build from PyTorch's CPU index
# instead of PyPI's multi-GB CUDA build, or pip's configured indexes where that index cannot be reached (the CI
# takes its local CPU wheel that way). scripts/install_state.py decides (torch_plan) and says what it downloads.
#
# Environment: PYTHON (base interpreter, default python3), COSYVOICE_VENV (default .venv),
# COSYVOICE_EXTRAS (default dev; scripts/webui.sh asks for ui), COSYVOICE_TORCH (cpu, cuda or configured:
# overrides the choice above), COSYVOICE_TORCH_CPU_INDEX (a mirror of the CPU index). Used by scripts/test.sh,
# scripts/webui.sh, .ci/run. `bash scripts/setup.sh --check` only reports what is missing (exit 1 when anything
# is); `--system` installs only the system packages and makes the venv, with no pip call (scripts/test.sh runs
# the pip installs and the Rust build at once after it).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_PY=${PYTHON:-python3}
VENV=${COSYVOICE_VENV:-.venv}
EXTRAS=${COSYVOICE_EXTRAS:-dev}
CHECK_ONLY=0
SYSTEM_ONLY=0
[ "${1:-}" = "--check" ] && CHECK_ONLY=1
[ "${1:-}" = "--system" ] && SYSTEM_ONLY=1
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1  # tests drive Debian's /usr/bin/chromium; never fetch browsers

log() { echo "[setup] $*" >&2; }

# ---- system packages (apt), each only where missing ------------------------------------------------
# (Prompt uploads libsndfile cannot read, WebM/Opus and M4A/AAC, are decoded by PyAV in process: no ffmpeg.)
# chromium + fonts-noto-cjk: the browser tests (Playwright drives /usr/bin/chromium; CJK text renders).
# python3.X-venv: Debian ships venv's pip bootstrap (ensurepip) separately.
py_mm=$("$BASE_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
missing_apt=()
if [[ ",$EXTRAS," == *",dev,"* ]]; then
  [ -x /usr/bin/chromium ] || missing_apt+=(chromium)
  if command -v dpkg-query >/dev/null 2>&1; then
    dpkg-query -W -f='${Status}' fonts-noto-cjk 2>/dev/null | grep -q 'ok installed' || missing_apt+=(fonts-noto-cjk)
  fi
fi
state() { "$VENV/bin/python" scripts/install_state.py "$1" "$VENV" "$EXTRAS"; }
up_to_date() { [ -x "$VENV/bin/python" ] && state check; }
# A venv whose pip cannot be imported (e.g. made by python3 -m venv before python3-venv was installed)
# is made again.
venv_usable() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import pip' >/dev/null 2>&1; }
if ! up_to_date && ! venv_usable && ! "$BASE_PY" -c 'import ensurepip' >/dev/null 2>&1; then
  missing_apt+=("python${py_mm}-venv")
fi

if [ ${#missing_apt[@]} -gt 0 ]; then
  if [ "$CHECK_ONLY" = 1 ]; then
    log "missing system packages: ${missing_apt[*]}"
  else
    SUDO=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
      log "installing system packages (apt): ${missing_apt[*]}"
      # A failure (e.g. no network) is reported, not fatal: what is installed may still be enough to start.
      if ! { $SUDO apt-get update -qq &&
             $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
               "${missing_apt[@]}" >/dev/null; }; then
        log "WARNING: apt-get could not install ${missing_apt[*]}"
      fi
    else
      log "WARNING: missing ${missing_apt[*]} and no apt-get/root to install them: install them yourself"
    fi
  fi
fi

# ---- the virtual environment ------------------------------------------------------------------------
# torch>=2.4,<2.15, as pyproject.toml says
torch_in_range() {
  "$1" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(not (2, 4) <= v < (2, 15))' >/dev/null 2>&1
}
if up_to_date; then
  [ "$CHECK_ONLY" = 1 ] && [ ${#missing_apt[@]} -gt 0 ] && exit 1
  log "python packages up to date in $VENV (extras [$EXTRAS]): no pip call"
  exit 0
fi
if [ "$CHECK_ONLY" = 1 ]; then
  log "python packages not installed (or pyproject.toml/python changed since): $VENV, extras [$EXTRAS]"
  exit 1
fi

if ! venv_usable; then
  # A machine whose own python3 already has a torch in our range (e.g. a CUDA build on a GPU box) keeps
  # it: the venv sees the system's packages, and pip installs only what is missing or too old.
  venv_args=()
  if torch_in_range "$BASE_PY"; then
    venv_args+=(--system-site-packages)
  fi
  log "creating the virtual environment $VENV (${venv_args[*]:-isolated}) with $("$BASE_PY" -c 'import sys; print(sys.executable)')"
  if [ -e "$VENV" ]; then
    # a half-made venv (e.g. from a failed ensurepip) is replaced; anything else there is left alone
    [ -f "$VENV/pyvenv.cfg" ] || { log "ERROR: $VENV exists and is not a virtual environment"; exit 1; }
    rm -rf "$VENV"
  fi
  "$BASE_PY" -m venv "${venv_args[@]}" "$VENV"
fi
[ "$SYSTEM_ONLY" = 1 ] && exit 0
PY="$VENV/bin/python"

# torch first and pinned, in the build torch-plan chose (line 1: what it downloads; then pip's arguments).
if ! torch_in_range "$PY"; then
  plan_text=$("$PY" scripts/install_state.py torch-plan "$VENV")  # exits, saying why, where the disk is too small
  mapfile -t plan <<< "$plan_text"
  log "torch: ${plan[0]}"
  "$PY" -m pip install "${plan[@]:1}"
fi
log "torch: $("$PY" scripts/install_state.py torch-installed)"
# No other package may move torch (a CUDA wheel is several GB): pin the installed version for the rest.
torch_pin="$VENV/torch-constraint.txt"
"$PY" -c 'import importlib.metadata as m; print("torch==" + m.version("torch").split("+")[0])' > "$torch_pin"

log "installing the project (editable, extras: $EXTRAS) and its dependencies; pip shows each download and skips \
what is already satisfied"
"$PY" -m pip install -c "$torch_pin" -e ".[${EXTRAS}]"
state mark
log "done: $VENV is up to date (the next start makes no pip call)"
