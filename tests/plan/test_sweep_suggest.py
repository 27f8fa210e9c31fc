"""`dropless plan --suggest` (`plan.sweep.suggest`): the layouts that fit, fastest first, equal to
predicting every candidate (`candidate_layouts`) and sorting them, as the search did before it
skipped what cannot fit; the pinned rows are what that search answered (it took 75 s and more
at 720,720 GPUs: 6,720 candidates, 18 of which fit)."""
import pytest

from dropless.plan import sweep
from dropless.plan.from_train import build_plan
from dropless.plan.memory import memory_per_device
from dropless.plan.model import predict

# (fsdp, ep, data, remat, ragged_buffer_factor, tokens_per_s) of deepseek3-671b on h200, as the
# exhaustive search answered
AT_720720 = [
    (7, 16, 6435, "full", 1.5, 16243568.828448286),
    (7, 16, 6435, "full", 2.0, 16243568.828448286),
    (7, 16, 6435, "full", 3.0, 16243568.828448286),
    (7, 16, 6435, "offload", 1.5, 16235117.918916237),
    (7, 16, 6435, "offload", 2.0, 16235117.918916237),
    (7, 16, 6435, "offload", 3.0, 16235117.918916237),
    (14, 8, 6435, "full", 1.5, 12173041.630808022),
    (14, 8, 6435, "full", 2.0, 12173041.630808022),
    (14, 8, 6435, "full", 3.0, 12173041.630808022),
    (14, 8, 6435, "offload", 1.5, 12168294.891448524),
]
AT_2_20 = [
    (256, 256, 16, "minimal", 1.5, 25564812.7378375),
    (128, 256, 32, "minimal", 1.5, 25537242.41943959),
    (256, 128, 32, "minimal", 1.5, 25524372.181228418),
    (128, 128, 64, "minimal", 1.5, 25494099.59224783),
    (512, 256, 8, "minimal", 1.5, 25472885.86381219),
    (256, 64, 64, "minimal", 1.5, 25442331.434834685),
    (512, 128, 16, "minimal", 1.5, 25434117.052282076),
    (256, 256, 16, "full", 1.5, 25413371.00903991),
    (256, 256, 16, "full", 2.0, 25413371.00903991),
    (256, 256, 16, "full", 3.0, 25413371.00903991),
]
AT_1024_GB300 = [   # min_factor 1.0: every buffer factor
    (4, 64, 4, "none", 1.25, 3870509.3649882814),
    (4, 64, 4, "none", 1.5, 3870509.3649882814),
    (4, 32, 8, "minimal", 1.25, 3778539.0608569076),
    (4, 32, 8, "minimal", 1.5, 3778539.0608569076),
    (4, 32, 8, "minimal", 2.0, 3778539.0608569076),
    (4, 32, 8, "minimal", 3.0, 3778539.0608569076),
    (4, 64, 4, "minimal", 1.25, 3776399.565388021),
    (4, 64, 4, "minimal", 1.5, 3776399.565388021),
]


def _key(row: dict) -> tuple:
    return (row["fsdp"], row["ep"], row["data"], row["remat"], row["ragged_buffer_factor"])


@pytest.mark.parametrize("settings,kw,pinned", [
    ([("gpus", 720720)], {}, AT_720720),
    ([("gpus", 2 ** 20)], {}, AT_2_20),
    ([("gpus", 1024), ("hardware", "gb300")], {"top": 8, "min_factor": 1.0}, AT_1024_GB300),
])
def test_the_suggestions_are_the_exhaustive_searchs(settings, kw, pinned):
    cfg, hw, _ = build_plan(settings)
    rows = sweep.suggest(cfg, hw, **kw)
    assert [_key(r) for r in rows] == [p[:5] for p in pinned]
    assert [r["tokens_per_s"] for r in rows] == pytest.approx([p[5] for p in pinned],
                                                              rel=1e-9)


def _every_candidate(cfg, hw, *, top, min_factor) -> list[dict]:
    """The search without skipping: predict every candidate, keep what fits, sort."""
    rows = []
    for c, factor in sweep.candidate_layouts(cfg, min_factor=min_factor):
        r = predict(c, hw)
        if r["memory"]["fits"]:
            rows.append(sweep.suggestion_row(c, factor, r))
    return sweep.best_rows(rows, top)


@pytest.mark.parametrize("settings,min_factor", [
    ([("preset", "deepseek3-test"), ("gpus", 48)], 1.5),
    ([("preset", "mixtral-8x7b"), ("gpus", 96)], 2.0),
    ([("preset", "qwen3-30b-a3b"), ("gpus", 64), ("model.moe.dispatcher", "a2a"),
      ("model.moe.ep_comm_overlap_chunks", 2)], 1.5),
    ([("preset", "small"), ("model.moe", None), ("gpus", 16)], 1.5),
    ([("gpus", 72)], 1.5),     # nothing fits
    # one device, float32 weights cast once to bfloat16: the unrolled step's gradients are
    # fewer bytes than the weights' (memory.unrolled_gradients)
    ([("preset", "deepseek3-1gpu"), ("gpus", 1)], 1.5),
    ([("preset", "deepseek3-1gpu"), ("gpus", 8), ("model.scan_layers", True)], 1.5),
])
def test_every_row_equals_predicting_every_candidate(settings, min_factor):
    cfg, hw, _ = build_plan(settings)
    assert sweep.suggest(cfg, hw, top=10 ** 4, min_factor=min_factor) == \
        _every_candidate(cfg, hw, top=10 ** 4, min_factor=min_factor)


@pytest.mark.parametrize("settings", [
    [("preset", "deepseek3-1gpu"), ("gpus", 1)], [("preset", "deepseek3-1gpu"), ("gpus", 4)],
    [("preset", "deepseek3-1gpu"), ("gpus", 2), ("model.scan_layers", True)],
    [("preset", "mixtral-8x7b"), ("gpus", 16)], [("preset", "small"), ("model.moe", None)]])
def test_the_weights_floor_is_below_every_variants_total(settings):
    cfg, hw, _ = build_plan(settings)
    models = sweep._models(cfg, 1.0)
    for layout in sweep._layouts(cfg):
        floor = sweep._weights_floor(layout)
        assert all(floor <= memory_per_device(c, hw)["total"]
                   for c, _ in sweep._variants(layout, models))


def test_only_what_fits_is_predicted(monkeypatch):
    """At 720,720 GPUs: 6,720 candidates, 18 fit; the layouts whose weights alone do not fit
    are not built into candidates at all."""
    cfg, hw, _ = build_plan([("gpus", 720720)])
    calls = {"predict": 0, "memory": 0}

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call
    monkeypatch.setattr(sweep, "predict", counted("predict", predict))
    monkeypatch.setattr(sweep, "memory_per_device", counted("memory", memory_per_device))
    assert len(sweep.suggest(cfg, hw, top=100)) == 18
    assert calls["predict"] == 18 and calls["memory"] < 1000
    assert len(sweep.candidate_layouts(cfg)) == 6720
