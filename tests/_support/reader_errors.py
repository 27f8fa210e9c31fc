"""The error every reader of one input raises, for the tests that hold them to one message."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from dropless.data import readers
from dropless.data.corpus import text_documents


def reader_errors(path, field: str = "text",
                  **more: Callable[[readers.InputFile], object]) -> dict[str, str]:
    """The ValueError message each reader raises on `path`: `data prepare`'s chunks, training's
    `data='PATH'` (its message with the key written as PATH, as the others name the file) and
    `more` (name -> a reading of the InputFile). A reader that raises nothing fails the test."""
    (f,) = readers.input_files(str(path))
    readings = {
        "prepare": lambda: [t for c in readers.text_chunks(f, field)
                            for t in readers.chunk_texts(f, c, field)],
        "train": lambda: text_documents(str(path)),
        **{name: (lambda read=read: read(f)) for name, read in more.items()},
    }
    out = {}
    for name, read in readings.items():
        with pytest.raises(ValueError) as e:
            read()
        out[name] = str(e.value).replace(f"data={str(path)!r}", str(path))
    return out
