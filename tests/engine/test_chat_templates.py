"""Chat templates render exactly as transformers renders them (its apply_chat_template).

The templates under data/chat_templates are the public chat templates of Qwen3 (0.6B-32B),
Qwen2.5-Instruct, Llama 3.2 and Llama 3.1/3.3 Instruct, kept as test data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from engine.chat_template import ChatTemplate
from engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

DATA = Path(__file__).parent / "data" / "chat_templates"
TEMPLATES = ("qwen3", "qwen2_5", "llama3_2", "llama3_3")
BOS = {"qwen3": None, "qwen2_5": None, "llama3_2": "<|begin_of_text|>",
       "llama3_3": "<|begin_of_text|>"}
EOS = {"qwen3": "<|im_end|>", "qwen2_5": "<|im_end|>", "llama3_2": "<|eot_id|>",
       "llama3_3": "<|eot_id|>"}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city — «today»",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "Zürich, 東京"}}}}}

CONVERSATIONS = {
    "user only": ([{"role": "user", "content": "Hello there!"}], {}),
    "system": ([{"role": "system", "content": "  You are terse.  "},
                {"role": "user", "content": "Hi"}], {}),
    "multi-turn": ([{"role": "system", "content": "Be kind."},
                    {"role": "user", "content": "What is 2+2?"},
                    {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "And 3+3? Ünïcödé ✓"}], {}),
    "thinking history": ([{"role": "user", "content": "Q1"},
                          {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
                          {"role": "user", "content": "Q2"}], {}),
    "no generation prompt": ([{"role": "user", "content": "a"},
                              {"role": "assistant", "content": "b"}],
                             {"add_generation_prompt": False}),
    "enable_thinking false": ([{"role": "user", "content": "Hi"}], {"enable_thinking": False}),
    "enable_thinking true": ([{"role": "user", "content": "Hi"}], {"enable_thinking": True}),
    "tools": ([{"role": "system", "content": "Use tools."},
               {"role": "user", "content": "Weather in Zürich?"}], {"tools": [WEATHER_TOOL]}),
    "tool call and result": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "{\"temp_c\": 21}"}],
        {"tools": [WEATHER_TOOL]}),
}


def _reference(template: str, name: str, messages: list[dict], options: dict) -> str:
    options = dict(options)
    add = options.pop("add_generation_prompt", True)
    special = {"eos_token": EOS[name]} | ({"bos_token": BOS[name]} if BOS[name] else {})
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add, **special, **options)
    return rendered[0]


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_public_templates_render_as_transformers_does(name: str, case: str) -> None:
    template = (DATA / f"{name}.jinja").read_text()
    messages, options = CONVERSATIONS[case]
    special = {"eos_token": EOS[name]} | ({"bos_token": BOS[name]} if BOS[name] else {})
    ours_options = dict(options)
    add = ours_options.pop("add_generation_prompt", True)
    try:
        expected = _reference(template, name, messages, options)
    except jinja2.TemplateError as exc:  # the template refuses this conversation: so must we
        with pytest.raises(jinja2.TemplateError, match=str(exc)[:40]):
            ChatTemplate(template, special).render(messages, add, **ours_options)
        return
    ours = ChatTemplate(template, special).render(messages, add, **ours_options)
    assert ours == expected


def test_enable_thinking_changes_the_qwen3_prompt() -> None:
    template = ChatTemplate((DATA / "qwen3.jinja").read_text(), {"eos_token": "<|im_end|>"})
    messages = [{"role": "user", "content": "Hi"}]
    off = template.render(messages, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(messages).endswith("<|im_start|>assistant\n")


def test_the_tokenizer_of_a_model_folder_renders_as_a_transformers_tokenizer(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Through our Tokenizer (tokenizer_config.json's special tokens) and through a
    PreTrainedTokenizerFast built on the same tokenizer.json: the same text."""
    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (DATA / "llama3_3.jinja").read_text()
    config["bos_token"] = "<|begin_of_text|>"
    config_path.write_text(json.dumps(config))
    ours = Tokenizer(folder)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                        bos_token="<|begin_of_text|>",
                                        eos_token=config.get("eos_token"),
                                        chat_template=config["chat_template"])
    for messages, options in CONVERSATIONS.values():
        options = dict(options)
        add = options.pop("add_generation_prompt", True)
        try:
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add, **options)
        except jinja2.TemplateError:
            continue
        assert ours.apply_chat_template(messages, add_generation_prompt=add, **options) == expected


@pytest.mark.parametrize("source, expected", [
    ("{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}", "1"),
    ("{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}", "13"),
    ("{{ {'b': 1, 'a': 'é<'} | tojson(sort_keys=True) }}", '{"a": "é<", "b": 1}'),
    ("{{ {'a': [1, 2]} | tojson(indent=2) }}", '{\n  "a": [\n    1,\n    2\n  ]\n}'),
    ("{{ [1, 2] | tojson(separators=(',', ':')) }}", "[1,2]"),
    ("{% generation %}kept{% endgeneration %}", "kept"),
    ("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}", "2"),
    ("{{ dict(a=1)['a'] }}", "1"),
    ("{{ strftime_now('%Y') }}", None),
])
def test_environment_features_match_transformers(source: str, expected: str | None) -> None:
    ours = ChatTemplate(source).render([], add_generation_prompt=False)
    reference, _ = render_jinja_template(conversations=[[]], chat_template=source)
    assert ours == reference[0]
    if expected is not None:
        assert ours == expected


def test_raise_exception_and_unsafe_namespaces_are_errors() -> None:
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
