"""Several `hepti` commands in one MPI job, one after another in the same ranks:
  mpiexec -n N python -m mpi4py tests/mpi/runs.py ARGS... [-- ARGS...]...

Each ARGS is a command line of `hepti` (`run --model DIR ...`), run by `hepti.cli.main` as
`python -m hepti` runs it; after each, rank 0 prints {"runs.py": i, "code": exit code} on its
own line, on stdout and on stderr. A launch's fixed cost (N interpreters importing hepti,
numpy and Numba and loading the kernels: most of a tiny model's `hepti run`) is then paid once
for all of them. Every command
runs even when an earlier one failed or was refused (an agreed error returns 2 on every rank);
the job exits 0 (the caller checks each code). tests/test_distributed_launch.py: `launch_runs`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from several import groups  # noqa: E402


def main(argv=None) -> int:
    from mpi4py import MPI  # noqa: F401  (MPI_Init here, when run standalone)
    from hepti.cli import main as hepti
    rank0 = MPI.COMM_WORLD.Get_rank() == 0
    for i, args in enumerate(groups(sys.argv[1:] if argv is None else argv)):
        code = hepti(args)
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Barrier()  # every rank done with this command before the next starts
        if rank0:  # on stderr too: what each command wrote there ends before its line
            line = json.dumps({"runs.py": i, "code": code})
            print(line, flush=True)
            print(line, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
