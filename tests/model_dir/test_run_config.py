"""model_dir/run_config.py: `upgrade` brings a config.json of an older form to the current one."""
from dropless.config import TrainConfig
from dropless.model_dir import from_dict, to_dict, upgrade
from dropless.presets import get_preset


def _saved(**kw) -> dict:
    return to_dict(TrainConfig(model=get_preset("tiny"), preset="tiny", **kw))


def test_a_run_saved_before_packing_resumes_as_it_trained():
    old = _saved()
    for key in ("packing", "sft", "sft_completion_only", "eval_data", "prefetch"):
        del old[key]                     # the keys a config.json of that time lacks
    assert upgrade(old)["packing"] == "stream"
    cfg = from_dict(old)
    assert cfg.packing == "stream" and not cfg.sft and cfg.eval_data == ""
    assert "packing" not in old          # the saved tree itself is left alone


def test_current_configs_and_partial_trees_are_unchanged():
    for packing in ("documents", "pad", "stream"):
        tree = _saved(packing=packing)
        assert upgrade(tree) == tree and from_dict(tree).packing == packing
    model_only = {"model": to_dict(TrainConfig(model=get_preset("tiny")))["model"]}
    assert "packing" not in upgrade(model_only)   # a model folder's model: no run settings
