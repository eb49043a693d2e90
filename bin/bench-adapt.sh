#!/usr/bin/env bash
# Re-planning while serving (hepti serve --replan on) against a fixed plan, per-phase oracle plans
# and even shares, on hostfiles/emu-drift4.json: node-c's link 940 -> 100 Mbit/s at 20 s, node-b's
# CPU halved at 40 s, both restored at 60 s, node-d down to 0.05 core at 80 s. BERT-base shape at
# 256 tokens, closed-loop requests. Needs root (hepti emulate). Writes results/adapt.{json,csv,png}.
# Makes the BERT-base-shaped random model if it is missing. About 55 minutes: three rounds of
# every variant, interleaved (--rounds 1 for one, about 18 minutes).
#   sudo bin/bench-adapt.sh             the scenario
#   sudo bin/bench-adapt.sh --flap      node-c's link flapping 940 <-> 100 Mbit/s every 2 s, after
#                                       20 s on the steady link: results/adapt-flap.{json,csv,png}
#   sudo bin/bench-adapt.sh --quiet-ab 600
#                                       no changes, the monitor paused on every other run of 20
#                                       batches in one launch (its overhead):
#                                       results/adapt-quiet-ab.json
#   sudo bin/bench-adapt.sh --spec hostfiles/emu-drop3.json --duration 120 --out results/adapt-drop3.json
#                                       issue 44's cluster: a quiet minute, then one link at 40 Mbit/s
#   sudo bin/bench-adapt.sh --spec hostfiles/emu-hang3.json --out results/adapt-hang3.json
#   sudo bin/bench-adapt.sh --spec hostfiles/emu-silent3.json --out results/adapt-silent3.json
#                                       node-b hangs (its link goes silent) from 40 to 70 s: the
#                                       wait for the first answer, requests lost, against a
#                                       steady launch on the two devices that answer
# Other options (--duration, --seq, --variants): hepti bench adapt --help
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "bench-adapt: needs root (hepti emulate makes network namespaces, tc shapers and cgroups); run it with sudo" >&2
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
[ -f weights/bert-base/index.json ] || hepti convert --random bert-base --out weights/bert-base
exec hepti bench adapt "$@"
