"""`dropless config reference`: prints the library's configuration reference and nothing else;
its --help says what it prints and how docs/config.md is regenerated."""
import pytest

from dropless.cli import main
from dropless.config_docs import reference


def test_reference_prints_the_library_markdown(capsys):
    assert main(["config", "reference"]) == 0
    captured = capsys.readouterr()
    assert captured.out == reference()
    assert captured.out.startswith("# Configuration reference\n")
    assert "| `model.moe.num_experts` |" in captured.out


def test_reference_help_describes_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["config", "--help"])
    assert e.value.code == 0
    assert "reference" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["config", "reference", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "configuration reference" in out
    assert "dropless config reference > docs/config.md" in out
