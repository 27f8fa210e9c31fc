"""`dropless plan --kernels` on the CPU: its refusals (one line, exit 2, nothing compiled) and
the table glue (`kernel_records`, `format_kernels`) on a jitted CPU function's HLO, checked
against `runtime.hlo_kernels` directly. The end-to-end run on the deepseek3-1gpu preset compiled
for an H100 is tests/train/test_preflight_gpu_compile.py (the GPU leg).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import pytest

from dropless.cli import main
from dropless.cli.plan import add_arguments, format_kernels, kernel_records
from dropless.machine import PROFILES
from dropless.runtime import hlo_kernels


def test_kernels_without_compile_for_is_refused(capsys):
    assert main(["plan", "--preset", "deepseek3-test", "--kernels"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("dropless: error: --kernels lists the kernels of the compiled "
                                 "step: give --compile-for h100 or h200 with it\n")


def test_kernels_with_the_preflight_switched_off_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("DROPLESS_NO_PREFLIGHT", "1")
    assert main(["plan", "--preset", "deepseek3-test", "--compile-for", "h100",
                 "--kernels"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("dropless: error: --kernels needs the step compiled, which "
                                 "DROPLESS_NO_PREFLIGHT=1 skips: unset it or leave --kernels "
                                 "out\n")


def test_the_table_of_a_compiled_function_and_its_text():
    def f(a, b):
        return jnp.tanh(jnp.dot(a, b)) + 1.0

    text = jax.jit(f).lower(jnp.ones((256, 512)), jnp.ones((512, 128))).compile().as_text()
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--preset", "deepseek3-test", "--hardware", "h100", "--seq", "256",
                         "--compile-for", "h100", "--kernels"])
    hw = PROFILES["h100"]
    table = kernel_records(text, hw, args, "deepseek3-test")
    head, recs = table[0], table[1:]
    assert head["command"] == ("dropless plan seq_len=256 preset=deepseek3-test hardware=h100 "
                               "--compile-for h100 --kernels")
    assert head["jax"] == jax.__version__ and head["machine"]["jax"] == jax.__version__
    assert (head["target"], head["hardware"], head["model"]) == ("h100", "h100",
                                                                 "deepseek3-test")
    # the records are hlo_kernels' with float32 dots at the TF32 peak
    ref = hlo_kernels.predict(hlo_kernels.kernels(text), hw,
                              peak=lambda p: {"float32": hw.peak_tf32}.get(p))
    assert recs == ref
    kern = [r for r in recs if r["event"] == "kernel"]
    assert head["kernels"] == len(kern)
    assert head["predicted_step_us"] == pytest.approx(sum(r["total_us"] for r in kern))
    dot = next(r for r in kern if r["flops"])
    assert dot["flops"] == 2 * 256 * 512 * 128 and dot["precision"] == "float32"
    out = format_kernels(table, top=1)
    lines = out.splitlines()
    assert lines[0] == (f"Kernels of the step compiled for h100 ({len(kern)} kernels; "
                        "predicted on the h100 profile, not measured):")
    assert lines[2].split()[0] == kern[0]["name"] and lines[3] == ""   # the top 1 only
    assert lines[4] == "By group:" and len(lines) == 5 + 1 + 6 + 1
    assert lines[-1] == (f"  predicted step: {head['predicted_step_us'] / 1e3:.1f} ms (the "
                         "kernels' sum, no overlap; the XLA attention, not cuDNN's, as "
                         "compiled without a GPU)")
