"""Stage `energon`: index packed shards with Energon's own API, blend them, cook packs.

`index` (prepare + dataset.yaml + verify), `blend` (MetadatasetV2 YAML), `cooker`
(`cook_pack`, `PACK_COOKER`, `PackedTaskEncoder`).
"""
