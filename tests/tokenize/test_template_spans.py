"""Assistant spans of every registered family's chat template, against the real processor.

For each ``prep example --family`` processor and each conversation shape (a system turn, several
replies, text only, images in several turns) the ids ``SampleTokenizer`` stores must equal the real
processor's and the loss mask must cover exactly the assistant replies. Both oracles are
independent of the code under test (:mod:`prep.tokenize.template`):

- ids: the processor's own template render (``ProcessorMixin.apply_chat_template``) and its flat
  ``processor(text=[...], images=[...])`` call on decoded images, as ``--verify-fraction`` runs it;
- mask: each reply found in those ids between the family's real turn markers, written down below
  from the published templates (e.g. Pixtral ``[/INST]`` reply ``</s>``), not derived by rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import ProcessorMixin
from transformers.image_utils import load_image
from transformers.models.smolvlm import processing_smolvlm

from families.processor import ProcessorBundle, load_processor
from families.registry import example_families, example_family
from packvlm.sample_error import SampleError
from prep.sources.conversation import Conversation
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.template import render, render_with_spans
from schemas.dataset_config import VideoSampling
from schemas.reasons import Reason
from tests.tokenize.families import cases


@dataclass(frozen=True)
class Markers:
    """What the family's template writes around a reply: ``opener`` reply ``closer``.

    ``closer`` None: the template closes no turn (GLM); a reply runs to the next ``<|user|>`` or the
    end. ``prefill``: what a generation prompt writes after the opener, skipped where a reply starts
    with one (MiniCPM-V 4.6: the empty ``<think>\\n\\n</think>\\n\\n`` with thinking off, before a
    reply without reasoning; ``<think>\\n`` with thinking on, before a reply's reasoning).
    ``space_token``: SentencePiece folds the space the template writes after ``</s>`` into the
    next token (LLaVA-NeXT ``▁[INST]``), which the character-overlap rule trains on too.
    """

    opener: str
    closer: str | None
    space_token: bool = False
    prefill: tuple[str, ...] = ()  # written after the opener by a generation prompt: prompt, not reply


CHATML = Markers("<|im_start|>assistant\n", "<|im_end|>\n")
MISTRAL = Markers("[/INST]", "</s>")
IDEFICS = Markers("\nAssistant:", "<end_of_utterance>\n")
MARKERS = {
    "qwen2_vl": CHATML,
    "qwen2_5_vl": CHATML,
    "qwen3_vl": CHATML,
    "qwen3_5": CHATML,
    "minicpmv4_6": Markers("<|im_start|>assistant\n", "<|im_end|>\n", prefill=("<think>\n\n</think>\n\n", "<think>\n")),
    "qwen2_5_omni": CHATML,
    "qwen3_omni_moe": CHATML,
    "internvl": CHATML,
    "lfm2_vl": CHATML,
    "llava_onevision": CHATML,
    "gemma3": Markers("<start_of_turn>model\n", "<end_of_turn>\n"),
    "gemma4": Markers("<|turn>model\n", "<turn|>\n"),
    "glm4v": Markers("<|assistant|>\n", None),  # GLM-4.6V's "<think></think>\n" is part of each reply
    "glm46v": Markers("<|assistant|>\n", None),
    "idefics3": IDEFICS,
    "smolvlm": IDEFICS,
    "llava_next": Markers("[/INST]", "</s>", space_token=True),
    "pixtral": MISTRAL,
    "mistral3": MISTRAL,
    "paddleocr_vl": Markers("Assistant:\n", "</s>"),  # ERNIE: User: ...\nAssistant:\nreply</s>
    "kimi_k25": Markers("<|im_assistant|>assistant<|im_middle|><think>", "<|im_end|>"),  # "</think>" + reply
}
SYSTEM = "You are a careful visual inspector."
REPLIES = ["A cat.", "A dog on a red table.", "Ciao."]


Turns = list[tuple[str, list[str | Path]]]


def _shapes(media: cases.MediaFiles) -> dict[str, Turns]:
    """Conversation shapes, as :func:`cases.conversation` turns."""
    text: Turns = [
        ("user", ["Hi there."]),
        ("assistant", [REPLIES[0]]),
        ("user", ["How?"]),
        ("assistant", [REPLIES[1]]),
    ]
    images: Turns = [
        ("user", [media["odd"], "What is it?"]),
        ("assistant", [REPLIES[0]]),
        ("user", ["And", media["rgba"], "this?"]),
        ("assistant", [REPLIES[1]]),
        ("user", ["No image here."]),
        ("assistant", [REPLIES[2]]),
    ]
    return {
        "system_one_reply": [("system", [SYSTEM]), ("user", [media["odd"], "Any defects?"]), ("assistant", ["None."])],
        "system_text_multi_turn": [("system", [SYSTEM]), *text],
        "system_images_multi_turn": [("system", [SYSTEM]), *images],
        "images_multi_turn": images,
        "reasoning_multi_turn": [  # GLM-4.6V keeps the reasoning of the last reply only
            ("system", [SYSTEM]),
            ("user", [media["odd"], "What is it?"]),
            ("assistant", [f"<think>\nLook.\n</think>\n\n{REPLIES[0]}"]),
            ("user", ["Sure?"]),
            ("assistant", [f"<think>\nCheck.\n</think>\n\n{REPLIES[1]}"]),
        ],
    }


# Conversations the real processor renders but prep refuses (a template_error row naming why), with the
# reason. MiniCPM-V 4.6's template (Qwen3.5's) raises on a conversation without a user turn, which is
# what locating a reply that opens the conversation renders.
REFUSED = {("minicpmv4_6", "reply_before_user"): "No user query found in messages."}
FAMILIES = example_families()
SHAPES = [
    "system_one_reply",
    "system_text_multi_turn",
    "system_images_multi_turn",
    "images_multi_turn",
    "reasoning_multi_turn",
]


@pytest.fixture(scope="module")
def family_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ProcessorBundle]:
    root = tmp_path_factory.mktemp("families")
    return {name: load_processor(str(example_family(name).build_processor(root / name))) for name in FAMILIES}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    images = {name: cases.STANDARD_IMAGES[name] for name in ("odd", "rgba")}
    return cases.write_images(tmp_path_factory.mktemp("span_media"), images)


def _processor_ids(bundle: ProcessorBundle, conv: Conversation) -> list[int]:
    """The processor's own template text, then ``processor(text, images)`` on decoded images."""
    processor: Any = bundle.processor
    assert processor is not None, "the real processor must load here"
    text = ProcessorMixin.apply_chat_template(processor, conv.messages, tokenize=False)  # SmolVLM's reads video
    bos = bundle.tokenizer.bos_token
    images = [load_image(item.ref.path) for item in conv.media] or None
    out = processor(text=[text], images=images, add_special_tokens=not (bos and text.startswith(bos)))
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]


def _find(ids: list[int], needle: list[int], start: int = 0) -> int:
    """Index of the first occurrence of ``needle`` in ``ids`` at or after ``start``; -1 if none."""
    for i in range(start, len(ids) - len(needle) + 1):
        if ids[i : i + len(needle)] == needle:
            return i
    return -1


def _reply_mask(bundle: ProcessorBundle, ids: list[int], markers: Markers) -> tuple[np.ndarray, list[str]]:
    """1 on every token from the end of each opener to the end of its closer; the replies' decoded text."""
    tok = bundle.tokenizer
    opener = tok(markers.opener, add_special_tokens=False)["input_ids"]
    mask = np.zeros(len(ids), dtype=np.uint8)
    texts = []
    pos = _find(ids, opener)
    prefills = [tok(text, add_special_tokens=False)["input_ids"] for text in markers.prefill]
    while pos != -1:
        start = pos + len(opener)
        start += next((len(pre) for pre in prefills if ids[start : start + len(pre)] == pre), 0)
        if markers.closer is None:
            stop = _find(ids, tok("<|user|>", add_special_tokens=False)["input_ids"], start)
            end = len(ids) if stop == -1 else stop
        else:
            closer = tok(markers.closer, add_special_tokens=False)["input_ids"]
            end = _find(ids, closer, start) + len(closer)
            assert end >= len(closer), f"no {markers.closer!r} after a reply"
            if markers.space_token and end < len(ids) and tok.convert_ids_to_tokens(ids[end]).startswith("▁"):
                end += 1
        mask[start:end] = 1
        texts.append(tok.decode(ids[start:end]))
        pos = _find(ids, opener, end)
    return mask, texts


@pytest.fixture(autouse=True)
def _smolvlm_without_num2words(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolVLM's processor imports num2words lazily for video text; images never use it."""
    if processing_smolvlm.num2words is None:
        monkeypatch.setattr(processing_smolvlm, "num2words", str)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_the_processor_and_the_mask_covers_exactly_the_replies(family_bundles, media, family, shape):
    bundle = family_bundles[family]
    tokenizer = SampleTokenizer(bundle)
    conv = tokenizer.for_template(cases.conversation(_shapes(media)[shape], join_text_turns=True))
    if (family, shape) in REFUSED:
        _processor_ids(bundle, conv)  # the real processor renders it
        with pytest.raises(SampleError, match=REFUSED[family, shape]) as err:
            tokenizer.tokenize(conv, VideoSampling())
        assert err.value.reason == Reason.TEMPLATE_ERROR
        return
    sample = tokenizer.tokenize(conv, VideoSampling())
    ids = _processor_ids(bundle, conv)
    assert sample.input_ids == ids
    expected, texts = _reply_mask(bundle, ids, MARKERS[family])
    replies = [m for m in conv.messages if m["role"] == "assistant"]
    assert len(texts) == len(replies)
    for text, message in zip(texts, replies, strict=True):
        content = message["content"]
        reply = content if isinstance(content, str) else "".join(c["text"] for c in content)
        assert reply.split("</think>")[-1].strip() in text, (text, reply)
    assert np.array_equal(sample.loss_mask, expected), (cases.learned_ids(sample), np.flatnonzero(expected))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reply_before_any_user_turn_trains_on_its_text_only(family_bundles, family):
    """Regression: an opening reply was trained from character 0 (the default system prompt, BOS and
    header included). Templates that refuse such a conversation (Gemma 3, pixtral-12b) are refused alike."""
    bundle = family_bundles[family]
    tokenizer = SampleTokenizer(bundle)
    conv = tokenizer.for_template(
        cases.conversation(
            [("assistant", ["Welcome."]), ("user", ["Hi"]), ("assistant", ["Hello."])], join_text_turns=True
        )
    )
    if (family, "reply_before_user") in REFUSED:
        _processor_ids(bundle, conv)  # the real processor renders it
        with pytest.raises(SampleError, match=REFUSED[family, "reply_before_user"]) as refused:
            tokenizer.tokenize(conv, VideoSampling())
        assert refused.value.reason == Reason.TEMPLATE_ERROR
        return
    try:
        ids = _processor_ids(bundle, conv)
    except Exception as exc:  # the template raises (roles must alternate): ours is a template_error row
        with pytest.raises(SampleError) as err:
            tokenizer.tokenize(conv, VideoSampling())
        assert err.value.reason == Reason.TEMPLATE_ERROR and str(exc)[:40] in str(err.value)
        return
    sample = tokenizer.tokenize(conv, VideoSampling())
    assert sample.input_ids == ids
    learned = np.flatnonzero(sample.loss_mask)
    first, *_ = np.split(learned, np.flatnonzero(np.diff(learned) > 1) + 1)
    markers = MARKERS[family]
    closer = (markers.closer or "") + (" [INST]" if markers.space_token else "")
    assert bundle.tokenizer.decode(ids[first[0] : first[-1] + 1]).strip() == ("Welcome." + closer).strip()
    assert "Welcome" not in bundle.tokenizer.decode(ids[: first[0]])
    expected, _ = _reply_mask(bundle, ids, markers)  # the later reply, found after its opener as above
    assert np.array_equal(sample.loss_mask[first[-1] + 1 :], expected[first[-1] + 1 :])


def test_every_family_has_markers():
    assert set(MARKERS) == set(FAMILIES)


# Synthetic templates on a real tokenizer: what the derivation accepts and what it refuses, and why.
COUNTED = "{{ messages | length }}|{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>{% endfor %}"
LAST_CLOSES_OTHERWISE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ '<END>' if loop.last else '<SEP>' }}{% endfor %}"
)
RECAP = "{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>{% endfor %}recap: {{ messages[-1].content }}"
TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "How?"},
    {"role": "assistant", "content": "Fine."},
]


def _spans(bundle: ProcessorBundle, template: str) -> list[str]:
    rendered = render_with_spans(bundle.tokenizer, template, TURNS)
    return [rendered.text[a:b] for a, b in rendered.assistant_spans]


def test_a_template_that_rewrites_its_start_still_gives_exact_spans(family_bundles):
    """The message count at the start changes with every prefix: no prefix is a prefix of the whole."""
    bundle = family_bundles["qwen2_vl"]
    assert not render(bundle.tokenizer, COUNTED, TURNS, generation_prompt=False).startswith(
        render(bundle.tokenizer, COUNTED, TURNS[:2], generation_prompt=False)
    )
    assert _spans(bundle, COUNTED) == ["Hello.<end>", "Fine.<end>"]


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (LAST_CLOSES_OTHERWISE, "the reply ends with '<END>' when the conversation ends there, but not inside it"),
        (RECAP, "it does not render the reply's text exactly once"),
    ],
    ids=["end_of_turn_differs", "reply_rendered_twice"],
)
def test_a_template_that_is_not_prefix_stable_is_a_template_error_naming_why(family_bundles, template, why):
    with pytest.raises(SampleError, match="cannot derive an assistant mask") as err:
        _spans(family_bundles["qwen2_vl"], template)
    assert err.value.reason == Reason.TEMPLATE_ERROR and why in str(err.value)


# Qwen3.5-like: the last reply's inline reasoning goes into a block of its own, earlier replies lose it.
MOVES_REASONING = (
    "{% if count %}<n={{ messages[-1].content | length }}>{% endif %}{% for m in messages %}<{{ m.role }}>"
    "{% set r = m.content.split('</think>')[0].split('<think>')[-1] if '</think>' in m.content else '' %}"
    "{% set a = m.content.split('</think>')[-1] %}"
    "{% if m.role == 'assistant' and loop.last %}<think>{{ r | trim }}</think>{{ a | trim }}"
    "{% elif m.role == 'assistant' %}{{ a | trim }}{% else %}{{ m.content }}{% endif %}<end>{% endfor %}"
    "{% if add_generation_prompt %}<assistant><think></think>{% endif %}"
)
REASONED = [*TURNS[:3], {"role": "assistant", "content": "<think> Hm. </think> Fine."}]


def test_a_reply_whose_reasoning_the_template_moves_trains_on_reasoning_and_answer(family_bundles):
    """MiniCPM-V 4.6 (Qwen3.5) renders the last reply as "<think>\\n{reasoning}\\n</think>\\n\\n{answer}":
    the span starts at the reasoning, where a thinking generation prompt ends."""
    rendered = render_with_spans(family_bundles["qwen2_vl"].tokenizer, MOVES_REASONING, REASONED)
    assert [rendered.text[a:b] for a, b in rendered.assistant_spans] == ["Hello.<end>", "Hm.</think>Fine.<end>"]


def test_a_moved_reasoning_that_also_changes_another_turn_is_a_template_error(family_bundles):
    """The same template writing the last reply's length at the start: swapping the reply changes more than
    the reply, so its span is not guessed."""
    bundle = family_bundles["qwen2_vl"]
    template = "{% set count = true %}" + MOVES_REASONING
    with pytest.raises(SampleError, match="changes how it renders the other turns") as err:
        render_with_spans(bundle.tokenizer, template, REASONED)
    assert err.value.reason == Reason.TEMPLATE_ERROR
