"""Triton kernels and FlashInfer wrappers for the hot paths, each with a torch twin."""
