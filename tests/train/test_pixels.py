"""8-bit pixels from the workers against the processor's own float32 output, every family.

The truth is the family's image processor called as it always is (rescale and normalize on):
``MediaProcessor.from_bundle(bundle, "float32")``, i.e. the layout with no extra keywords. The
8-bit path must give the same float32 tensors bit for bit - per item, and joined over items of
different sizes and tile counts (the padding a join adds must stay exactly 0.0) - at a quarter
of the bytes. Mutations: frames without their extents, a table from other settings, a
processor whose resize is not 8-bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from families.processor import load_processor
from families.registry import example_families, example_family, find_layout
from tests.train.probe_images import probe_image
from train.join import join_fields
from train.media import MediaProcessor
from train.pixels import PackedPixels, RawPixelsError, as_uint8, frame_extents, normalization_table, vision_inputs

#: (width, height): tiny, odd, both orientations, extreme aspect, a camera frame
SIZES = ((1, 1), (37, 211), (300, 200), (200, 300), (1200, 90), (640, 480))


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pixels")
    return {f: example_family(f).build_processor(root / f) for f in example_families()}


def _media(processors: dict[str, Path], family: str) -> tuple[MediaProcessor, MediaProcessor]:
    bundle = load_processor(str(processors[family]))
    assert find_layout(bundle.processor_class) is not None, f"{family}: no training layout (families.registry)"
    return MediaProcessor.from_bundle(bundle, "uint8"), MediaProcessor.from_bundle(bundle, "float32")


def _items(media: MediaProcessor, images: list[Image.Image]) -> list[dict]:
    got = media.layout.sample_inputs(images, [])
    return [media._packed(item.tensors) for item in got.items]


@pytest.mark.parametrize("family", example_families())
def test_every_item_is_bit_equal_to_the_processor_at_a_quarter_of_the_bytes(processors, family: str) -> None:
    raw, truth = _media(processors, family)
    assert raw.layout.pixel_kwargs and raw.table is not None  # every family ships 8-bit pixels
    for seed, (width, height) in enumerate(SIZES):
        image = probe_image(width, height, seed)
        (ours,) = _items(raw, [image])
        (want,) = _items(truth, [image])
        packed = ours["pixel_values"]
        assert isinstance(packed, PackedPixels) and packed.values.dtype == torch.uint8
        assert want["pixel_values"].dtype == torch.float32
        assert packed.values.nbytes * 4 == want["pixel_values"].nbytes
        got = vision_inputs(ours)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), (family, (width, height), key)


@pytest.mark.parametrize("family", example_families())
def test_a_pack_of_different_sizes_joins_like_the_floats(processors, family: str) -> None:
    """Items of different sizes / tile counts joined by the layout's rules: padding stays 0.0."""
    raw, truth = _media(processors, family)
    images = [probe_image(w, h, seed) for seed, (w, h) in enumerate(SIZES[2:])]
    joins = raw.layout.joins
    ours = join_fields(joins, _items(raw, images))
    want = join_fields(joins, _items(truth, images))
    got = vision_inputs(ours)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), (family, key)
    extents = ours["pixel_values"].extents
    if "pad_cat" in joins.values():  # the sizes differ, so this join padded: the case under test
        assert extents is not None and bool((extents < torch.tensor(ours["pixel_values"].shape[-2:])).any())


def test_frames_without_extents_fail_where_a_join_padded() -> None:
    """Mutation: the lookup alone turns join padding into -mean/std (Pixtral sizes differ)."""
    table = torch.tensor([[0.5 * v - 1.0 for v in range(256)]] * 3)
    a = PackedPixels.of(torch.full((1, 3, 2, 4), 7.0), table)
    b = PackedPixels.of(torch.full((1, 3, 4, 2), 9.0), table)
    joined = join_fields({"pixel_values": "pad_cat"}, [{"pixel_values": a}, {"pixel_values": b}])["pixel_values"]
    assert joined.extents.tolist() == [[2, 4], [4, 2]]
    out = joined.normalized()
    assert out[0, :, :2, :4].eq(2.5).all() and out[0, :, 2:].eq(0).all()
    assert out[1, :, :4, :2].eq(3.5).all() and out[1, :, :, 2:].eq(0).all()
    unmasked = dataclasses.replace(joined, extents=None).normalized()
    assert unmasked[0, :, 2:].eq(-1.0).all()  # padding looked up as the value 0: -1.0, not the processor's 0.0


def test_tile_padding_from_a_join_is_whole_zero_frames() -> None:
    """LLaVA: [1, tiles, 3, S, S] items of 3 and 1 tiles -> the second image's tiles 1..2 are 0.0."""
    table = torch.tensor([[v / 255 for v in range(256)]] * 3)
    items = [PackedPixels.of(torch.full((1, n, 3, 2, 2), 255.0), table) for n in (3, 1)]
    joined = join_fields({"pixel_values": "pad_cat"}, [{"pixel_values": p} for p in items])["pixel_values"]
    assert joined.extents.shape == (2, 3, 2) and joined.extents[1, 1:].eq(0).all()
    out = joined.normalized()
    assert out[0].eq(1).all() and out[1, 0].eq(1).all() and out[1, 1:].eq(0).all()


def test_processor_padding_mask_becomes_extents_and_must_be_a_rectangle() -> None:
    mask = torch.zeros(1, 2, 4, 4, dtype=torch.int64)
    mask[0, 0] = 1
    mask[0, 1, :3, :2] = 1
    assert frame_extents(torch.zeros(1, 2, 3, 4, 4), mask).tolist() == [[[4, 4], [3, 2]]]
    mask[0, 1, 0, 3] = 1  # not a top-left rectangle
    with pytest.raises(RawPixelsError, match="rectangle"):
        frame_extents(torch.zeros(1, 2, 3, 4, 4), mask)


def test_values_that_are_not_8_bit_are_refused() -> None:
    assert as_uint8(torch.tensor([0.0, 255.0])).tolist() == [0, 255]
    for bad in (torch.tensor([0.5]), torch.tensor([256.0]), torch.tensor([-1.0])):
        with pytest.raises(RawPixelsError, match="--pixels float32"):
            as_uint8(bad)


def test_table_is_the_processors_own_arithmetic(processors) -> None:
    """PIL backend: float32(float64(v) * scale), then (x - mean) / std in float32, per channel."""
    bundle = load_processor(str(processors["qwen2_vl"]))
    ip = bundle.image_processor
    table = normalization_table(ip)
    values = np.arange(256, dtype=np.float64)
    for c in range(3):
        scaled = (values * ip.rescale_factor).astype(np.float32)
        want = (scaled - np.float32(ip.image_mean[c])) / np.float32(ip.image_std[c])
        assert np.array_equal(table[c].numpy(), want.astype(np.float32))
    other = normalization_table(ip, {"image_mean": [0.5, 0.5, 0.5]})
    assert not torch.equal(other, table)  # images_kwargs override the file's settings, as in a call


def test_a_table_that_does_not_match_the_processor_fails_at_start(processors) -> None:
    raw, _ = _media(processors, "qwen2_vl")
    float_layout = dataclasses.replace(raw.layout, pixel_kwargs={})
    wrong = dataclasses.replace(raw, table=raw.table + 1e-6)
    with pytest.raises(RawPixelsError, match="probe image"):
        wrong.check_pixels(float_layout, "qwen2_vl")
    raw.check_pixels(float_layout, "qwen2_vl")  # the real table passes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_normalised_on_the_gpu_equals_the_cpu() -> None:
    table = torch.randn(3, 256)
    pixels = PackedPixels.of(torch.randint(0, 256, (2, 3, 5, 7)).float(), table)
    assert torch.equal(pixels.to("cuda").normalized().cpu(), pixels.normalized())


def test_worker_heap_threshold_is_fixed_unless_the_user_set_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from train.worker_heap import bound_worker_heap

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert bound_worker_heap() is False  # the user's setting stands
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    import platform

    assert bound_worker_heap() is (platform.libc_ver()[0] == "glibc")
