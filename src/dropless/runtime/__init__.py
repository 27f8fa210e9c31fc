"""What a process sets up before and as JAX starts: XLA flag recipes and environment
(`runtime.xla_flags`), the multi-process runtime (`runtime.distributed`). Imports nothing of
dropless above it."""
