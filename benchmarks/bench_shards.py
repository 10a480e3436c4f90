"""Benchmark shard writing against a plain sequential copy of the same media bytes.

    python benchmarks/bench_shards.py --media-mb 400 --workdir /tmp/bench-shards

Generates JPEG-sized random blobs (half files, half in one LMDB), a synthetic tokenized
directory (one image per sample, 200..2000 tokens, written with the real schema) and then,
on the same disk in the same run: (1) baseline: read every blob in sample order and append
it to one file; (2) shard writing alone: one `ShardWorker` in this process (like the copy)
writing every shard of a frozen plan; (3) `prep pack` with the local executor end to end:
plan, size shards (stat every blob), write tars, read them back for the conservation check.
Prints MB/s of media moved by each and the ratios (target for (2)/(1): >= 85 %). Both runs read from a
warm page cache (the blobs were just written); both fsync what they write (each shard is
fsynced before its rename), after an ``os.sync()`` so earlier dirty pages do not interfere.

``--profile`` adds one more shard run under cProfile and prints where the main thread's time
went (writes, fsync, waiting for the writer thread, media reads, tar headers, JSON, npy,
hashing, read-back, other Python). cProfile sees only the main thread: since the tar writer
thread reads the media and writes the members, its work shows as "waiting for the writer
thread" when it is the bottleneck (as a plain copy would be).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import shutil
import time
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pyarrow as pa

from packvlm.atomic import write_json_atomic
from prep.pack.shard_cut import parse_shard_size
from prep.pack.stage import PackConfig, run_pack
from prep.run import LOCAL
from prep.shards.stage import ShardsConfig, run_shards
from prep.sources.media import LmdbPool, read_bytes
from schemas.layout import MANIFEST_FILE, SAMPLES_DIR, part_name
from schemas.manifest import (
    SHARDS_MANIFEST_FILE,
    ProcessorIdentity,
    RowCounts,
    TokenizeInputs,
    TokenizeManifest,
    TokenTotals,
    VerifyCounts,
)
from schemas.media_ref import MediaRef
from schemas.tokenized import SAMPLES_SCHEMA

TARGET = 0.85
CATEGORIES = (  # (label, substrings of "file:function" in a cProfile entry), first match wins
    ("writes (writev/write)", ("posix.writev", "posix.write")),
    ("fsync", ("posix.fsync",)),
    ("waiting for the writer thread (reads, writes)", ("_thread.lock",)),
    (
        "media reads (file, LMDB)",
        ("BufferedReader", "Transaction", "io.open", "pathlib", "media.py:", "read.py:read_media"),
    ),
    ("tar headers", ("ustar_header", "member_parts", "end_of_archive")),
    ("JSON", ("json/", "to_json", "from_json")),
    ("npy", ("_format_impl", "core.py:_npy")),
    ("hashing", ("sha256", "hashlib")),
    ("read-back", ("readback.py", "iter_pack_metas")),
    ("tokenized rows (Arrow views)", ("shards/read.py", "numpy", "pyarrow")),
    ("pack metadata (build_pack, schemas)", ("shards/core.py", "schemas/", "worker.py")),
)


def make_media(root: Path, total_bytes: int, rng: np.random.Generator) -> list[str]:
    """Random blobs of 50..350 KB; even ones as files, odd ones in an LMDB. Returns refs."""
    media, db = root / "media", root / "media" / "images.lmdb"
    media.mkdir(parents=True)
    refs, done = [], 0
    env = lmdb.open(str(db), map_size=4 * total_bytes + (1 << 30))
    txn = env.begin(write=True)
    while done < total_bytes:
        size = int(rng.integers(50_000, 350_000))
        blob = b"\xff\xd8" + rng.bytes(size - 4) + b"\xff\xd9"
        name = f"img_{len(refs):07d}.jpg"
        if len(refs) % 2 == 0:
            (media / name).write_bytes(blob)
            refs.append(str(media / name))
        else:
            txn.put(name.encode(), blob)
            refs.append(MediaRef(path=str(db), key=name).format())
        done += size
    txn.commit()
    env.close()
    return refs


def make_tokenized(root: Path, refs: list[str], rng: np.random.Generator, rows_per_part: int = 512) -> Path:
    """A tokenized directory in the real schema: one image sample per ref."""
    out = root / "tok"
    (out / SAMPLES_DIR).mkdir(parents=True)
    pool = LmdbPool()
    chunks = 0
    for start in range(0, len(refs), rows_per_part):
        batch = refs[start : start + rows_per_part]
        lengths = rng.integers(200, 2000, len(batch))
        rows = [
            {
                "sample_id": f"bench:{start + i}:0",
                "dataset": "bench",
                "source": "bench.jsonl",
                "line": start + i,
                "copy": 0,
                "input_ids": rng.integers(0, 150_000, n, dtype=np.int32),
                "loss_mask": (rng.random(n) < 0.5).astype(np.uint8),
                "num_tokens": int(n),
                "num_text_tokens": int(n) - 100,
                "num_media_tokens": 100,
                "media": [
                    {
                        "kind": "image",
                        "ref": ref,
                        "width": 448,
                        "height": 448,
                        "grid_t": 1,
                        "grid_h": 20,
                        "grid_w": 20,
                        "num_tokens": 100,
                        "frame_indices": [],
                        "timestamps": [],
                        "num_bytes": media_size(ref, pool),
                        "num_tiles": 1,
                    }
                ],
            }
            for i, (ref, n) in enumerate(zip(batch, lengths))
        ]
        table = pa.Table.from_pylist(rows, schema=SAMPLES_SCHEMA)
        with (
            pa.OSFile(str(out / SAMPLES_DIR / part_name(chunks)), "wb") as sink,
            pa.ipc.new_file(sink, table.schema) as w,
        ):
            w.write_table(table)
        chunks += 1
    pool.close()  # the shard workers of this process open the LMDB themselves
    rows = RowCounts(samples=len(refs), errors=0)
    manifest = TokenizeManifest.create(
        config={},
        datasets=(),
        processor=ProcessorIdentity(class_name="Bench", sha256="0" * 64, source="bench"),
        inputs=TokenizeInputs(records=len(refs), rows_used=len(refs), chunks=chunks),
        rows=rows,
        per_dataset={"bench": rows},
        errors_by_reason={},
        tokens=TokenTotals(total=0, text=0, media=0, max_sample=0, mean_sample=0.0),
        verify=VerifyCounts(checked=0, skipped_no_reference=0),
    )
    write_json_atomic(out / MANIFEST_FILE, manifest.to_json())
    return out


def media_size(ref: str, pool: LmdbPool) -> int:
    """What tokenize records as ``num_bytes``: the file's size or the LMDB value's length."""
    media = MediaRef.parse(ref)
    return len(read_bytes(media, pool)) if media.is_lmdb else Path(media.path).stat().st_size


def sequential_copy(refs: list[str], dest: Path) -> int:
    """Baseline: read each blob (file or LMDB, as the shard writer reads it) and append it to one file."""
    total = 0
    pool = LmdbPool()  # closed before the shard workers open the same LMDB in this process
    with open(dest, "wb", buffering=0) as out:  # one write per blob, no extra copy
        for ref in refs:
            data = read_bytes(MediaRef.parse(ref), pool)
            out.write(data)
            total += len(data)
        out.flush()
        os.fsync(out.fileno())  # shards are fsynced too: compare what reaches the disk
    pool.close()
    return total


def profile_shards(packed: Path) -> None:
    """One more shard run under cProfile: the main thread's time per category."""
    profiler = cProfile.Profile()
    os.sync()
    profiler.enable()
    run_shards(ShardsConfig(packed_dir=str(packed), executor=LOCAL))
    profiler.disable()
    totals: dict[str, float] = {}
    raw = pstats.Stats(profiler).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    for (path, _line, func), (_cc, _nc, tottime, _ct, _callers) in raw.items():
        where = f"{Path(path).parent.name}/{Path(path).name}:{func}" if path != "~" else func
        label = next((name for name, keys in CATEGORIES if any(k in where for k in keys)), "other Python")
        totals[label] = totals.get(label, 0.0) + tottime
    whole = sum(totals.values())
    print(f"profile of one shard run ({whole:.2f} s on the main thread, under cProfile):")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:46s} {seconds:6.3f} s  {seconds / whole:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--media-mb", type=int, default=400)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-shards"))
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--shard-size", default="256MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="add one shard run under cProfile")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    rng = np.random.default_rng(0)
    refs = make_media(args.workdir, args.media_mb * 10**6, rng)
    tok = make_tokenized(args.workdir, refs, rng)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"{len(refs):,} blobs, {args.media_mb} MB media, workdir {args.workdir}"
    )
    config = PackConfig(
        inputs=(str(tok),), output_dir="", pack_size=args.pack_size, shard_size=parse_shard_size(args.shard_size)
    )
    copy_s, write_s, pack_s = [], [], []
    for r in range(args.repeats):
        dest = args.workdir / "copy.bin"
        os.sync()
        t = time.perf_counter()
        media_bytes = sequential_copy(refs, dest)
        copy_s.append(time.perf_counter() - t)
        dest.unlink()

        out = args.workdir / f"packed{r}"
        os.sync()
        t = time.perf_counter()
        manifest = run_pack(replace(config, output_dir=str(out)))
        os.sync()
        t_shards = time.perf_counter()
        shards = run_shards(ShardsConfig(packed_dir=str(out), executor=LOCAL))
        end = time.perf_counter()
        write_s.append(end - t_shards)
        pack_s.append(end - t)
        shard_bytes = shards.num_bytes
        if args.profile and r == args.repeats - 1:
            shutil.rmtree(out / "shards")
            (out / SHARDS_MANIFEST_FILE).unlink()
            profile_shards(out)
        shutil.rmtree(out)
    copy_t, write_t, pack_t = min(copy_s), min(write_s), min(pack_s)
    copy_mbs = media_bytes / copy_t / 1e6
    write_mbs, pack_mbs = media_bytes / write_t / 1e6, media_bytes / pack_t / 1e6
    print(f"sequential copy         : {copy_mbs:8.1f} MB/s of media ({copy_t:.2f} s)")
    print(
        f"prep shards (+read-back): {write_mbs:8.1f} MB/s of media ({write_t:.2f} s; {shard_bytes / 1e6:.0f} MB tar "
        f"= {shard_bytes / write_t / 1e6:.1f} MB/s written)  ratio {write_mbs / copy_mbs:.1%} (target >= {TARGET:.0%})"
    )
    print(f"prep pack end to end    : {pack_mbs:8.1f} MB/s of media ({pack_t:.2f} s)  ratio {pack_mbs / copy_mbs:.1%}")
    print(
        f"packs {manifest.packs.packs:,}, LB2 {manifest.packs.lb2:,}, "
        f"efficiency {manifest.packs.efficiency:.2%}, {len(shards.shards)} shards; best of {args.repeats}"
    )


if __name__ == "__main__":
    main()
