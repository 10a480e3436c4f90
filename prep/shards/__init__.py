"""Stage `shards`: webdataset tars from a frozen pack plan.

`layout` cuts the plan into shards, `read` maps tokenized rows and media, `worker` builds
one shard per task, `tar` writes deterministic tars via temp + rename.
"""
