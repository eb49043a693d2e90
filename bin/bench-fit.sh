#!/usr/bin/env bash
# Faithful prediction on this machine's own ranks (the planner issue's loopback figure): per
# case and round, `hepti profile` then `hepti run --strategy auto`, measured median latency
# against the plan's predicted_latency_s. Writes results/fit.json. Makes the BERT-base-shaped
# random model if it is missing. About 4 minutes.
#   bin/bench-fit.sh             MiniLM @128 tokens and BERT-base @256 tokens, 2 ranks, 5 rounds
#   bin/bench-fit.sh --rounds 3  (any option of hepti bench fit)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
[ -f weights/bert-base/index.json ] || hepti convert --random bert-base --out weights/bert-base
exec hepti bench fit --case weights/minilm-l6:128 --case weights/bert-base:256 "$@"
