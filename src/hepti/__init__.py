"""hepti: heterogeneity-aware parallel transformer inference for clusters of edge devices.

Dependency direction: cli -> parallel/plan/emulate -> model/weights -> kernels.
Kernels and the planner never import MPI.
"""
__version__ = "0.1.0"
