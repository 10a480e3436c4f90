"""How a family's model attends inside image blocks is recorded, and trained only where packing applies it.

The fact travels from the family counter through the tokenize manifest and the pack manifest
to ``train``, which compares it with the rule the family's training layout applies: Gemma 3
(bidirectional blocks, `train.block_attention`) and a Qwen example (causal) pass; data whose
recorded attention the layout does not apply (here: Gemma 3 data with a layout that would
train it causally) is refused, never trained with the wrong mask.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from families.gemma3.layout import Gemma3Layout
from prep.energon.index import index_dataset
from prep.example.dataset import write_example_dataset
from prep.run import LOCAL
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.layout import MANIFEST_FILE
from schemas.manifest import PackManifest, TokenizeManifest, read_manifest
from tests.shards.oracles import pack
from train.dataset import TrainConfigError, open_packed_dataset


def _packed(tmp_path: Path, family: str) -> Path:
    config = write_example_dataset(tmp_path / "ex", num_samples=6, with_bad_rows=False, family=family)
    tok = tmp_path / "tok"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(tmp_path / "ex" / "processor"),
            output_dir=str(tok),
            datasets=["sharegpt_json"],  # images only: Gemma 3 has no video input
            executor=LOCAL,
            max_error_rate=1.0,
        )
    )
    out = tmp_path / "packed"
    pack([tok], out, pack_size=8192, shard_size="4packs", pad_to_multiple_of=1)
    index_dataset(out)
    return out


@pytest.mark.parametrize(("family", "attention"), [("gemma3", "bidirectional"), ("qwen2_vl", "causal")])
def test_image_attention_is_recorded_and_trained(tmp_path: Path, family: str, attention: str) -> None:
    out = _packed(tmp_path, family)
    tokenized = read_manifest(tmp_path / "tok" / MANIFEST_FILE, TokenizeManifest)
    packed = read_manifest(out / MANIFEST_FILE, PackManifest)
    assert tokenized.processor.image_attention == attention
    assert [i.processor.image_attention for i in packed.inputs] == [attention]
    assert open_packed_dataset(out).num_packs >= 1


def test_attention_the_layout_does_not_apply_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _packed(tmp_path, "gemma3")
    monkeypatch.setattr(Gemma3Layout, "image_attention", "causal")
    with pytest.raises(TrainConfigError, match="bidirectionally inside each image block"):
        open_packed_dataset(out)
