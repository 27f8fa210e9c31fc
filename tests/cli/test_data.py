"""`dropless data prepare` at the command line: an hf:DIR tokenizer resolved to its
tokenizer.json and recorded as given, --text-field, --no-add-eos, the JSON summary line."""
import json

from dropless import cli
from dropless.data import manifest as mf
from tests._support.tokenizer_folders import FOLDERS, write_folder


def test_prepare_with_an_hf_folder(tmp_path, capsys, monkeypatch):
    folder = write_folder(tmp_path / "llama", *FOLDERS["llama"])
    (tmp_path / "d.jsonl").write_text("".join(
        json.dumps({"body": f"The quick brown fox {i}"}) + "\n" for i in range(40)))
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["data", "prepare", "d.jsonl", "out", "--tokenizer", f"hf:{folder}",
                   "--text-field", "body", "--workers", "0", "--no-add-eos",
                   "--eval-fraction", "0.1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    m = mf.read_manifest(tmp_path / "out")
    assert summary["num_tokens"] == m.num_tokens and summary["dtype"] == "uint16"
    assert m.tokenizer.kind == "hf" and m.tokenizer.source == f"hf:{folder}"
    assert m.tokenizer.sha256 == mf.file_sha256(folder / "tokenizer.json")
    assert (m.add_bos, m.add_eos, m.bos_id, m.eos_id) == (True, False, 1, 2)
    assert m.num_documents["train"] + m.num_documents["eval"] == 40
    toks, ends = mf.open_shard(tmp_path / "out", m, m.splits["train"][0])
    assert toks[0] == 1 and toks[ends[0] - 1] != 2     # BOS first, no EOS


def test_sources_then_out_are_required(capsys):
    assert cli.main(["data", "prepare", "only.jsonl", "--tokenizer", "byte"]) == 2
    assert "SRC... OUT" in capsys.readouterr().err
