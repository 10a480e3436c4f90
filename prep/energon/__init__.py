"""Stage `energon`: index packed shards with Energon's own API and blend indexed datasets.

`index` (prepare + dataset.yaml + verify), `blend` (MetadatasetV2 YAML). The load hooks
(cooker, TaskEncoder base) live in `packvlm.energon`, shared with `train`.
"""
