#!/usr/bin/env bash
# The Hepti paper's motivating experiment on the emulated pairs (hostfiles/emu-pair-*.json: 940 or
# 240 Mbit/s, secondary CPU equal to the primary's or a quarter of it): `hepti bench offload`.
# For each pair, one `hepti emulate` launch of `mpiexec -n 2 hepti bench offload --sweep`: five
# MatMuls [256,1024]x[1024,1024] with 0%..100% of the rows offloaded in 10% steps (interleaved
# rounds, medians) and the planner's share for a profile measured there. Then
# results/offload.json (every scenario and a summary) and results/offload.png (matplotlib,
# optional). Needs root (network namespaces, tc, cgroups). About 2 minutes.
#   sudo bin/bench-offload.sh                   7 rounds per share
#   sudo bin/bench-offload.sh --quick           3 rounds per share
#   sudo bin/bench-offload.sh --repeat 11       11 rounds per share
# Other options (--specs, --steps, --out, --plot): hepti bench offload --help
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "bench-offload: hepti emulate needs root; run it as: sudo $0 $*" >&2; exit 1
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if [ "${1:-}" = "--quick" ]; then
  shift
  exec hepti bench offload --repeat 3 "$@"
fi
exec hepti bench offload "$@"
