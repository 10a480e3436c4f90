"""LFM2-VL: the closed-form counter against the real ``Lfm2VlProcessor`` offline.

The processor directory is :mod:`families.lfm2_vl.example`'s (``prep example --family
lfm2_vl``): the example byte-level BPE with the LFM2 special tokens (``<image>``, the 100
``<|img_row_R_col_C|>`` tile tokens, ``<|img_thumbnail|>``, ``<|image_start|>``,
``<|image_end|>``), the chat template of ``LiquidAI/LFM2-VL-450M`` verbatim, and its image
settings (``processor_config.json``: patch 16, downsample 2, 64..256 image tokens, tolerance
2.0, 2..10 tiles of 512 px, no thumbnail; ``preprocessor_config.json``: mean / std 0.5,
bilinear). Variants flip ``use_thumbnail`` and ``do_image_splitting``, and set
``use_image_special_tokens: false`` in ``processor_config.json`` (the processor ignores it: not
an ``__init__`` argument; so does the counter).

``Lfm2VlImageProcessor`` exists only in torchvision form: tests that build the real processor
are marked ``torchvision`` (CI runs them in its CUDA-torch environment); the rest run anywhere,
as ``prep tokenize`` counts LFM2-VL without torchvision.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from families.counter import MediaRejected
from families.lfm2_vl.counter import Lfm2VlCounter, plan_image
from families.lfm2_vl.example import build_lfm2_vl_dir
from families.lfm2_vl.settings import CLASS_DEFAULTS
from families.processor import ProcessorBundle, SettingsOnlyImageProcessor, load_processor
from packvlm.sample_error import SampleError
from prep.tokenize.core import SampleTokenizer
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason
from tests.tokenize.families import cases

torchvision_only = pytest.mark.torchvision
VARIANTS: dict[str, dict[str, Any]] = {
    "checkpoint": {},
    "thumbnail": {"use_thumbnail": True},
    "no_splitting": {"do_image_splitting": False},
}


def _build(root: Path, name: str) -> Path:
    out = build_lfm2_vl_dir(root / name)
    if name == "special_tokens_key":
        cases.edit_json(out / "processor_config.json", use_image_special_tokens=False)
    elif VARIANTS.get(name):
        cases.edit_json(out / "preprocessor_config.json", **VARIANTS[name])
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lfm2_vl")
    return {name: _build(root, name) for name in (*VARIANTS, "special_tokens_key")}


@pytest.fixture(scope="module")
def bundles(dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    pytest.importorskip("torchvision")
    return cases.load_bundles(dirs)


@pytest.fixture(scope="module")
def counters(bundles: dict[str, ProcessorBundle]) -> dict[str, Lfm2VlCounter]:
    return {name: Lfm2VlCounter.from_processor(bundle) for name, bundle in bundles.items()}


# --- without torchvision: the settings, the token text, worked examples --------------------------


def test_counts_without_torchvision_from_the_settings_alone(dirs, monkeypatch):
    """No torchvision: the image processor is preprocessor_config.json alone and counts are the same."""
    import families.processor as processor_module

    monkeypatch.setattr(processor_module, "is_torchvision_available", lambda: False)
    monkeypatch.setattr(processor_module.AutoProcessor, "from_pretrained", _raise_no_torchvision)
    monkeypatch.setattr(processor_module.AutoImageProcessor, "from_pretrained", _raise_no_torchvision)
    bundle = load_processor(str(dirs["thumbnail"]))
    assert isinstance(bundle.image_processor, SettingsOnlyImageProcessor)
    assert bundle.processor is None and bundle.processor_class == "Lfm2VlProcessor"
    counter = Lfm2VlCounter.from_processor(bundle)
    assert counter.settings.use_thumbnail is True  # the file's value over the class default
    assert counter.settings.max_num_patches == 1024 and counter.settings.tokens_per_tile == 256
    count = counter.count_image(1024, 768)  # 3 x 2 tiles + a 576 x 416 thumbnail
    assert (count.grid_h, count.grid_w, count.num_tiles, count.num_tokens) == (2, 3, 7, 6 * 256 + 18 * 13)
    assert len(count.expansion) == count.num_tokens + 6 + 1 + 2


@torchvision_only
def test_identity_is_the_same_with_and_without_torchvision(bundles, dirs, monkeypatch):
    """Tokenize without torchvision, train with it: `train.identity` compares these hashes."""
    import families.processor as processor_module

    real = bundles["thumbnail"].identity()
    monkeypatch.setattr(processor_module, "is_torchvision_available", lambda: False)
    monkeypatch.setattr(processor_module.AutoProcessor, "from_pretrained", _raise_no_torchvision)
    monkeypatch.setattr(processor_module.AutoImageProcessor, "from_pretrained", _raise_no_torchvision)
    settings_only = load_processor(str(dirs["thumbnail"]))
    assert isinstance(settings_only.image_processor, SettingsOnlyImageProcessor)
    assert settings_only.identity() == real
    assert bundles["checkpoint"].identity()["sha256"] != real["sha256"]  # use_thumbnail is in the hash


def _raise_no_torchvision(*args: Any, **kwargs: Any) -> Any:
    raise ImportError("Lfm2VlImageProcessor requires the Torchvision library but it was not found")


def _text_processor(settings: Any) -> SimpleNamespace:
    """What ``Lfm2VlProcessor._build_image_tokens`` reads of ``self`` (its module imports no torchvision)."""
    return SimpleNamespace(
        image_token="<image>",
        image_start_token="<|image_start|>",
        image_end_token="<|image_end|>",
        image_thumbnail_token="<|img_thumbnail|>",
    )


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("size", [(1024, 768), (768, 1024), (2000, 1000), (5000, 600), (64, 64), (512, 512)])
def test_expansion_is_the_processors_token_text(tmp_path, size, special):
    """Our ids decode to ``_build_image_tokens``' text (transformers' own function) for our plan."""
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    bundle = load_processor(str(build_lfm2_vl_dir(tmp_path / "p")))
    counter = Lfm2VlCounter.from_processor(bundle)
    for thumbnail in (False, True):
        settings = counter.settings.__class__(
            **{**_fields(counter.settings), "use_thumbnail": thumbnail, "use_image_special_tokens": special}
        )
        plan = plan_image(*size, settings)
        per_tile = Lfm2VlProcessor._compute_tokens_per_tile(None, 512, 16, 2)
        resized = Lfm2VlProcessor._compute_tokens_for_image(None, list(plan.resized), 16, 2)
        text = Lfm2VlProcessor._build_image_tokens(
            _text_processor(settings), plan.rows, plan.cols, per_tile, resized, thumbnail, special
        )
        ours = Lfm2VlCounter(settings=settings, processor_class="Lfm2VlProcessor").expansion(plan)
        assert list(ours) == bundle.tokenizer.encode(text, add_special_tokens=False), (size, thumbnail)


def _fields(settings: Any) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in settings.__slots__}


def test_worked_examples(tmp_path):
    """Sizes computed by hand from the processor's arithmetic (LFM2-VL-450M settings)."""
    counter = Lfm2VlCounter.from_processor(load_processor(str(build_lfm2_vl_dir(tmp_path / "p"))))
    s = counter.settings
    assert plan_image(1, 1, s).resized == (256, 256)  # scaled up to 64 tokens
    assert plan_image(1024, 512, s).split is False  # 524288 px: exactly the tolerance, not above
    assert (plan_image(1024, 544, s).rows, plan_image(1024, 544, s).cols) == (1, 2)  # above it
    assert plan_image(512, 512, s).num_tokens == 256
    assert plan_image(1600, 100, s).resized == (96, 1600)  # 6 x 100 patches: 3 x 50 tokens
    with pytest.raises(MediaRejected, match="more than the 1024"):
        plan_image(1109, 1, s)  # 32 x 34xx: the processor's mask is shorter than its pixels
    with pytest.raises(MediaRejected):
        plan_image(0, 10, s)


def test_video_is_unsupported(tmp_path):
    counter = Lfm2VlCounter.from_processor(load_processor(str(build_lfm2_vl_dir(tmp_path / "p"))))
    with pytest.raises(SampleError) as err:
        counter.count_video(VideoMeta(num_frames=8, fps=4.0, width=64, height=48), VideoSampling())
    assert err.value.reason == Reason.UNSUPPORTED_MEDIA


# --- against the real processor (torchvision) ---------------------------------------------------


@torchvision_only
def test_class_defaults_are_the_image_processors(bundles, counters):
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    assert {name: getattr(Lfm2VlImageProcessor, name) for name in CLASS_DEFAULTS} == CLASS_DEFAULTS
    assert type(bundles["checkpoint"].image_processor).__name__ == "Lfm2VlImageProcessor"
    assert bundles["special_tokens_key"].processor.use_image_special_tokens is True  # the file's false is dropped
    assert counters["special_tokens_key"].settings.use_image_special_tokens is True


def _processor_ids(bundle: ProcessorBundle, width: int, height: int) -> tuple[list[int], Any]:
    assert bundle.processor is not None
    out = bundle.processor(text=["<image>"], images=[[Image.new("RGB", (width, height))]])
    return [int(t) for t in out["input_ids"][0]], out


def _assert_equal_or_refused(bundle: ProcessorBundle, counter: Lfm2VlCounter, width: int, height: int) -> None:
    """Ids, tiles and per-tile patch grids equal the processor's; a refused size is one it cannot serve."""
    try:
        ids, out = _processor_ids(bundle, width, height)
    except (ValueError, RuntimeError):  # RuntimeError: an oversized thumbnail does not stack with its tiles
        with pytest.raises(MediaRejected):
            counter.count_image(width, height)
        return
    try:
        count = counter.count_image(width, height)
    except MediaRejected:  # the processor's mask is shorter than its pixels: no model takes it
        assert out["pixel_values"].shape[1] > out["pixel_attention_mask"].shape[1], (width, height)
        return
    assert list(count.expansion) == ids, (width, height)
    assert count.num_tiles == out["pixel_values"].shape[0], (width, height)
    assert count.num_tokens == int((out["spatial_shapes"] // 2).prod(-1).sum()), (width, height)


def _dense_sizes() -> list[tuple[int, int]]:
    """Tiny, huge, extreme aspect, the tolerance and min-pixel thresholds, grid ties, random."""
    sizes = [(1, 1), (2, 3), (10, 10), (31, 33), (8000, 6000), (6000, 8000), (3000, 16), (16, 3000), (4100, 20)]
    sizes += [(1109, 1), (1, 1658), (2000, 40), (40, 2000), (20000, 64), (333, 517), (1537, 29)]
    sizes += [(1024, 512), (1024, 528), (1024, 544), (1008, 520), (724, 724), (725, 725), (256, 256), (255, 257)]
    sizes += [(1040, 960), (1300, 1200), (1536, 1024), (650, 600), (2048, 2048), (5120, 512), (512, 5120)]
    # aspect 1.25 ties 2x2 with 3x2 (both 0.25 off): 3x2 when w*h > 0.5 * 512^2 * 6 = 786432, else 2x2
    sizes += [(960, 768), (990, 792), (1000, 800), (1250, 1000), (768, 960), (800, 1000)]
    rng = random.Random(0)
    sizes += [(int(2 ** rng.uniform(0, 13)), int(2 ** rng.uniform(0, 13))) for _ in range(24)]
    return sizes


@torchvision_only
@pytest.mark.parametrize("variant", [*VARIANTS, "special_tokens_key"])
def test_dense_grid_equals_processor(bundles, counters, variant):
    sizes = _dense_sizes()
    if variant not in ("checkpoint", "thumbnail"):  # fewer images where only one setting differs (CI time)
        sizes = sizes[::3]
    for width, height in sizes:
        _assert_equal_or_refused(bundles[variant], counters[variant], width, height)


@torchvision_only
@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 6000), height=st.integers(1, 6000))
def test_random_sizes_equal_processor(bundles, counters, width, height):
    _assert_equal_or_refused(bundles["thumbnail"], counters["thumbnail"], width, height)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    sizes = {**cases.NOISE_SIZES, "tiled": (1300, 900)}
    del sizes["extreme"]
    return cases.write_noise_images(tmp_path_factory.mktemp("lfm2_vl_images"), sizes)


@torchvision_only
@pytest.mark.parametrize("variant", ["checkpoint", "thumbnail"])
def test_conversations_equal_processor_chat_template(bundles, images, variant):
    """Five images over turns, a system turn, a text-only turn; EXIF from paths; loss mask = replies."""
    bundle = bundles[variant]
    conv = cases.conversation(cases.images_in_turns(images, "exif"))
    sample = cases.assert_ids_equal_processor(SampleTokenizer(bundle), conv)
    learned = bundle.tokenizer.decode(cases.learned_ids(sample))
    assert learned == "First answer.<|im_end|>\nSecond answer.<|im_end|>\nThird.<|im_end|>\n"
    image_id = bundle.tokenizer.convert_tokens_to_ids("<image>")
    assert cases.ignored_ids(sample).count(image_id) == sum(c.num_tokens for _, c in sample.media)
    huge = cases.conversation([("user", [images["huge"], images["tiled"], "Both?"]), ("assistant", ["Yes."])])
    cases.assert_ids_equal_processor(SampleTokenizer(bundle), huge)


@torchvision_only
def test_extreme_aspect_ratio_is_an_error_row(bundles, tmp_path):
    media = cases.write_noise_images(tmp_path, {"extreme": (1658, 1)})
    conv = cases.conversation([("user", [media["extreme"], "x"]), ("assistant", ["y"])])
    with pytest.raises(SampleError) as err:
        SampleTokenizer(bundles["checkpoint"]).tokenize(conv, VideoSampling())
    assert err.value.reason == Reason.PROCESSOR_REJECTED
    assert "more than the 1024" in str(err.value)


def test_example_directory_names_the_checkpoint_settings(tmp_path):
    out = build_lfm2_vl_dir(tmp_path / "p")
    image = json.loads((out / "preprocessor_config.json").read_text("utf-8"))
    assert (image["tile_size"], image["min_tiles"], image["max_tiles"], image["use_thumbnail"]) == (512, 2, 10, False)
    assert (image["min_image_tokens"], image["max_image_tokens"], image["encoder_patch_size"]) == (64, 256, 16)
