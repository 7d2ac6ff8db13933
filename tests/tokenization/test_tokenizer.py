"""pagedllm's tokenizer (``pagedllm/tokenization/``) against transformers' on the same files:
ids, tokens and text token for token and string for string, incremental decoding as the
engine's detokenizer runs it, chat templates (system, tools, documents, generation prompt, a
continued final message, the globals and filters templates use), and the folders it refuses
(left to transformers)."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import transformers

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sequence import Sequence
from pagedllm.engine.detokenizer import Detokenizer
from pagedllm.tokenization.loading import NotPlain, load_plain_tokenizer
from pagedllm.tokenization.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading, double  spaces\tand\ttabs\n\nnewlines\r\n",
    "def f(x):\n    return x ** 2  # comment\n",
    "émoji 🦙🚀 日本語 한국어 العربية Ελληνικά",
    "family 👩\u200d👩\u200d👧 and flags 🇫🇷 and combining e\u0301",
    "<s>starts</s> with <pad> specials<s>glued</s>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "[CLS] Hello [MASK] world [SEP]",
    "HELLO The Cat sat. Don't, won't! 'quoted' ?",
    "\u00a0non-breaking\u2009thin\u3000ideographic space",
    "a" * 300,
]

SYSTEM_TOOLS_TEMPLATE = """{%- set ns = namespace(system=none) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% set ns.system = m.content %}{% endif -%}
{%- endfor -%}
{{ bos_token }}
{%- if ns.system is not none %}<sys>{{ ns.system | trim }}</sys>
{% endif -%}
{%- if tools %}<tools>{{ tools | tojson }}</tools>
<pretty>{{ tools[0] | tojson(indent=2, sort_keys=true) }}</pretty>
{% endif -%}
{%- if documents %}{% for d in documents %}<doc title="{{ d.title }}">{{ d.text }}</doc>
{% endfor %}{% endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% continue %}{% endif -%}
  {%- if m.role not in ['user', 'assistant', 'tool'] -%}
    {{ raise_exception('unknown role ' + m.role) }}
  {%- endif %}
<{{ m.role }}>
  {%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif -%}
  {{ m.content if m.content is defined else '' }}
  {%- if m.tool_calls is defined %}{% for c in m.tool_calls -%}
    <call>{{ c.function | tojson }}</call>
  {%- endfor %}{% endif -%}
</{{ m.role }}>{{ eos_token }}
  {%- if loop.index > 50 %}{% break %}{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}<assistant>
  {%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif -%}
"""

GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "A: {{ m.content }}{% endgeneration %}{% else %}U: {{ m.content }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
DATE_TEMPLATE = "{{ strftime_now('%Y') }}|{{ dict(a=1) | tojson }}|{{ messages[0].content }}"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather <now> & "later" in a city',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Zürich, 東京"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is 2+2? <s>"},
        {"role": "assistant", "content": "4", "reasoning_content": "adding"},
        {"role": "user", "content": "And 🦙?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "name": None},
        {"role": "assistant", "content": "It is sunny", "thinking": "tool said so"},
    ],
]


def _pair(folder: Path) -> tuple[Tokenizer, Any]:
    ours = load_plain_tokenizer(folder)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(folder), local_files_only=True
    )
    return ours, theirs


def _assert_same(ours: Tokenizer, theirs: Any, texts: list[str] = TEXTS) -> None:
    """Every answer the engine and the server ask a tokenizer for, compared."""
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for name in (
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "bos_token_id",
        "eos_token_id",
        "unk_token_id",
        "pad_token_id",
        "sep_token_id",
        "cls_token_id",
        "mask_token_id",
        "all_special_tokens",
        "all_special_ids",
        "special_tokens_map",
        "vocab_size",
        "chat_template",
        "model_input_names",
        "model_max_length",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special
            ), (text, special)
        assert ours(text) == dict(theirs(text)), text
        ids = theirs.encode(text)
        tokens = theirs.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids) == tokens
        assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
        assert ours.convert_tokens_to_string(tokens) == theirs.convert_tokens_to_string(tokens)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == (
                theirs.convert_ids_to_tokens(ids, skip_special_tokens=skip)
            )
            for i in range(len(ids) + 1):  # every prefix: what streaming decodes
                assert ours.decode(ids[:i], skip_special_tokens=skip) == theirs.decode(
                    ids[:i], skip_special_tokens=skip
                )
    for a, b in itertools.pairwise(texts):  # pairs: a cross-encoder's input
        assert ours(a, b) == dict(theirs(a, b)), (a, b)
        whole = len(ours.encode(a, b))
        for cut in (whole - 1, whole - 3, 2):  # the last: too short to keep the first text
            try:
                want = dict(theirs(a, b, truncation="only_second", max_length=cut))
            except Exception as exc:  # the library's refusal: ours passes the same on
                with pytest.raises(type(exc)):
                    ours(a, b, truncation="only_second", max_length=cut)
                continue
            assert ours(a, b, truncation="only_second", max_length=cut) == want, (a, b, cut)
    copy = pickle.loads(pickle.dumps(ours))  # what a template worker receives
    assert copy.backend_tokenizer.to_str() == ours.backend_tokenizer.to_str()
    assert copy.encode(texts[0]) == ours.encode(texts[0])
    assert copy.all_special_ids == ours.all_special_ids


def _stream(tokenizer: Any, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    """The engine's incremental detokenizer over ``output``, token by token."""
    params = SamplingParams(max_tokens=len(output) + 1, skip_special_tokens=skip)
    seq = Sequence(0, prompt, block_size=16)
    detok = Detokenizer(tokenizer)
    pieces = []
    for token in output:
        seq.append_token(token, 0.0, None)
        pieces.append(detok.decode_new(seq, params))
    return pieces


def _assert_same_stream(ours: Tokenizer, theirs: Any) -> None:
    text = "".join(TEXTS[3:9])
    ids = theirs.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert _stream(ours, ids[:3], ids[3:], skip) == _stream(theirs, ids[:3], ids[3:], skip)


def _assert_same_chats(ours: Tokenizer, theirs: Any, template: str | None = None) -> None:
    for conversation in CONVERSATIONS:
        for kwargs in (
            {"add_generation_prompt": True},
            {"add_generation_prompt": False},
            {"add_generation_prompt": True, "tools": TOOLS},
            {"documents": [{"title": "T<1>", "text": "body"}], "enable_thinking": False},
            {"add_generation_prompt": True, "enable_thinking": False},
            {"continue_final_message": True},
        ):
            if kwargs.get("continue_final_message") and conversation[-1]["role"] != "assistant":
                continue
            try:
                want = theirs.apply_chat_template(
                    conversation, chat_template=template, tokenize=False, **kwargs
                )
            except Exception as exc:  # a template that cannot render it: ours refuses alike
                with pytest.raises(type(exc)):
                    ours.apply_chat_template(
                        conversation, chat_template=template, tokenize=False, **kwargs
                    )
                continue
            got = ours.apply_chat_template(
                conversation, chat_template=template, tokenize=False, **kwargs
            )
            assert got == want, (conversation, kwargs)
            ids = ours.apply_chat_template(
                conversation, chat_template=template, return_dict=False, **kwargs
            )
            assert ids == theirs.encode(want, add_special_tokens=False)


def test_the_tests_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from tests.conftest import build_tokenizer

    build_tokenizer(tmp_path)
    ours, theirs = _pair(tmp_path)
    _assert_same(ours, theirs)
    _assert_same_stream(ours, theirs)
    _assert_same_chats(ours, theirs, SYSTEM_TOOLS_TEMPLATE)
    for template in (GENERATION_TEMPLATE, DATE_TEMPLATE):
        for conversation in CONVERSATIONS:
            want = theirs.apply_chat_template(conversation, chat_template=template, tokenize=False)
            assert (
                ours.apply_chat_template(conversation, chat_template=template, tokenize=False)
                == want
            )


def test_template_errors_are_raised_as_transformers_raises_them(tmp_path: Path) -> None:
    from jinja2.exceptions import SecurityError, TemplateError

    from tests.conftest import build_tokenizer

    build_tokenizer(tmp_path)
    ours, theirs = _pair(tmp_path)
    bad_role = [{"role": "wizard", "content": "x"}]
    for tok in (ours, theirs):
        with pytest.raises(TemplateError, match="unknown role wizard"):
            tok.apply_chat_template(bad_role, chat_template=SYSTEM_TOOLS_TEMPLATE, tokenize=False)
        with pytest.raises(SecurityError):
            tok.apply_chat_template(
                bad_role, chat_template="{% set n = namespace(_x=1) %}", tokenize=False
            )
        with pytest.raises(SecurityError):  # the sandbox: no reach into Python's internals
            tok.apply_chat_template(
                bad_role, chat_template="{{ messages.__class__.__mro__ }}", tokenize=False
            )
        with pytest.raises(ValueError):
            tok.apply_chat_template([], chat_template=DATE_TEMPLATE, tokenize=False)
        with pytest.raises(ValueError):
            tok.apply_chat_template(
                CONVERSATIONS[1],
                chat_template=DATE_TEMPLATE,
                tokenize=False,
                add_generation_prompt=True,
                continue_final_message=True,
            )


def _converted(gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    """The GGUF's tokenizer as the engine loads it (converted, cached, loaded back), and its
    cache folder."""
    from pagedllm.engine.prompts import load_tokenizer

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache))
    tok = load_tokenizer(str(gguf))
    (folder,) = (cache / "gguf-tokenizers").iterdir()
    return tok, folder


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_converted_gguf_tokenizer_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, add_bos: bool
) -> None:
    """The tests' byte-level BPE written into a GGUF file, converted by transformers once; the
    engine then serves with pagedllm's class, equal to transformers' on the cached folder and
    to transformers' own reading of the GGUF file."""
    from tests.conftest import build_model
    from tests.models.gguf_files import write_gguf

    meta = {"tokenizer.ggml.add_bos_token": add_bos}
    path = write_gguf(build_model(tmp_path / "llama", "llama"), tmp_path / "m.gguf", metadata=meta)
    tok, folder = _converted(path, tmp_path / "cache", monkeypatch)
    assert isinstance(tok, Tokenizer)
    ours, theirs = _pair(folder)
    _assert_same(ours, theirs)
    _assert_same_stream(ours, theirs)
    _assert_same_chats(ours, theirs)
    direct = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        assert tok.encode(text) == direct.encode(text), text
    assert (tok.encode("hi")[0] == tok.bos_token_id) is add_bos


def test_a_wordpiece_gguf_tokenizer_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BERT GGUF (our WordPiece conversion, cached): pairs with token types, truncation of
    the second text, [CLS]/[SEP] and lower-casing as transformers' class on the same folder."""
    from tests.models.gguf_bert_files import write_bert_gguf
    from tests.models.test_gguf_bert import build_bert

    path = write_bert_gguf(build_bert(tmp_path / "bert"), tmp_path / "b.gguf")
    tok, folder = _converted(path, tmp_path / "cache", monkeypatch)
    assert isinstance(tok, Tokenizer)
    ours, theirs = _pair(folder)
    _assert_same(ours, theirs)
    _assert_same_stream(ours, theirs)
    bert = transformers.BertTokenizerFast.from_pretrained(str(tmp_path / "bert"))
    for a, b in itertools.pairwise(TEXTS):
        assert ours(a, b) == {k: v for k, v in bert(a, b).items() if k in ours(a, b)}


def test_the_demo_models_tokenizer_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm.entrypoints.demo_model import fetch_demo_model

    fetched = fetch_demo_model()
    if fetched.path is None:
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched: {fetched.reason}")
    tok, folder = _converted(fetched.path, tmp_path / "cache", monkeypatch)
    assert isinstance(tok, Tokenizer)
    ours, theirs = _pair(folder)
    _assert_same(ours, theirs, TEXTS[:9])
    _assert_same_stream(ours, theirs)
    _assert_same_chats(ours, theirs)  # the model's own template
    _assert_same_chats(ours, theirs, SYSTEM_TOOLS_TEMPLATE)


def _edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(changes)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"tokenizer_class": "LlamaTokenizer"}, "tokenizer_class 'LlamaTokenizer'"),
        ({"legacy": False}, "sets legacy"),
        ({"image_token": "<image>"}, "sets image_token"),
        ({"split_special_tokens": True}, "split_special_tokens"),
        ({"extra_special_tokens": {"image_token": "<image>"}}, "model-specific"),
        ({"model_max_length": "long"}, "not read as a plain tokenizer"),
    ],
)
def test_what_it_cannot_express_is_left_to_transformers(
    tmp_path: Path, change: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder this class would not load as transformers does is refused with the reason,
    and the engine's loader then uses transformers (saying so in the log)."""
    from pagedllm.engine.prompts import load_tokenizer
    from tests.conftest import build_tokenizer

    build_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), Tokenizer)
    _edit_config(tmp_path, **change)
    with pytest.raises(NotPlain, match=reason):
        load_plain_tokenizer(tmp_path)
    caplog.set_level("INFO", logger="pagedllm.engine.prompts")
    tok = load_tokenizer(str(tmp_path))
    assert not isinstance(tok, Tokenizer)
    assert "transformers' AutoTokenizer" in caplog.text


def test_side_files_and_backend_settings_are_left_to_transformers(tmp_path: Path) -> None:
    from tests.conftest import build_tokenizer

    build_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(NotPlain, match="special_tokens_map.json"):
        load_plain_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").unlink()
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["truncation"] = {
        "max_length": 8,
        "strategy": "LongestFirst",
        "stride": 0,
        "direction": "Right",
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(NotPlain, match="truncation"):
        load_plain_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(NotPlain, match="no tokenizer.json"):
        load_plain_tokenizer(tmp_path)


def test_a_special_token_missing_from_the_file_is_added_as_transformers_adds_it(
    tmp_path: Path,
) -> None:
    """A named special token the tokenizer.json does not hold becomes an added special token
    (a new id), as transformers' constructor makes it; ids and decoding then agree."""
    from tests.conftest import build_tokenizer

    build_tokenizer(tmp_path)
    _edit_config(tmp_path, unk_token="<unk-new>", additional_special_tokens=["<tool>"])
    ours, theirs = _pair(tmp_path)
    assert ours.unk_token_id == len(ours) - 2
    _assert_same(ours, theirs, [*TEXTS[:5], "x <tool> y <unk-new>"])
