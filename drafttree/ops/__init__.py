"""Numerical kernels (plain PyTorch). Each fast op has a readable reference beside it."""
