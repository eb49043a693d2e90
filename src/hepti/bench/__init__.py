"""Benchmarks, each run as `hepti bench NAME` (hepti.bench.registry names them all).

Each bench module has `add_arguments(parser)` and `run(args)`; what they share (interleaved
rounds, the launcher under mpiexec and `hepti emulate`, the result document) is in
hepti.bench.harness. The bin/bench-*.sh scripts set up the venv and the weights, then call
`hepti bench NAME`.
"""
