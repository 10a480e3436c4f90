"""8-bit patch rows (Gemma 4, LFM2-VL) against the real processor's float32 ``pixel_values``.

Gemma 4 and LFM2-VL patchify after normalising: ``pixel_values`` ``[..., N, p * p * 3]``, the
channel the fastest axis of a row, rows past an image's patches padding (0.0). Their layouts
declare this (`families.layout.PatchRows`) and ship the processor's 8-bit rows; the step looks
every value up in the processor's own table (`train.pixels`). The truth is the family's real
processor called as a user calls it (``processor(text=..., images=[image])``, rescale and
normalize on): per image, over many sizes and aspect ratios (tiny, odd, extreme, tiled), the
rebuilt tensor must be ``torch.equal`` to its ``pixel_values`` and the masks / position ids
equal; joined over a pack, equal to the processor's outputs concatenated. Variants of the
settings make channel order and padding matter: with the released settings (one mean / std for
all channels; Gemma 4 only rescales, so a padding 0 looks up to 0.0) a wrong channel order or
lost padding marks would go unseen, so each family also runs with per-channel ImageNet mean /
std (normalize on), where both show.

Mutations: the real-row marks dropped, the channel order declared wrong, a patch size that does
not fit, padding marks of another shape. LFM2-VL's processor is torchvision-only: its cases
are marked ``torchvision`` (run in CI's torchvision environment); Gemma 4's run everywhere (the
PIL processor here, the torchvision one where torchvision imports).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from families.layout import PatchRows
from families.processor import ProcessorBundle, load_processor
from families.registry import example_family
from tests.train.probe_images import probe_image
from train.join import join_fields
from train.media import MediaProcessor
from train.pixels import PackedPixels, RawPixelsError, vision_inputs

#: (width, height): 1 px, below one patch, odd, exact multiples, both orientations, wide and tall
#: extremes, camera frames, large enough to tile (LFM2-VL) or to be shrunk to the budget (Gemma 4)
SIZES = (
    (1, 1),
    (7, 3),
    (16, 16),
    (37, 211),
    (48, 48),
    (200, 120),
    (300, 200),
    (200, 300),
    (511, 513),
    (640, 480),
    (768, 1024),
    (1100, 600),
    (1200, 90),
    (90, 1200),
    (3000, 200),
    (1600, 1200),
)
IMAGENET = {"do_normalize": True, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
#: name -> (example family, preprocessor_config.json changes, the processor's image token)
VARIANTS = {
    "gemma4": ("gemma4", {}, "<|image|>"),
    "gemma4_budget_70": ("gemma4", {"max_soft_tokens": 70, "image_seq_length": 70}, "<|image|>"),
    "gemma4_budget_1120": ("gemma4", {"max_soft_tokens": 1120, "image_seq_length": 1120}, "<|image|>"),
    "gemma4_imagenet": ("gemma4", IMAGENET, "<|image|>"),
    "lfm2_vl": ("lfm2_vl", {}, "<image>"),
    "lfm2_vl_thumbnail": ("lfm2_vl", {"use_thumbnail": True}, "<image>"),
    "lfm2_vl_imagenet": ("lfm2_vl", IMAGENET | {"use_thumbnail": True}, "<image>"),
}
TORCHVISION = {name for name, (family, _, _) in VARIANTS.items() if family == "lfm2_vl"}


def _params(names: list[str]) -> list[object]:
    marks = [pytest.mark.torchvision]
    return [pytest.param(n, marks=marks) if n in TORCHVISION else n for n in names]


@pytest.fixture(scope="module")
def bundle_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ProcessorBundle]:
    """A variant's processor (the example's directory, settings changed), built once when first asked for."""
    root = tmp_path_factory.mktemp("patch_rows")
    loaded: dict[str, ProcessorBundle] = {}

    def load(name: str) -> ProcessorBundle:
        family, changes, _ = VARIANTS[name]
        if family == "lfm2_vl":
            pytest.importorskip("torchvision")
        if name not in loaded:
            path: Path = example_family(family).build_processor(root / name)
            config = path / "preprocessor_config.json"
            config.write_text(json.dumps(json.loads(config.read_text("utf-8")) | changes), "utf-8")
            loaded[name] = load_processor(str(path))
        return loaded[name]

    return load


def _truth(bundle: ProcessorBundle, token: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """The real processor's vision outputs for ``images`` (one placeholder each), as a user calls it."""
    out = bundle.processor(text=token * len(images), images=images, return_tensors="pt")  # type: ignore[misc]
    return {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}


@pytest.mark.parametrize("variant", _params(list(VARIANTS)))
def test_every_size_is_the_processors_pixel_values_bit_for_bit(bundle_of, variant: str) -> None:
    bundle, token = bundle_of(variant), VARIANTS[variant][2]
    media = MediaProcessor.from_bundle(bundle, "uint8")
    rows = media.layout.pixel_rows  # type: ignore[attr-defined]
    assert media.table is not None and rows.channel_order == "last"
    padded = 0
    for seed, (width, height) in enumerate(SIZES):
        image = probe_image(width, height, seed)
        (item,) = media.layout.sample_inputs([image], []).items
        ours = media._packed(item.tensors)
        packed = ours["pixel_values"]
        assert isinstance(packed, PackedPixels) and packed.values.dtype == torch.uint8
        want = _truth(bundle, token, [image])
        assert want["pixel_values"].dtype == torch.float32
        assert packed.values.nbytes * 4 == want["pixel_values"].nbytes  # a quarter of the float bytes
        got = vision_inputs(ours)
        assert got.keys() == want.keys(), variant
        for key, value in want.items():
            assert torch.equal(got[key], value), (variant, (width, height), key)
        assert packed.real_rows is not None and int(packed.real_rows.sum()) == item.num_patches
        padded += int((~packed.real_rows).sum())
    assert padded > 0  # padding rows were in play (where a lost mark would show)


@pytest.mark.parametrize("variant", _params(["gemma4", "gemma4_imagenet", "lfm2_vl_thumbnail", "lfm2_vl_imagenet"]))
def test_a_pack_joins_to_the_processors_outputs_in_order(bundle_of, variant: str) -> None:
    bundle, token = bundle_of(variant), VARIANTS[variant][2]
    media = MediaProcessor.from_bundle(bundle, "uint8")
    images = [probe_image(w, h, seed) for seed, (w, h) in enumerate(((1100, 600), (37, 211), (640, 480), (1, 1)))]
    items = [media._packed(i.tensors) for i in media.layout.sample_inputs(images, []).items]
    got = vision_inputs(join_fields(media.layout.joins, items))
    want = _truth(bundle, token, images)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), (variant, key)


@pytest.mark.parametrize("variant", _params(["gemma4_imagenet", "lfm2_vl_imagenet"]))
def test_mutations_of_the_declaration_are_seen(bundle_of, variant: str) -> None:
    """Per-channel mean / std and a padded image: the marks and the channel order both matter."""
    bundle, token = bundle_of(variant), VARIANTS[variant][2]
    media = MediaProcessor.from_bundle(bundle, "uint8")
    image = probe_image(300, 200, 0)
    (item,) = media.layout.sample_inputs([image], []).items
    packed = media._packed(item.tensors)["pixel_values"]
    assert isinstance(packed, PackedPixels) and packed.rows is not None
    want = _truth(bundle, token, [image])["pixel_values"]
    assert torch.equal(packed.normalized(), want)
    unmarked = dataclasses.replace(packed, real_rows=None).normalized()
    assert not torch.equal(unmarked, want)  # padding looked up as the value 0: -mean / std, not 0.0
    major = dataclasses.replace(packed, rows=dataclasses.replace(packed.rows, channel_order="major"))
    assert not torch.equal(major.normalized(), want)


def test_check_pixels_compares_positions_too(bundle_of) -> None:
    """The worker-start probe fails when the 8-bit call's position ids differ from the float call's."""
    media = MediaProcessor.from_bundle(bundle_of("gemma4"), "uint8")
    float_layout = dataclasses.replace(media.layout, pixel_kwargs={})
    media.check_pixels(float_layout, "gemma4")  # the real layout passes

    class Shifted:
        def __init__(self, layout: object) -> None:
            self.layout = layout

        def sample_inputs(self, images, videos):  # noqa: ANN001, ANN202
            got = self.layout.sample_inputs(images, videos)  # type: ignore[attr-defined]
            positions = got.items[0].tensors["image_position_ids"]
            got.items[0].tensors["image_position_ids"] = torch.where(positions >= 0, positions + 1, positions)
            return got

    with pytest.raises(RawPixelsError, match="image_position_ids"):
        media.check_pixels(Shifted(float_layout), "gemma4")  # type: ignore[arg-type]


def _patchify(image: np.ndarray, patch: int) -> np.ndarray:
    """transformers' SigLIP2 / Gemma 4 patchify of a [C, H, W] array (the function itself)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import convert_image_to_patches

    return convert_image_to_patches(image, patch)


def test_channel_last_rows_equal_the_table_applied_before_patchify() -> None:
    """The lookup on patchified bytes == the table applied per channel in image space, then patchified
    by transformers' own function and padded with 0.0 (distinct tables per channel, 4 x 4 patches)."""
    rng = np.random.default_rng(0)
    table = torch.from_numpy(rng.normal(size=(3, 256)).astype(np.float32))
    image = rng.integers(0, 256, (3, 12, 8), dtype=np.uint8)
    floats = np.stack([table[c].numpy()[image[c]] for c in range(3)])
    want = np.zeros((1, 10, 48), np.float32)
    want[0, :6] = _patchify(floats, 4)
    values = np.zeros((1, 10, 48), np.uint8)
    values[0, :6] = _patchify(image, 4)
    positions = torch.full((1, 10, 2), -1)
    positions[0, :6] = 0
    rows = PatchRows(patch_size=4, channel_order="last", padding_keyword="image_position_ids", padding_value=-1)
    packed = PackedPixels.of_rows(torch.from_numpy(values), table, rows, positions)
    assert packed.real_rows is not None and packed.real_rows.tolist() == [[True] * 6 + [False] * 4]
    assert torch.equal(packed.normalized(), torch.from_numpy(want))
    major = np.zeros((1, 10, 48), np.float32)  # channel-major rows: [C, p, p] flattened
    major[0, :6] = floats.reshape(3, 3, 4, 2, 4).transpose(1, 3, 0, 2, 4).reshape(6, 48)
    values_major = np.zeros((1, 10, 48), np.uint8)
    values_major[0, :6] = image.reshape(3, 3, 4, 2, 4).transpose(1, 3, 0, 2, 4).reshape(6, 48)
    as_major = dataclasses.replace(rows, channel_order="major")
    packed_major = PackedPixels.of_rows(torch.from_numpy(values_major), table, as_major, positions)
    assert torch.equal(packed_major.normalized(), torch.from_numpy(major))


def test_rows_join_by_their_rule_and_added_rows_are_padding() -> None:
    """cat keeps each item's marks; pad_cat's added rows (a shorter item) are 0.0; a mixed join is refused."""
    table = torch.tensor([[v / 255 - 1.0 for v in range(256)]] * 3)  # 0 -> -1.0, 51 -> -0.8
    rows = PatchRows(patch_size=1, channel_order="last", padding_keyword="pixel_attention_mask", padding_value=0)
    a = PackedPixels.of_rows(torch.full((1, 4, 3), 51), table, rows, torch.tensor([[1, 1, 1, 0]]))
    b = PackedPixels.of_rows(torch.full((1, 2, 3), 51), table, rows, torch.tensor([[1, 1]]))
    cat = join_fields({"pixel_values": "cat"}, [{"pixel_values": a}, {"pixel_values": a}])["pixel_values"]
    assert isinstance(cat, PackedPixels)
    out = cat.normalized()
    assert out.shape == (2, 4, 3) and out[:, 3].eq(0).all() and out[:, :3].eq(table[0, 51]).all()
    padded = join_fields({"pixel_values": "pad_cat"}, [{"pixel_values": a}, {"pixel_values": b}])["pixel_values"]
    assert isinstance(padded, PackedPixels) and padded.real_rows is not None
    assert padded.real_rows.tolist() == [[True, True, True, False], [True, True, False, False]]
    out = padded.normalized()
    assert out[1, :2].eq(table[0, 51]).all() and out[1, 2:].eq(0).all()
    assert dataclasses.replace(padded, real_rows=None).normalized()[1, 2:].eq(-1).all()  # the mutation
    other = PackedPixels.of(torch.full((1, 3, 1, 4), 255.0), table)
    with pytest.raises(ValueError, match="patch-row layouts"):
        join_fields({"pixel_values": "cat"}, [{"pixel_values": a}, {"pixel_values": other}])


def test_a_declaration_that_does_not_fit_is_refused() -> None:
    table = torch.zeros(3, 256)
    rows = PatchRows(patch_size=4, channel_order="last", padding_keyword="pixel_attention_mask", padding_value=0)
    with pytest.raises(RawPixelsError, match="rows of 4 x 4 x 3"):
        PackedPixels.of_rows(torch.zeros(2, 10, 27), table, rows, torch.ones(2, 10))
    with pytest.raises(RawPixelsError, match="does not mark the rows"):
        PackedPixels.of_rows(torch.zeros(2, 10, 48), table, rows, torch.ones(2, 9))
    with pytest.raises(RawPixelsError, match="--pixels float32"):
        PackedPixels.of_rows(torch.full((2, 10, 48), 0.5), table, rows, torch.ones(2, 10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_normalised_on_the_gpu_equal_the_cpu() -> None:
    table = torch.randn(3, 256)
    rows = PatchRows(patch_size=2, channel_order="last", padding_keyword="pixel_attention_mask", padding_value=0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pixels = PackedPixels.of_rows(torch.randint(0, 256, (2, 5, 12)), table, rows, mask)
    assert torch.equal(pixels.to("cuda").normalized().cpu(), pixels.normalized())
