"""One folder per model family, beneath `prep` and `train`, above `schemas` and `packvlm`.

A family is what one HF processor class (or a few alike) needs from packvlm, kept in one
folder ``families/<name>/`` with one name everywhere (folder, registry, tests):

    counter.py   prep's face: closed-form token counts per image / video (`families.counter`)
    layout.py    train's face: the model's vision keywords, their joins, rope and attention
                 rule (`families.layout`)
    example.py   ``EXAMPLES``: offline processor directories + tiny model configs for
                 ``prep example --family`` and the tests (`families.example.base`)

and, where the faces share settings read from the processor, a ``settings.py`` they both
build from the loaded processor (`families.processor.ProcessorBundle`), so a setting is
derived once. Below the families: `families.processor` (loading a processor and its
identity), `families.settings` (pixel limits, video options, call-time image kwargs) and
`families.example` (the small BPE, templates and tiny model scaffolding examples share).

Imports flow downward only: `prep` / `train` -> `families` -> `schemas` / `packvlm`. A
family never imports `prep` or `train` (``tests/schemas/test_import_graph.py``).

Adding a family (see ``families/README.md`` for a walk-through):

1. ``families/<name>/`` with ``__init__.py``, ``counter.py``, ``layout.py``, ``example.py``
   (copy the closest family; ``qwen2_vl`` for patch grids, ``llava`` for tiles);
2. one ``Family(...)`` line in `families.registry.FAMILIES` naming its processor classes,
   counter class, layout class and example names;
3. ``pytest tests/families`` fails until every face exists and every key agrees; the
   per-family tests (``tests/tokenize/families``, ``tests/train/families``) then check the
   counts against the real processor and the packed forward against an unpacked one.
"""
