"""The `train` recipes, one file each, read top to bottom: config, command, loop.

- `train.recipes.hf`: `train hf`, a Hugging Face model on packed THD micro-batches.
- `train.recipes.megatron`: `train megatron`, a megatron-core language model (plus the family's
  Hugging Face vision tower) on the same micro-batches.

Both claim their run directory through `train.run_dir`, build their loader through
`train.loader.rank_loader_config`, take the data flags from `train.recipes.options` and report
`train.metrics.StepMetrics`; `train.cli` only assembles the commands.
"""
