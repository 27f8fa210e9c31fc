"""A run resumed with the other expert layout (prefuse_moe_weights flipped) restores its
checkpoint exactly: the trainer converts fused <-> unfused expert weights (and their optimizer
moments) on restore, and the resumed losses equal a run that never switched."""
import numpy as np
import pytest

from tests._support.train_mini import mini, shared_compilation_cache
from dropless.train.loop import train


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    yield from shared_compilation_cache(tmp_path_factory)


def _quiet(*_):
    pass


def test_resume_in_the_other_expert_layout_continues_the_same_run(tmp_path):
    kw = dict(checkpoint_every=1, async_checkpoints=False, time_kernels=False, run_name="r")
    train(mini(tmp_path, steps=2, **kw), echo=_quiet)
    switched = train(mini(tmp_path, steps=3, **kw, **{"model.moe.prefuse_moe_weights": True}),
                     echo=_quiet)
    straight = train(mini(tmp_path, steps=3, **dict(kw, run_name="b")), echo=_quiet)
    assert sorted(switched.losses) == [3]
    np.testing.assert_allclose(switched.losses[3], straight.losses[3], rtol=2e-5, atol=2e-6)
