"""`prep stats`: JSON + self-contained HTML report of a tokenized or packed directory.

Modules, in call order: :mod:`~prep.stats.read` (typed manifests, memory-mapped columns,
``pack_stats.arrow``), :mod:`~prep.stats.collect` and :mod:`~prep.stats.packs` (pure:
tables -> :class:`Stats`), :mod:`~prep.stats.labels` (readable names, percentages),
:mod:`~prep.stats.plots` (PNG bytes), :mod:`~prep.stats.html` (the report),
:mod:`~prep.stats.stage` (files), :mod:`~prep.stats.cli` (the click command).
"""
