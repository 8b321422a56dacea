#!/usr/bin/env bash
# The gateway measured by two outside serving benchmarks from PyPI, guidellm and aiperf (issue 23).
#
#   bench/external_clients.sh [--modes k0,auto] [--concurrency 1,4,16] [--clients guidellm,aiperf] ...
#   bench/external_clients.sh --install-only
#
# Installs each client, once, into a virtual environment of its own (bench/.venv-guidellm, bench/.venv-aiperf;
# a stamp file names what was installed, so a second run installs nothing), then runs bench/external_clients.py
# with the project's .venv (its flags: --help). Needs `make install` and `make models` first. Nothing is fetched
# from a model hub: HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE are set and the tokenizer is .models/target.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
GUIDELLM_SPEC="${GUIDELLM_SPEC:-guidellm==0.8.1}"
AIPERF_SPEC="${AIPERF_SPEC:-aiperf==0.13.0}"
# guidellm depends on torch, and pip would take the newest CUDA build (GBs); the CPU build the project pins is
# installed first and held with a constraint. aiperf needs no torch.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1

[ -x "$PY" ] || { echo "no $PY: run 'make install' first" >&2; exit 1; }
[ -f "$ROOT/.models/target/tokenizer.json" ] || { echo "no .models/target: run 'make models' first" >&2; exit 1; }

install_client() {  # venv-dir stamp-text pip-arguments...
    local venv="$1" want="$2"
    shift 2
    if [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$want" ]; then
        return 0
    fi
    echo "installing $want into $venv" >&2
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "$@"
    echo "$want" > "$venv/.installed"
}

constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo "$TORCH_SPEC" > "$constraint"
install_client "$ROOT/bench/.venv-guidellm" "$TORCH_SPEC $GUIDELLM_SPEC" \
    -c "$constraint" "$TORCH_SPEC" "$GUIDELLM_SPEC"
install_client "$ROOT/bench/.venv-aiperf" "$AIPERF_SPEC" "$AIPERF_SPEC"

if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi
exec "$PY" "$ROOT/bench/external_clients.py" "$@"
