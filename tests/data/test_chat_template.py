"""data/chat_template.py against transformers (tests/fixtures/chat/reference.json, written by
`tools/make_hf_fixtures.py --chat` with transformers 5.25.0, 5.24.0 and 4.57.6: their renderings,
ids and assistant masks for two real templates), and the environment's details on hand-written
templates."""
import json
from pathlib import Path

import jinja2
import numpy as np
import pytest

from dropless.data import chat_template as ct
from dropless.data.sft import example_from_record
from dropless.data.tokenizer import HFTokenizer

CHAT = Path(__file__).parents[1] / "fixtures" / "chat"
VERSIONS = json.loads((CHAT / "reference.json").read_text(encoding="utf-8"))
REFERENCE = VERSIONS["5.25.0"]
FOLDERS = ("qwen3_all_assistant", "deepseek_r1_distill")


@pytest.fixture(scope="module", params=FOLDERS)
def folder(request):
    d = CHAT / request.param
    return request.param, HFTokenizer(d / "tokenizer.json"), ct.read_chat_template(d)


def test_fixture_covers_both_mask_methods():
    tpls = {n: ct.read_chat_template(CHAT / n) for n in FOLDERS}
    assert tpls["qwen3_all_assistant"].has_generation_blocks
    assert not tpls["deepseek_r1_distill"].has_generation_blocks
    assert sorted(VERSIONS) == ["4.57.6", "5.24.0", "5.25.0"]   # one 4.x, two 5.x releases


@pytest.mark.parametrize("version", ["4.57.6", "5.24.0", "5.25.0"])
def test_text_ids_and_mask_equal_transformers(folder, version):
    name, tok, tpl = folder
    for case in VERSIONS[version][name]:
        text, spans = ct.assistant_spans(tpl, case["messages"])
        assert text == case["text"]
        ids, offsets = tok.encode_offsets(text, add_special_tokens=False)
        assert ids.tolist() == case["ids"], text
        assert ct.token_mask(offsets, spans).astype(int).tolist() == case["mask"], text
        ex = example_from_record("r", {"messages": case["messages"]}, tok=tok, template=tpl)
        assert ex.ids_T.tolist() == case["ids"]
        assert ex.completion_T.astype(int).tolist() == case["mask"]


def test_rendered_chat_gets_no_second_bos():
    """The DeepSeek folder's tokenizer.json adds BOS (add_bos_token true); the template writes
    it too, and transformers encodes the rendered chat without the post-processor's: one BOS."""
    tok = HFTokenizer(CHAT / "deepseek_r1_distill" / "tokenizer.json")
    ids = REFERENCE["deepseek_r1_distill"][0]["ids"]
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    assert tok.encode("x")[0] == tok.bos_id   # the post-processor does add it to plain text


def _tpl(text: str, **special) -> ct.ChatTemplate:
    return ct.ChatTemplate(text=text, source="t.jinja", special=tuple(special.items()))


def test_environment_matches_transformers_helpers():
    # trim_blocks + lstrip_blocks: the block lines leave no newline or indent behind
    tpl = _tpl("{% for m in messages %}\n    {% if m.role %}\n[{{ m.content }}]\n    {% endif %}\n"
               "{% endfor %}")
    assert ct.render(tpl, [{"role": "u", "content": "a"}, {"role": "u", "content": "b"}])[0] \
        == "[a]\n[b]\n"
    # tojson leaves HTML characters and non-ASCII alone; indent passes through
    tpl = _tpl("{{ messages[0].content | tojson }}|{{ {'a': 1} | tojson(indent=2) }}")
    out = ct.render(tpl, [{"role": "u", "content": "<b>é&"}])[0]
    assert out == '"<b>é&"|{\n  "a": 1\n}'
    # raise_exception is a TemplateError; loop controls work; namespaces refuse "_" names
    with pytest.raises(jinja2.TemplateError, match="only user"):
        ct.render(_tpl("{{ raise_exception('only user') }}"), [])
    assert ct.render(_tpl("{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}"
                          "{% endfor %}"), [])[0] == "1"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ct.render(_tpl("{% set ns = namespace(_x=1) %}"), [])
    # the sandbox: no attribute walk to Python internals
    with pytest.raises(jinja2.exceptions.SecurityError):
        ct.render(_tpl("{{ messages.__class__.__mro__ }}"), [])
    # special tokens as strings, an absent one undefined; strftime_now is the clock's
    tpl = _tpl("{{ bos_token }}|{{ eos_token is defined }}|{{ strftime_now('%Y') | length }}",
               bos_token="<s>")
    assert ct.render(tpl, [])[0] == "<s>|False|4"


def test_messages_as_transformers_hands_them():
    tpl = _tpl("{% for m in messages %}{{ m.tool_calls is defined }} {{ m.reasoning_content }}"
               "{% endfor %}")
    msgs = [{"role": "assistant", "content": "a", "tool_calls": None, "thinking": "t"}]
    assert ct.render(tpl, msgs)[0] == "False t"


def test_generation_blocks_give_spans():
    tpl = _tpl("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
               "{% generation %}{{ m.content }}</a>{% endgeneration %}{% else %}{{ m.content }}"
               "{% endif %}{% endfor %}")
    text, spans = ct.assistant_spans(tpl, [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "ok"}])
    assert text == "<user>q<assistant>ok</a>"
    assert [text[a:b] for a, b in spans] == ["ok</a>"]


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_prefix_spans_hand_worked():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "r"}, {"role": "assistant", "content": "a2"}]
    text, spans = ct.assistant_spans(_tpl(CHATML), msgs)
    # the header <|im_start|>assistant\n is the generation prompt's, content + <|im_end|>\n
    # the turn's
    assert [text[a:b] for a, b in spans] == ["a1<|im_end|>\n", "a2<|im_end|>\n"]


def test_prefix_mismatch_is_refused():
    # drops the content of every assistant turn but the last, as reasoning-stripping templates do
    tpl = _tpl("{% for m in messages %}[{{ m.role }}:{% if m.role != 'assistant' or loop.last %}"
               "{{ m.content }}{% endif %}]{% endfor %}")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "r"}, {"role": "assistant", "content": "a2"}]
    with pytest.raises(ct.PrefixMismatch, match="message 2.*generation"):
        ct.assistant_spans(tpl, msgs)


def test_token_mask_overlap_rule():
    # tokens [0,2) [2,5) [5,6) [6,6) and a span [3,5): the token [2,5) overlaps it, [5,6) not
    offsets = np.array([[0, 2], [2, 5], [5, 6], [6, 6]])
    assert ct.token_mask(offsets, [(3, 5)]).tolist() == [False, True, False, False]
    assert ct.token_mask(offsets, [(0, 0)]).tolist() == [False] * 4


def test_read_chat_template_sources(tmp_path):
    assert ct.read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"},
                           {"name": "default", "template": "D"}],
         "bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": None}))
    tpl = ct.read_chat_template(tmp_path)
    assert tpl.text == "D" and dict(tpl.special) == {"bos_token": "<s>"}
    (tmp_path / "chat_template.jinja").write_text("J")   # the file wins, as in transformers
    assert ct.read_chat_template(tmp_path).text == "J"
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="chat_template.jinja.*does not parse"):
        ct.read_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ValueError, match="tokenizer_config.json.*must be a string"):
        ct.read_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ValueError, match="without a 'default'.*tool_use"):
        ct.read_chat_template(tmp_path)


def test_prefix_method_on_qwen3_without_generation_blocks():
    """Qwen3's template with its {% generation %} tags made plain blocks (same whitespace): the
    prefix method finds transformers' masks for one turn, and refuses two turns, because Qwen3
    renders a <think> block only for turns after the last user message."""
    d = CHAT / "qwen3_all_assistant"
    gen = ct.read_chat_template(d)
    plain = ct.ChatTemplate(text=gen.text.replace("{% generation %}", "{% if true %}")
                            .replace("{% endgeneration %}", "{% endif %}"),
                            source="plain", special=gen.special)
    assert not plain.has_generation_blocks
    tok = HFTokenizer(d / "tokenizer.json")
    for case in REFERENCE["qwen3_all_assistant"]:
        if sum(m["role"] == "assistant" for m in case["messages"]) > 1:
            with pytest.raises(ct.PrefixMismatch, match="message 2.*differently once later"):
                ct.assistant_spans(plain, case["messages"])
            continue
        text, spans = ct.assistant_spans(plain, case["messages"])
        _, offsets = tok.encode_offsets(text, add_special_tokens=False)
        assert text == case["text"]
        assert ct.token_mask(offsets, spans).astype(int).tolist() == case["mask"]


# Meta-Llama-3-8B-Instruct's chat_template (its tokenizer_config.json)
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_prefix_spans_llama3():
    tpl = _tpl(LLAMA3, bos_token="<|begin_of_text|>")
    msgs = [{"role": "user", "content": " 2+2? "}, {"role": "assistant", "content": "4\n"}]
    text, spans = ct.assistant_spans(tpl, msgs)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>")
    assert [text[a:b] for a, b in spans] == ["4<|eot_id|>"]
