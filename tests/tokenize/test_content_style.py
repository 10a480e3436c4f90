"""Templates that drop plain-string turns get content lists; the reply is rendered and learned.

Truth: the real processor's own ``apply_chat_template`` on the content-list form of the same
conversation, and the reply text found under the loss mask. Templates that render strings
(Qwen) keep their messages unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from families.processor import load_processor
from families.registry import example_family
from prep.sources.conversation import Conversation, MediaItem
from prep.tokenize.content_style import as_content_lists, needs_content_lists
from prep.tokenize.core import SampleTokenizer
from schemas.dataset_config import VideoSampling
from schemas.media_ref import MediaRef

REPLY = "A small grey cat sits on the mat."


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    path = tmp_path_factory.mktemp("img") / "a.png"
    Image.new("RGB", (500, 300), (40, 90, 200)).save(path)
    return path


def _conversation(image: Path) -> Conversation:
    return Conversation(
        messages=[
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": "And the colour?"},
            {"role": "assistant", "content": "Grey."},
        ],
        media=[MediaItem(kind="image", ref=MediaRef.parse(str(image)))],
    )


@pytest.mark.parametrize(("family", "lists"), [("llava_onevision", True), ("idefics3", True), ("qwen2_vl", False)])
def test_string_replies_are_rendered_and_learned(tmp_path: Path, image: Path, family: str, lists: bool) -> None:
    bundle = load_processor(str(example_family(family).build_processor(tmp_path / "p")))
    assert needs_content_lists(bundle.tokenizer, bundle.chat_template) is lists
    tok = SampleTokenizer(bundle)
    conv = _conversation(image)
    sample = tok.tokenize(conv, VideoSampling())
    learned = bundle.tokenizer.decode(np.asarray(sample.input_ids)[sample.loss_mask.astype(bool)])
    assert REPLY in learned and "Grey." in learned
    messages = as_content_lists(conv.messages) if lists else conv.messages
    expected = bundle.processor.apply_chat_template(
        [m if m["role"] == "assistant" or isinstance(m["content"], str) else _with_path(m, image) for m in messages],
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert sample.input_ids == list(np.asarray(expected).reshape(-1))


def _with_path(message: dict, image: Path) -> dict:
    """The processor decodes the image itself when the item carries its path."""
    items = [{**c, "path": str(image)} if c.get("type") == "image" else c for c in message["content"]]
    return {**message, "content": items}
