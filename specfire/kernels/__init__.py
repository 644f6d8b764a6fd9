"""Kernel families. Each family package has ref.py (the PyTorch reference), its Triton kernel
module(s) and an __init__ whose public functions take Triton on CUDA and the reference elsewhere."""
