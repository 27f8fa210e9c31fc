"""The native library's GEMM kernels a test runs each of: the tiled kernel, OpenBLAS's, and MKL's
where the `mkl` wheel is installed (`make setup` installs it on Linux x86_64)."""
import pytest

from dropless.ops.native import load

KERNELS = ["own", "openblas",
           pytest.param("mkl", marks=pytest.mark.skipif(
               load.mkl_version() is None, reason="the mkl wheel is not installed"))]
