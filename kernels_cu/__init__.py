"""The CUDA sources, shipped as package data (cufa.kernels_cu) and read as text through
importlib.resources. This file makes the folder a regular package, so that those reads
work from every install, a zipped one included (a namespace package has no reader there)."""
