"""hepti: heterogeneity-aware parallel transformer inference for clusters of edge devices.

Layers, lowest first: kernels -> graph -> model -> weights -> plan -> parallel -> the job ->
serve, bench, cli; the emulator beside kernels. Imports run one way (docs/architecture.md,
tests/test_layers.py); kernels and the planner never import MPI.
"""
__version__ = "0.1.0"
