"""LLaVA-OneVision / LLaVA-NeXT: the closed form against the real processors, built offline.

Processor directories come from :mod:`families.llava.example`:

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

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.image_processing_utils import select_best_resolution
from transformers.image_utils import load_image
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from families.counter import MediaRejected
from families.llava.counter import LlavaCounter
from families.llava.example import build_next_dir, build_onevision_dir
from families.processor import ProcessorBundle
from families.registry import find_counter
from prep.sources.conversation import Conversation
from prep.tokenize.core import SampleTokenizer, splice_media
from prep.tokenize.encode import tokenize_rendered
from prep.tokenize.template import render_with_spans
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from tests.tokenize.families import cases

CHECKPOINTS = {"llava_onevision": build_onevision_dir, "llava_next": build_next_dir}
IMAGES = {
    **cases.STANDARD_IMAGES,
    "odd2": (1023, 767, "RGB", "JPEG", None),
    "exif6": (900, 200, "RGB", "JPEG", 6),  # stored 900x200, shown 200x900
    "rgba": (500, 300, "RGBA", "PNG", None),
    "gray": (700, 350, "L", "PNG", None),
    "h1": (1000, 1, "RGB", "PNG", None),
    "h3": (40, 3, "RGB", "PNG", None),  # 3 rows: looks like a channel axis to naive code
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {name: build(root / name) for name, build in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def bundles(dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return cases.load_bundles(dirs)


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("llava_media"), IMAGES, video=True)


def _hf_nested(bundle: ProcessorBundle, conv: Conversation, **kwargs: Any) -> dict[str, Any]:
    """``apply_chat_template(tokenize=True)``: HF loads the paths; a conversation's images are one batch entry."""
    return cases.chat_template_output(bundle, conv.messages, [item.ref.path for item in conv.media], **kwargs)


def test_load_builds_the_real_processors_and_reads_their_settings(bundles):
    ov, nx = bundles["llava_onevision"], bundles["llava_next"]
    # the real class with torchvision installed, else its image-only subclass (the video processor needs torchvision)
    names = [cls.__name__ for cls in type(ov.processor).__mro__]
    assert names[0] == "LlavaOnevisionProcessor" or names[1] == "LlavaOnevisionProcessor"
    assert type(nx.processor).__name__ == "LlavaNextProcessor"
    c_ov, c_nx = (find_counter(b.processor_class)(b) for b in (ov, nx))
    assert isinstance(c_ov, LlavaCounter) and isinstance(c_nx, LlavaCounter)
    s_ov, s_nx = c_ov.settings, c_nx.settings
    assert (s_ov.feature_rows, s_ov.base_features, s_ov.max_num_patches, s_ov.drop_one) == (27, 729, 9, False)
    assert (s_ov.tiles.cut, s_ov.tiles.tile_height, len(s_ov.tiles.pinpoints)) == (384, 384, 36)
    assert (s_nx.feature_rows, s_nx.base_features, s_nx.max_num_patches, s_nx.drop_one) == (24, 577, None, True)
    assert (s_nx.tiles.cut, s_nx.tiles.tile_height, len(s_nx.tiles.pinpoints)) == (336, 336, 5)
    assert c_ov.image_token_id == ov.tokenizer.convert_tokens_to_ids("<image>") == ov.processor.image_token_id
    assert c_nx.image_token_id == nx.tokenizer.convert_tokens_to_ids("<image>") == nx.processor.image_token_id
    # <image> is a special token: the expansion cannot merge with neighbouring text, ids are spliced
    assert all(b.tokenizer.tokenize("a<image>b")[1] == "<image>" for b in (ov, nx))
    # module docstring's worked examples
    assert (c_nx.count_image(800, 600).num_tokens, c_nx.num_tiles(800, 600)) == (2340, 5)
    assert (c_ov.count_image(800, 600).num_tokens, c_ov.num_tiles(800, 600)) == (4725, 7)


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("name", [*IMAGES, "huge"])
def test_single_image_equals_the_processor(bundles, media, checkpoint, name):
    bundle = bundles[checkpoint]
    conv = cases.conversation([("user", [media[name], "Describe it."]), ("assistant", ["A picture."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    hf = _hf_nested(bundle, conv)
    assert sample.input_ids == hf["input_ids"]
    if name != "huge":  # one image: the flat call is the same call (decoding 48 MP twice costs ~10 s)
        assert sample.input_ids == cases.flat_processor_ids(bundle, conv)
    (_, count), tiles = sample.media[0], len(hf["pixel_values"][0])
    assert count.num_tiles == tiles  # pixel_values' patch dimension (one image: no batch padding)
    assert [count.height, count.width] == hf["image_sizes"]  # EXIF-transposed size, as HF loads it


def _multi(media: cases.MediaFiles, system: bool = True) -> Conversation:
    return cases.conversation(cases.images_in_turns(media, "exif6", system=system))


def test_onevision_many_images_equal_the_flat_processor_call_and_its_mask(bundles, media):
    bundle = bundles["llava_onevision"]
    conv = _multi(media)
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == cases.flat_processor_ids(bundle, conv)
    assert [c.num_tiles > 1 for _, c in sample.media] == [True] * 5  # flat: every image tiled
    # mask: HF's {% generation %} spans (reply text) plus each reply's <|im_end|>\n, nothing else
    tok = bundle.tokenizer
    learned = tok.decode(cases.learned_ids(sample))
    assert learned == "First answer.<|im_end|>\nSecond answer.<|im_end|>\nThird.<|im_end|>\n"


def test_onevision_mask_contains_the_hf_generation_mask(bundles, media):
    """One image in all (nested == flat): HF's assistant mask = ours minus each <|im_end|>, \\n."""
    bundle = bundles["llava_onevision"]
    conv = cases.conversation(
        [
            ("user", [media["odd"], "What is it?"]),
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


def test_onevision_nested_images_follow_the_multi_image_rule(bundles, media):
    """apply_chat_template nests a conversation's images: each is one 384 tile, 729 + 1 tokens."""
    bundle = bundles["llava_onevision"]
    counter = LlavaCounter.from_processor(bundle)
    conv = _multi(media)
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


def test_next_many_images_and_turns_equal_the_processor(bundles, media):
    bundle = bundles["llava_next"]
    conv = _multi(media, system=False)  # the template reads a system turn's content[0]['text'] only
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _hf_nested(bundle, conv)["input_ids"] == cases.flat_processor_ids(bundle, conv)
    image_id = bundle.tokenizer.convert_tokens_to_ids("<image>")
    ignored = cases.ignored_ids(sample)
    assert ignored.count(image_id) == sum(c.num_tokens for _, c in sample.media)
    # mask: the replies as rendered, ' ' + content[0]['text'] + '</s> ' (the template renders only the
    # first text item: "Second", as HF does); SentencePiece folds each reply's trailing space into
    # the next turn's '▁[INST]', which the overlap rule therefore masks 1 too.
    tok = bundle.tokenizer
    learned = tok.decode(cases.learned_ids(sample))
    assert learned == "First answer.</s> [INST] Second</s> [INST] Third.</s> "


def test_next_takes_no_video(bundles):
    cases.assert_video_unsupported(find_counter("LlavaNextProcessor")(bundles["llava_next"]))


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


def test_onevision_video_sample_is_counted_in_closed_form(bundles, media):
    bundle = bundles["llava_onevision"]
    conv = cases.video_conversation(media["clip"], reply="Nothing.")
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling(fps=2.0))
    (_, count) = sample.media[0]
    assert count.frame_indices == (0, 2, 4, 6) and count.num_tokens == 4 * 196 + 1
    video_id = bundle.tokenizer.convert_tokens_to_ids("<video>")
    assert sample.input_ids.count(video_id) == count.num_tokens


def _property_sizes(rng: random.Random, n: int, top: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..top, a fifth of them on or next to a pinpoint side."""
    sizes = []
    for _ in range(n):
        w, h = cases.log_uniform_pair(rng, top)
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
    tile = counter.settings.tiles.tile_height
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


def test_stage_stores_the_processor_ids(dirs, bundles, media, tmp_path):
    """``prep tokenize`` (LOCAL) on a small ShareGPT dataset, every sample verified by the stage too."""
    names = sorted(path.name for name, path in media.paths.items() if name not in ("huge", "clip"))
    records = [cases.exchange(f"<image>Describe {n}.", "ok", images=[n]) for n in names[:6]]
    records.append(cases.exchange("abc<image><image>def", "Two.", images=[names[0], names[1]]))
    run = cases.run_stage(tmp_path, dirs["llava_onevision"], media.root, records)
    assert run.errors == []
    assert len(run.rows) == len(records) and run.manifest.verify.checked == len(run.rows)
    tok = SampleTokenizer(bundles["llava_onevision"])
    assert tok.content_lists  # the template drops string replies: they go in as content lists
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.flat_processor_ids(bundles["llava_onevision"], tok.for_template(conv))
