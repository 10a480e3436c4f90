"""The loss mask of the real-processor path (video of GLM-4V, InternVL, SmolVLM2, Qwen-Omni) on every transformers.

`tokenize_with_processor` maps the rendered text's assistant spans onto the processor's expanded
ids two ways: from the processor's ``text_replacement_offsets`` (transformers 5.13+) or, where
the installed transformers does not report them (5.8 - 5.12), by aligning the rendered text's
own ids with the expanded ids. Oracle: the closed-form path (`SampleTokenizer`), whose ids equal
the processor's and whose mask is checked token by token in ``tests/tokenize/families``, on
conversations with images touching text and in several turns. Both mappings must equal it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from families.processor import load_processor
from families.registry import example_family
from prep.sources.media import LmdbPool
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.processor_path import (
    REPLACEMENT_OFFSETS,
    ReferenceUnavailable,
    mask_by_alignment,
    mask_from_offsets,
    run_processor,
)
from schemas.dataset_config import VideoSampling
from tests.tokenize.families import cases

#: families whose video takes the processor path, plus the Qwen2-VL reference
FAMILIES = ("glm4v", "internvl", "qwen2_5_omni", "qwen2_vl", "smolvlm")


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, rng = tmp_path_factory.mktemp("media"), np.random.default_rng(0)
    paths = {name: root / f"{name}.png" for name in ("a", "b", "c")}
    for path, (w, h) in zip(paths.values(), [(120, 90), (64, 200), (50, 50)], strict=True):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return paths


@pytest.mark.parametrize("method", ["alignment", "replacement_offsets"])
@pytest.mark.parametrize("family", FAMILIES)
def test_processor_path_mask_equals_the_closed_form(
    family: str, method: str, media: dict[str, Path], tmp_path: Path
) -> None:
    bundle = load_processor(str(example_family(family).build_processor(tmp_path / "processor")))
    tokenizer = SampleTokenizer(bundle)
    turns: list[tuple[str, list[str | Path]]] = [
        ("user", [media["a"], "What is this?", media["b"]]),
        ("assistant", ["A square and a tall one."]),
        ("user", ["And this", media["c"]]),
        ("assistant", ["A small one."]),
    ]
    conv = tokenizer.for_template(cases.conversation(turns, join_text_turns=True))
    truth = tokenizer.tokenize(conv, VideoSampling())
    assert truth.loss_mask.sum() > 0 and truth.num_media_tokens > 0

    extra: dict[str, Any] = {"return_offsets_mapping": True}
    if method == "replacement_offsets":
        extra[REPLACEMENT_OFFSETS] = True
    try:
        rendered, out, _ = run_processor(bundle, conv, VideoSampling(), LmdbPool(), **extra)
    except ReferenceUnavailable as exc:  # Qwen2.5-Omni on transformers 5.8 - 5.12 without torchvision
        pytest.skip(f"the processor cannot run here: {exc}")
    ids = [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]
    assert ids == truth.input_ids
    if method == "alignment":
        bos = bundle.tokenizer.bos_token
        add_special = not (bos is not None and rendered.text.startswith(bos))
        mask = mask_by_alignment(bundle.tokenizer, rendered, ids, add_special_tokens=add_special)
    else:
        if "text_replacement_offsets" not in out:
            pytest.skip("this transformers does not report text_replacement_offsets (5.8 - 5.12)")
        offsets = [tuple(o) for o in np.asarray(out["offset_mapping"][0]).tolist()]
        mask = mask_from_offsets(offsets, rendered.assistant_spans, out["text_replacement_offsets"][0] or [])
    np.testing.assert_array_equal(mask, truth.loss_mask)
