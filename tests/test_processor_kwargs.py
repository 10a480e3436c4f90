"""`packvlm.processor_kwargs` against what each processor really passes its image processor.

Oracle: every example family's real processor (as ``prep tokenize`` loads it) expands a
one-image conversation the way ``--verify-fraction`` calls it (`run_processor`); the image
processor's ``preprocess`` records the kwargs it receives. The helper must return exactly those, on
whichever transformers is installed (CI runs this on 5.24 and on 5.12.1).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from families.processor import ProcessorBundle, load_processor
from families.registry import example_families, example_family
from packvlm.processor_kwargs import ProcessorApiError, call_images_kwargs, class_images_kwargs
from prep.sources.media import LmdbPool
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.processor_path import ReferenceUnavailable, run_processor
from schemas.dataset_config import VideoSampling
from tests.tokenize.families.cases import conversation

FAMILIES = example_families()
#: the class defaults a processor passes over preprocessor_config.json (checked by name: a wrong
#: version branch in the helper would lose exactly these)
CLASS_DEFAULTS = {
    "gemma3": {"do_pan_and_scan": False, "pan_and_scan_max_num_crops": 4},
    "internvl": {"crop_to_patches": True},
}
#: what a processor's own ``__call__`` adds after the merge (Pixtral / Mistral 3: patch x merge size)
ADDED_BY_CALL = {"mistral3": {"patch_size"}, "pixtral": {"patch_size"}}


def _received_images_kwargs(bundle: ProcessorBundle, image_path: Path) -> dict[str, Any]:
    """What ``preprocess`` gets when packvlm's processor path (`run_processor`) expands one image."""
    image_processor: Any = bundle.image_processor
    calls: list[dict[str, Any]] = []
    preprocess = image_processor.preprocess

    def record(images: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return preprocess(images, *args, **kwargs)

    turns: list[tuple[str, list[str | Path]]] = [("user", [image_path, "Hi"]), ("assistant", ["Hello"])]
    conv = SampleTokenizer(bundle).for_template(conversation(turns, join_text_turns=True))
    image_processor.preprocess = record  # an instance attribute shadows the method for this object only
    try:  # Qwen-Omni on transformers 5.12 without torchvision fails after the image call: not what is checked
        with contextlib.suppress(ReferenceUnavailable):
            run_processor(bundle, conv, VideoSampling(), LmdbPool())
    finally:
        del image_processor.preprocess
    assert len(calls) == 1, calls
    return calls[0]


@pytest.fixture(scope="module")
def image_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("image") / "a.png"
    Image.new("RGB", (96, 64), (120, 30, 200)).save(path)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_call_images_kwargs_equal_what_the_image_processor_receives(
    family: str, image_path: Path, tmp_path: Path
) -> None:
    bundle = load_processor(str(example_family(family).build_processor(tmp_path / "processor")))
    assert bundle.processor is not None
    assert bundle.image_processor is getattr(bundle.processor, "image_processor", None)
    received = _received_images_kwargs(bundle, image_path)
    merged = call_images_kwargs(bundle.processor)
    assert merged == {k: v for k, v in received.items() if k not in ADDED_BY_CALL.get(family, set())}
    assert CLASS_DEFAULTS.get(family, {}).items() <= received.items()
    # without an instance: the class's declared defaults, each as a call passes it
    declared = class_images_kwargs(type(bundle.processor))
    assert CLASS_DEFAULTS.get(family, {}).items() <= declared.items()
    assert {k: received[k] for k in declared if k in received} == {k: v for k, v in declared.items() if k in received}


def test_a_changed_merge_api_is_an_environment_error(tmp_path: Path) -> None:
    bundle = load_processor(str(example_family("gemma3").build_processor(tmp_path / "processor")))
    processor: Any = bundle.processor

    def changed(self: Any, *, other: Any = None) -> dict[str, Any]:
        return {}

    processor._merge_kwargs = changed.__get__(processor)
    with pytest.raises(ProcessorApiError, match=r"transformers .* outside the tested transformers>=5\.8"):
        call_images_kwargs(processor)
