#!/usr/bin/env bash
# Executed peaks (issue 20): each rank's activation high-water mark (allocation counter and
# tracemalloc) under BTSearch's order against the model's peak, for MobileNetV2, ResNet-50,
# VGG-16 at 224, BERT-base at 128 and 256 tokens, ViT-B/16 at 224, batch 1; on 1 rank, then
# on 2 (mpiexec -n 2). Makes weights/bert-base and weights/vit-base (random) when missing.
# Writes results/order-exec.json and results/order-exec-2.json. About a minute and a half.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
for m in bert-base vit-base; do
  [ -f "weights/$m/index.json" ] || hepti convert --random "$m" --out "weights/$m"
done
hepti bench order-exec --out results/order-exec.json "$@"
timeout 900 mpiexec -n 2 python -m mpi4py -m hepti bench order-exec --out results/order-exec-2.json "$@"
