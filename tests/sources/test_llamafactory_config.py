"""LLaMA-Factory ``dataset_info.json`` entries read as is: defaults, refusals, skipped entries.

Truth: LLaMA-Factory's documented keys and defaults (its ``data/README.md`` and
``src/llamafactory/data/parser.py``), written out here as a user's config would be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prep.sources.conversation import Conversation
from prep.sources.errors import RecordError
from prep.sources.formats.base import reader_for
from prep.sources.records import plan_chunks
from schemas.dataset_config import ConfigError, UnsupportedEntry, load_dataset_config, read_dataset_config
from schemas.reasons import Reason

SFT = {
    "alpaca_en_demo": {"file_name": "alpaca.json"},
    "glaive_toolcall_en_demo": {
        "file_name": "glaive.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    },
    "mllm_demo": {
        "file_name": "mllm.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    },
    "subset": {"file_name": "alpaca.json", "num_samples": 2, "split": "train", "hf_hub_url": "x/y"},
}
NOT_SFT = {
    "hub_only": ({"hf_hub_url": "llamafactory/demo", "formatting": "sharegpt"}, "hf_hub_url", "download it"),
    "ms_only": ({"ms_hub_url": "AI-ModelScope/demo"}, "ms_hub_url", "point file_name at it"),
    "script_only": ({"script_url": "my_script"}, "script_url", "download it"),
    "dpo_en_demo": (
        {"file_name": "alpaca.json", "ranking": True, "formatting": "sharegpt"},
        "ranking",
        "--dataset",
    ),
    "kto_en_demo": (
        {"file_name": "mllm.json", "formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"}},
        "kto_tag",
        "--dataset",
    ),
    "mllm_audio_demo": (
        {"file_name": "mllm.json", "formatting": "sharegpt", "columns": {"messages": "messages", "audios": "audios"}},
        "audios",
        "--dataset",
    ),
    "c4_demo": ({"file_name": "alpaca.json", "columns": {"prompt": "text"}}, "columns.response", "--dataset"),
}


@pytest.fixture()
def meta_config(tmp_path: Path) -> Path:
    for name in ("alpaca.json", "glaive.json", "mllm.json"):
        (tmp_path / name).write_text("[]", "utf-8")
    config = {**SFT, **{name: entry for name, (entry, _, _) in NOT_SFT.items()}}
    path = tmp_path / "dataset_info.json"
    path.write_text(json.dumps(config), "utf-8")
    return path


def test_whole_meta_config_yields_its_sft_entries_and_lists_the_rest(meta_config: Path) -> None:
    loaded = read_dataset_config(meta_config)
    assert sorted(s.name for s in loaded.specs) == sorted(SFT)
    assert sorted(s.name for s in loaded.skipped) == sorted(NOT_SFT)
    for entry in loaded.skipped:
        _, key, hint = NOT_SFT[entry.name]
        assert repr(entry.name) in entry.why and key in entry.why and hint in entry.why, entry.why


def test_skipped_entries_are_one_warning_by_kind_and_listed_at_debug(
    meta_config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("DEBUG", logger="schemas.dataset_config"):
        specs = load_dataset_config(meta_config)
    assert len(specs) == len(SFT)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"skipped {len(NOT_SFT)} entries that prep tokenize cannot read: 3 not on local disk, "
        "2 preference (DPO/RM/KTO), 1 audio, 1 pre-training text (-v lists each with what to do)"
    ]
    listed = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "DEBUG")
    assert all(repr(name) in listed for name in NOT_SFT)


@pytest.mark.parametrize("name", sorted(NOT_SFT))
def test_selecting_a_non_sft_entry_is_refused_with_what_to_do(meta_config: Path, name: str) -> None:
    _, key, hint = NOT_SFT[name]
    with pytest.raises(UnsupportedEntry) as info:
        read_dataset_config(meta_config, [name])
    message = str(info.value)
    assert repr(name) in message and key in message and hint in message


def test_llamafactory_defaults(meta_config: Path) -> None:
    specs = {s.name: s for s in load_dataset_config(meta_config)}
    alpaca = specs["alpaca_en_demo"]
    assert alpaca.formatting == "alpaca"  # no formatting key means alpaca in LLaMA-Factory
    assert (alpaca.columns.prompt, alpaca.columns.query, alpaca.columns.response) == ("instruction", "input", "output")
    glaive = specs["glaive_toolcall_en_demo"]
    assert (glaive.tags.role_tag, glaive.tags.content_tag) == ("from", "value")
    assert (glaive.tags.user_tag, glaive.tags.assistant_tag) == ("human", "gpt")
    assert (glaive.tags.function_tag, glaive.tags.observation_tag, glaive.tags.system_tag) == (
        "function_call",
        "observation",
        "system",
    )
    assert glaive.columns.tools == "tools"
    assert (specs["subset"].num_samples, specs["subset"].split) == (2, "train")
    assert specs["mllm_demo"].cloud_file_name is None


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ({"file_name": "alpaca.json", "formatting": "openai"}, "formatting 'openai' unsupported"),
        ({"file_name": "alpaca.json", "colums": {}}, "unknown keys ['colums']"),
        ({"file_name": "alpaca.json", "columns": {"prompt": 3}}, "columns.prompt must be a column name"),
        ({"file_name": "alpaca.json", "num_samples": "ten"}, "num_samples must be an integer"),
        ({"file_name": "missing.json"}, "does not exist"),
        ({"formatting": "alpaca"}, "missing 'file_name'"),
        ({"cloud_file_name": "bucket/data.json"}, "cloud_file_name must be a URL"),
    ],
)
def test_config_mistakes_name_the_entry_and_key(tmp_path: Path, entry: dict, fragment: str) -> None:
    (tmp_path / "alpaca.json").write_text("[]", "utf-8")
    path = tmp_path / "dataset_info.json"
    path.write_text(json.dumps({"mine": entry}), "utf-8")
    with pytest.raises(ConfigError) as info:
        read_dataset_config(path)
    assert "'mine'" in str(info.value) and fragment in str(info.value)
    assert not isinstance(info.value, UnsupportedEntry)  # a mistake stops the run even without --dataset


def _read(tmp_path: Path, entry: dict, records: list[dict]) -> list[Conversation | RecordError]:
    (tmp_path / "media").mkdir(exist_ok=True)
    (tmp_path / "d.json").write_text(json.dumps(records), "utf-8")
    path = tmp_path / "dataset_info.json"
    path.write_text(json.dumps({"d": {"file_name": "d.json", "media_dir": "media", **entry}}), "utf-8")
    (spec,) = load_dataset_config(path)
    return [r.parsed for c in plan_chunks([spec], rows_per_chunk=100, seed=0) for r in reader_for(spec).read(c)]


def test_alpaca_rows_become_llamafactory_conversations(tmp_path: Path) -> None:
    """AlpacaDatasetConverter: history pairs first, then prompt + "\\n" + query (non-empty only)."""
    records = [
        {"instruction": "Add.", "input": "1+1", "output": "2", "history": [["Hi", "Hello"]], "system": "Be exact."},
        {"instruction": "Name it.", "input": "", "output": "A cat."},
        {"instruction": "<image>What?", "output": "Blue.", "images": ["a.jpg"]},
        {"instruction": "No answer."},
        {"instruction": "<image>Two?", "output": "x", "images": []},
        {"instruction": "Q", "output": "A", "history": "not pairs"},
    ]
    got = _read(tmp_path, {}, records)
    assert isinstance(got[0], Conversation) and got[0].messages == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Add.\n1+1"},
        {"role": "assistant", "content": "2"},
    ]
    assert isinstance(got[1], Conversation) and got[1].messages[0] == {"role": "user", "content": "Name it."}
    assert isinstance(got[2], Conversation) and got[2].messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "What?"},
    ]
    assert [m.ref.path for m in got[2].media] == [str(tmp_path / "media" / "a.jpg")]
    assert [g.reason for g in got[3:] if isinstance(g, RecordError)] == [
        Reason.EMPTY_CONVERSATION,
        Reason.MEDIA_TAG_MISMATCH,
        Reason.BAD_RECORD,
    ]


def test_sharegpt_tools_function_calls_and_observations(tmp_path: Path) -> None:
    tools = [{"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}]
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    record = {
        "conversations": [
            {"from": "system", "value": "Use tools."},
            {"from": "human", "value": "1+2?"},
            {"from": "function_call", "value": json.dumps(call)},
            {"from": "observation", "value": "3"},
            {"from": "gpt", "value": "It is 3."},
        ],
        "system": "ignored: the system turn wins, as in LLaMA-Factory",
        "tools": json.dumps(tools),
    }
    bad = [
        {**record, "tools": "{not json"},
        {**record, "conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "oops"}]},
    ]
    entry = {"formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}}
    conv, *errors = _read(tmp_path, entry, [record, *bad])
    assert isinstance(conv, Conversation)
    assert conv.tools == [{"type": "function", "function": tools[0]}]
    assert conv.messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "It is 3."},
    ]
    assert [e.reason for e in errors if isinstance(e, RecordError)] == [Reason.BAD_RECORD, Reason.BAD_RECORD]


def test_content_lists_mix_with_strings_and_media_lists(tmp_path: Path) -> None:
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And"}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Two."}]},
            {"role": "user", "content": "<image>Third?"},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": [{"type": "image", "image": "own.png"}, {"type": "text", "text": "Own?"}]},
            {"role": "assistant", "content": "Own."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u.png"}}]},
            {"role": "assistant", "content": "Url."},
        ],
        "images": ["1.jpg", "2.jpg", "3.jpg"],
    }
    too_few = {**record, "images": ["1.jpg"]}
    audio = {"messages": [{"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "x"}]}
    unknown = {"messages": [{"role": "user", "content": [{"type": "chart"}]}, {"role": "assistant", "content": "x"}]}
    entry = {"formatting": "sharegpt", "columns": {"messages": "messages"}}
    conv, *errors = _read(tmp_path, entry, [record, too_few, audio, unknown])
    assert isinstance(conv, Conversation)
    media = tmp_path / "media"
    assert [m.ref.path for m in conv.media] == [str(media / n) for n in ("1.jpg", "2.jpg", "3.jpg", "own.png", "u.png")]
    assert conv.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "And"}, {"type": "image"}]
    assert conv.messages[1]["content"] == [{"type": "text", "text": "Two."}]
    assert [e.reason for e in errors if isinstance(e, RecordError)] == [
        Reason.MEDIA_TAG_MISMATCH,
        Reason.UNSUPPORTED_MEDIA,
        Reason.BAD_RECORD,
    ]
