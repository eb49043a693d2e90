#!/usr/bin/env bash
# Operator order (issue 20): BTSearch's peak on the nine ONNX Model Zoo topologies the onnx
# wheel ships, hepti's CNNs and encoders and synthetic random wiring, against the file order
# and 100 random orders, checked against the downset DP; then states explored against operator
# count with and without bound, hashing and dominance. Writes results/order.json, order.csv,
# order-states.json and order-states.png. About two and a half minutes (RandWire's in-place row
# alone takes 1.5 of them).
#   bin/bench-order.sh                    everything
#   bin/bench-order.sh --what table       (any option of hepti bench order)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec hepti bench order "$@"
