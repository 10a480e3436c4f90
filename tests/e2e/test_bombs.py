"""Decompression bombs in PNG, JPEG, WebP, GIF and TIFF (issue 29): each 20,000 x 20,000 with a
real compressed stream (`tests.bombs`), refused as ``image_too_large`` before any pixel is
decoded, by `prep tokenize` and by `train`'s loader.

"Nothing decoded" is measured, not assumed: the peak RSS of a process that meets the bombs is
compared with the same process on small images of the same formats. The smallest bomb decodes to
400 MB (8-bit grey; WebP's canvas is 1.6 GB), so the 100 MB margin is four times below what one
decode costs and far above the noise of loading the same code twice (a few MB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.bombs import BOMB_WRITERS
from tests.e2e.test_hostile_inputs import _row, write_dataset

ROOT = Path(__file__).resolve().parents[2]
BOMB_SIDE = 20_000
SMALL_SIDE = 64
RSS_MARGIN_BYTES = 100 * 2**20
FORMATS = tuple(BOMB_WRITERS)


@pytest.mark.parametrize("ext", FORMATS)
@pytest.mark.parametrize("side", [SMALL_SIDE, 4128])  # 4128: GIF's LZW table fills and the zlib blocks repeat
def test_bomb_writers_make_images_that_decode(tmp_path, ext, side) -> None:
    """The same writers at a small side make images every pixel of which decodes to the one value."""
    path = BOMB_WRITERS[ext](tmp_path / f"b.{ext}", side)
    with Image.open(path) as img:
        img.load()
        pixels = np.asarray(img.convert("RGBA") if ext == "webp" else img)
    assert img.size == (side, side)
    assert np.unique(pixels).tolist() == ([128] if ext == "jpg" else [0])


def _run_measured(code: str) -> dict:
    """Run ``code`` in a fresh interpreter on this tree: it calls ``peak(name)`` after each phase
    (the process's peak RSS so far) and leaves its findings in ``out``, printed as JSON."""
    wrapper = (
        "import json, resource\n"
        "out = {'peak_rss': {}}\n"
        "def peak(name):\n"
        "    out['peak_rss'][name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        f"{code}\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _growth(run: dict) -> str:
    """Peak RSS after the bombs less the peak after the clean phase (which loaded all the code)."""
    grew = run["peak_rss"]["bombs"] - run["peak_rss"]["clean"]
    assert grew < RSS_MARGIN_BYTES, f"peak RSS {grew / 2**20:.0f} MB above the clean phase: a bomb was decoded"
    return f"{grew / 2**20:.1f} MB"


def _dataset(root: Path, side: int) -> Path:
    write_dataset(root, {"d": []})
    names = [BOMB_WRITERS[ext](root / "media" / f"img.{ext}", side).name for ext in FORMATS]
    Image.new("RGB", (200, 150), (10, 120, 200)).save(root / "media" / "good.png")
    rows = [_row(name, f"look {i}") for i, name in enumerate(names)] + [_row("good.png", "fine")]
    return write_dataset(root, {"d": rows})


TOKENIZE = """
from prep.cli import main
for name, config in {configs!r}:
    main(["tokenize", "--dataset-config", config, "--processor", {processor!r}, "--output", config + ".tok",
          "--executor", "local", "--max-error-rate", "1"], standalone_mode=False)
    peak(name)
"""


def test_tokenize_refuses_bombs_without_decoding_them(tmp_path, processor_dirs) -> None:
    """One process tokenizes a clean dataset, then the same rows with 20,000 x 20,000 images."""
    configs = [
        (name, str(_dataset(tmp_path / name, side))) for name, side in (("clean", SMALL_SIDE), ("bombs", BOMB_SIDE))
    ]
    run = _run_measured(TOKENIZE.format(configs=configs, processor=str(processor_dirs["qwen2_vl"])))
    assert _errors(Path(configs[0][1] + ".tok")) == []
    bombs = _errors(Path(configs[1][1] + ".tok"))
    assert [(e["line"], e["reason"]) for e in bombs] == [(i, "image_too_large") for i in range(len(FORMATS))]
    assert all(f"{BOMB_SIDE * BOMB_SIDE:,} pixels" in e["message"] for e in bombs), bombs
    print(f"peak RSS growth over the clean phase: {_growth(run)}")


def _errors(out: Path) -> list[dict]:
    import pyarrow as pa

    from schemas.layout import ERRORS_DIR

    parts = sorted((out / ERRORS_DIR).glob("part-*.arrow"))
    return [row for p in parts for row in pa.ipc.open_file(pa.memory_map(str(p))).read_all().to_pylist()]


DECODE = """
from pathlib import Path
from train.media import MediaOrigin, decode_image
origin = MediaOrigin(pack_key="pack-00000000", sample_id="d:0:0", member="img0000")
for name, folder in {folders!r}:
    out[name] = {{"decoded": [], "refused": []}}
    for path in sorted(Path(folder).iterdir()):
        try:
            image = decode_image(path.read_bytes(), origin)
            out[name]["decoded"].append([path.suffix, image.size[0], image.size[1]])
            del image
        except Exception as exc:
            out[name]["refused"].append([path.suffix, type(exc).__name__, str(exc)])
    peak(name)
"""


def test_train_loader_refuses_a_bomb_in_a_pack_without_decoding_it(tmp_path) -> None:
    """What `train.media.MediaProcessor` calls for every image of a pack, on the bytes a shard holds:
    one process decodes the small images, then meets the bombs."""
    folders = []
    for name, side in (("clean", SMALL_SIDE), ("bombs", BOMB_SIDE)):
        (tmp_path / name).mkdir()
        for ext, write in BOMB_WRITERS.items():
            write(tmp_path / name / f"img.{ext}", side)
        folders.append((name, str(tmp_path / name)))
    run = _run_measured(DECODE.format(folders=folders))
    assert sorted(s for s, *_ in run["clean"]["decoded"]) == sorted(f".{e}" for e in FORMATS)
    assert all(w == h == SMALL_SIDE for _, w, h in run["clean"]["decoded"])
    refused = run["bombs"]["refused"]
    assert run["bombs"]["decoded"] == [] and len(refused) == len(FORMATS), refused
    assert all(kind == "ImageTooLargeError" for _, kind, _ in refused), refused  # a data error: exit 1
    assert all("pack-00000000, sample d:0:0" in m and f"{BOMB_SIDE * BOMB_SIDE:,} pixels" in m for *_, m in refused)
    print(f"peak RSS growth over the clean phase: {_growth(run)}")
