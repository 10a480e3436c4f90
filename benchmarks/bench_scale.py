"""Scale: `prep tokenize` -> `prep pack` (plan) on N synthetic rows; peak RSS and rows/s per N.

    python benchmarks/bench_scale.py                          # CI-sized: 2,000 rows
    python benchmarks/bench_scale.py --rows 100000 1000000 --workdir /tmp/bench-scale

Each row is a ShareGPT conversation (two turns, seeded text) with 1-3 images. Every image is
its own LMDB value holding a real JPEG: a tiny encoded image whose SOF header is rewritten to
one of six photo sizes (640x480 .. 2048x1536), so tokenize reads a real header and end marker
per image, as on real data, without gigabytes of pixels (nothing here decodes them). Both
stages run in a fresh process each (the tokenize executor as given, ``local`` by default:
one process, so ``ru_maxrss`` is the stage's whole footprint); the script prints rows/s and
peak RSS per stage and N, and its anonymous part (heap and arrays, sampled every 50 ms: the
LMDB is memory-mapped, so every page of it read counts in RSS as reclaimable page cache), and
the peak RSS ratio between the largest and smallest N, so memory flatness with N is a
measured fact. Times are wall-clock on a possibly shared
machine: compare rows measured in the same run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
from machine import cpu_model
from PIL import Image

from schemas.media_ref import MediaRef

SIZES = [(640, 480), (1024, 768), (1280, 720), (1920, 1080), (800, 1200), (2048, 1536)]
LMDB_NAME = "images.lmdb"
WORDS = "the a picture shows colourful gradient sky tree river car street light shadow detail".split()

CHILD = """
import json, resource, sys, threading, time
from prep.run import ExecutorConfig
stage, args = sys.argv[1], json.loads(sys.argv[2])
peak_anon = [0]
def rss_anon():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("RssAnon"))
def sample():
    while True:
        peak_anon[0] = max(peak_anon[0], rss_anon())
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
if stage == "tokenize":
    from prep.tokenize.stage import TokenizeConfig, run_tokenize
    manifest = run_tokenize(TokenizeConfig(
        dataset_config=args["config"], processor=args["processor"], output_dir=args["out"],
        rows_per_chunk=args["rows_per_chunk"], executor=ExecutorConfig(executor=args["executor"]),
    ))
    rows = manifest.rows.samples
else:
    from prep.pack.stage import PackConfig, run_pack
    manifest = run_pack(PackConfig(inputs=(args["tok"],), output_dir=args["out"], pack_size=args["pack_size"]))
    rows = manifest.samples.packed
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
peak_anon[0] = max(peak_anon[0], rss_anon())
print("RESULT", json.dumps({"rows": rows, "seconds": seconds, "peak": peak, "anon": peak_anon[0]}))
"""


def jpeg_template() -> tuple[bytes, int]:
    """A tiny real JPEG and the offset of its SOF0 height field (width follows)."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 140, 200)).save(buf, format="JPEG", quality=50)
    data = buf.getvalue()
    sof = data.index(b"\xff\xc0")
    return data, sof + 5


def write_rows(root: Path, num_rows: int, seed: int) -> Path:
    """ShareGPT JSONL of ``num_rows`` rows, 1-3 LMDB images each; returns dataset_info.json."""
    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True)
    template, at = jpeg_template()
    counts = rng.integers(1, 4, num_rows)
    sizes = rng.integers(0, len(SIZES), int(counts.sum()))
    env = lmdb.open(str(media / LMDB_NAME), map_size=max(1 << 30, 4 * len(template) * sizes.size))
    image = 0
    with open(root / "rows.jsonl", "w", encoding="utf-8") as fh:
        txn = env.begin(write=True)
        for row in range(num_rows):
            refs = []
            for _ in range(int(counts[row])):
                w, h = SIZES[int(sizes[image])]
                key = f"{image:09d}.jpg"
                txn.put(key.encode(), template[:at] + h.to_bytes(2, "big") + w.to_bytes(2, "big") + template[at + 4 :])
                refs.append(MediaRef(path=LMDB_NAME, key=key).format())
                image += 1
            words = " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(5, 120))))
            turns = [
                {"role": "user", "content": "<image>" * len(refs) + f"Describe set {row}."},
                {"role": "assistant", "content": words},
            ]
            fh.write(json.dumps({"messages": turns, "images": refs}) + "\n")
            if row % 50_000 == 49_999:
                txn.commit()
                txn = env.begin(write=True)
        txn.commit()
    env.close()
    config = {"scale": {"file_name": "rows.jsonl", "formatting": "sharegpt", "media_dir": "media"}}
    (root / "dataset_info.json").write_text(json.dumps(config))
    return root / "dataset_info.json"


@dataclass(frozen=True)
class StageRun:
    rows: int
    seconds: float
    peak: int  # VmHWM: anonymous + file-backed (mapped LMDB pages, libraries)
    anon: int  # peak RssAnon (heap and arrays), sampled every 50 ms


def run_stage(stage: str, args: dict[str, object]) -> StageRun:
    """One stage in a fresh process: its rows, seconds and peak RSS."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, stage, json.dumps(args)], check=True, stdout=subprocess.PIPE, text=True
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    return StageRun(rows=got["rows"], seconds=got["seconds"], peak=got["peak"], anon=got["anon"])


def main() -> None:
    from families.registry import example_family

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[2000])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-scale"))
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--executor", default="local", choices=["auto", "local", "ray"])
    parser.add_argument("--rows-per-chunk", type=int, default=512)
    parser.add_argument("--pack-size", type=int, default=16384, help="fits 3 images of 2048x1536")
    parser.add_argument("--keep", action="store_true", help="keep each N's data and outputs")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(
        f"machine: {platform.platform()} | {cpu_model()} | {os.cpu_count()} CPUs | python "
        f"{platform.python_version()} | executor {args.executor} | family {args.family}"
    )
    shutil.rmtree(args.workdir, ignore_errors=True)
    processor = example_family(args.family).build_processor(args.workdir / "processor")
    results = []
    for n in args.rows:
        root = args.workdir / f"n{n}"
        start = time.perf_counter()
        config = write_rows(root, n, seed=0)
        made = time.perf_counter() - start
        tok = run_stage(
            "tokenize",
            {
                "config": str(config),
                "processor": str(processor),
                "out": str(root / "tok"),
                "rows_per_chunk": args.rows_per_chunk,
                "executor": args.executor,
            },
        )
        pack = run_stage("pack", {"tok": str(root / "tok"), "out": str(root / "packed"), "pack_size": args.pack_size})
        results.append((n, tok, pack))
        print(
            f"N={n:,} (rows written in {made:.1f} s): tokenize {tok.rows / tok.seconds:,.0f} rows/s "
            f"({tok.seconds:.1f} s), peak RSS {tok.peak / 1e9:.2f} GB | pack plan {pack.rows / pack.seconds:,.0f} "
            f"rows/s ({pack.seconds:.1f} s), peak RSS {pack.peak / 1e9:.2f} GB",
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(root)
    resource_note = f"(this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB)"
    print("\n| N | tokenize rows/s | tokenize peak RSS (anon) | pack plan rows/s | pack plan peak RSS (anon) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n, tok, pack in results:
        print(
            f"| {n:,} | {tok.rows / tok.seconds:,.0f} | {tok.peak / 1e9:.2f} GB ({tok.anon / 1e9:.2f}) | "
            f"{pack.rows / pack.seconds:,.0f} | {pack.peak / 1e9:.2f} GB ({pack.anon / 1e9:.2f}) |"
        )
    if len(results) > 1:
        (n0, tok0, pack0), (n1, tok1, pack1) = results[0], results[-1]
        print(
            f"\npeak RSS x{n1 / n0:,.0f} rows: tokenize x{tok1.peak / tok0.peak:.2f}, pack plan "
            f"x{pack1.peak / pack0.peak:.2f}; peak anonymous RSS: tokenize x{tok1.anon / tok0.anon:.2f}, pack plan "
            f"x{pack1.anon / pack0.anon:.2f} {resource_note}"
        )


if __name__ == "__main__":
    main()
