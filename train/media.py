"""A pack's stored media -> the model's vision inputs, with the family's own processors.

Images are decoded from their original bytes by transformers' ``load_image`` (EXIF transpose,
then ``convert("RGB")``: alpha is dropped, palette/grey expanded) - the rules `prep tokenize`
assumed when it counted tokens from headers. Videos: exactly the frames listed in
``frame_indices`` are decoded with PyAV (``rgb24``, as transformers' PyAV reader
``load_video(backend="pyav")`` does) and given to the processor's video processor with
``do_sample_frames=False``. Note that a processor given a video *path* decodes with torchcodec
by default (it needs system FFmpeg); torchcodec's RGB conversion is not checked to be
bit-identical to PyAV's. `tests/train/test_video.py` checks this path against the real
processors (needs torchvision).

What happens to the decoded media is the family's business: its layout (``families/<name>/layout.py``) runs
the family's image / video processor one sample at a time and says how each vision keyword
joins (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``, ...).
For every item, what the processor made of it (grid, tiles, placeholder tokens) must equal
what `prep tokenize` stored: that is what keeps the token plan exact end to end; otherwise
`PlanMismatchError` naming pack, sample, member and both values. Every error here is a broken
invariant, never a pack to skip: `train.loader` re-raises it as is, and
`train.encoder.PackedBatchTaskEncoder` lowers Energon's failure tolerance to 1 so that any
other loader stops on it too.

Image pixels leave the worker as 8-bit values (`train.pixels.PackedPixels`, ``pixels="uint8"``,
the default): the layouts call their image processor with rescale / normalize off and the step
applies the processor's own per-value table on the device, bit-equal to its float32 output
(checked on a probe image when the worker starts, with every other keyword of the item). Patch
rows with the channel last and padding rows (Gemma 4, LFM2-VL) ship the same way: the layout
declares them (``pixel_rows``, `families.layout.PatchRows`). ``pixels="float32"`` ships the processor's
float output as before. Video pixels are always float32 (HF video processors need torchvision,
which the CPU checks here lack). Each pack's pixels are joined once, over all its items.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import numpy as np
import torch
from PIL import Image
from transformers.image_utils import load_image

from families.layout import DecodedVideo, FamilyLayout, ItemInputs, PatchRows, SampleInputs
from families.processor import ProcessorBundle
from families.registry import find_layout
from packvlm.errors import DataBudgetError
from packvlm.image_header import DECODE_LIMIT_PIXELS, ImageTooLarge, open_image_checked, pil_pixel_limit
from packvlm.optional import MissingPackageError, missing_package_message
from schemas.packed import PackedMediaItem
from train.join import VisionValue, join_fields
from train.pixels import PADDING_MASK, PIXEL_KEYWORDS, PackedPixels, RawPixelsError, normalization_table, vision_inputs


class PackEncodeError(DataBudgetError, ValueError):
    """A pack cannot become a micro-batch; the message names pack, sample and fix."""


class PlanMismatchError(PackEncodeError):
    """The processor's grid / tiles / tokens for an item differ from what `prep tokenize` stored."""


GridMismatchError = PlanMismatchError  # the name before every family was checked (grids only)


class VideoProcessorUnavailable(PackEncodeError):
    """A pack holds a video the family's layout cannot process (no video layout, or no torchvision)."""


class VideoPackageMissing(MissingPackageError):
    """A pack holds a video and the family's video processor needs a package not installed here."""


#: the install line of torchvision, the package every HF video processor needs
TORCHVISION_INSTALL = "pip install torchvision (the build matching your torch), or train on image/text-only data"


def video_package_missing(where: str, package: str) -> VideoPackageMissing:
    """The exit-3 error for a video that ``package`` (absent) would process, ``where`` naming it."""
    message = missing_package_message(package, purpose="video packs", install=TORCHVISION_INSTALL)
    return VideoPackageMissing(f"{where}: the pack holds a video; {message}")


#: why a layout without ``no_video_reason`` cannot take a video
NO_VIDEO_LAYOUT = "this family's training layout takes images only: train it on image/text data"


class MediaDecodeError(PackEncodeError):
    """Stored media bytes no longer decode (tokenize decoded their headers without error)."""


class ImageTooLargeError(MediaDecodeError):
    """A stored image claims more pixels than training decodes (a decompression bomb); nothing was decoded."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaOrigin:
    """Where a media item sits, for error messages."""

    pack_key: str
    sample_id: str
    member: str

    @classmethod
    def of(cls, pack_key: str, item: PackedMediaItem, sample_ids: Sequence[str]) -> MediaOrigin:
        return cls(pack_key=pack_key, sample_id=sample_ids[item.meta.sample], member=item.meta.member)

    def __str__(self) -> str:
        return f"pack {self.pack_key}, sample {self.sample_id}, member {self.member}"


def decode_image(data: bytes, origin: MediaOrigin) -> Image.Image:
    """Decode like ``transformers.image_utils.load_image``: EXIF transpose, then RGB.

    The header's size is checked first (`packvlm.image_header`): an image past what PIL decodes
    is `ImageTooLargeError` before any pixel is, whatever PIL's global limit is set to.
    """
    try:
        image = open_image_checked(io.BytesIO(data), DECODE_LIMIT_PIXELS)
        with pil_pixel_limit(DECODE_LIMIT_PIXELS):
            return load_image(image)
    except ImageTooLarge as exc:
        raise ImageTooLargeError(
            f"{origin}: image_too_large: {exc}, more than training decodes (a decompression bomb); `prep tokenize` "
            "refuses such images: re-run tokenize, pack and shards from the original data"
        ) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaDecodeError(f"{origin}: image does not decode ({exc}); re-run prep pack") from exc


def decode_video_frames(data: bytes, frame_indices: Sequence[int], origin: MediaOrigin) -> DecodedVideo:
    """Decode exactly ``frame_indices`` (sorted, unique), stopping after the last one."""
    import av  # deferred: only datasets with video need PyAV

    wanted = list(frame_indices)
    if not wanted or wanted != sorted(set(wanted)):
        raise MediaDecodeError(f"{origin}: frame_indices {wanted[:8]} must be non-empty, sorted and unique")
    keep = set(wanted)
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            # the same fields prep.sources.media.video_meta (and transformers' PyAV reader) read
            total = int(stream.frames)
            fps = float(stream.average_rate) if stream.average_rate else 0.0
            if total <= 0:  # header without a frame count: count packets, as tokenize did
                total = sum(1 for packet in container.demux(stream) if packet.size)
                container.seek(0)
            for index, frame in enumerate(container.decode(video=0)):
                if index in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if index >= wanted[-1]:
                    break
    except (av.error.FFmpegError, IndexError) as exc:
        raise MediaDecodeError(f"{origin}: video does not decode ({exc}); re-run prep pack") from exc
    if len(frames) != len(wanted) or fps <= 0:
        raise MediaDecodeError(f"{origin}: decoded {len(frames)} of {len(wanted)} frames (fps {fps})")
    return DecodedVideo(frames=np.stack(frames), total_frames=total, fps=fps)


#: the probe image `MediaProcessor.check_pixels` runs: noise, not square, no multiple of a patch or tile
PROBE_WIDTH, PROBE_HEIGHT = 200, 120


def without_pixels(tensors: Mapping[str, VisionValue]) -> dict[str, torch.Tensor]:
    """The keywords a sample's rope index may read: all but the pixels."""
    return {
        k: v
        for k, v in tensors.items()
        if isinstance(v, torch.Tensor) and k not in PIXEL_KEYWORDS and k != "pixel_values_videos"
    }


#: the stored facts of an item the processor's output is checked against, in message order
PLAN_FIELDS = ("grid_thw", "num_tiles", "num_tokens")


def check_plan(origin: MediaOrigin, stored: PackedMediaItem, got: ItemInputs) -> None:
    """Raise `PlanMismatchError` unless the processor's grid, tiles and tokens equal the stored ones."""
    for name in PLAN_FIELDS:
        want, have = getattr(stored.meta, name), getattr(got, name)
        if tuple(np.atleast_1d(want).tolist()) != tuple(np.atleast_1d(have).tolist()):
            raise PlanMismatchError(
                f"{origin}: processor {name} {have} != stored {name} {want}; the processor settings differ from "
                "those `prep tokenize` used: train with the same processor or re-run tokenize and pack"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PackVision:
    """The vision keywords of one pack (joined in token order) and each sample's own part."""

    tensors: dict[str, VisionValue]
    #: per sample: its items' keywords but the pixels, joined (what its rope index reads: grids, seconds)
    samples: tuple[dict[str, torch.Tensor], ...]
    num_media: int
    num_patches: int  # vision-encoder patches of all items


class NoTrainingLayout(PackEncodeError):
    """The data's processor class has no family layout (`families.registry`): this family cannot train here."""


#: how image pixels leave a loader worker: "uint8" (`train.pixels.PackedPixels`, normalised in the
#: step) or "float32" (the processor's own float output, as a plain tensor)
PixelWire = Literal["uint8", "float32"]
PIXEL_WIRES: tuple[PixelWire, ...] = ("uint8", "float32")
DEFAULT_PIXEL_WIRE: PixelWire = "uint8"  # `train.loader.LoaderConfig.pixels` and the encoders' default


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaProcessor:
    """The family's layout for one worker; `process` is pure given it."""

    layout: FamilyLayout
    table: torch.Tensor | None  # `train.pixels.normalization_table` for "uint8"; None for "float32"

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle, pixels: PixelWire = DEFAULT_PIXEL_WIRE) -> MediaProcessor:
        """From the loaded processor: the layout its family registers for its class.

        With ``pixels="uint8"`` the processor's float pixels and the table's are compared once,
        on a probe image, before any pack: a processor that does not fit `train.pixels` fails here.
        """
        layout_class = find_layout(bundle.processor_class)
        if layout_class is None:
            raise NoTrainingLayout(
                f"{bundle.source}: no training layout for {bundle.processor_class} (families.registry); "
                "packvlm cannot build this family's vision inputs"
            )
        layout: Any = layout_class.from_bundle(bundle)
        if pixels == "float32" or not layout.pixel_kwargs:  # asked for, or a layout that ships floats
            return cls(layout=replace(layout, pixel_kwargs={}), table=None)
        table = normalization_table(bundle.image_processor, getattr(layout, "images_kwargs", None))
        media = cls(layout=layout, table=table)
        media.check_pixels(replace(layout, pixel_kwargs={}), f"{bundle.source} ({bundle.processor_class})")
        return media

    def check_pixels(self, float_layout: FamilyLayout, name: str) -> None:
        """Raise `RawPixelsError` unless 8-bit pixels + table give the processor's float pixels bit for bit.

        Every keyword of the probe's item is compared (masks and positions from the 8-bit call too).
        """
        probe = Image.fromarray(np.random.default_rng(0).integers(0, 256, (PROBE_HEIGHT, PROBE_WIDTH, 3), np.uint8))
        want = vision_inputs(float_layout.sample_inputs([probe], []).items[0].tensors)
        got = vision_inputs(self._packed(self.layout.sample_inputs([probe], []).items[0].tensors))
        for key in want:
            if key not in got or not torch.equal(got[key], want[key]):
                raise RawPixelsError(
                    f"{name}: {key} from 8-bit values and the processor's rescale/normalize table differ from the "
                    "processor's own float output on a probe image; train with --pixels float32"
                )

    def _packed(self, item: Mapping[str, torch.Tensor]) -> dict[str, VisionValue]:
        """An item's keywords with its pixel keywords as `PackedPixels` (``table`` set), else as they are."""
        tensors: dict[str, VisionValue] = dict(item)
        if self.table is None:
            return tensors
        rows: PatchRows | None = getattr(self.layout, "pixel_rows", None)
        for key in PIXEL_KEYWORDS:
            value = item.get(key)
            if value is None:
                continue
            if rows is not None:  # declared patch rows (Gemma 4, LFM2-VL): padding rows from their keyword
                tensors[key] = PackedPixels.of_rows(value, self.table, rows, item[rows.padding_keyword])
            else:
                tensors[key] = PackedPixels.of(value, self.table, item.get(PADDING_MASK))
        return tensors

    def process(
        self, pack_key: str, media: Sequence[PackedMediaItem], sample_ids: Sequence[str], num_samples: int
    ) -> PackVision:
        """Vision keywords for a pack's media (already in token order); every item checked against the plan.

        Pixels are joined once, over all items of the pack; each sample keeps only its small keywords.
        """
        parts: list[Mapping[str, VisionValue]] = []
        samples: list[dict[str, torch.Tensor]] = []
        patches = 0
        for sample in range(num_samples):
            mine = [m for m in media if m.meta.sample == sample]
            got = self._sample(pack_key, mine, sample_ids) if mine else SampleInputs()
            own: list[Mapping[str, VisionValue]] = [*(self._packed(i.tensors) for i in got.items), got.tensors]
            parts += own
            small = join_fields(self.layout.joins, [without_pixels(t) for t in own])
            samples.append(cast(dict[str, torch.Tensor], small))  # tensors in, tensors out
            patches += sum(i.num_patches for i in got.items)
        return PackVision(
            tensors=join_fields(self.layout.joins, parts),
            samples=tuple(samples),
            num_media=len(media),
            num_patches=patches,
        )

    def _sample(self, pack_key: str, items: Sequence[PackedMediaItem], sample_ids: Sequence[str]) -> SampleInputs:
        images = [m for m in items if m.meta.kind == "image"]
        videos = [m for m in items if m.meta.kind == "video"]
        origins = [MediaOrigin.of(pack_key, m, sample_ids) for m in (*images, *videos)]
        if videos and not self.layout.supports_video:
            package = getattr(self.layout, "missing_video_package", None)
            if package is not None:
                raise video_package_missing(str(origins[len(images)]), package)
            reason = getattr(self.layout, "no_video_reason", NO_VIDEO_LAYOUT)
            raise VideoProcessorUnavailable(f"{origins[len(images)]}: the pack holds a video, but {reason}")
        decoded_images = [decode_image(m.data, o) for m, o in zip(images, origins)]
        decoded_videos = [
            decode_video_frames(m.data, m.meta.frame_indices, o) for m, o in zip(videos, origins[len(images) :])
        ]
        got: SampleInputs = self.layout.sample_inputs(decoded_images, decoded_videos)
        del decoded_images, decoded_videos  # the processor's output is all that stays
        if len(got.items) != len(origins):
            raise PackEncodeError(f"{origins[0]}: the layout returned {len(got.items)} items for {len(origins)}")
        for stored, origin, item in zip((*images, *videos), origins, got.items):
            check_plan(origin, stored, item)
        return got
