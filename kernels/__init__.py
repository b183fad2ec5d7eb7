"""Triton kernels for the hot paths, each with a plain-torch reference twin used on CPU and in tests."""
