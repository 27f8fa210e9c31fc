"""The on-disk format of a training step: write, read (the whole state, or the parameters
alone), the step folders present, layout conversion (`checkpoint.format`); content hashes and
damage (`checkpoint.integrity`); periodic saves and the words for a failed one
(`checkpoint.saver`); the one reader every command uses, with its fall-back, and the leases
and rotation that let readers and the trainer work at once (`checkpoint.reader`). Callers
write `from dropless import checkpoint as ckpt`.

Layer (docs/architecture.md): below `model_dir` (a run directory's weights) and `train`
(resume); imports `models` and `moe` for the layout conversion and `runtime.files` for the
lock check, nothing above them."""
from dropless.checkpoint.format import (DoesNotFit, all_steps, check_compatible, fit_problems,
                                        latest_step, manager, read_meta, read_params,
                                        read_saved_tree, restore, save)
from dropless.checkpoint.integrity import (DAMAGED, CheckpointDamaged, Damage, inspect,
                                           quarantine)
from dropless.checkpoint.reader import (Found, NoIntactStep, fallback_words, lease,
                                        read_newest, rotate, set_aside)
from dropless.checkpoint.saver import CheckpointError, Saver, explain, quiet_orbax_errors

__all__ = ["DAMAGED", "CheckpointDamaged", "CheckpointError", "Damage", "DoesNotFit", "Found",
           "NoIntactStep", "Saver", "all_steps", "fallback_words", "lease", "read_newest",
           "rotate", "set_aside", "check_compatible", "explain", "fit_problems", "inspect",
           "latest_step", "manager", "quarantine", "quiet_orbax_errors", "read_meta",
           "read_params", "read_saved_tree", "restore", "save"]
