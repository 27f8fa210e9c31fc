"""The grouped-matmul backends for NVIDIA GPUs (Pallas via Triton, tokamax) and the checks of
their kernels as XLA parses them."""
