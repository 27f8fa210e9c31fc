"""Chat templates: a model folder's Jinja chat template, rendered as transformers renders it, and
the characters of each assistant turn (what SFT learns).

Legend: T tokens of one rendered conversation.

Where the template comes from (as transformers' `from_pretrained` reads a folder): the folder's
`chat_template.jinja` if there is one, else `tokenizer_config.json`'s `chat_template` (a string,
or a list of {"name", "template"} of which "default" is used). The template sees `messages`,
`add_generation_prompt`, `tools` and `documents` (None), and the folder's special tokens as strings
(`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`, as
`tokenizer_config.json` names them; an absent or null one is left undefined), as transformers'
`apply_chat_template` passes its `special_tokens_map`.

The environment is transformers' (`utils/chat_template_utils._cached_compile_jinja_template`,
transformers 5.24 and 5.25): jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` block tag; `tojson` that
does not escape HTML (json.dumps, ensure_ascii off); `raise_exception(msg)` raising
`jinja2.TemplateError`; `strftime_now(fmt)` (the clock now: a template that reads it renders
differently on another day); `dict` and a `namespace` that refuses names starting with "_".
Messages go in with their None-valued keys dropped and `reasoning_content` filled from `thinking`
/ `reasoning` (as transformers 5 does). A rendered chat is encoded with the tokenizer as it is,
without the post-processor's special tokens (the template writes BOS itself), as transformers does.

Which characters are the assistant's (`assistant_spans`), one of two exact methods:
* the template marks them with `{% generation %}...{% endgeneration %}`: those blocks' characters,
  as transformers' `return_assistant_tokens_mask` takes them;
* otherwise, by rendering prefixes: for message k (from 0), an assistant turn, its characters
  are those that `render(messages[:k + 1])` adds after
  `render(messages[:k], add_generation_prompt=True)` (the assistant header is the prompt's; the
  turn's content and end-of-turn markup, e.g. ChatML's `<|im_end|>\\n` or Llama-3's
  `<|eot_id|>`, are the completion's). This holds only when each rendering is a prefix of the
  next and of the whole conversation; a template that renders earlier turns differently once
  later ones follow (Qwen3 writes a turn's <think> block only after the last user message) is
  refused for that conversation, with the way out: a template with
  `{% generation %}` blocks, or prompt / completion records.
A token is the assistant's when its characters overlap a span (`token_mask`), transformers' rule.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path

import numpy as np

from dropless.data.decoding import json_object

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A folder's chat template and the special-token strings it is rendered with."""
    text: str
    source: str                 # the file it was read from (errors name it)
    special: tuple[tuple[str, str], ...]   # (name, token string), e.g. ("bos_token", "<s>")

    @property
    def has_generation_blocks(self) -> bool:
        """The template marks assistant text with {% generation %} (see the module doc)."""
        return _compiled(self.text).generation_blocks


def _token_string(value, where: str, key: str) -> str | None:
    if value is None:
        return None
    text = value.get("content") if isinstance(value, dict) else value
    if not isinstance(text, str):
        raise ValueError(f"{where}: {key}={value!r} is not a token string")
    return text


def _template_of(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{where}: chat_template is a list of templates without a 'default' one "
                         f"(it names {sorted(str(n) for n in named)})")
    raise ValueError(f"{where}: chat_template must be a string, not {type(value).__name__}")


def read_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a tokenizer folder (module doc), or None when it has none. Raises
    ValueError naming the file for unreadable JSON, a chat_template of the wrong type, a bad
    special token or a template Jinja cannot parse."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = json_object(config_path) if config_path.is_file() else {}
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        text, source = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    elif config.get("chat_template") is not None:
        text, source = _template_of(config["chat_template"], str(config_path)), str(config_path)
    else:
        return None
    special = tuple((k, s) for k in SPECIAL_KEYS
                    if (s := _token_string(config.get(k), str(config_path), k)) is not None)
    tpl = ChatTemplate(text=text, source=source, special=special)
    try:
        _compiled(text)
    except Exception as e:  # noqa: BLE001 - jinja2 raises TemplateSyntaxError and friends
        raise ValueError(f"{source}: the chat template does not parse ({e})") from None
    return tpl


# ---- the Jinja environment (module doc) ---------------------------------------------------------

class _Compiled:
    """A compiled template, the tracker its {% generation %} blocks report to, and whether it
    has any such block."""

    def __init__(self, template, tracker: ContextVar, generation_blocks: bool):
        self.template, self.tracker, self.generation_blocks = template, tracker, generation_blocks


@functools.lru_cache(maxsize=16)
def _compiled(text: str) -> _Compiled:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tracker: ContextVar = ContextVar("generation_spans", default=None)

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body and, while a render is
        tracked, records the body's [start, end) characters in the output so far."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body
                                          ).set_lineno(lineno)

        def _block(self, caller):
            out = caller()
            state = tracker.get()
            if state is not None:
                pieces, spans = state
                start = sum(map(len, pieces))
                spans.append((start, start + len(out)))
            return out

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):   # noqa: N805 - jinja's own signature trick
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    ast = env.parse(text)
    has_blocks = any(isinstance(n.call.node, jinja2.nodes.ExtensionAttribute)
                     and n.call.node.name == "_block"
                     for n in ast.find_all(jinja2.nodes.CallBlock))
    return _Compiled(env.from_string(ast), tracker, has_blocks)


def _message_for_template(message: dict) -> dict:
    """A message as transformers hands it to the template: None values dropped, reasoning under
    `reasoning_content` (and `thinking`) when given under any of REASONING_KEYS."""
    msg = {k: v for k, v in message.items() if v is not None}
    reasoning = next((msg[k] for k in REASONING_KEYS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def render(tpl: ChatTemplate, messages: list[dict], *, add_generation_prompt: bool = False,
           ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) characters of its {% generation %}
    blocks (none when the template has none). Raises jinja2.TemplateError for what the template
    refuses (`raise_exception`) and jinja2's errors for what it cannot render."""
    compiled = _compiled(tpl.text)
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    context = dict(tpl.special, messages=[_message_for_template(m) for m in messages],
                   tools=None, documents=None, add_generation_prompt=add_generation_prompt)
    token = compiled.tracker.set((pieces, spans))
    try:
        for piece in compiled.template.generate(**context):
            pieces.append(piece)
    finally:
        compiled.tracker.reset(token)
    return "".join(pieces), spans


class PrefixMismatch(ValueError):
    """The template renders an earlier turn differently once later turns follow, so the prefix
    method cannot place an assistant turn (module doc)."""


def assistant_spans(tpl: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation (no generation prompt) and the [start, end) characters of its
    assistant turns, by the template's {% generation %} blocks or by prefix rendering (module
    doc). Raises PrefixMismatch naming the message whose rendering is not a prefix, and what
    `render` raises."""
    text, spans = render(tpl, messages)
    if tpl.has_generation_blocks:
        return text, spans
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, _ = render(tpl, messages[:k], add_generation_prompt=True)
        upto, _ = render(tpl, messages[:k + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            what = ("the conversation up to it does not render as the one before it plus the "
                    "generation prompt, then the turn" if not upto.startswith(before) else
                    "the conversation renders this turn differently once later turns follow")
            raise PrefixMismatch(
                f"message {k + 1} (assistant): {what}, so the chat template's rendering cannot "
                "tell this turn's tokens from the prompt's; mark the assistant text with "
                "{% generation %} in the template, or give prompt / completion records")
        spans.append((len(before), len(upto)))
    return text, spans


def token_mask(offsets_T2: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """bool [T]: the tokens whose [start, end) characters overlap one of `spans` (sorted,
    disjoint), transformers' `return_assistant_tokens_mask` rule."""
    mask = np.zeros(len(offsets_T2), bool)
    for start, end in spans:
        mask |= (offsets_T2[:, 1] > start) & (offsets_T2[:, 0] < end)
    return mask
