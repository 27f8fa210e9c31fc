"""`dropless plan --preset` plans a preset at the run settings `dropless train --preset` applies
(`presets.RUN_SETTINGS`): the same sequence, batch and remat as the trainer's config of the
same settings (`config_file.build_config`, the reference), a flag or key given still winning,
the settings taken from the preset printed; a preset without run settings is planned at the
planner's defaults (`from_train.PLAN_DEFAULTS`).
"""
from __future__ import annotations

import json

import pytest

from dropless.cli import main
from dropless.config_file import build_config
from dropless.plan.from_train import PLAN_DEFAULTS, build_plan
from dropless.presets import RUN_SETTINGS

PRESET = "deepseek3-1gpu"
KEYS = ("seq_len", "per_device_batch_size", "remat")
PLAN_DEFAULTS_DICT = dict(PLAN_DEFAULTS)


def _settings(run) -> dict:
    return {k: getattr(run, k) for k in KEYS}


def _plan(settings):
    notes: list[str] = []
    return build_plan(settings, notes=notes).plan.run, notes


def test_the_preset_is_planned_as_it_is_trained():
    run, notes = _plan([("preset", PRESET)])
    assert _settings(run) == {"seq_len": 4096, "per_device_batch_size": 4, "remat": "minimal"}
    # what dropless train builds from the same settings (the trainer's defaults are not the
    # planner's: only the preset's run settings are compared)
    trained = build_config([("preset", PRESET)])
    assert _settings(run) == _settings(trained) == RUN_SETTINGS[PRESET]
    assert notes == [f"from preset {PRESET}'s run settings (as dropless train): seq_len=4096, "
                     f"per_device_batch_size=4, remat=minimal (a flag or key given wins)"]


@pytest.mark.parametrize("given,want,left", [
    ([("seq_len", 1024)], {"seq_len": 1024}, ("per_device_batch_size", "remat")),
    ([("remat", "full")], {"remat": "full"}, ("seq_len", "per_device_batch_size")),
    ([("per_device_batch_size", 1), ("remat", "none")],
     {"per_device_batch_size": 1, "remat": "none"}, ("seq_len",)),
    # MaxText's spelling of the sequence length is a setting given too
    ([("max_target_length", 2048)], {"seq_len": 2048}, ("per_device_batch_size", "remat")),
    # a setting given equal to the preset's value is the user's, not the preset's
    ([("seq_len", 4096)], {}, ("per_device_batch_size", "remat")),
    ([("max_target_length", 4096), ("remat", "minimal")], {}, ("per_device_batch_size",)),
    # the planner's default, given, is the user's too
    ([("remat", PLAN_DEFAULTS_DICT["remat"])], {"remat": PLAN_DEFAULTS_DICT["remat"]},
     ("seq_len", "per_device_batch_size")),
])
def test_a_setting_given_wins_and_the_rest_come_from_the_preset(given, want, left):
    run, notes = _plan([("preset", PRESET), *given])
    assert _settings(run) == {**RUN_SETTINGS[PRESET], **want}
    assert _settings(run) == _settings(build_config([("preset", PRESET), *given]))
    (note,) = notes
    named = note.split(": ", 1)[1].split(" (a flag")[0]
    assert named == ", ".join(f"{k}={RUN_SETTINGS[PRESET][k]}" for k in left)


@pytest.mark.parametrize("preset", ["deepseek3-test", "deepseek3-671b"])
def test_a_preset_without_run_settings_is_planned_at_the_planners_defaults(preset):
    assert preset not in RUN_SETTINGS
    run, notes = _plan([("preset", preset)])
    defaults = dict(PLAN_DEFAULTS)
    assert _settings(run) == {k: defaults[k] for k in KEYS} and notes == []
    run, notes = _plan([("preset", preset), ("seq_len", 1024)])
    assert run.seq_len == 1024 and notes == []


def test_the_command_prints_the_settings_it_took_from_the_preset(capsys, tmp_path):
    assert main(["plan", "--preset", PRESET, "--seq", "1024"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  per-device batch 4 x seq 1024, remat minimal,")
    assert lines[2] == (f"  from preset {PRESET}'s run settings (as dropless train): "
                        f"per_device_batch_size=4, remat=minimal (a flag or key given wins)")
    assert main(["plan", "--preset", PRESET, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["per_device_batch"] == 4 and out["layout"]["remat"] == "minimal"
    assert out["notes"] == [f"from preset {PRESET}'s run settings (as dropless train): "
                            f"seq_len=4096, per_device_batch_size=4, remat=minimal (a flag or "
                            f"key given wins)"]
    assert main(["plan", "--preset", "deepseek3-test"]) == 0
    assert "run settings" not in capsys.readouterr().out
    # every run setting given (one in a --config file, equal to the preset's): no such line
    cfg = tmp_path / "run.yml"
    cfg.write_text("per_device_batch_size: 4\n")
    assert main(["plan", "--preset", PRESET, "--config", str(cfg), "--seq", "4096",
                 "--remat", "minimal"]) == 0
    assert "run settings" not in capsys.readouterr().out
