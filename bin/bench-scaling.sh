#!/usr/bin/env bash
# 1 rank vs 2 ranks (rows, tensor; even shares; one thread per rank), interleaved rounds.
# 9 rounds: a launch alone moves MiniLM by up to 7% on this machine (the same process, run
# again, lands on other pages and cores), so a median needs several launches.
# Writes results/scaling.json. Makes the BERT-base- and ViT-base-shaped random models if missing.
#   bin/bench-scaling.sh            full run (MiniLM @128 tokens, BERT-base @256, ViT-base @224
#                                   pixels = 197 tokens, ResNet-50 and VGG-16 at 224x224: even
#                                   bands and auto)
#   bin/bench-scaling.sh --cnn      the CNNs alone
#   bin/bench-scaling.sh --quick    MiniLM only, fewer rounds
#   bin/bench-scaling.sh --decoder  llama-1b: `hepti generate`'s decode and prefill tokens/s,
#                                   single against tensor on 2 ranks, 32 tokens, in float32
#                                   (results/scaling-llm.json) then int8
#                                   (results/scaling-llm-int8.json); makes weights/llama-1b
#                                   (4.2 GB) and weights/llama-1b-int8 (1.3 GB) if missing
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if [ "${1:-}" = "--quick" ]; then
  exec hepti bench scaling --case weights/minilm-l6:128 --rounds 3 --repeat 5
fi
if [ "${1:-}" = "--decoder" ]; then
  shift
  [ -f weights/llama-1b/index.json ] || hepti convert --random llama-1b --out weights/llama-1b
  [ -f weights/llama-1b-int8/index.json ] \
    || hepti convert --random llama-1b --dtype int8 --out weights/llama-1b-int8
  hepti bench llm --model weights/llama-1b --variants hepti:single:1,hepti:tensor:2 \
    --tokens 32 --rounds 5 --out results/scaling-llm.json "$@"
  exec hepti bench llm --model weights/llama-1b-int8 --variants hepti:single:1,hepti:tensor:2 \
    --tokens 32 --rounds 5 --out results/scaling-llm-int8.json "$@"
fi
if [ "${1:-}" = "--cnn" ]; then
  shift
  [ -f weights/resnet50/index.json ] || hepti convert --random resnet50 --out weights/resnet50
  [ -f weights/vgg16/index.json ] || hepti convert --random vgg16 --out weights/vgg16
  exec hepti bench scaling --case weights/resnet50:224 --case weights/vgg16:224 \
    --rounds 9 --repeat 5 --out results/scaling-cnn.json "$@"
fi
[ -f weights/bert-base/index.json ] || hepti convert --random bert-base --out weights/bert-base
[ -f weights/vit-base/index.json ] || hepti convert --random vit-base --out weights/vit-base
[ -f weights/resnet50/index.json ] || hepti convert --random resnet50 --out weights/resnet50
[ -f weights/vgg16/index.json ] || hepti convert --random vgg16 --out weights/vgg16
exec hepti bench scaling --case weights/minilm-l6:128 --case weights/bert-base:256 \
  --case weights/vit-base:197 --case weights/resnet50:224 --case weights/vgg16:224 \
  --rounds 9 --repeat 10 "$@"
