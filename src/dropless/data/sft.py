"""Supervised fine-tuning data: prompt / completion or chat records become examples (token ids and
which of them are the completion's), examples are packed whole into rows, and batch `i` is a pure
function of (examples, seed, i), as `data.batch.Batch`.

Legend: B rows, S sequence length (a row holds S + 1 token slots: inputs [:S], targets [1:]),
T tokens of one example, R packed rows.

Records (each a dict, with where it came from: "d.jsonl line 3"), one of two forms:
* {"prompt": str, "completion": str}: `prompt + completion` encoded once (special tokens as the
  tokenizer's post-processor adds them, as for pre-training text), followed by the EOS id unless
  it ends with it already; the completion's tokens are those overlapping its characters (a token
  across the boundary is the completion's) and the EOS.
* {"messages": [{"role": str, "content": str, ...}, ...]}: rendered with the tokenizer folder's
  chat template and encoded as transformers' `apply_chat_template` does; the assistant turns'
  tokens are the completion's (`data.chat_template` says how they are found). Nothing is appended:
  the template writes its own end-of-turn tokens.
Refused, naming the record: a record of neither form or of both, a field of the wrong type, an
empty completion or assistant turn, a message without role or content, a conversation without an
assistant turn, a message the template does not render (a role it does not know) or refuses
(`raise_exception`), and chat records with no chat template.

Packing keeps each example whole. "documents": examples, in an order drawn from the seed, go
each into the open row with the least room that still holds it (best fit; a new row when none
does), so a row holds several examples; "pad": one example per row. A row's examples get segment
ids 1, 2, ... and positions from 0 each; the rest of the row is padding (segment 0). A target
counts (loss mask 1) when it is in the same example as its input and, under
`completion_only`, is a completion token. An example longer than a row (S + 1 tokens) is refused,
naming it: nothing is truncated. Rows are shuffled per epoch: global row g = i * B + j of the run
is row perm_e[g mod R], e = g // R, perm_e seeded by (seed, e).

Size: examples are held in memory, up to MAX_TOKENS tokens in all (`read_examples` refuses more
and names `dropless data prepare`).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import zlib
from pathlib import Path
from typing import Iterable

import numpy as np

from dropless.data.batch import Batch
from dropless.data.chat_template import ChatTemplate, PrefixMismatch, assistant_spans, \
    read_chat_template, render, token_mask
from dropless.data.corpus import is_eval_document
from dropless.data.decoding import json_kind
from dropless.data import readers
from dropless.data.tokenizer import ByteTokenizer, make_tokenizer

MAX_TOKENS = 1 << 25    # 33.5 M tokens: ~170 MB of ids and masks
SFT_PACKINGS = ("documents", "pad")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    """One record's tokens; `completion_T` marks the completion's (assistant's) tokens."""
    where: str
    ids_T: np.ndarray           # int32
    completion_T: np.ndarray    # bool


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ExampleSet:
    """The examples of a source, in record order (compared by identity: packings are cached)."""
    examples: tuple[Example, ...]
    source: str

    @property
    def num_tokens(self) -> int:
        return sum(e.ids_T.size for e in self.examples)

    def fingerprint(self) -> dict:
        """Identifies the examples in a checkpoint (counts and a CRC32 of ids and masks)."""
        crc = 0
        for e in self.examples:
            crc = zlib.crc32(e.completion_T.astype(np.uint8).tobytes(),
                             zlib.crc32(e.ids_T.astype(np.int32).tobytes(), crc))
        return {"sft_examples": len(self.examples), "sft_tokens": self.num_tokens, "crc32": crc}


# ---- records -> examples ------------------------------------------------------------------------

def _string(where: str, record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: '{key}' must be a string, not {json_kind(value)}")
    return value


def _prompt_completion(where: str, record: dict, tok) -> Example:
    for key in ("prompt", "completion"):
        if key not in record:
            other = "completion" if key == "prompt" else "prompt"
            raise ValueError(f"{where}: has '{other}' but no '{key}' (an SFT record is "
                             "prompt / completion strings or a 'messages' list)")
    prompt, completion = _string(where, record, "prompt"), _string(where, record, "completion")
    if not completion.strip():
        raise ValueError(f"{where}: 'completion' is empty: nothing to learn from this record")
    text = prompt + completion
    ids_T, offsets_T2 = tok.encode_offsets(text)
    mask_T = token_mask(offsets_T2, [(len(prompt), len(text))])
    ids_T = np.asarray(ids_T, np.int32)
    if ids_T.size and ids_T[-1] == tok.eos_id:
        mask_T[-1] = True   # the post-processor's EOS (offsets (0, 0)) is the completion's too
    else:
        ids_T, mask_T = np.append(ids_T, np.int32(tok.eos_id)), np.append(mask_T, True)
    return Example(where=where, ids_T=ids_T.astype(np.int32), completion_T=mask_T)


def _checked_messages(where: str, messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} "
                         f"objects, not {json_kind(messages)}"
                         + (" (an empty list)" if isinstance(messages, list) else ""))
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message {i} must be an object with 'role' and 'content', "
                             f"not {json_kind(m)}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"{where}: message {i} has no '{key}'")
        if not isinstance(m["role"], str) or not m["role"]:
            raise ValueError(f"{where}: message {i}: 'role' must be a non-empty string, not "
                             + ("an empty one" if m["role"] == "" else json_kind(m["role"])))
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: message {i} ({m['role']}): 'content' must be a string, "
                             f"not {json_kind(m['content'])} (content parts are not read)")
        if m["role"] == "assistant" and not m["content"].strip():
            raise ValueError(f"{where}: message {i} (assistant) is empty: nothing to learn")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no 'assistant' message: nothing to learn from this record "
                         f"(roles: {', '.join(m['role'] for m in messages)})")
    return messages


def _render_checked(where: str, tpl: ChatTemplate, messages: list[dict]):
    """The rendered text and assistant spans; ValueError naming the record for what the template
    refuses, cannot render, or leaves out (a role it does not know)."""
    import jinja2
    try:
        text, spans = assistant_spans(tpl, messages)
    except PrefixMismatch as e:
        raise ValueError(f"{where}: {e}") from None
    except jinja2.TemplateError as e:
        raise ValueError(f"{where}: the chat template of {tpl.source} refuses this "
                         f"conversation: {e}") from None
    except (TypeError, AttributeError, KeyError) as e:   # what a template's own code can raise
        raise ValueError(f"{where}: the chat template of {tpl.source} cannot render this "
                         f"conversation ({type(e).__name__}: {e})") from None
    for i, m in enumerate(messages, 1):
        if _renders_without(tpl, messages, i - 1) == text:
            raise ValueError(f"{where}: message {i} (role {m['role']!r}) is not rendered by "
                             f"the chat template of {tpl.source}: a role it does not know")
    return text, spans


def _renders_without(tpl: ChatTemplate, messages: list[dict], k: int) -> str | None:
    """The conversation rendered without message k; None when the template refuses that (the
    message mattered to it, e.g. roles must alternate)."""
    try:
        return render(tpl, messages[:k] + messages[k + 1:])[0]
    except Exception:  # noqa: BLE001 - any refusal means the message was read
        return None


def _chat(where: str, record: dict, tok, tpl: ChatTemplate | None) -> Example:
    messages = _checked_messages(where, record["messages"])
    if tpl is None:
        raise ValueError(f"{where}: chat 'messages' need a chat template, and tokenizer "
                         f"{tok.name} has none (tokenizer_config.json's chat_template or a "
                         "chat_template.jinja beside tokenizer.json); use a model folder's "
                         "tokenizer that has one, or prompt / completion records")
    text, spans = _render_checked(where, tpl, messages)
    ids_T, offsets_T2 = tok.encode_offsets(text, add_special_tokens=False)
    return Example(where=where, ids_T=np.asarray(ids_T, np.int32),
                   completion_T=token_mask(offsets_T2, spans))


def example_from_record(where: str, record, *, tok, template: ChatTemplate | None) -> Example:
    """One SFT record (module doc) as an Example; `tok` a data.tokenizer tokenizer, `template`
    the chat template of its folder (None: chat records are refused). Raises ValueError
    starting with `where` for every refused record (module doc)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: an SFT record must be an object, not {json_kind(record)}")
    if "messages" in record:
        both = [k for k in ("prompt", "completion") if k in record]
        if both:
            raise ValueError(f"{where}: has both 'messages' and '{both[0]}': give one form "
                             "(chat messages, or prompt / completion)")
        ex = _chat(where, record, tok, template)
    elif "prompt" in record or "completion" in record:
        ex = _prompt_completion(where, record, tok)
    else:
        raise ValueError(f"{where}: an SFT record needs 'prompt' and 'completion' strings or a "
                         f"'messages' list; it has {sorted(record) or 'no keys'}")
    if not ex.completion_T.any():
        raise ValueError(f"{where}: no token of the completion survives tokenizing")
    return ex


def template_for(tok) -> ChatTemplate | None:
    """The chat template of the folder `tok` (a data.tokenizer tokenizer) was read from: its
    tokenizer.json's folder (`chat_template.read_chat_template`); None for byte tokens."""
    if isinstance(tok, ByteTokenizer):
        return None
    return read_chat_template(Path(tok.name).parent)


def read_examples(records: Iterable[tuple[str, dict]], *, tok, template: ChatTemplate | None,
                  source: str, max_tokens: int = MAX_TOKENS) -> ExampleSet:
    """Every (where, record) pair as an Example (`example_from_record`), in order. Raises
    ValueError for the first bad record, when the tokens pass `max_tokens` (naming the record
    and `dropless data prepare`), and when there is no record."""
    out, total = [], 0
    for where, record in records:
        ex = example_from_record(where, record, tok=tok, template=template)
        total += ex.ids_T.size
        if total > max_tokens:
            raise ValueError(f"{where}: the SFT data passes {max_tokens:,} tokens here, the most "
                             "held in memory; prepare larger data with `dropless data prepare` "
                             "and train on the prepared dataset")
        out.append(ex)
    if not out:
        raise ValueError(f"{source}: holds no SFT records")
    return ExampleSet(examples=tuple(out), source=source)


def split_examples(data: ExampleSet, eval_fraction: float) -> tuple[ExampleSet, ExampleSet]:
    """Train and held-out examples, each held out by the CRC32 of where it came from
    (`corpus.is_eval_document`): stable, whatever the order of the records."""
    held = [is_eval_document(e.where, eval_fraction) for e in data.examples]
    pick = lambda want: tuple(e for e, h in zip(data.examples, held) if h == want)  # noqa: E731
    return (ExampleSet(examples=pick(False), source=data.source),
            ExampleSet(examples=pick(True), source=data.source))


# ---- examples -> rows -> batches ----------------------------------------------------------------

def _check_fits(data: ExampleSet, seq_len: int) -> None:
    for e in data.examples:
        if e.ids_T.size > seq_len + 1:
            raise ValueError(f"{e.where}: the example is {e.ids_T.size} tokens, longer than a "
                             f"row of seq_len + 1 = {seq_len + 1}; examples are never cut: raise "
                             "seq_len or shorten the record")


@functools.lru_cache(maxsize=8)
def pack_rows(data: ExampleSet, seq_len: int, seed: int, packing: str = "documents"
              ) -> tuple[tuple[int, ...], ...]:
    """The example indices of each row (module doc: best fit in a seeded order, or one per row).
    Raises ValueError for a packing SFT does not use and an example longer than a row."""
    if packing not in SFT_PACKINGS:
        raise ValueError(f"packing={packing!r} joins documents across rows; SFT keeps each "
                         f"example whole: use packing={' or '.join(SFT_PACKINGS)}")
    if not data.examples:
        raise ValueError(f"{data.source}: no SFT examples to pack")
    _check_fits(data, seq_len)
    order = np.random.default_rng([seed, len(data.examples)]).permutation(len(data.examples))
    if packing == "pad":
        return tuple((int(i),) for i in order)
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []   # (room, row), sorted: best fit = first room >= T
    for i in order:
        need = int(data.examples[i].ids_T.size)
        at = bisect.bisect_left(open_rows, (need, -1))
        if at < len(open_rows):
            room, row = open_rows.pop(at)
        else:
            room, row = seq_len + 1, len(rows)
            rows.append([])
        rows[row].append(int(i))
        if room - need > 0:
            bisect.insort(open_rows, (room - need, row))
    return tuple(tuple(r) for r in rows)


def _row(data: ExampleSet, members: tuple[int, ...], seq_len: int):
    """One row's S + 1 slots: token ids, segment ids, positions, completion flags."""
    tok = np.zeros(seq_len + 1, np.int32)
    seg = np.zeros(seq_len + 1, np.int32)
    pos = np.zeros(seq_len + 1, np.int32)
    comp = np.zeros(seq_len + 1, bool)
    at = 0
    for s, i in enumerate(members, 1):
        e = data.examples[i]
        n = e.ids_T.size
        tok[at:at + n], seg[at:at + n] = e.ids_T, s
        pos[at:at + n], comp[at:at + n] = np.arange(n), e.completion_T
        at += n
    return tok, seg, pos, comp


@functools.lru_cache(maxsize=4)
def _row_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


class Addressing:
    """The run's SFT rows addressed by global sample number g (module doc: row perm_e[g mod R]),
    as `data.loader.Addressing` addresses pre-training rows; `n` rows an epoch. Raises
    ValueError for what `pack_rows` raises."""

    def __init__(self, data: ExampleSet, *, seq_len: int, seed: int, packing: str = "documents",
                 completion_only: bool = True, shuffle: bool = True):
        self.data, self.s, self.seed = data, seq_len, seed
        self.completion_only, self.shuffle = completion_only, shuffle
        self.packed = pack_rows(data, seq_len, seed, packing)
        self.n = len(self.packed)

    def rows(self, samples) -> Batch:
        """The rows of these sample numbers, as a Batch [len(samples), S]."""
        slots = []
        for g in samples:
            epoch, at = divmod(g, self.n)
            r = int(_row_order(self.n, self.seed, epoch)[at]) if self.shuffle else at
            slots.append(_row(self.data, self.packed[r], self.s))
        tok, seg, pos, comp = (np.stack(a) for a in zip(*slots))
        counts = (seg[:, :-1] != 0) & (seg[:, :-1] == seg[:, 1:])
        if self.completion_only:
            counts &= comp[:, 1:]
        return Batch(tokens_BS=tok[:, :-1], targets_BS=tok[:, 1:], segment_ids_BS=seg[:, :-1],
                     positions_BS=pos[:, :-1], loss_mask_BS=counts.astype(np.float32))


def sft_batch_at(data: ExampleSet, index: int, *, batch_size: int, seq_len: int, seed: int,
                 completion_only: bool = True, packing: str = "documents", shuffle: bool = True,
                 rows: tuple[int, int] | None = None) -> Batch:
    """Batch `index` of the run (module doc) as a Batch of [B, S] arrays; `rows` = (start,
    stop): only those rows of the batch (a process's share), the same as slicing the whole one.
    Raises ValueError for index < 0 and what `pack_rows` raises."""
    if index < 0:
        raise ValueError(f"batch index={index} must be >= 0")
    addr = Addressing(data, seq_len=seq_len, seed=seed, packing=packing,
                      completion_only=completion_only, shuffle=shuffle)
    start, stop = rows if rows is not None else (0, batch_size)
    return addr.rows(range(index * batch_size + start, index * batch_size + stop))


def num_rows(data: ExampleSet, *, seq_len: int, seed: int, packing: str = "documents") -> int:
    """Rows one epoch of the examples fills (`pack_rows`)."""
    return len(pack_rows(data, seq_len, seed, packing))


# ---- a training source ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SftCorpus:
    """A run's SFT data (TrainConfig.sft): train and held-out examples of one source."""
    train: ExampleSet
    eval: ExampleSet
    vocab_size: int
    source: str
    notes: tuple[str, ...] = ()

    def fingerprint(self) -> dict:
        """Identifies the examples in a checkpoint, so a resume on other data is refused."""
        return {"sft": {"train": self.train.fingerprint(), "eval": self.eval.fingerprint()}}

    def describe(self) -> str:
        return (f"{len(self.train.examples):,} train / {len(self.eval.examples):,} eval SFT "
                f"examples, {self.train.num_tokens:,} / {self.eval.num_tokens:,} tokens")


def load_sft(source: str, *, tokenizer: str, eval_fraction: float, seq_len: int, seed: int,
             packing: str) -> SftCorpus:
    """The SFT records of `source` (any `data.readers` source: JSONL, Parquet, Arrow), read as
    examples with `tokenizer` (and its folder's chat template), held out by `split_examples`
    and packed once here, so a bad record or an example longer than a row is refused before
    anything compiles. The held-out split gets the first example when it would be empty."""
    tok = make_tokenizer(tokenizer)
    files = readers.input_files(source)
    data = read_examples(((readers.where(f, i), r) for f in files for i, r in readers.records(f)),
                         tok=tok, template=template_for(tok), source=source)
    train, held = split_examples(data, eval_fraction)
    if not held.examples:
        held = ExampleSet(examples=data.examples[:1], source=source)
    if not train.examples:
        raise ValueError(f"data={source!r}: every SFT record is held out for eval; add records "
                         "or lower eval_fraction")
    for part in (train, held):
        pack_rows(part, seq_len, seed, packing)
    return SftCorpus(train=train, eval=held, vocab_size=tok.vocab_size, source=source)
