"""Attention over paged KV: the torch reference here, CUDA kernels beside it."""
