"""The on-disk format of a training step: write, read (the whole state, or the parameters
alone), the step folders present, layout conversion (`checkpoint.format`); content hashes and
damage (`checkpoint.integrity`); periodic saves and the words for a failed one
(`checkpoint.saver`). Callers write `from dropless import checkpoint as ckpt`.

Layer (docs/architecture.md): below `model_dir` (a run directory's weights) and `train`
(resume); imports `models` and `moe` for the layout conversion, nothing above them."""
from dropless.checkpoint.format import (all_steps, check_compatible, latest_step, manager,
                                        read_meta, read_params, restore, save)
from dropless.checkpoint.integrity import (DAMAGED, CheckpointDamaged, Damage, inspect,
                                           quarantine)
from dropless.checkpoint.saver import CheckpointError, Saver, explain, quiet_orbax_errors

__all__ = ["DAMAGED", "CheckpointDamaged", "CheckpointError", "Damage", "Saver", "all_steps",
           "check_compatible", "explain", "inspect", "latest_step", "manager", "quarantine",
           "quiet_orbax_errors", "read_meta", "read_params", "restore", "save"]
