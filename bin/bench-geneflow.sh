#!/usr/bin/env bash
# GenEFlow's grid (issue 20): BERT-base @128 tokens and ViT-B/16 @224 (197 tokens) on the first
# 2, 3 and 4 devices of hostfiles/emu-geneflow4.json, memory caps none / 75% / 50% of the
# single-device peak. Predicted for every case over 10 seeds (GenEFlow against the LP's plan,
# the single-dimension plans rows and tensor, and even), measured under `hepti emulate` for
# the 4-device cases by default (--measure 2,3,4 or all for more; --measure none: predicted
# only, no root once the profiles are cached in results/tmp/). Writes results/geneflow.json
# and results/geneflow.csv and prints the targets. Needs root to profile and measure. Takes
# the bench lock (/tmp/hepti-bench.lock) while it runs. Makes the random-weight models if
# missing (weights stay out of git).
#   sudo bin/bench-geneflow.sh                 profiles, the predicted grid, 4-device runs
#   sudo bin/bench-geneflow.sh --measure all   every case measured (about 3x as long)
# Other options: python -m hepti.bench.geneflow --help
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
[ -f weights/bert-base/index.json ] || hepti convert --random bert-base --out weights/bert-base
[ -f weights/vit-base/index.json ] || hepti convert --random vit-base --out weights/vit-base
measure=1
for a in "$@"; do [ "$a" = "none" ] && measure=0; done
if [ "$measure" = 1 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "bench-geneflow: needs root to profile and measure (hepti emulate); run it with sudo, or" \
         "--measure none for the predicted grid from cached profiles" >&2
    exit 2
  fi
  while [ -e /tmp/hepti-quiet ]; do
    echo "bench-geneflow: the machine is asked to be quiet (/tmp/hepti-quiet); waiting" >&2
    sleep 60
  done
  while [ -e /tmp/hepti-bench.lock ] && [ "$(cat /tmp/hepti-bench.lock 2>/dev/null)" != "bench-geneflow $$" ]; do
    echo "bench-geneflow: waiting for the bench lock ($(cat /tmp/hepti-bench.lock 2>/dev/null))" >&2
    sleep 30
  done
  echo "bench-geneflow $$" > /tmp/hepti-bench.lock
  trap 'rm -f /tmp/hepti-bench.lock' EXIT
fi
python -m hepti.bench.geneflow "$@"  # not exec: the EXIT trap must remove the lock
