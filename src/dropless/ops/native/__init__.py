"""The native CPU library: grouped GEMMs, the fused SwiGLU expert FFN, and the MoE layer's row
movement (gathers, the sort by expert, top-k), one C++ library behind XLA's FFI."""
from dropless.ops.native.library import *  # noqa: F401,F403
