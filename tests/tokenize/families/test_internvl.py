"""InternVL 3 / 3.5: the closed-form counter against the real ``InternVLProcessor`` offline.

The processor directory is :mod:`prep.example.families.internvl`'s (``prep example --family
internvl``): the example byte-level BPE plus the InternVL added
tokens (``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ``<quad>`` ... ``</box>``, ``<video>``, as
transformers' ``convert_internvl_weights_to_hf.write_tokenizer`` adds them to the Qwen2.5
tokenizer, with the same ``extra_special_tokens`` names), the chat template of that script (the
one the ``-hf`` checkpoints ship), and the image / processor settings of
``OpenGVLab/InternVL3-1B-hf`` (``preprocessor_config.json``: GotOcr2, 448x448 tiles,
``crop_to_patches: false``, patches 1..12; ``processor_config.json``: ``image_seq_length`` 256).
InternVL3.5-hf checkpoints share the tokenizer format, template and GotOcr2 settings.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image

from prep.example.families.internvl import build_internvl_dir
from prep.sources.conversation import Conversation, MediaItem
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.errors import SampleError
from prep.tokenize.families.internvl import InternVLCounter
from prep.tokenize.processor import ProcessorBundle, load_processor
from schemas.dataset_config import VideoSampling
from schemas.media_ref import MediaRef
from schemas.reasons import Reason


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ProcessorBundle:
    return load_processor(str(build_internvl_dir(tmp_path_factory.mktemp("internvl"))))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("internvl_images")
    rng = np.random.default_rng(0)

    def noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
        return Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode)

    out: dict[str, Path] = {}
    for name, (w, h) in {
        "tiny1": (1, 1),
        "tiny10": (10, 10),
        "wide": (3000, 16),
        "tall": (16, 3000),
        "extreme": (4100, 20),  # > 200:1 (Qwen would reject it; InternVL tiles it 12x1)
        "odd": (333, 517),
        "odd2": (1023, 767),
        "square_tie": (634, 634),  # 1x1 / 2x2 / 3x3 tie broken by area
    }.items():
        out[name] = root / f"{name}.png"
        noise(w, h).save(out[name])
    out["huge"] = root / "huge.jpg"
    Image.new("RGB", (8000, 6000), (10, 200, 30)).save(out["huge"], quality=50)
    out["exif"] = root / "exif.jpg"  # stored 900x200, orientation 6: shown 200x900
    exif = Image.Exif()
    exif[0x0112] = 6
    noise(900, 200).save(out["exif"], exif=exif.tobytes())
    out["rgba"] = root / "rgba.png"
    noise(500, 300, "RGBA").save(out["rgba"])
    out["gray"] = root / "gray.png"
    noise(700, 350, "L").save(out["gray"])
    return out


def _conv(turns: list[tuple[str, list[str | Path]]]) -> Conversation:
    """Turns of (role, parts); a Path part is an image, a str part is text."""
    messages: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    for role, parts in turns:
        if all(isinstance(p, str) for p in parts):
            messages.append({"role": role, "content": "".join(str(p) for p in parts)})
            continue
        content: list[dict[str, str]] = []
        for part in parts:
            if isinstance(part, Path):
                content.append({"type": "image"})
                media.append(MediaItem(kind="image", ref=MediaRef(path=str(part))))
            else:
                content.append({"type": "text", "text": part})
        messages.append({"role": role, "content": content})
    return Conversation(messages=messages, media=media)


def _processor_ids(bundle: ProcessorBundle, conv: Conversation) -> list[int]:
    """The oracle: HF's template render + ``processor(text=..., images=...)`` on decoded images."""
    processor = bundle.processor
    assert processor is not None
    text = processor.apply_chat_template(conv.messages, tokenize=False)
    pixels = [load_image(item.ref.path) for item in conv.media] or None
    return processor(text=[text], images=pixels)["input_ids"][0]


SINGLE = ["tiny1", "tiny10", "wide", "tall", "extreme", "odd", "odd2", "square_tie", "huge", "exif", "rgba", "gray"]


@pytest.mark.parametrize("name", SINGLE)
def test_single_image_equals_processor(bundle, images, name):
    conv = _conv([("user", [images[name], "Describe it."]), ("assistant", ["A picture."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, conv)


def test_crop_to_patches_comes_from_the_processor_class(bundle):
    assert bundle.image_processor.crop_to_patches is False  # the file says false...
    counter = InternVLCounter.from_processor(bundle)
    assert counter.crop_to_patches is True  # ...InternVLProcessor.images_kwargs says True
    assert counter.num_tiles(800, 600) == 13
    assert counter.count_image(800, 600).num_tokens == 13 * 256


def test_many_images_turns_and_touching_text(bundle, images):
    conv = _conv(
        [
            ("system", ["You are helpful."]),
            ("user", ["abc", images["odd"], images["wide"], "xyz", images["gray"], "end"]),
            ("assistant", ["First answer."]),
            ("user", [images["exif"], "again?", images["tiny1"]]),
            ("assistant", ["Second", " answer."]),
            ("user", ["no image here"]),
            ("assistant", ["Third."]),
        ]
    )
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, conv)
    assert [c.kind for _, c in sample.media] == ["image"] * 5
    # loss mask: exactly the assistant replies, each with its <|im_end|>\n
    learned = bundle.tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert learned == "First answer.<|im_end|>\nSecond answer.<|im_end|>\nThird.<|im_end|>\n"
    ignored = [t for t, m in zip(sample.input_ids, sample.loss_mask) if not m]
    context_id = bundle.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert ignored.count(context_id) == sample.num_media_tokens == sum(c.num_tokens for _, c in sample.media)


def test_video_sample_is_exact_or_a_clear_error_row(bundle, tmp_path):
    conv = Conversation(
        messages=[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        media=[MediaItem(kind="video", ref=MediaRef(path=str(tmp_path / "clip.mp4")))],
    )
    if getattr(bundle.processor, "video_processor", None) is not None:
        pytest.skip("torchvision present: video runs the real processor (covered by its own path)")
    with pytest.raises(SampleError) as info:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert info.value.reason == Reason.PROCESSOR_REJECTED
    assert "real processor" in str(info.value)


def _random_sizes(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """Half fully random (log-uniform sides), half exact grid aspect ratios at random scale (ties)."""
    rng = random.Random(seed)
    grids = [(c, r) for c in range(1, 13) for r in range(1, 13) if c * r <= 12]
    sizes = []
    for i in range(count):
        if i % 2:
            sizes.append((int(2 ** rng.uniform(0, 11.5)), int(2 ** rng.uniform(0, 11.5))))
        else:
            c, r = rng.choice(grids)
            k = rng.randint(1, max(1, 2400 // max(c, r)))
            sizes.append((c * k, r * k))
    return sizes


def test_tile_count_matches_pil_image_processor_on_500_sizes(bundle):
    counter = InternVLCounter.from_processor(bundle)
    ip = bundle.image_processor
    kwargs = {"crop_to_patches": True, "do_rescale": False, "do_normalize": False}
    for width, height in _random_sizes(500):
        image = Image.new("RGB", (width, height), (90, 20, 160))
        num_patches = ip(images=[image], **kwargs)["num_patches"][0]
        assert counter.num_tiles(width, height) == num_patches, (width, height)


def test_other_image_processor_is_refused_not_guessed(bundle):
    from dataclasses import replace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from prep.tokenize.processor import ProcessorLoadError

    with pytest.raises(ProcessorLoadError, match="GotOcr2"):
        InternVLCounter.from_processor(replace(bundle, image_processor=Qwen2VLImageProcessorPil()))
