"""Fault rows: command-line arguments refused before anything runs (no compile, no benchmark),
each in one line naming the argument and its value. Rows past argparse run in-process."""
from pathlib import Path

from tests._support.fault import Fault
from tests._support.paths import HF_FIXTURES


def _yaml(text: str):
    def setup(case: Path, _artifacts) -> None:
        (case / "c.yaml").write_text(text)
    return setup


def _step(s: int, **change) -> dict:
    rec = {"event": "step", "step": s, "loss": 5.0 - s / 10, "step_time_s": 0.5,
           "tokens_per_s": 4000.0, "tflops_per_device": 0.02, "dropped_tokens": 0,
           "tokens_per_expert": [[3, 5, 4, 4], [6, 2, 4, 4]]}
    rec.update(change)
    return {k: v for k, v in rec.items() if v is not ...}


def _metrics(*bad: tuple[int, dict]):
    """A run folder `r` whose metrics.jsonl holds a start record and steps 1..4, with the step
    records of `bad` ((step, changes); a change to `...` drops the field) in their place."""
    def setup(case: Path, _artifacts) -> None:
        import json
        changes = dict(bad)
        recs = [{"event": "start"}] + [_step(s, **changes.get(s, {})) for s in range(1, 5)]
        (case / "r").mkdir()
        (case / "r" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return setup


def _json_stdout(case: Path, res) -> None:
    import json
    doc = json.loads(res.out[:res.out.rindex("}") + 1])   # strict JSON: no NaN token
    assert doc["last_loss"] is None and doc["last_loss_nonfinite"] == "nan", doc


def _file_in_the_way(case: Path, _artifacts) -> None:
    (case / "f").write_text("a file, not a folder\n")


def _run_folder(config_text: str | None = None):
    """runs/x: a run's config.json (a tiny config as `dropless train` saves it, or
    `config_text`), and an empty checkpoints/."""
    def setup(case: Path, _artifacts) -> None:
        import json
        from dropless.config_file import build_config
        from dropless.model_dir import to_dict
        run = case / "runs" / "x"
        (run / "checkpoints").mkdir(parents=True)
        text = config_text if config_text is not None else json.dumps(to_dict(build_config(
            [("run_dir", "runs"), ("run_name", "x")])), indent=2)
        (run / "config.json").write_text(text)
    return setup


def _run_folder_with(key: str):
    """runs/x as `_run_folder` writes it, its config.json holding one more key (dotted)."""
    def setup(case: Path, artifacts) -> None:
        import json
        _run_folder()(case, artifacts)
        path = case / "runs" / "x" / "config.json"
        tree = json.loads(path.read_text())
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node[p]
        node[leaf] = 1
        path.write_text(json.dumps(tree))
    return setup


def _folder_config(text: str):
    def setup(case: Path, _artifacts) -> None:
        (case / "m").mkdir()
        (case / "m" / "config.json").write_text(text)
    return setup


def _fifo(name: str):
    def setup(case: Path, _artifacts) -> None:
        import os
        os.mkfifo(case / name)
    return setup


def arg(id_, argv, words, **kw):
    """A row refused with exit 2, in-process; the timeout bounds a benchmark that would run."""
    return Fault(id_, argv, rc=2, words=words, in_process=True, timeout=120, **kw)


ROWS = [
    # a subprocess: the one row whose exit 2 comes from argparse through the interpreter's own
    # exit (`python -m dropless.cli`), not from a status `main` returns
    Fault("cli-unknown-command", ["nosuchcommand"], rc=2, words=("invalid choice",)),
    # plan
    arg("plan-gpus-zero", ["plan", "--gpus", "0"], ("gpus=0", "positive")),
    arg("plan-sweep-gpus-not-int", ["plan", "--sweep-gpus", "8,x"], ("--sweep-gpus", "'x'")),
    arg("plan-sweep-gpus-zero", ["plan", "--sweep-gpus", "0,8"], ("--sweep-gpus", "0")),
    arg("plan-suggest-top-zero", ["plan", "--suggest", "--top", "0"], ("--top", "0")),
    arg("plan-min-buffer-factor-below-one", ["plan", "--suggest", "--min-buffer-factor", "0.5"],
        ("--min-buffer-factor", "0.5")),
    arg("plan-calibrate-devices-zero", ["plan", "--calibrate", "--calibrate-devices", "0"],
        ("--calibrate-devices", "0")),
    arg("plan-override-not-int", ["plan", "seq_len=abc"], ("seq_len", "'abc'")),
    arg("plan-ragged-buffer-factor-nan", ["plan", "--ragged-buffer-factor", "nan"],
        ("ragged_buffer_factor", "nan")),
    arg("plan-config-missing", ["plan", "--config", "nope.yaml"], ("nope.yaml",)),
    arg("plan-config-duplicate-key", ["plan", "--config", "c.yaml"],
        ("c.yaml", "'seq_len'", "twice"), setup=_yaml("seq_len: 4096\nseq_len: 2048\n"),
        unchanged=("c.yaml",)),
    arg("plan-config-not-mapping", ["plan", "--config", "c.yaml"], ("c.yaml", "mapping"),
        setup=_yaml("- 1\n- 2\n")),
    # bench
    arg("bench-gmm-m-zero", ["bench", "gmm", "--m", "0"], ("--m", "0")),
    arg("bench-gmm-groups-not-int", ["bench", "gmm", "--groups", "8,x"], ("--groups", "'x'")),
    arg("bench-gmm-dtype-unknown", ["bench", "gmm", "--dtypes", "float99"],
        ("--dtypes", "float99")),
    arg("bench-gmm-backend-unknown", ["bench", "gmm", "--backends", "nosuch"],
        ("--backends", "nosuch", "ragged_dot")),
    arg("bench-gmm-kernel-suffix-unknown", ["bench", "gmm", "--backends", "openblas:fast"],
        ("--backends", "openblas:fast", "native:own")),
    arg("bench-gmm-kernel-suffix-not-native", ["bench", "gmm", "--backends", "tiled:own"],
        ("--backends", "tiled:own", "native only")),
    arg("bench-host-malloc-unknown", ["bench", "moe", "--quick"],
        ("DROPLESS_HOST_MALLOC", "bogus", "system, reuse"),
        env={"DROPLESS_HOST_MALLOC": "bogus"}),
    arg("train-host-malloc-unknown", ["train", "steps=1"],
        ("DROPLESS_HOST_MALLOC", "fast", "system, reuse"),
        env={"DROPLESS_HOST_MALLOC": "fast"}),
    arg("bench-gmm-routing-unknown", ["bench", "gmm", "--routings", "nosuch"],
        ("--routings", "nosuch", "uniform")),
    arg("bench-gmm-repeats-zero", ["bench", "gmm", "--repeats", "0"], ("--repeats", "0")),
    arg("bench-gmm-budget-negative", ["bench", "gmm", "--budget-s", "-1"], ("--budget-s", "-1")),
    arg("bench-moe-top-k-above-experts", ["bench", "moe", "--experts", "8:9"],
        ("--experts", "8:9", "top_k")),
    arg("bench-moe-experts-format", ["bench", "moe", "--experts", "8-2"],
        ("--experts", "'8-2'", "e:k")),
    arg("bench-moe-capacity-negative", ["bench", "moe", "--capacity-factors", "-1"],
        ("--capacity-factors", "-1")),
    arg("bench-dispatch-ep-not-dividing", ["bench", "dispatch", "--ep", "3"],
        ("--ep=3", "--host-devices=8")),
    arg("bench-dispatch-unknown-dispatcher", ["bench", "dispatch", "--dispatchers", "nosuch"],
        ("--dispatchers", "nosuch", "a2a")),
    arg("bench-quant-shape-zero", ["bench", "quant", "--shape", "0", "512", "512", "8"],
        ("--shape", "0")),
    # checked by bench/gpu.py itself, before any section runs
    arg("bench-gpu-section-unknown", ["bench", "gpu", "--sections", "nosuch", "--dry-run"],
        ("--sections", "nosuch", "gmm")),
    # the environment, checked before JAX reads it (XLA would abort; JAX fails late)
    arg("env-jax-platforms-not-installed", ["eval", "m", "--data", "x.txt"],
        ("JAX_PLATFORMS='tpu'", "no TPU runtime", "available: cpu"),
        env={"JAX_PLATFORMS": "tpu"}),
    arg("env-jax-platforms-typo", ["train", "steps=1"], ("JAX_PLATFORMS='cpuu'", "'cpuu'"),
        env={"JAX_PLATFORMS": "cpuu"}, unchanged=(".",)),
    arg("env-xla-flag-unknown", ["train", "steps=1"],
        ("XLA_FLAGS", "'--xla_gpu_no_such_flag=1'", "jaxlib"),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_no_such_flag=1"},
        unchanged=(".",)),
    arg("env-xla-flag-not-a-flag", ["bench", "gmm"], ("XLA_FLAGS", "'fast'"),
        env={"XLA_FLAGS": "fast"}),
    arg("env-xla-flag-no-prefix", ["generate", "m", "--prompt", "a"],
        ("XLA_FLAGS", "'--noxla_cpu_enable_fast_math'"),
        env={"XLA_FLAGS": "--noxla_cpu_enable_fast_math"}),
    # sizes that cannot fit: refused with the memory they need, before anything is allocated
    arg("bench-gmm-m-absurd", ["bench", "gmm", "--m", "100000000000"],
        ("dropless bench gmm", "--m", "needs at least", "TiB", "available")),
    arg("bench-gmm-weights-absurd", ["bench", "gmm", "--k", "1000000", "--n", "1000000"],
        ("--groups", "needs at least")),
    arg("bench-moe-rows-absurd", ["bench", "moe", "--rows", "99999999999"],
        ("dropless bench moe", "--rows", "needs at least")),
    arg("bench-moe-experts-absurd", ["bench", "moe", "--experts", "100000000:2"],
        ("--experts", "needs at least")),
    arg("bench-dispatch-tokens-absurd", ["bench", "dispatch", "--tokens", "99999999999"],
        ("dropless bench dispatch", "--tokens", "needs at least", "host's RAM")),
    arg("bench-quant-shape-absurd", ["bench", "quant", "--shape", "99999999", "99999", "9999",
                                     "8"], ("dropless bench quant", "--shape", "needs at least")),
    arg("bench-quant-error-shape-absurd", ["bench", "quant", "--error-shape", "9999999",
                                           "9999999"], ("--error-shape", "needs at least")),
    Fault("generate-max-new-tokens-absurd",
          ["generate", f"hf:{HF_FIXTURES / 'mixtral'}", "--prompt", "hi", "--tokenizer", "byte",
           "--max-new-tokens", "1000000000000"], rc=2, timeout=120, in_process=True,
          words=("--max-new-tokens 1000000000000", "needs at least", "TiB")),
    # report: a record without what the report reads -> the file and line
    arg("report-step-without-loss", ["report", "r"], ("metrics.jsonl line 3", "'loss'"),
        setup=_metrics((2, {"loss": ...})), unchanged=("r",)),
    arg("report-loss-a-string", ["report", "r"], ("metrics.jsonl line 4", "loss='low'"),
        setup=_metrics((3, {"loss": "low"})), unchanged=("r",)),
    arg("report-step-not-int", ["report", "r"], ("line 2", "step=", "an int"),
        setup=_metrics((1, {"step": "one"})), unchanged=("r",)),
    arg("report-expert-load-ragged", ["report", "r"], ("line 5", "tokens_per_expert"),
        setup=_metrics((4, {"tokens_per_expert": [[1, 2], [3]]})), unchanged=("r",)),
    arg("report-expert-load-changes-shape", ["report", "r"], ("line 5", "two runs"),
        setup=_metrics((4, {"tokens_per_expert": [[1, 2, 3, 4, 5, 6, 7, 8]]})),
        unchanged=("r",)),
    Fault("report-nan-loss-is-json", ["report", "r"], rc=0, in_process=True,
          words=("last_loss_nonfinite",), setup=_metrics((4, {"loss": float("nan")})),
          check=_json_stdout),
    # --out that cannot be written: refused before anything is computed
    arg("plan-out-under-a-file", ["plan", "--out", "f/plan.json"], ("--out", "f/plan.json",
                                                                    "is a file"),
        setup=_file_in_the_way, unchanged=("f",)),
    arg("plan-out-a-folder", ["plan", "--out", "."], ("--out", "is a folder")),
    arg("bench-out-under-a-file", ["bench", "gmm", "--out", "f/a/b.jsonl"],
        ("--out", "is a file"), setup=_file_in_the_way, unchanged=("f",)),
    arg("bench-plot-under-a-file", ["bench", "quant", "--plot", "f/p.png"],
        ("--plot", "is a file"), setup=_file_in_the_way, unchanged=("f",)),
    arg("bench-gpu-out-dir-under-a-file", ["bench", "gpu", "--dry-run", "--out-dir", "f/o"],
        ("--out-dir", "is a file"), setup=_file_in_the_way, unchanged=("f",)),
    arg("env-compilation-cache-under-a-file", ["train", "steps=1"],
        ("JAX_COMPILATION_CACHE_DIR", "is a file"), setup=_file_in_the_way,
        env={"JAX_COMPILATION_CACHE_DIR": "f/cache"}, unchanged=(".",)),
    arg("env-dropless-cache-under-a-file", ["train", "steps=1"],
        ("XDG_CACHE_HOME", "is a file", "DROPLESS_CPU_PEAK_FLOPS"), setup=_file_in_the_way,
        env={"XDG_CACHE_HOME": "f", "DROPLESS_CPU_PEAK_FLOPS": ""}, unchanged=(".",)),
    # contradictions: refused, naming both sides
    arg("plan-node-size-does-not-divide", ["plan", "--gpus", "8", "--devices-per-node", "3"],
        ("devices_per_node=3", "8 devices", "2")),
    arg("plan-node-size-does-not-divide-gpus", ["plan", "--gpus", "12", "--devices-per-node",
                                                "8"], ("devices_per_node=8", "12 devices")),
    arg("plan-node-size-from-override", ["plan", "gpus=24", "devices_per_node=16"],
        ("devices_per_node=16", "24 devices")),
    arg("train-resume-override-moves-run", ["train", "--resume", "runs/x", "run_name=other"],
        ("--resume runs/x", "runs/other", "run_name='other'"), setup=_run_folder(),
        unchanged=("runs",)),
    arg("train-resume-override-moves-run-dir", ["train", "--resume", "runs/x", "run_dir=elsewhere"],
        ("--resume runs/x", "elsewhere/x", "run_dir='elsewhere'"), setup=_run_folder(),
        unchanged=("runs",)),
    # a run's or model folder's config.json that is not what it should be: the file named
    arg("train-resume-config-not-json", ["train", "--resume", "runs/x"],
        ("runs/x/config.json", "JSON"), setup=_run_folder('{"steps": 3,'), unchanged=("runs",)),
    arg("eval-run-config-not-json", ["eval", "runs/x", "--data", "runs/x/config.json"],
        ("runs/x/config.json", "not valid JSON"), setup=_run_folder('{"steps": 3,'),
        unchanged=("runs",)),
    arg("train-init-from-config-not-json", ["train", "init_from=runs/x", "steps=1"],
        ("init_from='runs/x'", "runs/x/config.json", "not valid JSON"),
        setup=_run_folder('{"model": '), unchanged=("runs",)),
    *[arg(f"{name}-config-json-unknown-{where}", cmd, words=("runs/x/config.json", key,
                                                            "does not know"),
          setup=_run_folder_with(key), unchanged=("runs",))
      for name, cmd in (("resume", ["train", "--resume", "runs/x"]),
                        ("eval", ["eval", "runs/x", "--data", "runs/x/config.json"]),
                        ("init-from", ["train", "init_from=runs/x", "steps=1"]),
                        ("convert", ["convert", "runs/x", "out"]),
                        ("generate", ["generate", "runs/x", "--prompt", "hi"]))
      for where, key in (("top", "bogus"), ("model", "model.bogus"),
                         ("moe", "model.moe.bogus"))],
    arg("convert-folder-neither-kind", ["convert", "m", "out"],
        ("dropless convert m", "config.json", "neither a dropless config", "hf:DIR"),
        setup=_folder_config('{"foo": 1}'), unchanged=("m", "out")),
    arg("generate-folder-neither-kind", ["generate", "m", "--prompt", "hi"],
        ("dropless generate m", "neither a dropless config"),
        setup=_folder_config('[1, 2]'), unchanged=("m",)),
    # only regular files are read as configs or written as outputs (a FIFO would block forever)
    arg("plan-config-a-fifo", ["plan", "--config", "c.yaml"], ("c.yaml", "not a regular file"),
        setup=_fifo("c.yaml")),
    arg("config-show-config-a-device", ["config", "show", "--config", "/dev/null"],
        ("/dev/null", "not a regular file")),
    arg("train-config-a-folder", ["train", "--config", "."], ("'.'", "directory")),
    arg("plan-out-a-fifo", ["plan", "--out", "o.json"], ("--out", "not a regular file"),
        setup=_fifo("o.json")),
    arg("bench-out-a-device", ["bench", "gmm", "--out", "/dev/stdout"],
        ("--out", "/dev/stdout", "not a regular file")),
]
