#!/usr/bin/env bash
# hepti serve under concurrent clients (1, 4, 16) next to `hepti run --input` on the same texts:
# requests/s and p50/p99 latency, lines/s; rounds taking turns. Writes results/serve.json.
#   bin/bench-serve.sh [--clients 1,4,16] [--seconds 20] [--rounds 3]    (--help for all)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec hepti bench serve "$@"
