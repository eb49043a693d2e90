"""hepti: heterogeneity-aware parallel transformer inference on MPI clusters of edge devices.

CMake-free on purpose: everything compiled is compiled by Numba at run time (and cached).
"""
from setuptools import find_packages, setup

setup(
    name="hepti",
    version="0.1.0",
    description="Heterogeneity-aware parallel transformer inference for clusters of edge devices",
    python_requires=">=3.10",
    package_dir={"": "src"},
    packages=find_packages("src"),
    package_data={"hepti.model": ["imagenet_labels.txt"],  # ImageNet class names (CNNs)
                  "hepti.weights": ["calibration.txt"]},  # --keep-float32 auto (calibrate.py)
    install_requires=[
        "mpi4py>=4.0",
        "mpich",  # brings mpiexec (Hydra) into the venv; no system MPI needed
        "numpy>=1.26",
        "numba>=0.60",
        "h5py>=3.10",
        "tqdm>=4.60",
        "scipy>=1.11",  # HiGHS LP/MILP for the partitioner
        "safetensors>=0.4",
        "tokenizers>=0.15",
        "Pillow>=9.0",  # image files for vision models (hepti.images)
        "onnx>=1.15",  # ONNX graphs' structure and shapes, for operator order (hepti.graph.onnx_import)
        "gguf>=0.10",  # llama.cpp's GGUF files, read by their own reader (hepti.weights.gguf)
        # a GGUF's chat template is a Jinja template: `hepti generate --chat` renders it in
        # Jinja's own immutable sandbox (as transformers does), never by a renderer of ours
        "jinja2>=3.1",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6"],
        "plot": ["matplotlib>=3.7"],
        # `hepti bench llm` only: llama.cpp (its sdist builds llama.cpp, minutes on 2 cores) and
        # what distributed-llama's own converters import; hepti itself never imports them.
        # torch pinned to the CPU build these machines keep on disk: unpinned, pip takes a
        # CUDA build of several GB
        "bench-llm": ["llama-cpp-python>=0.3", "torch==2.13.0", "sentencepiece"],
    },
    entry_points={"console_scripts": ["hepti=hepti.cli:main"]},
)
