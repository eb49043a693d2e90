#!/usr/bin/env bash
# The main job as a benchmark: 10,000 short lines embedded on 2 ranks to --output, timed whole,
# with rank 0's peak RSS and the pass's wall time against its forwards. Writes
# results/filejob.json.
#   bin/bench-file.sh                       2 rounds of this tree
#   bin/bench-file.sh --against 418c61c     taking turns with another commit (a git worktree)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec hepti bench file "$@"
