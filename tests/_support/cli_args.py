"""A command's parsed defaults, then the fields a test sets: what `dropless <command>` would hand
its `run` with those options."""
import argparse


def parsed_args(module, **kw) -> argparse.Namespace:
    """`module.add_arguments`'s defaults (no arguments given), with `kw` set on top."""
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args
