"""Records from the files corpora come in: JSONL (plain, .gz, .zst), Parquet, Arrow (IPC file or
stream, a `datasets.save_to_disk` folder) and text files, streamed (a file is never held whole).

A source is `PATH[@WEIGHT]`: a file, a directory (every readable file under it, through links to
folders (`walk`), sorted by path; a `save_to_disk` folder: its Arrow files in its own order, a
DatasetDict folder: its `train` split) or a glob (`data/*.parquet`, `**` recursive). `input_files`
expands a source into `InputFile`s; each record of a file has an index (JSONL: its 0-based line
number, blank lines skipped; Parquet / Arrow: its 0-based row; a text file is one record, index 0)
and a `name` (`InputFile.name`: the path relative to the source's root) that, with the index,
identifies a document stably wherever the data is moved (`identity`).

Two ways to read:
* `records(file)`: (index, record dict) for every record (SFT reads prompt / completion or
  messages through it);
* `text_chunks(file, text_field)`: the fast path of `data.prepare`: raw chunks (undecoded JSONL
  lines, or a column's strings) that a worker process turns into texts with `chunk_texts`;
* `text_parts(file)`: a text file's one text in parts, for one larger than TEXT_WHOLE_BYTES
  (`streamed`), which `data.prepare` encodes as it reads it rather than as one chunk.

Bytes become text and records through `data.decoding` (UTF-8, a byte-order mark at the start
of a file dropped, JSON objects with unique keys); a Parquet / Arrow column read twice by one
name is refused, as JSON's repeated key is. Errors are ValueErrors naming the file and the line
or row (`where`).
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import os
from pathlib import Path
from typing import Iterator

from dropless.data.decoding import UTF8_BOM, check_encodable, decode_utf8, json_object, \
    parse_jsonl_line, record_text, strip_bom, utf8_error

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
CHUNK_RECORDS = 1024
CHUNK_BYTES = 4 << 20        # a JSONL chunk ends at this many raw bytes even when short of records
TEXT_WHOLE_BYTES = 4 << 20   # a text file up to this size is one chunk; a larger one is streamed
TEXT_PART_BYTES = 1 << 20    # bytes `text_parts` reads at a time
KINDS = {"jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES, "arrow": ARROW_SUFFIXES,
         "text": TEXT_SUFFIXES}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputFile:
    """One file of a source. name: its path relative to the source's root (the identity of its
    documents); weight: the source's (see `data.prepare`)."""
    path: Path
    name: str
    kind: str
    weight: float
    size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunk:
    """Consecutive records of one file, undecoded. indices[i] is the index of payload[i];
    `decoded`: payload holds texts (or None) rather than raw JSONL lines; bytes_done: how far
    into the file (bytes of the file on disk) the chunk ends, for progress."""
    indices: list[int]
    payload: list
    decoded: bool
    bytes_done: int


def kind_of(path: Path) -> str | None:
    """The reader of a file by its suffix ("jsonl", "parquet", "arrow", "text"), or None."""
    name = path.name.lower()
    for kind, suffixes in KINDS.items():
        if any(name.endswith(s) for s in suffixes):
            return kind
    return None


def where(file: InputFile, index: int) -> str:
    """How an error names a record: 'a.jsonl line 3', 'b.parquet row 17', 'c.txt'."""
    if file.kind == "jsonl":
        return f"{file.path} line {index + 1}"
    if file.kind == "text":
        return str(file.path)
    return f"{file.path} row {index}"


def identity(file: InputFile, index: int) -> str:
    """The stable name of a record, held out for eval by its CRC32 (`corpus.is_eval_document`)."""
    return file.name if file.kind == "text" else f"{file.name}:{index}"


# --- sources ------------------------------------------------------------------------------------

def parse_source(spec: str) -> tuple[str, float]:
    """(pattern, weight) of `PATH[@WEIGHT]`; a path that exists as written keeps its '@'.
    Raises ValueError for a weight that is not a positive number."""
    if "@" not in spec or Path(spec).exists():
        return spec, 1.0
    pattern, _, w = spec.rpartition("@")
    try:
        weight = float(w)
    except ValueError:
        raise ValueError(f"source {spec!r}: weight {w!r} after '@' is not a number "
                         "(SRC@WEIGHT, e.g. data/wiki.jsonl.zst@2)") from None
    if not weight > 0 or weight > 1e6:
        raise ValueError(f"source {spec!r}: weight {weight} must be > 0 (and at most 1e6)")
    return pattern, weight


def _unsupported(path: Path, spec: str) -> ValueError:
    extra = ("; a .json file is not JSONL (one JSON object per line, suffix .jsonl)"
             if path.suffix == ".json" else "")
    return ValueError(f"source {spec!r}: {path} is not a format dropless reads (JSONL "
                      f"{', '.join(JSONL_SUFFIXES)}; Parquet .parquet; Arrow .arrow; text "
                      f"{', '.join(TEXT_SUFFIXES)}){extra}")


def _file(path: Path, root: Path, weight: float, spec: str) -> InputFile:
    kind = kind_of(path)
    if kind is None:
        raise _unsupported(path, spec)
    name = path.name if path == root else path.relative_to(root).as_posix()
    return InputFile(path=path, name=name, kind=kind, weight=weight, size=path.stat().st_size)


def _saved_dataset(folder: Path, spec: str) -> list[Path] | None:
    """The Arrow files of a `datasets.save_to_disk` folder in its own order (a DatasetDict
    folder: its train split's), or None when `folder` is not one."""
    if (folder / "dataset_dict.json").is_file():
        splits = json_object(folder / "dataset_dict.json").get("splits", [])
        if "train" not in splits:
            raise ValueError(f"source {spec!r}: {folder} is a DatasetDict with splits "
                             f"{', '.join(map(str, splits)) or '(none)'} and no 'train'; give "
                             "the split's folder (DIR/<split>)")
        return _saved_dataset(folder / "train", spec)
    if not (folder / "state.json").is_file():
        return None
    files = json_object(folder / "state.json").get("_data_files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f
                                              for f in files):
        raise ValueError(f"{folder / 'state.json'}: '_data_files' must be a list of "
                         "{\"filename\": ...} (is this a datasets.save_to_disk folder?)")
    paths = [folder / f["filename"] for f in files]
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{folder / 'state.json'} names {p.name}, which is missing")
    return paths


def walk(folder: Path, what: str, above: frozenset = frozenset()) -> Iterator[Path]:
    """Every path under `folder`, through links to folders too (as a glob's `**` goes; Python
    3.11's rglob does not, which skipped their files silently). Raises ValueError, starting
    with `what` (the argument that named the folder), naming a link to nothing, a link to a
    folder above it (an endless tree) and a folder that cannot be listed."""
    above = above | {os.path.realpath(folder)}
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        raise ValueError(f"{what}: folder {folder} cannot be read ({e.strerror}); "
                         "give this user access to it, or leave it out") from None
    for p in entries:
        if p.is_symlink() and not p.exists():
            raise ValueError(f"{what}: {p} is a link to nothing (dangling or pointing at "
                             "itself); remove it or fix its target")
        yield p
        if p.is_dir():
            if os.path.realpath(p) in above:
                raise ValueError(f"{what}: {p} is a link to {os.path.realpath(p)}, a "
                                 "folder above it (the tree would never end); remove the link")
            yield from walk(p, what, above)


def _directory(folder: Path, root: Path, weight: float, spec: str) -> list[InputFile]:
    saved = _saved_dataset(folder, spec)
    if saved is not None:
        return [_file(p, root, weight, spec) for p in saved]
    found = sorted((p for p in walk(folder, f"source {spec!r}")
                    if p.is_file() and kind_of(p) is not None),
                   key=lambda p: p.relative_to(folder).as_posix())
    if not found:
        raise ValueError(f"source {spec!r}: {folder} holds no file dropless reads (JSONL, "
                         "Parquet, Arrow or text)")
    return [_file(p, root, weight, spec) for p in found]


def _glob_root(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard."""
    parts = Path(pattern).parts
    fixed = parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]
    return Path(*fixed) if fixed else Path(".")


def check_readable(path: Path, where: str) -> None:
    """Refuse a file this process may not read, naming it after `where` (the argument that
    named it): every reader of a user's data files (`input_files`, training's and eval's
    corpus) checks each file here before it reads any."""
    if not os.access(path, os.R_OK):
        raise ValueError(f"{where}: {path} cannot be read (permission denied); give this user "
                         "read access to it, or leave it out")


def input_files(spec: str) -> list[InputFile]:
    """The files of one source `PATH[@WEIGHT]` (module doc), in reading order. Raises
    ValueError for a path that does not exist, a glob that matches nothing, an unsupported
    file, an empty file, and a folder with nothing to read."""
    pattern, weight = parse_source(spec)
    path = Path(pattern)
    if glob.has_magic(pattern) and not path.exists():
        root = _glob_root(pattern)
        matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
        if not matches:
            raise ValueError(f"source {spec!r} matches no file")
        for m in matches:
            if m.is_symlink() and not m.exists():
                raise ValueError(f"source {spec!r}: {m} is a link to nothing (dangling or "
                                 "pointing at itself); remove it or fix its target")
        found = [f for m in matches for f in (_directory(m, root, weight, spec) if m.is_dir()
                                             else [_file(m, root, weight, spec)])]
        files = list({f.path: f for f in found}.values())   # `**` matches a folder and its files
    elif path.is_dir():
        files = _directory(path, path, weight, spec)
    elif path.is_file():
        files = [_file(path, path, weight, spec)]
    elif path.is_symlink():
        raise ValueError(f"source {spec!r} is a link to nothing (dangling or pointing at "
                         "itself); fix its target")
    else:
        raise ValueError(f"source {spec!r} does not exist")
    for f in files:
        check_readable(f.path, f"source {spec!r}")
    for f in files:
        if f.size == 0:
            raise ValueError(f"source {spec!r}: {f.path} is empty (0 bytes)")
    return files


# --- JSONL --------------------------------------------------------------------------------------

def _open_jsonl(path: Path):
    """(line-iterable binary stream, the raw file whose tell() is the progress) of a JSONL file."""
    raw = open(path, "rb")
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(raw), buffer_size=1 << 20), raw
    return raw, raw


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of zstd frames, one after another; a file that ends
    inside a frame raises EOFError (zstandard's stream_reader would end there silently)."""

    def __init__(self, raw):
        import zstandard
        self.raw, self.zstd = raw, zstandard
        self.obj, self.fed = zstandard.ZstdDecompressor().decompressobj(), False
        self.pending, self.at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.at == len(self.pending):
            block = self.raw.read(1 << 20)
            if not block:
                if self.fed and not self.obj.eof:
                    raise EOFError("the file ends inside a zstd frame (cut short?)")
                return 0
            self.pending, self.at = b"", 0
            while block:
                if self.obj.eof:
                    self.obj = self.zstd.ZstdDecompressor().decompressobj()
                self.pending += self.obj.decompress(block)
                self.fed = True
                block = self.obj.unused_data if self.obj.eof else b""
        n = min(len(buf), len(self.pending) - self.at)
        buf[:n] = self.pending[self.at: self.at + n]
        self.at += n
        return n


def jsonl_lines(file: InputFile, start: int = 0) -> Iterator[tuple[int, bytes, int]]:
    """(line index, raw line without its newline, bytes read) per non-blank line >= start;
    line 0 without a byte-order mark (`decoding.strip_bom`)."""
    stream, raw = _open_jsonl(file.path)
    try:
        for i, line in enumerate(_read_lines(stream, file)):
            if i == 0:
                line = strip_bom(line)
            if i >= start and line.strip():
                yield i, line.rstrip(b"\r\n"), raw.tell()
    finally:
        stream.close()
        raw.close()


def _read_lines(stream, file: InputFile) -> Iterator[bytes]:
    import zstandard
    try:
        yield from stream
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise ValueError(f"{file.path}: cannot be decompressed ({e})") from None


# --- Parquet and Arrow --------------------------------------------------------------------------

def _string_type(t) -> bool:
    import pyarrow as pa
    if pa.types.is_dictionary(t):    # a categorical column: read as its strings
        return _string_type(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))


def _check_column(file: InputFile, schema, text_field: str) -> None:
    if text_field not in schema.names:
        raise ValueError(f"{file.path} has no column {text_field!r} (its columns: "
                         f"{', '.join(schema.names[:8]) or 'none'}); choose the text column "
                         "with --text-field")
    t = schema.field(text_field).type
    if not _string_type(t):
        raise ValueError(f"{file.path}: column {text_field!r} is {t}, not a string column; "
                         "choose the text column with --text-field")


def _check_unique_columns(file: InputFile, schema, columns: list[str] | None) -> None:
    """A column read (`columns`; None: every one) that the schema names twice is refused:
    a record dict would keep one of them, and pyarrow cannot select it by name."""
    names = schema.names
    for c in dict.fromkeys(names if columns is None else columns):
        if names.count(c) > 1:
            raise ValueError(f"{file.path}: column {c!r} appears {names.count(c)} times (its "
                             f"columns: {', '.join(names[:8])}); a record holds one value per "
                             "name: rename the others")


def _arrow_batches(file: InputFile, columns: list[str] | None, start: int, size: int):
    """(first row, pyarrow RecordBatch of at most `size` rows, fraction of the file done) from
    row `start` on."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if file.kind == "parquet":
        try:
            pf = pq.ParquetFile(file.path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{file.path}: not a readable Parquet file ({e})") from None
        schema, total = pf.schema_arrow, pf.metadata.num_rows
        # the row groups from the one holding row `start` on; `row`: the first one's first row
        groups, row, pos = [], 0, 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if pos + n > start:
                groups.append(g)
            elif not groups:
                row = pos + n
            pos += n
        batches = pf.iter_batches(batch_size=size, row_groups=groups, columns=columns) \
            if groups else iter(())
    else:
        source = pa.memory_map(str(file.path))
        try:
            reader = pa.ipc.open_file(source)
            total = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid as e:
                raise ValueError(f"{file.path}: not an Arrow IPC file or stream ({e})") from None
            total, batches = None, iter(reader)
        schema, row = reader.schema, 0
    _check_unique_columns(file, schema, columns)
    if columns:
        for c in columns:
            _check_column(file, schema, c)
    try:
        for b in batches:
            n = b.num_rows
            if row + n > start:
                lo = max(0, start - row)
                part = b.slice(lo) if lo else b
                if columns and file.kind == "arrow":
                    part = part.select(columns)
                done = (row + n) / total if total else min(1.0, (source.tell() / file.size))
                for k in range(0, part.num_rows, size):   # an Arrow batch holds any number
                    yield row + lo + k, part.slice(k, size), done
            row += n
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{file.path}: cannot be read at row {row} ({e})") from None


# --- the two ways to read -----------------------------------------------------------------------

def records(file: InputFile, *, start: int = 0) -> Iterator[tuple[int, dict]]:
    """(index, record) of every record of `file` from index `start` on (a text file: one record
    {"text": its content}). Raises ValueError naming the file and line / row of a bad record."""
    if file.kind == "jsonl":
        for i, line, _ in jsonl_lines(file, start):
            yield i, parse_jsonl_line(line, where(file, i))
    elif file.kind == "text":
        if start == 0:
            yield 0, {"text": _read_text(file)}
    else:
        for first, batch, _ in _arrow_batches(file, None, start, CHUNK_RECORDS):
            for j, rec in enumerate(batch.to_pylist()):
                yield first + j, rec


def _read_text(file: InputFile) -> str:
    """The file's text (`decode_utf8`)."""
    return decode_utf8(file.path.read_bytes(), str(file.path))


def streamed(file: InputFile) -> bool:
    """Whether `data.prepare` reads `file` in parts (`text_parts`) rather than in chunks: a text
    file larger than TEXT_WHOLE_BYTES, one document that no chunk need hold whole."""
    return file.kind == "text" and file.size > TEXT_WHOLE_BYTES


def text_size(file: InputFile) -> int:
    """The bytes of a text file's UTF-8 text: its size, less a leading byte-order mark."""
    with open(file.path, "rb") as f:
        return file.size - len(UTF8_BOM) * (f.read(len(UTF8_BOM)) == UTF8_BOM)


def _utf8_end(data: bytes) -> int:
    """Where a last UTF-8 character that `data` holds only the first bytes of starts (its
    length when the last one is whole, or when the bytes are not UTF-8: decoding names them)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return n
        if b >= 0xC0:                   # a lead byte: of 2, 3 or 4 bytes
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n - back if need > back else n
    return n


def text_parts(file: InputFile, part_bytes: int | None = None) -> Iterator[tuple[str, int]]:
    """A text file's text (`_read_text`'s, that is `decode_utf8`'s) in parts of about
    `part_bytes` (None: TEXT_PART_BYTES) cut between characters, each with how many bytes of
    the file are read; the same ValueError as `_read_text` for bytes that are not UTF-8 (the
    first such, naming its line)."""
    part_bytes = part_bytes or TEXT_PART_BYTES
    head, carry, lines, done = None, b"", 0, 0
    with open(file.path, "rb") as f:
        while True:
            block = f.read(part_bytes if head else max(part_bytes, len(UTF8_BOM)))
            done += len(block)
            data = carry + block
            if head is None:
                data = strip_bom(data)
                head = data[:len(UTF8_BOM)]
            end = _utf8_end(data) if block else len(data)
            try:
                text = data[:end].decode("utf-8")
            except UnicodeDecodeError as e:
                raise utf8_error(data[:end], e, str(file.path), lines_before=lines,
                                 head=head) from None
            lines += data.count(b"\n", 0, end)
            carry = data[end:]
            if text:
                yield text, done
            if not block:
                return


def text_chunks(file: InputFile, text_field: str, *, start: int = 0,
                records_per_chunk: int = CHUNK_RECORDS) -> Iterator[Chunk]:
    """`file`'s records from index `start` on, in chunks for `chunk_texts`. A Parquet / Arrow
    column's name and type are checked here, before any chunk (ValueError naming the file)."""
    if file.kind == "text":
        if start == 0:
            yield Chunk(indices=[0], payload=[_read_text(file)], decoded=True,
                        bytes_done=file.size)
    elif file.kind == "jsonl":
        idx, lines, size = [], [], 0
        for i, line, done in jsonl_lines(file, start):
            idx.append(i)
            lines.append(line)
            size += len(line)
            if len(lines) >= records_per_chunk or size >= CHUNK_BYTES:
                yield Chunk(indices=idx, payload=lines, decoded=False, bytes_done=done)
                idx, lines, size = [], [], 0
        if lines:
            yield Chunk(indices=idx, payload=lines, decoded=False, bytes_done=file.size)
    else:
        for first, batch, done in _arrow_batches(file, [text_field], start, records_per_chunk):
            texts = batch.column(0).to_pylist()
            yield Chunk(indices=list(range(first, first + len(texts))), payload=texts,
                        decoded=True, bytes_done=int(done * file.size))


def max_chunks(file: InputFile, records_per_chunk: int = CHUNK_RECORDS) -> int | None:
    """At most how many chunks `text_chunks(file)` yields, from the file's size alone; None
    when the size does not bound them (compressed JSONL, Parquet, Arrow). A JSONL record takes
    at least 3 bytes (`{}` and a newline; the last line may go without), and a chunk ends at
    `records_per_chunk` records, at CHUNK_BYTES bytes of lines, or at the file's end. Only the
    number of worker processes depends on it, never the output. A streamed text file
    (`streamed`) makes none: the main process encodes it."""
    if file.kind == "text":
        return 0 if streamed(file) else 1
    if file.kind == "jsonl" and not file.path.name.lower().endswith((".gz", ".zst")):
        return (file.size + 1) // 3 // records_per_chunk + file.size // CHUNK_BYTES + 1
    return None


def chunk_text_bytes(file: InputFile, text_field: str,
                     records_per_chunk: int = CHUNK_RECORDS) -> int:
    """About how many bytes of text the largest chunk of `file` holds, from its size or its
    metadata, reading no record (`prepare_workers` sizes a worker's memory by it), as
    `text_chunks` cuts them: a text file is one chunk of its size (a streamed one, `streamed`,
    is no worker's chunk: 0); a JSONL chunk ends at
    CHUNK_BYTES of lines (a plain file's size bounds it too; a compressed file's content size
    is unknown); a Parquet chunk is `records_per_chunk` rows (read across row groups), at the
    text column's bytes per row of the row group where they are most; an Arrow chunk is
    `records_per_chunk` rows of one record batch, sized so by the batch where it is most. A file
    whose metadata cannot be read: its size. A line or row much longer than its neighbours
    makes a chunk larger than this."""
    if file.kind == "text":
        return 0 if streamed(file) else file.size
    if file.kind == "jsonl":
        compressed = file.path.name.lower().endswith((".gz", ".zst"))
        return CHUNK_BYTES if compressed else min(file.size, CHUNK_BYTES)
    import pyarrow as pa
    try:
        if file.kind == "arrow":
            return max((size * min(n, records_per_chunk) // n
                        for n, size in _arrow_groups(file, text_field) if n), default=0)
        groups = [g for g in _parquet_groups(file, text_field) if g[0]]
    except (pa.ArrowException, OSError):
        return file.size
    rows = min(records_per_chunk, sum(n for n, _ in groups))
    return max((size * rows // n for n, size in groups), default=0)


def _parquet_groups(file: InputFile, text_field: str) -> Iterator[tuple[int, int]]:
    """(rows, uncompressed bytes of the text column, or of every column without one) per row
    group, from the footer."""
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(file.path).metadata
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        cols = [rg.column(c) for c in range(rg.num_columns)]
        named = [c for c in cols if c.path_in_schema.split(".")[0] == text_field]
        yield rg.num_rows, sum(c.total_uncompressed_size for c in named or cols)


def _arrow_groups(file: InputFile, text_field: str) -> Iterator[tuple[int, int]]:
    """(rows, bytes of the text column, or of the batch without one) per record batch (the
    batches of a memory-mapped IPC file or stream without compression are views of the map:
    only their headers are read)."""
    import pyarrow as pa
    source = pa.memory_map(str(file.path))
    try:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        batches = pa.ipc.open_stream(source)
    for b in batches:
        i = b.schema.get_field_index(text_field)
        yield b.num_rows, (b.column(i) if i >= 0 else b).nbytes


def chunk_texts(file: InputFile, chunk: Chunk, text_field: str) -> list[str]:
    """The texts of a chunk (worker side): JSONL lines parsed and their `text_field` read, a
    column's nulls refused. Raises ValueError naming the file and line / row."""
    if chunk.decoded:
        for i, t in zip(chunk.indices, chunk.payload):
            if t is None:
                raise ValueError(f"{where(file, i)}: {text_field!r} is null; it must be a "
                                 "string")
        texts = chunk.payload
    else:
        texts = [record_text(parse_jsonl_line(raw, where(file, i), text_field), text_field,
                             where(file, i)) for i, raw in zip(chunk.indices, chunk.payload)]
    for i, t in zip(chunk.indices, texts):
        check_encodable(t, where(file, i))
    return texts
