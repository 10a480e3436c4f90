"""prep tokenize's closed-form path vs the full HF processor on decoded images.

Both paths see the same generated image-heavy samples in the same run:
  ours       header-only image sizes + one template render + one tokenizer call + splice
  reference  decode every image (transformers.load_image) + processor(text, images), which is
             what pipelines that "count by processing" do
It prints samples/s of each, the ratio, and mismatches (ours vs reference input_ids; must be 0),
then the whole stage under --executor local vs Ray on this machine. ``--family`` repeats the
comparison for example processors of other families (``prep example --family`` choices, or
``all``) and ends with one table row per family.

    python benchmarks/bench_tokenize.py --num-samples 200
    python benchmarks/bench_tokenize.py --family all --num-samples 40 --skip-executors
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

SIZES = [(640, 480), (1024, 768), (1280, 720), (1920, 1080), (800, 1200), (2048, 1536)]


def make_dataset(root: Path, num_samples: int, seed: int) -> Path:
    """Image-heavy ShareGPT JSONL: 1-3 smooth JPEG photos per sample, multi-turn text."""
    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True)
    paths = []
    for i, (w, h) in enumerate(SIZES * 4):
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([(xx * (i + 1)) % 256, (yy * 3) % 256, (xx + yy + 40 * i) % 256], -1).astype(np.uint8)
        img = np.clip(img + rng.integers(0, 12, img.shape), 0, 255).astype(np.uint8)
        path = media / f"img{i}.jpg"
        Image.fromarray(img).save(path, quality=90)
        paths.append(path.name)
    with open(root / "bench.jsonl", "w", encoding="utf-8") as fh:
        for i in range(num_samples):
            k = int(rng.integers(1, 4))
            imgs = [paths[int(j)] for j in rng.integers(0, len(paths), k)]
            turns = [
                {"role": "user", "content": "<image>" * k + f"Describe picture set {i} in detail."},
                {
                    "role": "assistant",
                    "content": "It shows " + " ".join(["colourful gradients"] * int(rng.integers(5, 40))),
                },
                {"role": "user", "content": "And the mood?"},
                {"role": "assistant", "content": "Calm."},
            ]
            fh.write(json.dumps({"messages": turns, "images": imgs}) + "\n")
    config = {"bench": {"file_name": "bench.jsonl", "formatting": "sharegpt", "media_dir": "media"}}
    (root / "dataset_info.json").write_text(json.dumps(config))
    return root / "dataset_info.json"


@dataclass(frozen=True)
class PathComparison:
    samples: int
    ours_per_s: float
    reference_per_s: float | None  # None: the real processor cannot run here
    mismatches: int


def compare_paths(config_path: Path, processor_dir: Path) -> PathComparison:
    from prep.sources.formats.sharegpt import to_conversation
    from prep.sources.records import decode_record, plan_chunks, read_chunk
    from prep.tokenize.core import SampleTokenizer
    from prep.tokenize.processor import load_processor
    from prep.tokenize.processor_path import ReferenceUnavailable, reference_input_ids
    from schemas.dataset_config import load_dataset_config

    spec = load_dataset_config(config_path)[0]
    bundle = load_processor(str(processor_dir))
    tok = SampleTokenizer(bundle)
    convs = [
        to_conversation(decode_record(r), spec)
        for c in plan_chunks([spec], rows_per_chunk=10**9, seed=0)
        for r in read_chunk(c)
    ]
    tok.tokenize(convs[0], spec.video)  # warm caches (template compile)
    t0 = time.perf_counter()
    ours = [tok.tokenize(c, spec.video).input_ids for c in convs]
    t_ours = time.perf_counter() - t0
    n = len(convs)
    print(f"samples: {n}, images: {sum(len(c.media) for c in convs)}, tokens: {sum(map(len, ours)):,}")
    print(f"ours (closed form):          {n / t_ours:10.1f} samples/s")
    t0 = time.perf_counter()
    try:
        ref = [reference_input_ids(bundle, tok.for_template(c), spec.video, tok.lmdb) for c in convs]
    except ReferenceUnavailable as exc:
        print(f"reference: cannot run here ({exc})")
        return PathComparison(samples=n, ours_per_s=n / t_ours, reference_per_s=None, mismatches=0)
    t_ref = time.perf_counter() - t0
    mismatches = sum(a != b for a, b in zip(ours, ref))
    print(f"reference (decode+process):  {n / t_ref:10.1f} samples/s")
    print(f"speed-up: {t_ref / t_ours:.1f}x   mismatches: {mismatches}")
    return PathComparison(samples=n, ours_per_s=n / t_ours, reference_per_s=n / t_ref, mismatches=mismatches)


def compare_executors(config_path: Path, processor_dir: Path, root: Path) -> None:
    from prep.run import ExecutorConfig
    from prep.tokenize.stage import TokenizeConfig, run_tokenize

    for executor in ("local", "ray"):
        cfg = TokenizeConfig(
            dataset_config=str(config_path),
            processor=str(processor_dir),
            output_dir=str(root / f"out-{executor}"),
            executor=ExecutorConfig(executor=executor),
            rows_per_chunk=25,
        )
        t0 = time.perf_counter()
        manifest = run_tokenize(cfg)
        dt = time.perf_counter() - t0
        rate = manifest.rows.samples / dt
        print(f"stage --executor {executor:5s}: {rate:8.1f} samples/s ({dt:.1f} s incl. startup)")


def main() -> None:
    from prep.example.families.base import example_families, example_family

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-executors", action="store_true")
    parser.add_argument(
        "--family",
        nargs="+",
        default=["qwen2_vl"],
        help=f"example processor families, or 'all': {', '.join(example_families())}",
    )
    args = parser.parse_args()
    families = list(example_families()) if args.family == ["all"] else args.family
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = make_dataset(root, args.num_samples, args.seed)
        for family in families:
            print(f"\n== {family} ==")
            processor = example_family(family).build_processor(root / f"processor-{family}")
            rows.append((family, compare_paths(config, processor)))
        if not args.skip_executors:
            compare_executors(config, example_family(families[0]).build_processor(root / "processor"), root)
    print("\n| family | closed form samples/s | real processor samples/s | speed-up | mismatches |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for family, r in rows:
        ref = "n/a" if r.reference_per_s is None else f"{r.reference_per_s:.1f}"
        ratio = "n/a" if r.reference_per_s is None else f"{r.ours_per_s / r.reference_per_s:.0f}x"
        print(f"| {family} | {r.ours_per_s:.1f} | {ref} | {ratio} | {r.mismatches} |")


if __name__ == "__main__":
    main()
