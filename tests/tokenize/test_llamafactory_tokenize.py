"""LLaMA-Factory records tokenize exactly as the processor's own ``apply_chat_template``.

Truth: the real processor (the offline example Qwen processors, real chat templates) called
with ``apply_chat_template(messages, tools=..., tokenize=True)`` on the conversation written
here by hand in Hugging Face form; loss masks against ``return_assistant_tokens_mask`` on a
test copy of the template with ``{% generation %}`` markers (the copy renders the same text,
checked). Records are LLaMA-Factory fixtures: alpaca with history and images, ShareGPT with
tools + function calls + observations, content-list turns, a meta config with hub and
ranking entries.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner
from PIL import Image

from families.processor import ProcessorBundle
from packvlm.sample_error import SampleError
from prep.cli import main
from prep.sources.conversation import Conversation
from prep.sources.formats.base import reader_for
from prep.sources.records import plan_chunks
from prep.tokenize.core import SampleTokenizer
from schemas.dataset_config import VideoSampling, load_dataset_config
from schemas.layout import SAMPLES_DIR
from schemas.reasons import Reason

# Qwen2.5's tool-calling chat template, verbatim (tokenizer_config.json of Qwen/Qwen2.5-0.5B,
# the Qwen2.5 family template with the default "You are a helpful assistant." system prompt).
QWEN2_5_TOOL_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
    {"name": "zoom", "description": "Zoom into the image.", "parameters": {"type": "object", "properties": {}}},
]
HF_TOOLS = [{"type": "function", "function": t} for t in TOOLS]  # transformers' tools= form


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lf_media")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "a.jpg")
    Image.new("RGB", (100, 140), (20, 160, 30)).save(root / "b.png")
    Image.new("RGB", (300, 200), (20, 30, 160)).save(root / "c.jpg")
    return root


def _config(root: Path, entries: dict[str, dict], files: dict[str, list[dict]]) -> Path:
    for name, records in files.items():
        (root / name).write_text(json.dumps(records, ensure_ascii=False), "utf-8")
    path = root / "dataset_info.json"
    path.write_text(json.dumps(entries), "utf-8")
    return path


def _conversations(config: Path, name: str) -> list[Conversation]:
    (spec,) = load_dataset_config(config, [name])
    chunks = plan_chunks([spec], rows_per_chunk=1000, seed=0)
    parsed = [r.parsed for c in chunks for r in reader_for(spec).read(c)]
    assert all(isinstance(p, Conversation) for p in parsed), parsed
    return parsed  # type: ignore[return-value]


def _hf(bundle: ProcessorBundle, messages: list[dict], tools: list | None, template: str | None = None) -> dict:
    assert bundle.processor is not None
    return bundle.processor.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template or bundle.chat_template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=template is not None and "generation" in template,
    )


def _ours(bundle: ProcessorBundle, conv: Conversation) -> tuple[list[int], list[int]]:
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    return list(sample.input_ids), [int(m) for m in sample.loss_mask]


def _marked_qwen2_vl(template: str) -> str:
    """The Qwen2-VL template with the assistant string branch inside {% generation %}."""
    old = "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    new = (
        "{% if message['content'] is string %}{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>\n"
        "{% endif %}{% else %}"
    )
    assert template.count(old) == 1
    return template.replace(old, new)


def _marked_qwen3_vl(template: str) -> str:
    """The Qwen3-VL template with the whole assistant turn body (tool calls included) marked."""
    start = "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role + '\\n' }}\n"
    end = "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    assert template.count(start) == 1 and template.count(end) == 1
    template = template.replace(start, start + "        {%- generation %}\n")
    return template.replace(end, "        {{- '<|im_end|>\\n' }}\n        {%- endgeneration %}\n" + end.split("\n")[1])


def test_alpaca_with_history_and_images_equals_hf(bundles: dict, media: Path, tmp_path: Path) -> None:
    bundle = bundles["qwen2_vl"]
    records = [
        {
            "instruction": "<image>What colour?",
            "input": "One word.",
            "output": "Red.",
            "history": [["Hello there.", "Hi! How can I help?"], ["<image>And this one?", "It is green."]],
            "system": "You are terse.",
            "images": ["b.png", "a.jpg"],
        },
        {"instruction": "Say hi.", "input": "", "output": "Hi."},
    ]
    config = _config(tmp_path, {"alpaca": {"file_name": "a.json", "media_dir": str(media)}}, {"a.json": records})
    expected = [
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": [{"type": "image", "image": str(media / "b.png")}, _text("And this one?")]},
            {"role": "assistant", "content": "It is green."},
            {
                "role": "user",
                "content": [{"type": "image", "image": str(media / "a.jpg")}, _text("What colour?\nOne word.")],
            },
            {"role": "assistant", "content": "Red."},
        ],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}],
    ]
    marked = _marked_qwen2_vl(bundle.chat_template)
    for conv, messages in zip(_conversations(config, "alpaca"), expected, strict=True):
        hf = _hf(bundle, messages, None, marked)
        assert bundle.processor.apply_chat_template(messages, chat_template=marked) == (
            bundle.processor.apply_chat_template(messages)
        )
        ids, mask = _ours(bundle, conv)
        assert ids == list(hf["input_ids"][0])
        assert mask == list(hf["assistant_masks"][0])


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


GLAIVE_RECORD = {
    "conversations": [
        {"from": "human", "value": "What is 2 + 3, and 4 + 5?"},
        {
            "from": "function_call",
            "value": json.dumps(
                [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 4, "b": 5}}]
            ),
        },
        {"from": "observation", "value": "5"},
        {"from": "observation", "value": "9"},
        {"from": "gpt", "value": "5 and 9."},
        {"from": "human", "value": "Thanks."},
        {"from": "gpt", "value": "You are welcome."},
    ],
    "system": "Use the tools.",
    "tools": json.dumps(TOOLS),
}
GLAIVE_HF = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 2 + 3, and 4 + 5?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("add", a=2, b=3), _call("add", a=4, b=5)]},
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "9"},
    {"role": "assistant", "content": "5 and 9."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You are welcome."},
]


def test_sharegpt_tools_equal_hf_with_the_qwen2_5_tool_template(bundles: dict, tmp_path: Path) -> None:
    bundle = replace(bundles["qwen2_vl"], chat_template=QWEN2_5_TOOL_TEMPLATE)
    entry = {
        "file_name": "g.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    }
    config = _config(tmp_path, {"glaive": entry}, {"g.json": [GLAIVE_RECORD]})
    (conv,) = _conversations(config, "glaive")
    ids, mask = _ours(bundle, conv)
    hf_ids = list(_hf(bundle, GLAIVE_HF, HF_TOOLS, QWEN2_5_TOOL_TEMPLATE)["input_ids"][0])
    assert ids == hf_ids
    learned = bundle.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert learned.count("<tool_call>") == 2 and "5 and 9." in learned and "You are welcome." in learned
    assert "<tool_response>" not in learned and "Thanks." not in learned and "# Tools" not in learned


def test_tools_with_images_equal_hf_with_the_qwen3_vl_template(bundles: dict, media: Path, tmp_path: Path) -> None:
    bundle = bundles["qwen3_vl"]
    record = {
        "messages": [
            {"role": "user", "content": "<image>Zoom in, then describe."},
            {"role": "function_call", "content": json.dumps({"name": "zoom", "arguments": {}})},
            {"role": "observation", "content": "zoomed"},
            {"role": "assistant", "content": "A blue block."},
        ],
        "images": ["c.jpg"],
        "tools": TOOLS,
    }
    entry = {
        "file_name": "t.jsonl",
        "formatting": "sharegpt",
        "media_dir": str(media),
        "columns": {"messages": "messages", "images": "images", "tools": "tools"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    }
    (tmp_path / "t.jsonl").write_text(json.dumps(record) + "\n", "utf-8")
    config = _config(tmp_path, {"tools": entry}, {})
    (conv,) = _conversations(config, "tools")
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(media / "c.jpg")}, _text("Zoom in, then describe.")],
        },
        {"role": "assistant", "content": "", "tool_calls": [_call("zoom")]},
        {"role": "tool", "content": "zoomed"},
        {"role": "assistant", "content": "A blue block."},
    ]
    marked = _marked_qwen3_vl(bundle.chat_template)
    assert bundle.processor.apply_chat_template(messages, tools=HF_TOOLS, chat_template=marked) == (
        bundle.processor.apply_chat_template(messages, tools=HF_TOOLS)
    )
    hf = _hf(bundle, messages, HF_TOOLS, marked)
    ids, mask = _ours(bundle, conv)
    assert ids == list(hf["input_ids"][0])
    assert mask == list(hf["assistant_masks"][0])


def test_content_list_turns_mixed_with_strings_equal_hf(bundles: dict, media: Path, tmp_path: Path) -> None:
    bundle = bundles["qwen2_vl"]
    record = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, _text("Compare with "), {"type": "image", "path": "c.jpg"}],
            },
            {"role": "assistant", "content": [_text("The second is larger.")]},
            {"role": "user", "content": "<image>And this?"},
            {"role": "assistant", "content": "Green."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.jpg"}}, _text("Last.")]},
            {"role": "assistant", "content": "Red."},
        ],
        "images": ["a.jpg", "b.png"],
    }
    entry = {
        "file_name": "c.json",
        "formatting": "sharegpt",
        "media_dir": str(media),
        "columns": {"messages": "messages"},
    }
    config = _config(tmp_path, {"lists": entry}, {"c.json": [record]})
    (conv,) = _conversations(config, "lists")

    def image(name: str) -> dict[str, str]:
        return {"type": "image", "image": str(media / name)}

    messages = [
        {"role": "user", "content": [image("a.jpg"), _text("Compare with "), image("c.jpg")]},
        {"role": "assistant", "content": [_text("The second is larger.")]},
        {"role": "user", "content": [image("b.png"), _text("And this?")]},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": [image("a.jpg"), _text("Last.")]},
        {"role": "assistant", "content": "Red."},
    ]
    ids, _ = _ours(bundle, conv)
    assert ids == list(_hf(bundle, messages, None)["input_ids"][0])


def test_a_template_without_tools_support_is_an_error_row(bundles: dict, tmp_path: Path) -> None:
    """The Qwen2-VL template never reads tools: rendering would drop them without a word."""
    bundle = bundles["qwen2_vl"]
    entry = {
        "file_name": "g.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    }
    config = _config(tmp_path, {"glaive": entry}, {"g.json": [GLAIVE_RECORD]})
    (conv,) = _conversations(config, "glaive")
    dropped = bundle.processor.apply_chat_template(GLAIVE_HF, tools=HF_TOOLS, tokenize=False)
    assert "add" not in dropped  # what would be trained on: no tool definitions, no calls
    with pytest.raises(SampleError) as info:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert info.value.reason == Reason.TEMPLATE_ERROR and "cannot render tool use" in str(info.value)


def _tokenize(config: Path, processor: Path, out: Path, *extra: str) -> Any:
    args = ["tokenize", "--dataset-config", str(config), "--processor", str(processor), "--output", str(out)]
    return CliRunner().invoke(main, [*args, "--executor", "local", *extra])


def test_meta_config_tokenizes_its_sft_entries_and_lists_the_rest(
    bundles: dict, processor_dirs: dict, media: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A LLaMA-Factory meta config as is: hub/ranking entries skipped and named, SFT rows equal HF."""
    bundle = bundles["qwen3_vl"]
    alpaca = [
        {"instruction": "<image>Colour?", "output": "Red.", "images": ["a.jpg"]},
        {"instruction": "Hi.", "output": "Hello."},
    ]
    entries = {
        "alpaca_en_demo": {"file_name": "alpaca.json", "media_dir": str(media)},
        "glaive_toolcall_en_demo": {
            "file_name": "glaive.json",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "tools": "tools"},
        },
        "llava_1k_en": {"hf_hub_url": "BUAADreamer/llava-en-zh-300k", "formatting": "sharegpt"},
        "dpo_en_demo": {"file_name": "glaive.json", "ranking": True, "formatting": "sharegpt"},
    }
    config = _config(tmp_path, entries, {"alpaca.json": alpaca, "glaive.json": [GLAIVE_RECORD]})
    with caplog.at_level("DEBUG", logger="schemas.dataset_config"):
        result = _tokenize(config, processor_dirs["qwen3_vl"], tmp_path / "out")
    assert result.exit_code == 0, result.output
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "skipped" in r.getMessage()]
    assert len(warned) == 1 and "skipped 2 entries" in warned[0]  # one line; -v lists each entry
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped: ")]
    assert any("'llava_1k_en'" in m and "hf_hub_url" in m and "download it" in m for m in skipped)
    assert any("'dpo_en_demo'" in m and "ranking" in m for m in skipped)
    expected = {
        ("alpaca_en_demo", 0): (
            [
                {"role": "user", "content": [{"type": "image", "image": str(media / "a.jpg")}, _text("Colour?")]},
                {"role": "assistant", "content": "Red."},
            ],
            None,
        ),
        ("alpaca_en_demo", 1): ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], None),
        ("glaive_toolcall_en_demo", 0): (GLAIVE_HF, HF_TOOLS),
    }
    rows = pa.concat_tables(
        pa.ipc.open_file(p).read_all() for p in sorted((tmp_path / "out" / SAMPLES_DIR).glob("*.arrow"))
    ).to_pylist()
    assert sorted((r["dataset"], r["line"]) for r in rows) == sorted(expected)
    for row in rows:
        messages, tools = expected[(row["dataset"], row["line"])]
        assert row["input_ids"] == list(_hf(bundle, messages, tools)["input_ids"][0]), row["sample_id"]


def test_error_budget_names_the_dataset_its_reasons_and_an_example(processor_dirs: dict, tmp_path: Path) -> None:
    good = [{"instruction": f"Count to {i}.", "output": " ".join(map(str, range(i)))} for i in range(1, 21)]
    good.append({"instruction": "No output column."})  # 1 of 21 rows: 4.8 % <= 5 %
    bad = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    ] * 4  # alpaca by default
    config = _config(
        tmp_path, {"good": {"file_name": "g.json"}, "bad": {"file_name": "b.json"}}, {"g.json": good, "b.json": bad}
    )
    failed = _tokenize(config, processor_dirs["qwen2_vl"], tmp_path / "all")
    assert failed.exit_code == 1
    message = failed.output
    assert "bad 4/4 rows (100.0%)" in message and "good 1/21" not in message
    assert "dataset 'bad', top error reasons:" in message
    assert "empty_conversation 4, e.g. bad:0:0: no response" in message
    assert "per dataset:" in message and "prep errors" in message
    ok = _tokenize(config, processor_dirs["qwen2_vl"], tmp_path / "good", "--dataset", "good")
    assert ok.exit_code == 0, ok.output
    assert "per dataset:" in ok.output and "4.8%" in ok.output
