"""Tests run on 8 host CPU devices so expert-parallel code can be tested without GPUs."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
