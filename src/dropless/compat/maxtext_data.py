"""MaxText's data flags translated to ours (compat/maxtext.py's docstring says what each
means; `DATA_TRANSLATORS` is its table of them): dropless reads local files, so a flag that
names a download, a glob or a format only `dropless data prepare` reads is refused with the
command that prepares it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dropless.compat.maxtext_values import Given, Pairs, Translator, read_bool, read_int

DATASET_TYPES = ("hf", "grain")   # both read local files here; tfds, c4_mlperf, synthetic: no
PREPARE = "prepare them once (dropless data prepare FILES... OUT --tokenizer hf:DIR|byte), then"


def _dataset_type(name: str, v: Any, given: Given) -> Pairs:
    if v not in DATASET_TYPES:
        raise ValueError(f"MaxText dataset_type={v!r} is not supported: dropless reads local "
                         "files (dataset_type=hf with hf_train_files, or grain with "
                         f"grain_train_files) and prepared datasets; {PREPARE} data=OUT")
    return []


def _hf_path(name: str, v: Any, given: Given) -> Pairs:
    """A local folder is the data (joined with hf_data_dir); a hub name would be a download."""
    path = Path(str(v)) / str(given.seen.get("hf_data_dir", ""))
    if not Path(str(v)).exists():
        raise ValueError(f"MaxText hf_path={v!r} is not a local folder, and dropless downloads "
                         "nothing from the Hugging Face hub: download the dataset's files "
                         f"(huggingface-cli download --repo-type dataset {v}), {PREPARE} "
                         "data=OUT")
    if "hf_train_files" in given.seen:
        return []   # the files name the data
    return [("data", str(path))]


def _hf_data_dir(name: str, v: Any, given: Given) -> Pairs:
    if "hf_path" not in given.seen:
        raise ValueError(f"MaxText hf_data_dir={v!r} needs hf_path (the folder it is inside)")
    return []   # read by hf_path


def _data_files(key: str) -> Translator:
    """hf_train_files / grain_train_files / hf_eval_files -> data or eval_data: one file or
    folder dropless trains on (a prepared dataset, text, JSONL, .npy/.bin). A glob or a list of
    several files (Parquet, ArrayRecord...) is prepared first."""
    def translate(name: str, v: Any, given: Given) -> Pairs:
        text = str(v)
        if isinstance(v, (list, tuple)) or any(c in text for c in "*?[,"):
            raise ValueError(f"MaxText {name}={v!r} names several files; dropless trains on "
                             f"one file or a prepared folder: {PREPARE} {key}=OUT")
        if Path(text).suffix in (".parquet", ".arrow", ".array_record", ".tfrecord"):
            raise ValueError(f"MaxText {name}={v!r}: a {Path(text).suffix} file is read by "
                             f"`dropless data prepare` only; {PREPARE} {key}=OUT")
        return [(key, text)]
    return translate


def _train_split(name: str, v: Any, given: Given) -> Pairs:
    if v != "train":
        raise ValueError(f"MaxText train_split={v!r} is not supported: dropless trains on the "
                         "'train' split of a prepared dataset (or on the whole of hf_train_files)"
                         "; prepare the split you want as its own dataset")
    return []


def _eval_split(name: str, v: Any, given: Given) -> Pairs:
    given.notes.append(f"eval_split={v} reads the held-out split dropless has: a prepared "
                       "dataset's 'eval' split, else eval_fraction of the data (or "
                       "hf_eval_files)")
    return []


def _packing(name: str, v: Any, given: Given) -> Pairs:
    return [("packing", "documents" if read_bool(name, v) else "pad")]


def _add_bos(name: str, v: Any, given: Given) -> Pairs:
    read_bool(name, v)
    given.notes.append(f"add_bos={v}: a BOS is added as the tokenizer's own post-processor says "
                       "(a prepared dataset's manifest records it); the flag changes nothing")
    return []


def _add_eos(name: str, v: Any, given: Given) -> Pairs:
    if not read_bool(name, v):
        raise ValueError("MaxText add_eos=false is not supported: dropless ends every document "
                         "with EOS (the tokenizer's) when it tokenizes text")
    return []


def _tokenizer_path(name: str, v: Any, given: Given) -> Pairs:
    """A folder holding tokenizer.json -> that file (MaxText names folders)."""
    p = Path(str(v))
    return [("tokenizer", str(p / "tokenizer.json") if (p / "tokenizer.json").is_file()
             else str(v))]


def _grain_worker_count(name: str, v: Any, given: Given) -> Pairs:
    read_int(name, v)
    given.notes.append(f"grain_worker_count={v} changes nothing: dropless builds batches on one "
                       "background thread, `prefetch` batches ahead (docs/data.md)")
    return []


# the data flags -> their translator (compat/maxtext.py adds them to SPECIAL_TRANSLATORS)
DATA_TRANSLATORS: dict[str, Translator] = {
    "dataset_type": _dataset_type, "hf_path": _hf_path, "hf_data_dir": _hf_data_dir,
    "hf_train_files": _data_files("data"), "grain_train_files": _data_files("data"),
    "hf_eval_files": _data_files("eval_data"), "train_split": _train_split,
    "eval_split": _eval_split, "packing": _packing, "add_bos": _add_bos, "add_eos": _add_eos,
    "tokenizer_path": _tokenizer_path, "grain_worker_count": _grain_worker_count,
}
