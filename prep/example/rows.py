"""The conversation records of the example datasets: one named row per feature, filler, bad rows.

Builders take ``m``, a map from media name to ref (relative to ``media_dir``), as written
by :func:`prep.example.dataset.write_example_dataset`: image names of
:data:`prep.example.media.IMAGE_SPECS`, ``"lmdb:KEY"``, ``"clip_*"`` videos,
``"corrupt_*"``, ``"lmdb_missing_key"``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from schemas.reasons import Reason

QUESTIONS = (
    "What is in this image?",
    "Describe the colours.",
    "How many stripes are there?",
    "Is it bright or dark?",
    "Read any text you see.",
    "Where is the brightest area?",
)
ANSWERS = (
    "A smooth gradient with stripes.",
    "Mostly red and green.",
    "There are 4 stripes.",
    "It is fairly bright.",
    "There is no text.",
    "Near the top right corner.",
)


def chat(turns: list[tuple[str, str]], images: Sequence[str] = (), videos: Sequence[str] = ()) -> dict[str, Any]:
    """A record in OpenAI spelling; ``turns`` are (role, content) pairs."""
    record: dict[str, Any] = {"messages": [{"role": r, "content": c} for r, c in turns]}
    if images:
        record["images"] = list(images)
    if videos:
        record["videos"] = list(videos)
    return record


def named_chat_rows(m: dict[str, str]) -> dict[str, dict]:
    """One row per feature the tokenizer and counters must get right, in file order."""
    u, a = "user", "assistant"
    rows = {
        "text_only": chat([(u, "What is 2 + 2?"), (a, "2 + 2 = 4.")]),
        "image_file": chat([(u, "<image>Describe this picture."), (a, ANSWERS[0])], [m["photo_640x480"]]),
        "image_lmdb": chat([(u, "<image>What colour dominates?"), (a, "Green.")], [m["lmdb:photo_800x600.jpg"]]),
        "multi_image": chat(
            [(u, "Compare <image> with <image> and <image>."), (a, "The second one is rotated.")],
            [m["photo_1024x768"], m["lmdb:exif_rot6_320x240.jpg"], m["exif_rot6_640x480"]],
        ),
        "video": chat(
            [(u, "<video>What moves in this clip?"), (a, "A white bar moves right.")],
            videos=[m["clip_320x240_40f_10fps"]],
        ),
        "system_turn": chat(
            [
                ("system", "You are a careful visual inspector."),
                (u, "<image>Any defects?"),
                (a, "None."),
            ],
            [m["photo_333x517"]],
        ),
        "multi_turn": chat(
            [
                (u, "<image>What is this?"),
                (a, "A gradient."),
                (u, "And its size?"),
                (a, "Medium."),
                (u, "Now this one: <image>"),
                (a, "A smaller gradient."),
            ],
            [m["photo_640x480"], m["tiny_10x10"]],
        ),
        "assistant_leading_newlines": chat([(u, "Say hi."), (a, "\n\nHi!\n")]),
        "cjk_emoji": chat([(u, "这张图片里有什么？😀 <image>"), (a, "一张渐变图。🐱✨")], [m["gray_256x256"]]),
        "literal_im_start": chat(
            [(u, "<image>Print the text <|im_start|> verbatim."), (a, "Printed it.")],
            [m["photo_640x480"]],
        ),
        "think": chat([(u, "How many cats?"), (a, "<think>\nCount them.\n</think>\n\nThree.")]),
        "image_and_video": chat(
            [(u, "<image><video>Is the picture a frame of the video?"), (a, "No.")],
            [m["photo_640x480"]],
            [m["clip_64x48_8f_4fps"]],
        ),
        "lmdb_unicode_key": chat([(u, "<image>Describe."), (a, "Stripes.")], [m["lmdb:nested/图片_01.jpg"]]),
    }
    edge_images = (
        "exif_rot8_640x480",
        "rgba_300x200",
        "cmyk_200x150",
        "pixel_1x1",
        "wide_3000x16",
        "photo_4000x3000",
        "lmdb:rgba_128x96.png",
    )
    for name in edge_images:
        rows["image_" + name.replace("lmdb:", "lmdb_").split(".")[0]] = chat(
            [(u, "<image>What is it?"), (a, "An image.")], [m[name]]
        )
    for name in sorted(k for k in m if k.startswith("clip_")):
        rows[f"video_{name}"] = chat([(u, "Summarise: <video>"), (a, "A bar moves.")], videos=[m[name]])
    return rows


def random_chat_row(rng: random.Random, m: dict[str, str]) -> dict[str, Any]:
    """A filler row: text, one or two images, or a video, with varied text."""
    kind = rng.randrange(4)
    question, answer = rng.choice(QUESTIONS), rng.choice(ANSWERS) + f" ({rng.randint(0, 999)})"
    photos = ["photo_640x480", "photo_1024x768", "photo_333x517", "lmdb:photo_800x600.jpg"]
    if kind == 0:
        return chat([("user", question), ("assistant", answer)])
    if kind == 1:
        return chat([("user", f"<image>{question}"), ("assistant", answer)], [m[rng.choice(photos)]])
    if kind == 2:
        pair = rng.sample(photos, 2)
        return chat([("user", f"<image>\n<image>\n{question}"), ("assistant", answer)], [m[p] for p in pair])
    clip = rng.choice(["clip_64x48_8f_4fps", "clip_160x120_30f_30fps"])
    return chat([("user", f"<video>{question}"), ("assistant", answer)], videos=[m[clip]])


def bad_chat_rows(m: dict[str, str]) -> list[tuple[bytes, Reason]]:
    """Raw lines with exactly one defect each, and the reason the tokenizer must report."""

    def line(record: dict[str, Any]) -> bytes:
        return json.dumps(record, ensure_ascii=False).encode("utf-8")

    qa = [("user", "<image>What is it?"), ("assistant", "Something.")]
    return [
        (b'{"messages": [{"role": "user", "content": "unterminated', Reason.MALFORMED_JSON),
        (b"", Reason.MALFORMED_JSON),  # a blank line is a row
        (b'{"messages": [{"role": "user", "content": "caf\xe9 \xff"}]}', Reason.NOT_UTF8),
        (b"[1, 2, 3]", Reason.BAD_RECORD),
        (line({"messages": []}), Reason.EMPTY_CONVERSATION),
        (line(chat([("robot", "beep"), ("assistant", "boop")])), Reason.BAD_ROLE),
        (
            line(
                chat(
                    [("user", "<image><image>Two tags."), ("assistant", "One image.")],
                    [m["photo_640x480"]],
                )
            ),
            Reason.MEDIA_TAG_MISMATCH,
        ),
        (line(chat(qa, ["no_such_image.jpg"])), Reason.MISSING_MEDIA),
        (line(chat(qa, [m["lmdb_missing_key"]])), Reason.MISSING_LMDB_KEY),
        (line(chat(qa, [m["corrupt_garbage"]])), Reason.CORRUPT_IMAGE),
        (line(chat(qa, [m["corrupt_truncated"]])), Reason.CORRUPT_IMAGE),
        (line(chat(qa, [m["lmdb:corrupt.jpg"]])), Reason.CORRUPT_IMAGE),
        (line(chat(qa, [m["too_wide_4100x20"]])), Reason.PROCESSOR_REJECTED),
        (
            line(
                chat(
                    [("user", "<video>What happens?"), ("assistant", "Nothing.")],
                    videos=[m["corrupt_video"]],
                )
            ),
            Reason.BAD_VIDEO,
        ),
    ]


def sharegpt(turns: list[tuple[str, str]], images: list[str], system: str | None = None) -> dict[str, Any]:
    """A record in from/value spelling; ``system`` fills the record-level system column."""
    record: dict[str, Any] = {
        "conversations": [{"from": f, "value": v} for f, v in turns],
        "images": images,
    }
    if system is not None:
        record["system"] = system
    return record


def sharegpt_records(
    m: dict[str, str], num_records: int, seed: int, with_bad: bool
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Records in from/value spelling (images only) and their expected error reasons."""
    rng = random.Random(seed + 1)
    h, g = "human", "gpt"
    records = [
        sharegpt([(h, "<image>What is shown?"), (g, ANSWERS[0])], [m["photo_640x480"]]),
        sharegpt(
            [
                ("system", "Answer briefly."),
                (h, "<image><image>Which is larger?"),
                (g, "The first."),
            ],
            [m["photo_1024x768"], m["lmdb:photo_800x600.jpg"]],
        ),
        sharegpt(
            [(h, "<image>Describe it."), (g, "Arr, stripes.")],
            [m["exif_rot8_640x480"]],
            system="You are a pirate.",
        ),
        sharegpt(
            [(h, "Hello!"), (g, "Hi."), (h, "<image>What about this?"), (g, "A gradient.")],
            [m["photo_333x517"]],
        ),
    ][:num_records]
    while len(records) < num_records:
        photo = rng.choice(["photo_640x480", "photo_1024x768", "lmdb:nested/图片_01.jpg"])
        records.append(sharegpt([(h, f"<image>{rng.choice(QUESTIONS)}"), (g, rng.choice(ANSWERS))], [m[photo]]))
    errors: dict[str, str] = {}
    if with_bad:
        errors[str(len(records))] = Reason.MEDIA_TAG_MISMATCH.value
        records.append(sharegpt([(h, "No tag here."), (g, "Ok.")], [m["photo_640x480"]]))
        errors[str(len(records))] = Reason.MISSING_MEDIA.value
        records.append(sharegpt([(h, "<image>Where?"), (g, "Gone.")], ["missing/none.png"]))
    return records, errors
