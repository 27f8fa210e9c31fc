"""A full disk under `convert` (both directions) and `report`: one line naming the destination
(the folder, or the plot), nothing of orbax's or tensorstore's background noise, nothing left
half-written, the old plot kept. The writers are made to fail as they do on a full disk (the
error orbax's tensorstore write raises, an OSError ENOSPC); as root, a real 256 KiB tmpfs
checks the same in a subprocess (skipped, with the reason, without mount rights)."""
import errno
import subprocess
import sys
from pathlib import Path

import pytest

from dropless import cli

from tests._support.paths import HF_FIXTURES, SRC
from tests._support.run_metrics import write_run

QWEN = HF_FIXTURES / "qwen3_moe"
# what orbax raises when one of its tensorstore writes finds the disk full
TENSORSTORE_FULL = ("RESOURCE_EXHAUSTED: Error writing \"layers.1/0\" in OCDBT database at local "
                    "file \"{d}/\": Failed to write 111613 bytes to file 15: No space left on "
                    "device [os_error_code='28']")


def _one_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "ERROR:" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_convert_to_dropless_onto_a_full_disk(tmp_path):
    # in a subprocess: a failed orbax write ends the command without joining orbax's threads
    script = ("import sys\nimport orbax.checkpoint as ocp\nfrom dropless import cli\n"
              "def full(self, path, *a, **k):\n"
              f"    raise ValueError({TENSORSTORE_FULL!r}.format(d=path))\n"
              "ocp.StandardCheckpointer.save = full\n"
              f"sys.exit(cli.main(['convert', 'hf:{QWEN}', '{tmp_path / 'out'}']))\n")
    before = _left(tmp_path)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin",
                                         "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)})
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    for w in ("no space left", str(tmp_path / "out"), "free space"):
        assert w in r.stderr, r.stderr
    assert _left(tmp_path) == before                      # no out/, no staging folder


def test_convert_to_hf_onto_a_full_disk(tmp_path, capsys, monkeypatch):
    assert cli.main(["convert", f"hf:{QWEN}", str(tmp_path / "dl")]) == 0
    capsys.readouterr()
    import safetensors.numpy

    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    before = _left(tmp_path)
    assert cli.main(["convert", str(tmp_path / "dl"), str(tmp_path / "hfout")]) == 1
    _one_line(capsys, "No space left on device", str(tmp_path / "hfout"), "free space")
    assert _left(tmp_path) == before


def test_report_onto_a_full_disk_names_the_plot_and_keeps_the_old_one(tmp_path, capsys,
                                                                      monkeypatch):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "r", steps=4)
    (run / "loss.png").write_bytes(b"the old plot")
    from matplotlib.figure import Figure

    def full(self, fname, **k):
        Path(fname).write_bytes(b"half a pl")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full)
    assert cli.main(["report", str(run)]) == 1
    _one_line(capsys, "No space left on device", str(run / "loss.png"))
    assert (run / "loss.png").read_bytes() == b"the old plot"
    assert sorted(p.name for p in run.iterdir()) == ["loss.png", "metrics.jsonl"]


@pytest.fixture
def tiny_disk(tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"no tmpfs mount here: {r.stderr.strip() or 'mount failed'}")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def test_convert_onto_a_real_full_disk_is_one_line(tmp_path, tiny_disk):
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu",
           "HOME": str(tmp_path)}

    def convert(src, dst):
        return subprocess.run([sys.executable, "-m", "dropless.cli", "convert", src, dst],
                              capture_output=True, text=True, env=env, timeout=300)
    r = convert(f"hf:{QWEN}", str(tiny_disk / "out"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "no space left" in r.stderr and str(tiny_disk / "out") in r.stderr
    assert convert(f"hf:{QWEN}", str(tmp_path / "dl")).returncode == 0
    r = convert(str(tmp_path / "dl"), str(tiny_disk / "hf"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "No space left" in r.stderr and str(tiny_disk / "hf") in r.stderr
    assert _left(tiny_disk) == []
