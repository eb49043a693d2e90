#!/usr/bin/env bash
# The Hepti paper's motivating experiment on the emulated pairs (hostfiles/emu-pair-*.json: 940 or
# 240 Mbit/s, secondary CPU equal to the primary's or a quarter of it). For each pair, `hepti
# emulate` runs `mpiexec -n 2 python -m hepti.bench.offload`: five MatMuls [256,1024]x[1024,1024]
# with 0%..100% of the rows offloaded in 10% steps (interleaved rounds, medians) and the planner's
# share for a profile measured there. Then results/offload.json (every scenario and a summary) and
# results/offload.png (matplotlib, optional). Needs root (network namespaces, tc, cgroups).
# About 2 minutes.
#   sudo bin/bench-offload.sh                   7 rounds per share
#   sudo bin/bench-offload.sh --quick           3 rounds per share
#   sudo bin/bench-offload.sh --repeat 11       11 rounds per share
#   HEPTI_PYTHON=/path/to/python bin/bench-offload.sh   use that Python (PYTHONPATH=src), skip bin/setup
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPEAT=7
case "${1:-}" in
  --quick) REPEAT=3 ;;
  --repeat) REPEAT="${2:?--repeat needs a number}" ;;
  "") ;;
  *) echo "usage: bin/bench-offload.sh [--quick | --repeat N]" >&2; exit 2 ;;
esac
if [ "$(id -u)" != 0 ]; then
  echo "bench-offload: hepti emulate needs root; run it as: sudo $0 $*" >&2; exit 1
fi
if [ -n "${HEPTI_PYTHON:-}" ]; then
  PY="$HEPTI_PYTHON"
  export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
else
  "$ROOT/bin/setup"
  PY="${HEPTI_VENV:-$ROOT/.venv}/bin/python"
fi
MPIEXEC="$(dirname "$PY")/mpiexec"
[ -x "$MPIEXEC" ] || MPIEXEC="$(command -v mpiexec)"
cd "$ROOT"
TMP="$(mktemp -d /tmp/hepti-offload-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT

"$PY" -m hepti.bench.offload --warm  # compile the kernels here, not on a 0.15-core device
START=$SECONDS
for spec in hostfiles/emu-pair-940-full.json hostfiles/emu-pair-240-full.json \
            hostfiles/emu-pair-940-quarter.json hostfiles/emu-pair-240-quarter.json; do
  name="$(basename "$spec" .json)"
  echo "== $name" >&2
  "$PY" -m hepti emulate --cluster "$spec" --timeout 600 -- \
    "$MPIEXEC" -n 2 "$PY" -m hepti.bench.offload --scenario "$name" --repeat "$REPEAT" \
    --out "$TMP/$name.json"
done
echo "== all pairs measured in $((SECONDS - START)) s" >&2
mkdir -p results
"$PY" -m hepti.bench.offload --collect "$TMP"/emu-pair-*.json --out results/offload.json \
  --plot results/offload.png
