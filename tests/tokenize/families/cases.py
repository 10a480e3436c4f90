"""Shared scaffolding of the per-family closed-form tests: edge-case media, conversations, oracles.

Every family test checks its counter against the *real* processor, built offline; what is the same
across families lives here so each test file keeps only its cases and its family's rules:

- media writers (:func:`write_images`, :func:`write_noise_images`) return name -> path;
- ShareGPT records and dataset files (:func:`one_image_records`, :func:`sharegpt_dataset`);
- conversation builders (:func:`conversation`, :func:`video_conversation`);
- oracles: the processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths*
  (it decodes and EXIF-transposes them itself, :func:`processor_ids`) and the flat
  ``processor(text=..., images=[...])`` call packvlm makes (:func:`flat_processor_ids`);
- the ``prep tokenize`` stage run with every sample verified (:func:`run_stage`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image
from transformers.image_utils import load_image

from families.counter import MediaRejected
from families.processor import ProcessorBundle, ProcessorLoadError, load_processor
from packvlm.processor_kwargs import call_images_kwargs
from packvlm.sample_error import SampleError
from prep.example.media import make_image_bytes, write_video
from prep.run import LOCAL
from prep.sources.conversation import Conversation, MediaItem
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.sample import TokenizedSample
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.dataset_config import DatasetSpec, VideoSampling, load_dataset_config
from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from schemas.manifest import TokenizeManifest
from schemas.media import VideoMeta
from schemas.media_ref import MediaRef
from schemas.reasons import Reason
from schemas.tokenized import list_parts, open_part

T = TypeVar("T")
ImageSpec = tuple[int, int, str, str, int | None]  # (width, height, mode, format, EXIF orientation)

# The standard edge cases; a family adds its own or overrides a size (dict order = record order).
STANDARD_IMAGES: dict[str, ImageSpec] = {
    "tiny1": (1, 1, "RGB", "PNG", None),
    "tiny10": (10, 10, "RGB", "JPEG", None),
    "wide": (3000, 16, "RGB", "PNG", None),
    "tall": (16, 3000, "RGB", "PNG", None),
    "ratio205": (4100, 20, "RGB", "PNG", None),  # > 200:1
    "odd": (333, 517, "RGB", "JPEG", None),
    "odd2": (1537, 29, "RGB", "JPEG", None),
    "exif6": (96, 40, "RGB", "JPEG", 6),  # stored 96x40, shown 40x96
    "exif8": (1300, 200, "RGB", "JPEG", 8),
    "rgba": (200, 90, "RGBA", "PNG", None),
    "gray": (70, 130, "L", "PNG", None),
}
# Qwen-VL's smart_resize edges: exactly 200:1 is accepted, ratio205 (> 200:1) raises.
QWEN_RULE_IMAGES: dict[str, ImageSpec] = {**STANDARD_IMAGES, "ratio200": (4000, 20, "RGB", "PNG", None)}
# Sizes of write_noise_images' standard cases.
NOISE_SIZES: dict[str, tuple[int, int]] = {
    "tiny1": (1, 1),
    "tiny10": (10, 10),
    "wide": (3000, 16),
    "tall": (16, 3000),
    "extreme": (4100, 20),  # > 200:1
    "odd": (333, 517),
    "odd2": (1023, 767),
}
VIDEO = "clip.mp4"


@dataclass(frozen=True)
class MediaFiles:
    """Written media: ``root`` (a dataset's ``media_dir``) and name -> path."""

    root: Path
    paths: dict[str, Path]

    def __getitem__(self, name: str) -> Path:
        return self.paths[name]

    def file(self, name: str) -> str:
        """The file name, as a ShareGPT record under ``media_dir`` names it."""
        return self.paths[name].name


def write_images(root: Path, images: dict[str, ImageSpec], *, video: bool = False) -> MediaFiles:
    """Each spec as ``<name>.png|jpg`` plus ``huge`` (8000x6000 JPEG) and, with ``video``, ``clip``."""
    paths: dict[str, Path] = {}
    for name, (width, height, mode, fmt, orientation) in images.items():
        paths[name] = root / f"{name}.{'jpg' if fmt == 'JPEG' else 'png'}"
        paths[name].write_bytes(make_image_bytes(width, height, mode, fmt, orientation, seed=width))
    paths["huge"] = root / "huge.jpg"
    Image.new("RGB", (8000, 6000), (30, 120, 200)).save(paths["huge"], quality=50)
    if video:
        paths["clip"] = write_video(root / VIDEO, 8, 4.0, 64, 48)
    return MediaFiles(root, paths)


def write_noise_images(root: Path, sizes: dict[str, tuple[int, int]]) -> MediaFiles:
    """Random-noise RGB PNGs of ``sizes``, then ``huge`` (8000x6000 JPEG), ``exif`` (stored 900x200,
    orientation 6: shown 200x900), ``rgba`` (500x300) and ``gray`` (700x350)."""
    rng = np.random.default_rng(0)

    def noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
        return Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode)

    out: dict[str, Path] = {}
    for name, (w, h) in sizes.items():
        out[name] = root / f"{name}.png"
        noise(w, h).save(out[name])
    out["huge"] = root / "huge.jpg"
    Image.new("RGB", (8000, 6000), (10, 200, 30)).save(out["huge"], quality=50)
    out["exif"] = root / "exif.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    noise(900, 200).save(out["exif"], exif=exif.tobytes())
    out["rgba"] = root / "rgba.png"
    noise(500, 300, "RGBA").save(out["rgba"])
    out["gray"] = root / "gray.png"
    noise(700, 350, "L").save(out["gray"])
    return MediaFiles(root, out)


def shown_size(path: str | Path) -> tuple[int, int]:
    """(width, height) as displayed: EXIF orientations 5..8 swap the stored sides."""
    with Image.open(path) as im:
        orientation = im.getexif().get(0x0112, 1)
        return (im.height, im.width) if orientation in (5, 6, 7, 8) else im.size


# --- ShareGPT records and dataset files ---------------------------------------------------------


def exchange(user: str, reply: str, **media: list[str]) -> dict[str, Any]:
    """One user turn and one reply; ``media`` is ``images=[...]`` / ``videos=[...]`` (file names)."""
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}], **media}


def one_image_records(media: MediaFiles, names: Iterable[str]) -> list[dict[str, Any]]:
    """``<image>Describe {name}.`` / ``It is {name}.`` for each image alone."""
    return [exchange(f"<image>Describe {name}.", f"It is {name}.", images=[media.file(name)]) for name in names]


def three_images_one_turn(files: list[str]) -> dict[str, Any]:
    """Several images in one turn, text touching the tag on both sides."""
    return exchange("abc<image><image>def<image>ghi", "Three images.", images=files)


def images_in_three_turns(
    files: list[str], *, system_turn: str | None = None, system_field: str | None = None
) -> dict[str, Any]:
    """An image in each of three user turns; a system prompt as a turn or as ShareGPT's ``system``."""
    turns = [
        ("user", "<image>What is it?"),
        ("assistant", "A cat."),
        ("user", "And here?<image>"),
        ("assistant", "A dog on a red table."),
        ("user", "x<image>y"),
        ("assistant", "The tree."),
    ]
    if system_turn is not None:
        turns.insert(0, ("system", system_turn))
    record = {"messages": [{"role": r, "content": c} for r, c in turns], "images": files}
    return record if system_field is None else {"system": system_field, **record}


def same_image_twice(files: list[str]) -> dict[str, Any]:
    """Three tags, the first and last image the same file."""
    return exchange("<image>1<image><image>", "Same.", images=files)


def qwen_rule_records(media: MediaFiles) -> list[dict[str, Any]]:
    """Every QWEN_RULE_IMAGES image but ratio205 alone, ``huge`` alone, three images in one turn,
    three turns with ShareGPT's ``system``."""
    f = media.file
    one = one_image_records(media, [n for n in [*QWEN_RULE_IMAGES, "huge"] if n != "ratio205"])
    three_turns = images_in_three_turns(
        [f("rgba"), f("gray"), f("tall")], system_field="You are Qwen, a virtual human."
    )
    return [*one, three_images_one_turn([f("odd"), f("exif6"), f("exif8")]), three_turns]


def replies(record: dict[str, Any]) -> list[str]:
    return [m["content"] for m in record["messages"] if m["role"] == "assistant"]


def edit_json(path: Path, **changes: Any) -> None:
    """Set top-level keys of a JSON file (a processor directory's settings)."""
    path.write_text(json.dumps({**json.loads(path.read_text("utf-8")), **changes}), "utf-8")


def sharegpt_dataset(tmp_path: Path, media_dir: Path | None, records: list[dict[str, Any]]) -> tuple[Path, DatasetSpec]:
    """``data.jsonl`` + ``dataset_info.json`` (ShareGPT) under ``tmp_path``: the config path and its spec."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    entry = {"file_name": str(data), "formatting": "sharegpt"}
    if media_dir is not None:
        entry["media_dir"] = str(media_dir)
    config = tmp_path / "dataset_info.json"
    config.write_text(json.dumps({"ds": entry}, indent=2, sort_keys=True) + "\n", "utf-8")
    return config, load_dataset_config(config)[0]


# --- conversations -------------------------------------------------------------------------------


def conversation(turns: list[tuple[str, list[str | Path]]], *, join_text_turns: bool = False) -> Conversation:
    """Turns of (role, parts): a Path part is an image, a str part is text; content is a list, or
    with ``join_text_turns`` a text-only turn is one string."""
    messages: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    for role, parts in turns:
        if join_text_turns and all(isinstance(p, str) for p in parts):
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


def images_in_turns(
    media: MediaFiles, exif: str, *, before: str = "", after: str = "", system: bool = True
) -> list[tuple[str, list[str | Path]]]:
    """Turns for :func:`conversation`: five images over two user turns (two adjacent, text touching
    them; ``before`` / ``after`` join that text), a text-only turn, three replies (one in two items)."""
    turns: list[tuple[str, list[str | Path]]] = [
        ("system", ["You are helpful."]),
        ("user", ["abc", media["odd"], media["wide"], f"{before}xyz", media["gray"], f"end{after}"]),
        ("assistant", ["First answer."]),
        ("user", [media[exif], "again?", media["tiny1"]]),
        ("assistant", ["Second", " answer."]),
        ("user", ["no image here"]),
        ("assistant", ["Third."]),
    ]
    return turns if system else turns[1:]


def video_conversation(path: Path, reply: str | None = None) -> Conversation:
    """``[video, "What happens?"]`` from the user, and ``reply`` from the assistant when given."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}
    ]
    if reply is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return Conversation(messages=messages, media=[MediaItem(kind="video", ref=MediaRef(path=str(path)))])


def load_bundles(dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    """Each processor directory loaded as packvlm loads it."""
    return {name: load_processor(str(path)) for name, path in dirs.items()}


# --- oracles -------------------------------------------------------------------------------------


def with_image_paths(messages: Sequence[Any], paths: Iterable[str]) -> list[dict[str, Any]]:
    """The messages with each image item carrying its file path, in order, for HF to load."""
    images = iter(paths)
    return [
        {
            "role": m["role"],
            "content": [{"type": "image", "path": next(images)} if c["type"] == "image" else c for c in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in messages
    ]


def _apply_chat_template(
    bundle: ProcessorBundle,
    messages: Sequence[Any],
    paths: Iterable[str],
    apply: Callable[..., Any] | None,
    **kwargs: Any,
) -> Any:
    assert bundle.processor is not None
    call = apply or type(bundle.processor).apply_chat_template
    return call(bundle.processor, with_image_paths(messages, paths), tokenize=True, return_dict=True, **kwargs)


def chat_template_output(
    bundle: ProcessorBundle,
    messages: Sequence[Any],
    paths: Iterable[str],
    *,
    apply: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``apply_chat_template(tokenize=True, return_dict=True)`` on image paths, first batch row as lists
    (``pixel_values`` left as is); ``apply`` replaces the processor's own method (e.g. the base class's)."""
    out = _apply_chat_template(bundle, messages, paths, apply, **kwargs)
    return {k: np.asarray(v[0]).tolist() if k != "pixel_values" else v for k, v in out.items()}


def processor_ids(
    bundle: ProcessorBundle,
    messages: Sequence[Any],
    paths: Iterable[str],
    *,
    apply: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> list[int]:
    """The processor's own template + image loading (from paths, EXIF applied) + expansion."""
    out = _apply_chat_template(bundle, messages, paths, apply, **kwargs)
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]


def conversation_ids(bundle: ProcessorBundle, conv: Conversation, **kwargs: Any) -> list[int]:
    """:func:`processor_ids` of a conversation, its media paths in order."""
    return processor_ids(bundle, conv.messages, [item.ref.path for item in conv.media], **kwargs)


def flat_processor_ids(bundle: ProcessorBundle, conv: Conversation) -> list[int]:
    """HF's template render + ``processor(text=[text], images=[...])`` with a flat list of decoded
    images, as packvlm calls it."""
    processor = bundle.processor
    assert processor is not None
    text = processor.apply_chat_template(conv.messages, tokenize=False)
    images = [load_image(item.ref.path) for item in conv.media] or None
    return [int(t) for t in np.asarray(processor(text=[text], images=images)["input_ids"][0]).tolist()]


def assert_ids_equal_processor(tokenizer: SampleTokenizer, conv: Conversation, msg: object = None) -> TokenizedSample:
    """Our ids equal :func:`conversation_ids`, and each count's size is the image's shown size."""
    sample = tokenizer.tokenize(conv, VideoSampling())
    assert sample.input_ids == conversation_ids(tokenizer.bundle, conv), msg
    for (_, count), item in zip(sample.media, conv.media, strict=True):
        assert (count.width, count.height) == shown_size(item.ref.path)
    return sample


def learned_ids(sample: TokenizedSample) -> list[int]:
    return [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]


def ignored_ids(sample: TokenizedSample) -> list[int]:
    return [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]


def assert_loss_mask(
    bundle: ProcessorBundle, sample: TokenizedSample, expected: str, media_ids: Collection[int]
) -> None:
    """The learned tokens decode to ``expected`` (the replies as rendered) and hold no media token."""
    assert bundle.tokenizer.decode(learned_ids(sample)) == expected
    assert not any(t in media_ids for t in learned_ids(sample))


def assert_rejected_like_processor(
    bundle: ProcessorBundle, tmp_path: Path, media: MediaFiles, name: str, match: str | None = None
) -> None:
    """The processor raises ValueError on image ``name``; we raise a processor_rejected SampleError."""
    record = exchange("<image>x", "y", images=[media.file(name)])
    _, spec = sharegpt_dataset(tmp_path, media.root, [record])
    conv = to_conversation(record, spec)
    with pytest.raises(ValueError, match=match):
        conversation_ids(bundle, conv)
    with pytest.raises(SampleError) as err:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert err.value.reason == Reason.PROCESSOR_REJECTED


def assert_video_unsupported(counter: Any) -> SampleError:
    """A family without video: counting one is an unsupported_media error (returned for more checks)."""
    with pytest.raises(SampleError) as err:
        counter.count_video(VideoMeta(num_frames=8, fps=4.0, width=64, height=48), VideoSampling())
    assert err.value.reason == Reason.UNSUPPORTED_MEDIA
    return err.value


def assert_video_needs_real_processor(bundle: ProcessorBundle, conv: Conversation) -> SampleError:
    """Video left to the real processor: without one (no torchvision) an error row, never a guess."""
    if getattr(bundle.processor, "video_processor", None) is not None:
        pytest.skip("torchvision present: video runs the real processor (covered by its own path)")
    with pytest.raises(SampleError) as err:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert err.value.reason == Reason.PROCESSOR_REJECTED
    return err.value


def assert_refuses_other_image_processor(counter_cls: Any, bundle: ProcessorBundle, match: str) -> None:
    """Another image processor class (Qwen2-VL's) under the family's processor is refused, not guessed."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with pytest.raises(ProcessorLoadError, match=match):
        counter_cls.from_processor(replace(bundle, image_processor=Qwen2VLImageProcessorPil()))


def assert_no_processor_image_kwargs(bundle: ProcessorBundle) -> None:
    """The processor adds no images_kwargs of its own (`packvlm.processor_kwargs`): the image
    processor's settings rule, which is what the counter reads."""
    merged = call_images_kwargs(bundle.processor)
    assert not {"size", "min_pixels", "max_pixels", "patch_size", "merge_size"} & set(merged)


# --- property tests ------------------------------------------------------------------------------


def log_uniform_pair(rng: random.Random, top: int) -> tuple[int, int]:
    """Two sides drawn log-uniform in 1..top."""
    w, h = (max(1, int(math.exp(rng.uniform(0, math.log(top))))) for _ in range(2))
    return w, h


def maybe_swapped(rng: random.Random, w: int, h: int) -> tuple[int, int]:
    return (w, h) if rng.random() < 0.5 else (h, w)


def or_rejected(call: Callable[[], T], counter: Any, width: int, height: int) -> T | None:
    """``call()`` (the real processor on a width x height image); if it raises ValueError, the counter
    must reject the size too (MediaRejected) and None is returned."""
    try:
        return call()
    except ValueError:
        with pytest.raises(MediaRejected):
            counter.count_image(width, height)
        return None


def qwen_rule_sizes(rng: random.Random, n: int, factors: Sequence[int]) -> list[tuple[int, int]]:
    """Log-uniform sides 1..1200, sides near multiples of a factor (patch x merge), ratios near 200:1.
    (One factor is used without drawing, so a seed gives the same sizes it always gave.)"""
    sizes = []
    for _ in range(n):
        w, h = log_uniform_pair(rng, 1200)
        pick = rng.random()
        if pick < 0.15:
            factor = factors[0] if len(factors) == 1 else rng.choice(factors)
            w = factor * rng.randint(1, 30) + rng.choice([-1, 0, 1])
        elif pick < 0.25:
            h = rng.randint(1, 6)
            w = h * 200 + rng.choice([-1, 0, 1, 2])
        sizes.append(maybe_swapped(rng, w, h))
    return sizes


def assert_qwen_grid_equals_image_processor(
    bundle: ProcessorBundle, counter: Any, sizes: list[tuple[int, int]]
) -> None:
    """Qwen-rule counters: ``image_grid_thw``, the patch rows and the expansion equal the image processor's."""
    for width, height in sizes:
        image = Image.new("RGB", (width, height))
        out = or_rejected(partial(bundle.image_processor, images=[image], return_tensors="np"), counter, width, height)
        if out is None:
            continue
        count = counter.count_image(width, height)
        assert [int(v) for v in out["image_grid_thw"][0]] == [count.grid_t, count.grid_h, count.grid_w], (width, height)
        assert out["pixel_values"].shape[0] == count.num_tokens * counter.settings.merge_size**2
        assert count.expansion == (counter.image_token_id,) * count.num_tokens


# --- the stage -----------------------------------------------------------------------------------


def read_table(out: Path, table: str) -> list[dict[str, Any]]:
    """All rows of one tokenized table (none when it wrote no part)."""
    parts = list_parts(out, table)
    return pa.concat_tables([open_part(p) for p in parts]).to_pylist() if parts else []


@dataclass(frozen=True)
class StageRun:
    manifest: TokenizeManifest
    spec: DatasetSpec
    rows: list[dict[str, Any]]
    errors: list[dict[str, Any]]

    def conversations(self, records: list[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], Conversation]]:
        """Each stored row with its source record's conversation."""
        for row in self.rows:
            yield row, to_conversation(records[row["line"]], self.spec)


def run_stage(tmp_path: Path, processor_dir: Path, media_dir: Path | None, records: list[dict[str, Any]]) -> StageRun:
    """``prep tokenize`` (LOCAL) on the records, every sample verified against the processor too."""
    config, spec = sharegpt_dataset(tmp_path, media_dir, records)
    out = tmp_path / "out"
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(processor_dir),
            output_dir=str(out),
            verify_fraction=1.0,
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    return StageRun(manifest, spec, read_table(out, SAMPLES_DIR), read_table(out, ERRORS_DIR))
