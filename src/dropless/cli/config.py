"""`dropless config show [--config FILE] [--preset NAME] [--maxtext] [key=value ...]`: the
effective config (YAML) and the model's parameter counts, FLOPs per token included, or with
--maxtext the config in MaxText's flags (`compat.maxtext_out`: the YAML, what it leaves out
and what MaxText reads otherwise said at its top and on stderr); `dropless config keys`: every
accepted key; `dropless config reference`: the configuration reference (markdown, what
docs/config.md holds)."""
from __future__ import annotations


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("show", help="print the effective config (YAML) and parameter counts")
    from dropless.cli.train import add_config_arguments
    add_config_arguments(p)   # what describes a config; not train's run options (--resume)
    p.add_argument("--maxtext", action="store_true",
                   help="print the config in MaxText's flags instead (a YAML MaxText reads over "
                        "its base.yml): the model, dtypes, sequence, batch, remat policy, "
                        "steps, learning-rate schedule, optimizer and mesh; the settings it "
                        "leaves out, and those MaxText reads otherwise, are listed at its top "
                        "and on stderr")
    sub.add_parser("keys", help="list every accepted key, ours and MaxText's")
    sub.add_parser("reference", help="print the configuration reference as markdown: every key "
                                     "of every section with its type, default, description "
                                     "and MaxText names (docs/config.md is this output)",
                   description="Print the configuration reference (markdown): how keys are "
                               "set, then one table per section (top level, mesh, model, "
                               "model.moe) giving each key's type, default, one-line "
                               "description and the MaxText names translated to it. "
                               "Regenerate the docs with: dropless config reference > "
                               "docs/config.md")


def run(args) -> int:
    if args.action == "reference":
        from dropless.config_docs import reference
        print(reference(), end="")
        return 0
    if args.action == "keys":
        from dropless.compat.maxtext import KNOWN
        from dropless.config_file import known_keys
        ours = known_keys()
        print("\n".join(ours))
        print("# MaxText names (translated; those spelled like ours are listed above):\n"
              + "\n".join(sorted(set(KNOWN) - set(ours))))
        print("# and any MaxText xla_* key (an XLA flag) and environment key (XLA_*, CUDA_*, "
              "NCCL_*, ...)")
        return 0
    from dropless.config_file import show
    from dropless.models.arithmetic import flops_per_token, format_counts, param_counts
    from dropless.cli.train import config_from_args
    notes: list[str] = []
    cfg = config_from_args(args, notes=notes)
    if args.maxtext:
        return _print_maxtext(cfg)
    print(show(cfg), end="")
    for line in notes:
        print(f"# note: {line}")
    moe = cfg.model.moe
    fpt = flops_per_token(cfg.model, cfg.seq_len,
                          capacity_factor=moe.capacity_factor if moe else None)
    print(f"# {cfg.preset}: {format_counts(param_counts(cfg.model))}; "
          f"{fpt['model'] / 1e9:.3f} GFLOPs per trained token at seq_len={cfg.seq_len}")
    return 0


def _print_maxtext(cfg) -> int:
    """The config as MaxText's YAML on stdout; on stderr one line naming what it leaves out
    and one for each flag MaxText reads otherwise (`maxtext_out.differences`).
    A setting MaxText cannot say (the capacity baseline, a grouped-matmul backend it lacks)
    raises ValueError naming it."""
    import sys

    from dropless.compat import maxtext_out
    header = (f"{cfg.preset} in MaxText's flags (`dropless config show --maxtext`): every key "
              "one of MaxText's configs/base.yml;\nMaxText reads them over its base.yml, "
              "dropless with `dropless config show --config FILE`.")
    print(maxtext_out.to_yaml(cfg, header), end="")
    gone = maxtext_out.left_out(cfg)
    if gone:
        print(f"dropless: note: the MaxText flags leave out {len(gone)} setting(s) away from "
              "dropless's defaults (listed at the top of the YAML): "
              + ", ".join(f"{k}={v}" for k, v in gone), file=sys.stderr)
    for line in maxtext_out.differences(cfg):
        print(f"dropless: note: {line}", file=sys.stderr)
    return 0
