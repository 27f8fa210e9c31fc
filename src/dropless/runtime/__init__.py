"""What a process sets up before and as JAX starts: XLA flag recipes (`runtime.xla_flags`), the
environment variables a config may set (`runtime.environment`), the multi-process runtime
(`runtime.distributed`). Imports nothing of dropless above it: a caller with something to say at
start-up (the trainer's notes) passes it in."""
