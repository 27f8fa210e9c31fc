"""The small training config the trainer tests share (in-process and in subprocesses)."""
from pathlib import Path

from dropless.config_file import build_config

TEXT = "def add(a, b):\n    return a + b\n\n" * 400

# A two-layer MLA model (one dense, one MoE layer) small enough to compile in seconds.
MINI = {"model.d_model": 32, "model.num_layers": 2, "model.num_heads": 2,
        "model.d_ff": 64, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
        "model.qk_rope_head_dim": 8, "model.v_head_dim": 8, "model.moe.d_ff": 16,
        "model.moe.num_experts": 4, "model.moe.gmm_backend": "ragged_dot",
        "per_device_batch_size": 4, "seq_len": 32, "eval_fraction": 0.1, "eval_every": 2,
        "eval_batches": 1, "checkpoint_every": 2, "keep_checkpoints": 5,
        "learning_rate": 1e-2, "warmup_steps": 2}


# An MLA model with a dense and an MoE layer and MTP depth 1, float32, for the train step's own
# tests (no data, no run directory): small enough to compile fast.
STEP_KEYS = {"preset": "deepseek3-test", "model.d_model": 32, "model.num_layers": 2,
             "model.num_heads": 2, "model.kv_lora_rank": 16, "model.q_lora_rank": 0,
             "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
             "model.moe.d_ff": 16, "model.moe.num_experts": 8, "model.moe.top_k": 2,
             "model.moe.gmm_backend": "ragged_dot", "model.mtp_depth": 1, "seq_len": 12,
             "per_device_batch_size": 4}


def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    if not path.exists():
        path.write_text(TEXT)
    return path


def mini(tmp_path: Path, **kw):
    """The MINI config with data and run_dir under tmp_path; `kw` overrides keys."""
    items = dict(MINI, data=str(corpus(tmp_path)), run_dir=str(tmp_path / "runs"))
    items.update(kw)
    return build_config(list(items.items()))


def shared_compilation_cache(tmp_path_factory):
    """Point JAX's persistent compilation cache at one directory for the whole session, so the
    trainer test modules (and their subprocesses, via `cache_env`) compile each step once."""
    import jax
    path = tmp_path_factory.getbasetemp() / "jaxcache"
    path.mkdir(exist_ok=True)
    old = (jax.config.jax_compilation_cache_dir,
           jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield path
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def snapshot(root: Path) -> dict:
    """Every path under `root` with its bytes (None for directories): equal snapshots mean a
    byte-identical tree."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}
