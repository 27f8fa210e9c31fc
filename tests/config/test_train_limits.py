"""TrainConfig's cross-field limits that a value past them would not fail on but misbehave
later: a seed the weights' PRNG key cannot hold, MTP depths no row has a target for, depths
whose layer-by-layer loops would not end, sizes past int32 (the planner's floats overflowed)
and more experts than any mixture has, and a weight decay that zeroes the weights."""
import jax
import numpy as np
import pytest

from dropless.config_file import build_config


def test_a_seed_past_32_bits_is_refused_since_the_prng_key_drops_the_rest():
    # why: PRNGKey keeps the low 32 bits (seed 2**32 draws seed 0's weights), 2**63 overflows
    assert (jax.random.PRNGKey(2 ** 32) == jax.random.PRNGKey(0)).all()
    assert build_config([("seed", 2 ** 32 - 1)]).seed == 2 ** 32 - 1
    for key in ("seed", "init_weights_seed"):
        for seed in (2 ** 32, 2 ** 63):
            with pytest.raises(ValueError, match=rf"TrainConfig.seed={seed} must be < 2\*\*32"):
                build_config([(key, seed)])


def test_an_mtp_depth_without_a_target_in_the_row_is_refused():
    # depth k's target at position i is token i + k + 1: inside a row of S tokens for k < S
    assert build_config([("model.mtp_depth", 7), ("seq_len", 8)]).model.mtp_depth == 7
    with pytest.raises(ValueError, match="TrainConfig.model.mtp_depth=8 must be < seq_len=8"):
        build_config([("model.mtp_depth", 8), ("seq_len", 8)])


@pytest.mark.parametrize("key,value,message", [
    ("model.dtype", "float64", r"ModelConfig.dtype='float64' is not a model dtype \(one of "
     r"float32, bfloat16, float16; float64 runs as float32 in JAX\)"),
    ("model.moe.weight_dtype", "float8_e4m3fn", "MoEConfig.weight_dtype='float8_e4m3fn' is not "
     "a model dtype"),
    ("model.moe.dtype", "int8", "MoEConfig.dtype='int8' is not a model dtype"),
    ("model.weight_dtype", "half", "ModelConfig.weight_dtype='half' must be spelled 'float16'"),
    ("model.dtype", "foo", "ModelConfig.dtype='foo' is not a dtype name"),
])
def test_a_dtype_no_model_runs_in_is_refused_not_run_as_another(key, value, message):
    # float64 ran as float32 (JAX without x64) while the config said float64; the planner,
    # which has no bytes for it, was the first to refuse
    with pytest.raises(ValueError, match=message):
        build_config([(key, value)])
    assert build_config([("dtype", "float16")]).model.moe.dtype == "float16"


@pytest.mark.parametrize("key", ["model.num_layers", "model.mtp_depth"])
def test_a_depth_past_the_layer_limit_is_refused_at_once(key):
    """`config show model.num_layers=1000000000` looped once a layer (parameter and FLOP counts,
    the planner) and never answered: refused, named, before any of it."""
    import time
    from dropless.config.names import MAX_LAYERS
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"\.{key.split('.')[1]}=1000000000 is more than "
                                         "10,000 layers"):
        build_config([(key, 10 ** 9), ("seq_len", 2 ** 31 - 1)])
    assert time.perf_counter() - t0 < 5
    build_config([(key, MAX_LAYERS), ("seq_len", 2 ** 31 - 1)])   # the limit itself is a model


@pytest.mark.parametrize("key,field", [
    ("model.vocab_size", "ModelConfig.vocab_size"), ("model.d_ff", "ModelConfig.d_ff"),
    ("model.kv_lora_rank", "ModelConfig.kv_lora_rank"), ("model.moe.d_ff", "MoEConfig.d_ff"),
    ("model.moe.top_k", "MoEConfig.top_k"), ("seq_len", "TrainConfig.seq_len"),
    ("per_device_batch_size", "TrainConfig.per_device_batch_size"),
    ("gradient_accumulation_steps", "TrainConfig.gradient_accumulation_steps")])
def test_a_size_past_int32_is_refused_naming_it(key, field):
    """A width of 1e200 made `dropless plan` die of an OverflowError (int too large to convert
    to float) and `config show` print 180-digit counts: sizes stay below 2**31."""
    with pytest.raises(ValueError, match=rf"{field}=2147483648 must be < 2\*\*31"):
        build_config([(key, 2 ** 31)])
    with pytest.raises(ValueError, match=r"must be < 2\*\*31"):
        build_config([(key, 10 ** 200)])


def test_a_size_just_below_the_limit_is_a_config():
    m = 2 ** 31 - 1
    cfg = build_config([("model.vocab_size", m), ("seq_len", m), ("per_device_batch_size", m)])
    assert (cfg.model.vocab_size, cfg.seq_len, cfg.per_device_batch_size) == (m, m, m)


def test_more_than_a_million_experts_is_refused():
    with pytest.raises(ValueError, match="MoEConfig.num_experts=1048577 is more than 1,048,576 "
                                         "experts"):
        build_config([("model.moe.num_experts", 2 ** 20 + 1)])
    assert build_config([("model.moe.num_experts", 2 ** 20)]).model.moe.num_experts == 2 ** 20


STEP_KEYS = ["steps", "warmup_steps", "lr_decay_steps", "eval_every", "checkpoint_every",
             "log_every", "profile_steps"]


@pytest.mark.parametrize("key", STEP_KEYS)
def test_a_step_count_past_the_int32_step_counter_is_refused(key):
    """The state's step and optax's count are int32: steps=2**31 wrapped to a negative step,
    warmup_steps=10**12 died in an OverflowError inside the jitted schedule after the model was
    compiled, and an interval past it is never reached (a typo)."""
    with pytest.raises(ValueError, match=rf"TrainConfig.{key}=2147483648 must be < 2\*\*31 = "
                                         r"2,147,483,648 \(the step counter is int32"):
        build_config([(key, 2 ** 31)])
    with pytest.raises(ValueError, match=rf"TrainConfig.{key}=10{'0' * 29} must be < 2\*\*31"):
        build_config([(key, 10 ** 30)])
    assert getattr(build_config([(key, 2 ** 31 - 1)]), key) == 2 ** 31 - 1


def test_the_step_limit_is_what_the_schedule_can_count():
    """Below the limit the jitted schedule takes the warmup (int32); at it, it overflows."""
    import jax.numpy as jnp
    from dropless.train.step import lr_schedule
    cfg = build_config([("warmup_steps", 2 ** 31 - 1), ("steps", 2 ** 31 - 1)])
    assert float(jax.jit(lr_schedule(cfg))(jnp.int32(0))) == 0.0
    with pytest.raises(OverflowError):
        jax.jit(lr_schedule(_unchecked(cfg, warmup_steps=2 ** 31)))(jnp.int32(0))


def _unchecked(cfg, **changes):
    """`cfg` with `changes` set past its checks (to show what a value the checks refuse does)."""
    import copy
    out = copy.copy(cfg)
    for k, v in changes.items():
        object.__setattr__(out, k, v)
    return out


@pytest.mark.parametrize("prefetch", [17, 10 ** 9])
def test_a_prefetch_past_the_bound_is_refused(prefetch):
    """prefetch=10**9 queued batches until host (or device) memory ran out."""
    from dropless.config.names import MAX_PREFETCH
    assert MAX_PREFETCH == 16
    with pytest.raises(ValueError, match=rf"TrainConfig.prefetch={prefetch} must be <= 16"):
        build_config([("prefetch", prefetch)])
    assert build_config([("prefetch", MAX_PREFETCH)]).prefetch == MAX_PREFETCH
    assert build_config([("prefetch", 0)]).prefetch == 0
    with pytest.raises(ValueError, match=r"TrainConfig.prefetch=-1 must be an int >= 0"):
        build_config([("prefetch", -1)])


# learning_rate x weight_decay: AdamW's decoupled decay takes lr x wd of each matrix a step
EXACTLY_ONE = [(0.5, 2.0), (10.0, 0.1), (1.0, 1.0)]     # 10 x 0.1 is 1 in float32
JUST_BELOW = float(np.nextafter(np.float32(2.0), np.float32(0.0)))   # 0.5 x this < 1 in float32


@pytest.mark.parametrize("lr,wd", EXACTLY_ONE + [(1e18, 0.1), (1e39, 0.1), (2.0, 1.0)])
def test_a_decay_that_zeroes_or_flips_the_weights_is_refused_naming_both(lr, wd):
    with pytest.raises(ValueError) as e:
        build_config([("learning_rate", lr), ("weight_decay", wd)])
    text = str(e.value)
    assert text.startswith(f"TrainConfig.learning_rate={lr!r} x weight_decay={wd!r} = ")
    assert "must be < 1" in text and "lower learning_rate or weight_decay" in text
    assert "\n" not in text


def test_the_decay_boundary_is_where_float32_puts_it():
    """Just below 1 is a config; 0.5 x 1.9999999999999998 is below 1 in float64 but 1 in the
    optimizer's float32, so it is refused with the product it has there."""
    cfg = build_config([("learning_rate", 0.5), ("weight_decay", JUST_BELOW)])
    assert cfg.weight_decay == JUST_BELOW
    assert build_config([("learning_rate", 3e-3), ("weight_decay", 0.1)]).weight_decay == 0.1
    assert build_config([("learning_rate", 1e18), ("weight_decay", 0.0)]).learning_rate == 1e18
    wd64 = float(np.nextafter(2.0, 0.0))
    assert 0.5 * wd64 < 1
    with pytest.raises(ValueError, match=r"= 1 must be < 1"):
        build_config([("learning_rate", 0.5), ("weight_decay", wd64)])


@pytest.mark.parametrize("wd,after", [(2.0, "zero"), (JUST_BELOW, "positive"),
                                      (3.0, "flipped")])
def test_the_optimizer_does_to_the_weights_what_the_rule_says(wd, after):
    """The rule checked as the optimizer runs it (train/step.make_optimizer at the peak, a zero
    gradient so only the decay moves a weight): at learning_rate x weight_decay = 1 the
    matrices are zero, above it their sign flips, just below they shrink and stay; norm
    weights are not decayed."""
    import jax.numpy as jnp
    import optax
    from dropless.train.step import make_optimizer
    cfg = _unchecked(build_config([("warmup_steps", 0)]), learning_rate=0.5, weight_decay=wd)
    params = {"w_up": jnp.ones((2, 2), jnp.float32), "norm": {"w_D": jnp.ones(2, jnp.float32)}}
    opt = make_optimizer(cfg, params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    w = float(new["w_up"][0, 0])
    assert {"zero": w == 0, "positive": 0 < w < 1e-6, "flipped": w < 0}[after], w
    assert (new["norm"]["w_D"] == 1).all()
    items = [("learning_rate", 0.5), ("weight_decay", wd)]
    if after == "positive":
        build_config(items)
    else:
        with pytest.raises(ValueError, match="must be < 1"):
            build_config(items)


@pytest.mark.parametrize("argv,in_process", [
    (["train", "steps=1", "time_kernels=false", "run_dir=runs", "learning_rate=0.5",
      "weight_decay=2"], False),
    (["config", "show", "learning_rate=0.5", "adam_weight_decay=2.0"], True)])
def test_the_command_line_refuses_it_in_one_line(tmp_path, argv, in_process):
    """`dropless train ... learning_rate=0.5 weight_decay=2` (a subprocess: the whole path a
    user takes) and MaxText's adam_weight_decay exit 2 with one line naming both keys and the
    product, before a run directory exists."""
    from tests._support.fault import Artifacts, Fault, check_row, command_env
    row = Fault("lr-x-wd", argv, rc=2, in_process=in_process, unchanged=("runs",),
                words=("learning_rate=0.5 x weight_decay=2.0 = 1 must be < 1",
                       "lower learning_rate or weight_decay"))
    (tmp_path / "case").mkdir()
    check_row(row, tmp_path / "case",
              Artifacts(tmp_path / "artifacts", {}, command_env(tmp_path / "jaxcache")))
