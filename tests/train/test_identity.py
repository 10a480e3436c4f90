"""Model, processor and shards belong together, or `train hf` exits 2 before a step (`train.identity`).

Truths: the example families' processors and tiny models (every one of them accepts its own
processor's output: `tests/example/test_models_all_families.py`), and the bugs as users met
them: a Qwen3-VL model on Qwen2-VL shards (was a reshape error at step 1), a processor of the
same class with other pixel limits (was a grid mismatch deep in a loader worker).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoConfig

import families
from families.processor import ProcessorBundle, load_processor_once
from families.registry import example_families, example_family, family_of_processor, find_layout
from prep.example.model import write_tiny_model
from train.cli import main
from train.identity import IdentityMismatch, check_model_matches_data, expected_processors


def _hf(data: Path, model: Path, processor: Path, out: Path):
    args = ["hf", "--data", str(data), "--model", str(model), "--processor", str(processor), "--output", str(out)]
    return CliRunner().invoke(main, [*args, "--max-steps", "1", "--num-workers", "0"])


@pytest.fixture(scope="module")
def images(packed_example):
    return packed_example(media="images")


def test_matching_model_and_processor_train(images, tmp_path):
    model = write_tiny_model(tmp_path / "model", "qwen2_vl", images.processor)
    result = _hf(images.path, model, images.processor, tmp_path / "run")
    assert result.exit_code == 0, result.output


def test_other_family_model_exits_2_naming_both(images, tmp_path):
    """The issue's case: Qwen3-VL model, Qwen2-VL shards (was `shape '[-1, 3, 2, 16, 16]' is invalid`)."""
    qwen3 = example_family("qwen3_vl").build_processor(tmp_path / "qwen3_processor")
    model = write_tiny_model(tmp_path / "model", "qwen3_vl", qwen3)
    result = _hf(images.path, model, images.processor, tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "Qwen3VLProcessor" in result.output and "Qwen2VLProcessor" in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_wrong_image_token_id_exits_2_naming_both_ids(images, tmp_path):
    model = write_tiny_model(tmp_path / "model", "qwen2_vl", images.processor)
    config = json.loads((model / "config.json").read_text())
    right = config["image_token_id"]
    config["image_token_id"] = right - 1
    (model / "config.json").write_text(json.dumps(config))
    result = _hf(images.path, model, images.processor, tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert f"image_token_id {right - 1}" in result.output and f"token id {right}" in result.output


def test_same_class_other_settings_exits_2(images, tmp_path):
    """Class names equal, pixel limits differ: other token counts, so the identity differs."""
    proc = tmp_path / "processor"
    shutil.copytree(images.processor, proc)
    settings = json.loads((proc / "preprocessor_config.json").read_text())
    settings["size"]["longest_edge"] = settings["max_pixels"] = 28 * 28 * 16
    (proc / "preprocessor_config.json").write_text(json.dumps(settings))
    model = write_tiny_model(tmp_path / "model", "qwen2_vl", images.processor)
    result = _hf(images.path, model, proc, tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "sha256" in result.output and "Qwen2VLProcessor" in result.output


def _check_one_settings(bundle: ProcessorBundle, layout: object) -> None:
    """The counter `prep tokenize` counted with and the layout hold one family settings object, equal."""
    family = family_of_processor(bundle.processor_class)
    assert family is not None
    if not (Path(families.__file__).parent / family.name / "settings.py").is_file():
        return  # a family whose faces share no setting
    counter = family.counter_class().from_processor(bundle)
    counter_settings, layout_settings = getattr(counter, "settings", None), getattr(layout, "settings", None)
    assert type(counter_settings).__module__ == f"families.{family.name}.settings", type(counter_settings)
    assert type(layout_settings) is type(counter_settings)
    assert layout_settings == counter_settings


@pytest.mark.parametrize("family", example_families())
def test_every_example_pair_matches_and_a_swapped_token_id_does_not(family, tmp_path):
    spec = example_family(family)
    processor_dir = spec.build_processor(tmp_path / "processor")
    assert spec.build_model is not None
    config = AutoConfig.from_pretrained(str(spec.build_model(tmp_path / "model", processor_dir)))
    bundle = load_processor_once(str(processor_dir))
    assert bundle.processor_class in expected_processors(config)
    layout_class = find_layout(bundle.processor_class)
    assert layout_class is not None, f"{bundle.processor_class}: no training layout"  # every family trains
    layout = layout_class.from_bundle(bundle)
    _check_one_settings(bundle, layout)
    ids = layout.mm_token_ids
    check_model_matches_data(config, bundle, ids, family)
    field = next(f for f in ("image_token_id", "image_token_index") if getattr(config, f, None) is not None)
    setattr(config, field, getattr(config, field) + 1)
    with pytest.raises(IdentityMismatch, match=field):
        check_model_matches_data(config, bundle, ids, family)
