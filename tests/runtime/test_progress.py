"""The one progress bar: both counts build, the status field is the one both commands fill,
and an unknown count is refused."""
import io

import pytest

from dropless.runtime.progress import terminal_bar


@pytest.mark.parametrize("count,total,done", [("steps", 10, 3), ("bytes", 4096, 1024)])
def test_bar_shows_label_amount_and_status(count, total, done):
    bar = terminal_bar("step" if count == "steps" else "prepare", count=count)
    bar.console.file = io.StringIO()
    bar.console.width = 200
    task = bar.add_task("t", total=total, status="")
    bar.update(task, completed=done, status="loss 1.2345")
    bar.console.print(bar.get_renderable())
    out = bar.console.file.getvalue()
    assert out.startswith("step" if count == "steps" else "prepare")
    assert "loss 1.2345" in out and "ETA" in out
    assert ("3/10" in out) if count == "steps" else ("1.0/4.1 kB" in out)


def test_unknown_count_is_refused():
    with pytest.raises(ValueError, match="count='rows' must be one of"):
        terminal_bar("x", count="rows")
