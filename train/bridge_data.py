"""Our packs as a Megatron-Bridge dataset: the ``cfg.dataset`` of a `train megatron` run.

Imports Megatron-Bridge at module import: import this module only after
``require_package("megatron.bridge", ...)`` (`train.recipes.megatron` does).

Bridge calls ``PackedDatasetConfig.build_datasets(context)`` from its ``setup`` (through
``data.utils.get_dataset_provider``'s protocol adapter) with the process groups of the run; we
hand back Bridge's own ``EnergonMultiModalDataModule`` loaders over our packs, with
`train.bridge.BridgeTaskEncoder` turning ``micro_batch_size`` packs into one THD row. The data
module shards by the pure data-parallel group, so context-parallel peers read the same packs.
``dataloader_type="external"``: Bridge iterates what we return as it is (Energon's loader is
endless), and saves / restores its position with the checkpoint (``dataloader_save``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.bridge.data.energon.base_energon_datamodule import EnergonMultiModalDataModule

from train.bridge import BridgeTaskEncoder


@dataclass(kw_only=True)
class PackedDatasetConfig(DatasetProvider):
    """`prep pack` output (indexed by `prep energon-index`) as Bridge's training data.

    Not frozen: Bridge's ``ConfigContainer`` validation writes to its dataset config.

    Attributes:
        path: The packed dataset directory.
        processor: Processor directory / hub id the packs were tokenized with.
        model_config: HF model directory / hub id whose config gives the rope rule.
        seq_length: Tokens of one pack (the manifest's pack size).
        micro_batch_size: Packs joined into one THD row (Bridge's in-batch packing analogue).
        do_validation: Build a validation loader from the ``val`` split.
    """

    path: str
    processor: str
    model_config: str
    seq_length: int
    micro_batch_size: int = 1
    dataloader_type: str = "external"
    do_validation: bool = False
    num_val_workers: int | None = None

    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any | None, Any | None, Any | None]:
        """Endless train (and validation) loaders of Bridge ``vlm_step`` batches; no test split."""
        encoder = BridgeTaskEncoder(self.processor, self.model_config)
        module = EnergonMultiModalDataModule(
            path=self.path,
            tokenizer=context.tokenizer,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            num_workers=self.num_workers,
            num_val_workers=self.num_val_workers,
            pin_memory=self.pin_memory,
            task_encoder=encoder,
            validation_task_encoder=encoder,
            pg_collection=context.pg_collection,
        )
        train = iter(module.train_dataloader()) if context.train_samples > 0 else None
        valid = iter(module.val_dataloader()) if self.do_validation and context.valid_samples > 0 else None
        return train, valid, None
