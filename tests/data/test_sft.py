"""data/sft.py: records -> examples (hand-worked ids and completion masks), the refusals of
tests/_support/faults_sft.py's table, and packed batches against a per-example reference."""
import json
from pathlib import Path

import numpy as np
import pytest

from dropless.data import sft
from dropless.data.chat_template import ChatTemplate, read_chat_template
from dropless.data.tokenizer import ByteTokenizer, HFTokenizer
from tests._support import faults_sft
from tests._support.tokenizer_folders import FOLDERS, write_folder

BYTE = ByteTokenizer()
CHAT = Path(__file__).parents[1] / "fixtures" / "chat"


def _pc(prompt, completion, where="r"):
    return sft.example_from_record(where, {"prompt": prompt, "completion": completion},
                                   tok=BYTE, template=None)


def test_prompt_completion_bytes_hand_worked():
    ex = _pc("ab", "cé")
    # bytes a b c é(2) then EOS 0; the completion is c, both bytes of é and the EOS
    assert ex.ids_T.tolist() == [97, 98, 99, 0xC3, 0xA9, 0]
    assert ex.completion_T.tolist() == [False, False, True, True, True, True]
    assert _pc("", "x").completion_T.tolist() == [True, True]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {n: HFTokenizer(write_folder(root / n, *FOLDERS[n]) / "tokenizer.json")
            for n in ("llama", "llama_eos")}


def test_prompt_completion_special_tokens(folders):
    tok = folders["llama"]     # adds BOS: not the completion's; EOS appended: the completion's
    ex = sft.example_from_record("r", {"prompt": "The quick", "completion": " brown fox"},
                                 tok=tok, template=None)
    whole = tok.encode("The quick brown fox").tolist()
    assert ex.ids_T.tolist() == whole + [tok.eos_id]
    assert ex.ids_T[0] == tok.bos_id and not ex.completion_T[0] and ex.completion_T[-1]
    prompt_tokens = len(tok.encode("The quick"))
    assert not ex.completion_T[:prompt_tokens].any() and ex.completion_T[prompt_tokens:].all()
    tok = folders["llama_eos"]  # the post-processor's EOS: kept once, and counted
    ex = sft.example_from_record("r", {"prompt": "The quick", "completion": " brown fox"},
                                 tok=tok, template=None)
    assert ex.ids_T.tolist() == tok.encode("The quick brown fox").tolist()
    assert (ex.ids_T == tok.eos_id).sum() == 1 and ex.completion_T[-1]


def test_chat_record_uses_the_folder_template():
    d = CHAT / "deepseek_r1_distill"
    tok, tpl = HFTokenizer(d / "tokenizer.json"), read_chat_template(d)
    ref = json.loads((CHAT / "reference.json").read_text(encoding="utf-8"))["5.25.0"]
    case = ref["deepseek_r1_distill"][1]
    assert sft.template_for(tok) == tpl and sft.template_for(BYTE) is None
    data = sft.read_examples([("d.jsonl line 1", {"messages": case["messages"]})], tok=tok,
                             template=tpl, source="d.jsonl")
    assert data.examples[0].ids_T.tolist() == case["ids"]
    assert data.examples[0].completion_T.astype(int).tolist() == case["mask"]


TEMPLATES = {None: None, faults_sft.CHATML: "chatml", faults_sft.ALTERNATE: "alternate"}


@pytest.mark.parametrize("case", faults_sft.CASES, ids=[c[0] for c in faults_sft.CASES])
def test_bad_records_refused_in_one_line(case):
    _, record, words, template = case
    tpl = None if template is None else ChatTemplate(text=template, source="tok/tokenizer_config"
                                                     ".json", special=())
    good = json.loads(json.dumps(faults_sft.GOOD))
    with pytest.raises(ValueError) as e:
        sft.read_examples([("d.jsonl line 1", good), ("d.jsonl line 2", record)], tok=BYTE,
                          template=tpl, source="d.jsonl")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("d.jsonl line 2: "), msg
    missing = [w for w in words if w.lower() not in msg.lower()]
    assert not missing, (missing, msg)


def test_good_chat_records_pass_the_fault_templates():
    # ALTERNATE has no generation prompt, so the assistant's header is the turn's own text
    for text, want in ((faults_sft.CHATML, "Hello.<|im_end|>\n"),
                       (faults_sft.ALTERNATE, "assistant: Hello.\n")):
        tpl = ChatTemplate(text=text, source="t", special=())
        ex = sft.example_from_record("r", {"messages": [faults_sft.USER, faults_sft.ASSISTANT]},
                                     tok=BYTE, template=tpl)
        assert bytes(ex.ids_T[ex.completion_T].astype(np.uint8)).decode() == want


def test_size_limit_names_the_record_and_prepare():
    records = [(f"d.jsonl line {i}", {"prompt": "p" * 10, "completion": "c"}) for i in range(5)]
    with pytest.raises(ValueError, match="d.jsonl line 2: .*30 tokens.*dropless data prepare"):
        sft.read_examples(records, tok=BYTE, template=None, source="d.jsonl", max_tokens=30)
    with pytest.raises(ValueError, match="holds no SFT records"):
        sft.read_examples([], tok=BYTE, template=None, source="d.jsonl")


# ---- packing and batches ------------------------------------------------------------------------

def _set(lengths, seed=0):
    """Byte examples of the given token lengths (prompt of n - 2 bytes, completion 1 byte, EOS)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        p = "".join(chr(97 + int(c)) for c in rng.integers(0, 26, n - 2))
        out.append(_pc(p, "Z", where=f"d.jsonl line {i + 1}"))
    return sft.ExampleSet(examples=tuple(out), source="d.jsonl")


def _reference_row(data, members, seq_len, completion_only):
    """One row built example by example: inputs, targets, segments, positions, loss mask."""
    tok, tgt = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32)
    seg, pos, loss = (np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32),
                      np.zeros(seq_len, np.float32))
    at = 0
    for s, i in enumerate(members, 1):
        e = data.examples[i]
        for t in range(e.ids_T.size):
            if at + t < seq_len:
                tok[at + t], seg[at + t], pos[at + t] = e.ids_T[t], s, t
            if 0 < at + t <= seq_len:
                tgt[at + t - 1] = e.ids_T[t]
            if t + 1 < e.ids_T.size and at + t < seq_len:
                loss[at + t] = 1.0 if (e.completion_T[t + 1] or not completion_only) else 0.0
        at += e.ids_T.size
    return tok, tgt, seg, pos, loss


def _reference_best_fit(data, seq_len, order):
    rows, room = [], []
    for i in order:
        need = data.examples[i].ids_T.size
        fits = [(room[r], r) for r in range(len(rows)) if room[r] >= need]
        r = min(fits)[1] if fits else len(rows)
        if not fits:
            rows.append([])
            room.append(seq_len + 1)
        rows[r].append(int(i))
        room[r] -= need
    return [tuple(r) for r in rows]


LENGTHS = [5, 9, 3, 17, 12, 4, 8, 6, 2, 11, 7, 16, 3, 10]


@pytest.mark.parametrize("completion_only", [True, False])
def test_batches_equal_the_per_example_reference(completion_only):
    data, seq_len, bs = _set(LENGTHS), 16, 3
    packed = sft.pack_rows(data, seq_len, 7)
    for index in range(6):    # past one epoch (len(packed) rows), so a second order is used
        b = sft.sft_batch_at(data, index, batch_size=bs, seq_len=seq_len, seed=7,
                             completion_only=completion_only)
        for j in range(bs):
            epoch, at = divmod(index * bs + j, len(packed))
            r = np.random.default_rng([7, epoch]).permutation(len(packed))[at]
            want = _reference_row(data, packed[r], seq_len, completion_only)
            for got, w in zip(b, want):
                np.testing.assert_array_equal(got[j], w)


def test_best_fit_hand_worked_and_against_reference():
    # order [0, 1, 2, 3] (seed picked so), capacity 17: 10 -> new row 0 (room 7); 8 -> new
    # row 1 (room 9); 6 -> row 0 (room 7 is the least that holds 6; room 1); 9 -> row 1 (room 0)
    data = _set([10, 8, 6, 9])
    seed = next(s for s in range(100)
                if np.random.default_rng([s, 4]).permutation(4).tolist() == [0, 1, 2, 3])
    assert sft.pack_rows(data, 16, seed) == ((0, 2), (1, 3))
    data = _set(LENGTHS * 5)
    for seed in range(3):
        order = np.random.default_rng([seed, len(data.examples)]).permutation(
            len(data.examples))
        got = sft.pack_rows(data, 24, seed)
        assert list(got) == _reference_best_fit(data, 24, order)
        assert sorted(i for r in got for i in r) == list(range(len(data.examples)))
        assert all(sum(data.examples[i].ids_T.size for i in r) <= 25 for r in got)


def test_pad_packing_is_one_example_per_row():
    data = _set(LENGTHS)
    rows = sft.pack_rows(data, 16, 0, "pad")
    assert sorted(r[0] for r in rows) == list(range(len(LENGTHS))) and {len(r) for r in rows} == {1}
    b = sft.sft_batch_at(data, 0, batch_size=4, seq_len=16, seed=0, packing="pad")
    assert b.segment_ids_BS.max() == 1


def test_deterministic_and_process_rows_equal_slices():
    data = _set(LENGTHS)
    kw = dict(batch_size=4, seq_len=16, seed=3)
    a, b = sft.sft_batch_at(data, 5, **kw), sft.sft_batch_at(data, 5, **kw)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    part = sft.sft_batch_at(data, 5, rows=(1, 3), **kw)
    for x, y in zip(a, part):
        np.testing.assert_array_equal(x[1:3], y)
    other = sft.sft_batch_at(data, 5, **dict(kw, seed=4))
    assert not np.array_equal(a.tokens_BS, other.tokens_BS)
    assert a.tokens_BS.dtype == np.int32 and a.loss_mask_BS.dtype == np.float32


def test_refusals():
    data = _set([5, 20])
    with pytest.raises(ValueError, match="d.jsonl line 2: the example is 20 tokens.*seq_len "
                                         r"\+ 1 = 17.*never cut"):
        sft.pack_rows(data, 16, 0)
    with pytest.raises(ValueError, match="packing='stream'.*documents or pad"):
        sft.pack_rows(data, 32, 0, "stream")
    with pytest.raises(ValueError, match="index=-1"):
        sft.sft_batch_at(data, -1, batch_size=1, seq_len=32, seed=0)


def test_split_and_fingerprint():
    data = _set(LENGTHS * 10)
    train, held = sft.split_examples(data, 0.2)
    assert len(train.examples) + len(held.examples) == len(data.examples)
    assert 0 < len(held.examples) < len(data.examples) // 2
    rev = sft.ExampleSet(examples=data.examples[::-1], source="d.jsonl")
    assert {e.where for e in sft.split_examples(rev, 0.2)[1].examples} == \
        {e.where for e in held.examples}
    e0 = data.examples[0]
    flipped = sft.Example(where=e0.where, ids_T=e0.ids_T, completion_T=~e0.completion_T)
    changed = sft.ExampleSet(examples=(flipped,) + data.examples[1:], source="d.jsonl")
    assert changed.fingerprint() != data.fingerprint()
    assert data.fingerprint()["sft_tokens"] == sum(LENGTHS) * 10


@pytest.mark.parametrize("case", faults_sft.CASES, ids=[c[0] for c in faults_sft.CASES])
def test_fault_row_inputs_are_refused_by_the_library(case, tmp_path):
    """What each CLI row of faults_sft writes (a tokenizer folder, d.jsonl with a good line 1),
    read as the trainer will: the folder's tokenizer and template, the file's lines."""
    id_, record, words, template = case
    faults_sft.case_setup(record, template)(tmp_path, None)
    tok = HFTokenizer(tmp_path / "tok" / "tokenizer.json")
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    records = [(f"d.jsonl line {i}", json.loads(line)) for i, line in enumerate(lines, 1)]
    with pytest.raises(ValueError) as e:
        sft.read_examples(records, tok=tok, template=sft.template_for(tok), source="d.jsonl")
    msg = str(e.value)
    assert msg.startswith("d.jsonl line 2: ") and all(w.lower() in msg.lower() for w in words), msg
