"""LLaVA-OneVision / LLaVA-NeXT: the closed form against the real processors, built offline.

Processor directories come from :mod:`prep.example.families.llava`:

- ``llava_onevision``: llava-hf/llava-onevision-qwen2-0.5b-ov-hf settings (Qwen2 BPE format +
  ``<image>``/``<video>``, 36 pinpoints 384..2304, 729 features per tile, "full", anyres_max_9)
  and the template of transformers' ``convert_llava_onevision_weights_to_hf.py``.
- ``llava_next``: llava-hf/llava-v1.6-mistral-7b-hf settings (SentencePiece-style BPE with
  ``<s>`` + ``<image>``/``<pad>``, pinpoints 336..1008, patch 14, "default", +1 CLS) and the
  checkpoint's ``chat_template.json``.

Oracles: the processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths* (it
decodes and EXIF-transposes them itself) and ``processor(text=..., images=[...])`` with a flat
image list, as packvlm calls it. The two differ for OneVision samples with several images
(``batch_num_images``); both rules are checked.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image
from transformers.image_processing_utils import select_best_resolution
from transformers.image_utils import load_image
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from prep.example.families.llava import build_next_dir, build_onevision_dir
from prep.example.media import make_image_bytes, write_video
from prep.run import LOCAL
from prep.sources.conversation import Conversation, MediaItem
from prep.sources.formats.sharegpt import to_conversation
from prep.sources.media import VideoMeta
from prep.tokenize.core import SampleTokenizer, splice_media
from prep.tokenize.errors import SampleError
from prep.tokenize.families.base import MediaRejected, find_counter
from prep.tokenize.families.llava import LlavaCounter
from prep.tokenize.processor import ProcessorBundle, load_processor
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from prep.tokenize.template import render_with_spans, tokenize_rendered
from schemas.dataset_config import VideoSampling, load_dataset_config
from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from schemas.media_ref import MediaRef
from schemas.reasons import Reason
from schemas.tokenized import list_parts, open_part

CHECKPOINTS = {"llava_onevision": build_onevision_dir, "llava_next": build_next_dir}
# name -> (width, height, mode, format, EXIF orientation)
IMAGES = {
    "tiny1": (1, 1, "RGB", "PNG", None),
    "tiny10": (10, 10, "RGB", "JPEG", None),
    "wide": (3000, 16, "RGB", "PNG", None),
    "tall": (16, 3000, "RGB", "PNG", None),
    "ratio205": (4100, 20, "RGB", "PNG", None),  # > 200:1
    "odd": (333, 517, "RGB", "JPEG", None),
    "odd2": (1023, 767, "RGB", "JPEG", None),
    "h1": (1000, 1, "RGB", "PNG", None),
    "h3": (40, 3, "RGB", "PNG", None),  # 3 rows: looks like a channel axis to naive code
    "exif6": (900, 200, "RGB", "JPEG", 6),  # stored 900x200, shown 200x900
    "exif8": (1300, 200, "RGB", "JPEG", 8),
    "rgba": (500, 300, "RGBA", "PNG", None),
    "gray": (700, 350, "L", "PNG", None),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {name: build(root / name) for name, build in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def bundles(dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return {name: load_processor(str(path)) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llava_media")
    for name, (width, height, mode, fmt, orientation) in IMAGES.items():
        suffix = "jpg" if fmt == "JPEG" else "png"
        (root / f"{name}.{suffix}").write_bytes(make_image_bytes(width, height, mode, fmt, orientation, seed=width))
    Image.new("RGB", (8000, 6000), (30, 120, 200)).save(root / "huge.jpg", quality=50)
    write_video(root / "clip.mp4", 8, 4.0, 64, 48)
    return root


def _path(media_dir: Path, name: str) -> Path:
    return next(p for p in media_dir.iterdir() if p.stem == name)


def _conv(turns: list[tuple[str, list[str | Path]]]) -> Conversation:
    """Turns of (role, parts): a Path is an image, a str is text; content is always a list
    (the checkpoints' templates iterate over content items)."""
    messages: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    for role, parts in turns:
        content: list[dict[str, str]] = []
        for part in parts:
            if isinstance(part, Path):
                content.append({"type": "image"})
                media.append(MediaItem(kind="image", ref=MediaRef(path=str(part))))
            else:
                content.append({"type": "text", "text": part})
        messages.append({"role": role, "content": content})
    return Conversation(messages=messages, media=media)


def _with_paths(conv: Conversation) -> list[dict[str, Any]]:
    paths = iter(item.ref.path for item in conv.media)
    return [
        {**m, "content": [{"type": "image", "path": next(paths)} if c["type"] == "image" else c for c in m["content"]]}
        for m in conv.messages
    ]


def _hf_nested(bundle: ProcessorBundle, conv: Conversation, **kwargs: Any) -> dict[str, Any]:
    """``apply_chat_template(tokenize=True)``: HF loads the paths; a conversation's images are one batch entry."""
    assert bundle.processor is not None
    out: Any = bundle.processor.apply_chat_template(_with_paths(conv), tokenize=True, return_dict=True, **kwargs)
    return {k: np.asarray(v[0]).tolist() if k != "pixel_values" else v for k, v in out.items()}


def _hf_flat(bundle: ProcessorBundle, conv: Conversation) -> list[int]:
    """``processor(text=[text], images=[...])`` with a flat image list, as packvlm calls it."""
    processor = bundle.processor
    assert processor is not None
    text = processor.apply_chat_template(conv.messages, tokenize=False)
    images = [load_image(item.ref.path) for item in conv.media] or None
    return [int(t) for t in np.asarray(processor(text=[text], images=images)["input_ids"][0]).tolist()]


def test_load_builds_the_real_processors_and_reads_their_settings(bundles):
    ov, nx = bundles["llava_onevision"], bundles["llava_next"]
    assert type(ov.processor).__mro__[1].__name__ == "LlavaOnevisionProcessor"  # image-only subclass (no torchvision)
    assert type(nx.processor).__name__ == "LlavaNextProcessor"
    c_ov, c_nx = (find_counter(b.processor_class)(b) for b in (ov, nx))
    assert isinstance(c_ov, LlavaCounter) and isinstance(c_nx, LlavaCounter)
    assert (c_ov.feature_rows, c_ov.base_features, c_ov.max_num_patches, c_ov.drop_one) == (27, 729, 9, False)
    assert (c_ov.layout.cut, c_ov.layout.tile_height, len(c_ov.layout.pinpoints)) == (384, 384, 36)
    assert (c_nx.feature_rows, c_nx.base_features, c_nx.max_num_patches, c_nx.drop_one) == (24, 577, None, True)
    assert (c_nx.layout.cut, c_nx.layout.tile_height, len(c_nx.layout.pinpoints)) == (336, 336, 5)
    assert c_ov.image_token_id == ov.tokenizer.convert_tokens_to_ids("<image>") == ov.processor.image_token_id
    assert c_nx.image_token_id == nx.tokenizer.convert_tokens_to_ids("<image>") == nx.processor.image_token_id
    # <image> is a special token: the expansion cannot merge with neighbouring text, ids are spliced
    assert all(b.tokenizer.tokenize("a<image>b")[1] == "<image>" for b in (ov, nx))
    # module docstring's worked examples
    assert (c_nx.count_image(800, 600).num_tokens, c_nx.num_tiles(800, 600)) == (2340, 5)
    assert (c_ov.count_image(800, 600).num_tokens, c_ov.num_tiles(800, 600)) == (4725, 7)


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("name", [*IMAGES, "huge"])
def test_single_image_equals_the_processor(bundles, media_dir, checkpoint, name):
    bundle = bundles[checkpoint]
    conv = _conv([("user", [_path(media_dir, name), "Describe it."]), ("assistant", ["A picture."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    hf = _hf_nested(bundle, conv)
    assert sample.input_ids == hf["input_ids"]
    if name != "huge":  # one image: the flat call is the same call (decoding 48 MP twice costs ~10 s)
        assert sample.input_ids == _hf_flat(bundle, conv)
    (_, count), tiles = sample.media[0], len(hf["pixel_values"][0])
    assert count.num_tiles == tiles  # pixel_values' patch dimension (one image: no batch padding)
    assert [count.height, count.width] == hf["image_sizes"]  # EXIF-transposed size, as HF loads it


MULTI = [
    ("system", ["You are helpful."]),
    ("user", ["abc", "odd", "wide", "xyz", "gray", "end"]),
    ("assistant", ["First answer."]),
    ("user", ["exif6", "again?", "tiny1"]),
    ("assistant", ["Second", " answer."]),
    ("user", ["no image here"]),
    ("assistant", ["Third."]),
]


def _multi(media_dir: Path, system: bool = True) -> Conversation:
    turns = [
        (role, [_path(media_dir, p) if p in IMAGES else p for p in parts])
        for role, parts in MULTI
        if system or role != "system"
    ]
    return _conv(turns)


def test_onevision_many_images_equal_the_flat_processor_call_and_its_mask(bundles, media_dir):
    bundle = bundles["llava_onevision"]
    conv = _multi(media_dir)
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _hf_flat(bundle, conv)
    assert [c.num_tiles > 1 for _, c in sample.media] == [True] * 5  # flat: every image tiled
    # mask: HF's {% generation %} spans (reply text) plus each reply's <|im_end|>\n, nothing else
    tok = bundle.tokenizer
    learned = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    assert learned == "First answer.<|im_end|>\nSecond answer.<|im_end|>\nThird.<|im_end|>\n"


def test_onevision_mask_contains_the_hf_generation_mask(bundles, media_dir):
    """One image in all (nested == flat): HF's assistant mask = ours minus each <|im_end|>, \\n."""
    bundle = bundles["llava_onevision"]
    conv = _conv(
        [
            ("user", [_path(media_dir, "odd"), "What is it?"]),
            ("assistant", ["A cat."]),
            ("user", ["And now?"]),
            ("assistant", ["Still", " a cat."]),
        ]
    )
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    hf = _hf_nested(bundle, conv, return_assistant_tokens_mask=True)
    assert sample.input_ids == hf["input_ids"]
    ours = np.asarray(sample.loss_mask, dtype=bool)
    theirs = np.asarray(hf["assistant_masks"], dtype=bool)
    assert not (theirs & ~ours).any()
    extra = [sample.input_ids[i] for i in np.flatnonzero(ours & ~theirs)]
    end, newline = bundle.tokenizer.convert_tokens_to_ids("<|im_end|>"), bundle.tokenizer.encode("\n")[0]
    assert extra == [end, newline, end, newline]


def test_onevision_nested_images_follow_the_multi_image_rule(bundles, media_dir):
    """apply_chat_template nests a conversation's images: each is one 384 tile, 729 + 1 tokens."""
    bundle = bundles["llava_onevision"]
    counter = LlavaCounter.from_processor(bundle)
    conv = _multi(media_dir)
    counts = []
    for item in conv.media:
        with Image.open(item.ref.path) as im:
            shown = load_image(im).size
        counts.append((item.ref.format(), counter.count_image(*shown, multi_image=True)))
    text = tokenize_rendered(bundle.tokenizer, render_with_spans(bundle.tokenizer, bundle.chat_template, conv.messages))
    ids, _ = splice_media(text.input_ids, text.loss_mask, counts, {"image": counter.image_token_id})
    hf = _hf_nested(bundle, conv)
    assert ids == hf["input_ids"]
    assert all(c.num_tokens == 730 and c.num_tiles == 1 for _, c in counts)
    assert ids != SampleTokenizer(bundle).tokenize(conv, VideoSampling()).input_ids  # the flat call differs


def test_next_many_images_and_turns_equal_the_processor(bundles, media_dir):
    bundle = bundles["llava_next"]
    conv = _multi(media_dir, system=False)  # the template reads a system turn's content[0]['text'] only
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _hf_nested(bundle, conv)["input_ids"] == _hf_flat(bundle, conv)
    image_id = bundle.tokenizer.convert_tokens_to_ids("<image>")
    ignored = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
    assert ignored.count(image_id) == sum(c.num_tokens for _, c in sample.media)
    # mask: the replies as rendered, ' ' + content[0]['text'] + '</s> ' (the template renders only the
    # first text item: "Second", as HF does); SentencePiece folds each reply's trailing space into
    # the next turn's '▁[INST]', which the overlap rule therefore masks 1 too.
    tok = bundle.tokenizer
    learned = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    assert learned == "First answer.</s> [INST] Second</s> [INST] Third.</s> "


def test_next_takes_no_video(bundles):
    counter = find_counter("LlavaNextProcessor")(bundles["llava_next"])
    with pytest.raises(SampleError) as err:
        counter.count_video(VideoMeta(num_frames=8, fps=4.0, width=64, height=48), VideoSampling())
    assert err.value.reason == Reason.UNSUPPORTED_MEDIA


@pytest.mark.parametrize(
    ("frames", "src_fps", "fps"), [(8, 4.0, 2.0), (300, 30.0, 1.0), (7, 25.0, 2.0), (90, 29.97, 0.5)]
)
def test_onevision_video_equals_the_processors_arithmetic(bundles, frames, src_fps, fps):
    """Frame sampling = video_utils.default_sample_indices_fn; tokens = replace_video_token (no torchvision here)."""
    bundle = bundles["llava_onevision"]
    counter = LlavaCounter.from_processor(bundle)
    meta = VideoMeta(num_frames=frames, fps=src_fps, width=64, height=48)
    for sampling in (VideoSampling(fps=fps), VideoSampling(fps=None)):
        count = counter.count_video(meta, sampling)
        indices = default_sample_indices_fn(VideoMetadata(total_num_frames=frames, fps=src_fps), fps=sampling.fps)
        assert list(count.frame_indices) == indices.tolist()
        fake = {"pixel_values_videos": [np.zeros((len(indices), 3, 1, 1))]}
        assert count.num_tokens == bundle.processor.replace_video_token(fake, 0).count("<video>")
        assert count.expansion == (counter.video_token_id,) * count.num_tokens
    assert counter.processor_video_kwargs(VideoSampling(fps=fps)) == {"fps": fps, "do_sample_frames": True}


def test_onevision_video_oversampling_is_rejected_like_the_processor(bundles):
    counter = LlavaCounter.from_processor(bundles["llava_onevision"])
    with pytest.raises(ValueError):
        default_sample_indices_fn(VideoMetadata(total_num_frames=8, fps=4.0), fps=10.0)
    with pytest.raises(MediaRejected):
        counter.count_video(VideoMeta(num_frames=8, fps=4.0, width=64, height=48), VideoSampling(fps=10.0))


def test_onevision_video_sample_is_counted_in_closed_form(bundles, media_dir):
    bundle = bundles["llava_onevision"]
    conv = Conversation(
        messages=[
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Nothing."}]},
        ],
        media=[MediaItem(kind="video", ref=MediaRef(path=str(media_dir / "clip.mp4")))],
    )
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling(fps=2.0))
    (_, count) = sample.media[0]
    assert count.frame_indices == (0, 2, 4, 6) and count.num_tokens == 4 * 196 + 1
    video_id = bundle.tokenizer.convert_tokens_to_ids("<video>")
    assert sample.input_ids.count(video_id) == count.num_tokens


def _property_sizes(rng: random.Random, n: int, top: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..top, a fifth of them on or next to a pinpoint side."""
    sizes = []
    for _ in range(n):
        w, h = (max(1, int(math.exp(rng.uniform(0, math.log(top))))) for _ in range(2))
        if rng.random() < 0.2:
            w = rng.choice([336, 337, 672, 1008, 384, 385, 768, 1152, 2304, 2305]) + rng.choice([-1, 0, 1])
        sizes.append((w, h))
    return sizes


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_property_tiles_and_tokens_equal_the_image_processor(bundles, checkpoint):
    """250 sizes per checkpoint (500 in all) through the PIL image processor; 3000 more through
    the processor's own arithmetic (select_best_resolution + _get_number_of_features)."""
    bundle = bundles[checkpoint]
    processor: Any = bundle.processor
    counter = LlavaCounter.from_processor(bundle)
    ip = bundle.image_processor
    rng = random.Random(11 if checkpoint == "llava_next" else 12)
    tile = counter.layout.tile_height
    default = processor.vision_feature_select_strategy == "default"
    for width, height in _property_sizes(rng, 3000, 4000):
        expected = processor._get_number_of_features(height, width, tile, tile) - default
        assert counter.count_image(width, height).num_tokens == expected, (width, height)
        pin = select_best_resolution([height, width], ip.image_grid_pinpoints)
        assert counter.tile_grid(width, height) == (pin[0] // tile, pin[1] // tile), (width, height)
    flags = {"do_rescale": False, "do_normalize": False}
    for width, height in _property_sizes(rng, 250, 2400):
        out = ip(images=[Image.new("RGB", (width, height), (90, 20, 160))], **flags)
        assert counter.num_tiles(width, height) == out["pixel_values"][0].shape[0], (width, height)
        assert out["pixel_values"][0].shape[-2:] == (tile, tile)
        assert [int(x) for x in out["image_sizes"][0]] == [height, width]


def _table(out: Path, table: str) -> pa.Table:
    return pa.concat_tables([open_part(p) for p in list_parts(out, table)])


def test_stage_stores_the_processor_ids(dirs, bundles, media_dir, tmp_path):
    """``prep tokenize`` (LOCAL) on a small ShareGPT dataset, every sample verified by the stage too."""
    names = [p.name for p in sorted(media_dir.iterdir()) if p.suffix != ".mp4" and p.stem != "huge"]
    records = [
        {"messages": [{"role": "user", "content": f"<image>Describe {n}."}, {"role": "assistant", "content": "ok"}]}
        | {"images": [n]}
        for n in names[:6]
    ]
    records.append(
        {
            "messages": [
                {"role": "user", "content": "abc<image><image>def"},
                {"role": "assistant", "content": "Two."},
            ],
            "images": [names[0], names[1]],
        }
    )
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    config = tmp_path / "dataset_info.json"
    config.write_text(
        json.dumps({"lv": {"file_name": str(data), "formatting": "sharegpt", "media_dir": str(media_dir)}})
    )
    spec = load_dataset_config(config)[0]
    out = tmp_path / "out"
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(dirs["llava_onevision"]),
            output_dir=str(out),
            verify_fraction=1.0,
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    assert not list_parts(out, ERRORS_DIR) or _table(out, ERRORS_DIR).num_rows == 0
    rows = _table(out, SAMPLES_DIR).to_pylist()
    assert len(rows) == len(records) and manifest.verify.checked == len(rows)
    bundle = bundles["llava_onevision"]
    for row in rows:
        assert row["input_ids"] == _hf_flat(bundle, to_conversation(records[row["line"]], spec))
