"""Fault rows: SFT records that are wrong (`dropless train data=d.jsonl sft=true`), refused in one
line naming the file and line before anything is compiled, leaving the data as it was.

`CASES` is the table: (id, the bad JSONL line, words the error must hold, whether the tokenizer
has a chat template). tests/data/test_sft.py runs every case through `data.sft` directly, with
the record at "d.jsonl line 2"; `ROWS` runs them through the CLI once the trainer reads SFT data
(`dropless.data.loader`, the loader's module, exists), with a good record on line 1.
"""
import importlib.util
import json
from pathlib import Path

from tests._support.fault import Fault
from tests._support.tokenizer_folders import write_folder

# a ChatML template: any role renders except "bot", which it skips (a role it does not know)
CHATML = ("{% for m in messages %}{% if m.role != 'bot' %}<|im_start|>{{ m.role }}\n"
          "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ALTERNATE = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
             "{{ m.role }}: {{ m.content }}\n{% endfor %}")
USER = {"role": "user", "content": "Hi"}
ASSISTANT = {"role": "assistant", "content": "Hello."}
GOOD = {"prompt": "Q: 2 + 2?\nA: ", "completion": "4"}


def _line(record) -> str:
    return record if isinstance(record, str) else json.dumps(record)


# (id, record on line 2, words, chat template of the tokenizer folder: None, CHATML, ALTERNATE)
CASES = [
    ("sft-no-fields", {"text": "plain"}, ("'prompt'", "'completion'", "'messages'", "text"),
     None),
    ("sft-prompt-only", {"prompt": "Q"}, ("'prompt'", "no 'completion'"), None),
    ("sft-completion-not-string", {"prompt": "Q", "completion": 4},
     ("'completion'", "string", "int"), None),
    ("sft-prompt-null", {"prompt": None, "completion": "A"}, ("'prompt'", "string", "null"),
     None),
    ("sft-empty-completion", {"prompt": "Q", "completion": "  "},
     ("'completion'", "empty"), None),
    ("sft-both-forms", {"prompt": "Q", "completion": "A", "messages": [USER, ASSISTANT]},
     ("both", "'messages'", "'prompt'"), CHATML),
    ("sft-record-is-list", [GOOD], ("object", "list"), None),
    ("sft-messages-not-list", {"messages": "Hi"}, ("'messages'", "list", "string"), CHATML),
    ("sft-messages-empty", {"messages": []}, ("'messages'", "empty"), CHATML),
    ("sft-message-not-object", {"messages": [USER, "Hello."]},
     ("message 2", "object", "string"), CHATML),
    ("sft-message-no-role", {"messages": [{"content": "Hi"}, ASSISTANT]},
     ("message 1", "no 'role'"), CHATML),
    ("sft-message-no-content", {"messages": [USER, {"role": "assistant"}]},
     ("message 2", "no 'content'"), CHATML),
    ("sft-role-not-string", {"messages": [{"role": 1, "content": "Hi"}, ASSISTANT]},
     ("message 1", "'role'", "string", "int"), CHATML),
    ("sft-role-empty", {"messages": [{"role": "", "content": "Hi"}, ASSISTANT]},
     ("message 1", "'role'", "empty"), CHATML),
    ("sft-content-parts", {"messages": [{"role": "user", "content": [{"text": "Hi"}]},
                                        ASSISTANT]},
     ("message 1", "'content'", "string", "list"), CHATML),
    ("sft-empty-assistant", {"messages": [USER, {"role": "assistant", "content": ""}]},
     ("message 2", "assistant", "empty"), CHATML),
    ("sft-no-assistant", {"messages": [USER]}, ("no 'assistant'", "user"), CHATML),
    ("sft-unknown-role", {"messages": [{"role": "bot", "content": "Hey"}, USER, ASSISTANT]},
     ("message 1", "'bot'", "not rendered", "chat template"), CHATML),
    ("sft-template-refuses", {"messages": [USER, USER, ASSISTANT]},
     ("chat template", "refuses", "roles must alternate"), ALTERNATE),
    ("sft-chat-without-template", {"messages": [USER, ASSISTANT]},
     ("chat template", "has none", "prompt / completion"), None),
]


def write_tokenizer(case: Path, template: str | None) -> Path:
    """A tokenizer folder under case/tok (tests/_support/tokenizer_folders' 120-token one) whose
    tokenizer_config.json holds `template` (None: no chat template)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    return write_folder(case / "tok", config, None, None) / "tokenizer.json"


def case_setup(record, template):
    def setup(case: Path, _artifacts) -> None:
        write_tokenizer(case, template)
        (case / "d.jsonl").write_text(json.dumps(GOOD) + "\n" + _line(record) + "\n")
    return setup


TRAIN = ["train", "steps=1", "time_kernels=false", "eval_every=1", "run_dir=runs",
         "run_name=r", "data=d.jsonl", "sft=true", "tokenizer=tok/tokenizer.json", "seq_len=64"]

# records no dict can hold, as they are written on line 2 (not in CASES, which are dicts)
RAW_CASES = [
    ("sft-key-twice", '{"messages": [{"role": "user", "content": "Hi", "content": "Hey"}, '
                      '{"role": "assistant", "content": "Hello."}]}',
     ("key 'content' appears twice",), CHATML),
]

ROWS = [Fault(id_, TRAIN, rc=2, words=("d.jsonl", "line 2") + words,
              setup=case_setup(record, template), unchanged=("d.jsonl",), in_process=True,
              timeout=300)
        for id_, record, words, template in CASES + RAW_CASES] \
    if importlib.util.find_spec("dropless.data.loader") is not None else []
