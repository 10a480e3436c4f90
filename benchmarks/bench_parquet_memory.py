"""Peak RSS of `prep tokenize` on a multi-GB Parquet file with embedded images.

    python benchmarks/bench_parquet_memory.py --size-gb 2 --workdir /tmp/bench-parquet

Writes a Hugging Face ``datasets``-layout Parquet file (``conversations``: list of
``{from, value}`` structs; ``images``: list of ``Image`` structs ``{bytes, path}``; row groups
of 100 rows, as ``datasets`` writes image data) of ``--size-gb`` of noise JPEGs (incompressible,
no dictionary encoding), streaming, then runs the tokenize stage on it in a child process,
once with the local executor (driver and worker in one process) and once with Ray
(``--ray-workers`` actors). A sampler thread polls the RSS of the child and all its descendants
every 0.1 s and prints each process's peak next to the file size: bounded means the peak
does not grow with the file (rerun with another ``--size-gb`` to see that), far below it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

ROW_GROUP_ROWS = 100
MB = 1 << 20


def noise_jpegs(count: int, rng: np.random.Generator) -> list[bytes]:
    """Distinct real JPEGs of noise (the header must parse), 150..400 KB each."""
    out = []
    for _ in range(count):
        w, h = int(rng.integers(400, 900)), int(rng.integers(300, 700))
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def write_parquet(path: Path, total_bytes: int, seed: int) -> tuple[int, int]:
    """Stream row groups until ``total_bytes`` of image bytes are written; returns (rows, file bytes)."""
    rng = np.random.default_rng(seed)
    jpegs = noise_jpegs(48, rng)
    schema = pa.schema(
        [
            ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
            ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ]
    )
    rows = written = 0
    with pq.ParquetWriter(path, schema, use_dictionary=False, compression="snappy") as writer:
        while written < total_bytes:
            convs, imgs = [], []
            for _ in range(ROW_GROUP_ROWS):
                data = jpegs[int(rng.integers(len(jpegs)))]
                convs.append(
                    [
                        {"from": "human", "value": f"<image>Describe picture {rows}."},
                        {"from": "gpt", "value": "Noise. " * int(rng.integers(1, 40))},
                    ]
                )
                imgs.append([{"bytes": data, "path": f"img{rows}.jpg"}])
                written += len(data)
                rows += 1
            writer.write_table(pa.table({"conversations": convs, "images": imgs}, schema=schema))
    return rows, path.stat().st_size


class PeakRss:
    """Peak RSS per process of a process tree, sampled in a thread."""

    def __init__(self, root_pid: int) -> None:
        self.root = psutil.Process(root_pid)
        self.peaks: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    name = _name(p)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if rss > self.peaks.get(p.pid, ("", 0))[1]:
                    self.peaks[p.pid] = (name, rss)
            time.sleep(0.1)

    def stop(self) -> dict[int, tuple[str, int]]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def _name(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    for tag in ("TokenizeWorker", "raylet", "gcs_server", "dashboard", "log_monitor", "ray::"):
        if tag in cmd:
            return tag
    return "driver" if "run_tokenize" in cmd else p.name()


CHILD = """
import sys
from prep.run import ExecutorConfig
from prep.tokenize.stage import TokenizeConfig, run_tokenize
config, processor, out, executor, workers = sys.argv[1:6]
ex = ExecutorConfig(executor=executor, num_workers=int(workers) or None)
m = run_tokenize(TokenizeConfig(dataset_config=config, processor=processor, output_dir=out, executor=ex))
print(m.rows.samples if hasattr(m.rows, "samples") else m.rows)
"""


def run_once(workdir: Path, executor: str, workers: int) -> tuple[float, dict[int, tuple[str, int]]]:
    out = workdir / f"tok-{executor}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-c", "# run_tokenize\n" + CHILD, str(workdir / "dataset_info.json")]
    cmd += [str(workdir / "processor"), str(out), executor, str(workers)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    sampler = PeakRss(proc.pid)
    code = proc.wait()
    peaks = sampler.stop()
    if code != 0:
        raise SystemExit(f"tokenize ({executor}) failed with exit code {code}")
    return time.perf_counter() - start, peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-parquet"))
    ap.add_argument("--ray-workers", type=int, default=2, help="0 skips the Ray run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from families.qwen2_vl.processor_dir import build_processor_dir

    args.workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.workdir).free
    if free < args.size_gb * 1.2 * (1 << 30):
        raise SystemExit(
            f"{args.workdir}: {free / (1 << 30):.1f} GB free, need {args.size_gb * 1.2:.1f}; lower --size-gb"
        )
    data = args.workdir / "d.parquet"
    t0 = time.perf_counter()
    rows, file_bytes = write_parquet(data, int(args.size_gb * (1 << 30)), args.seed)
    print(f"wrote {data}: {rows} rows, {file_bytes / MB:.0f} MB in {time.perf_counter() - t0:.0f} s")
    build_processor_dir(args.workdir / "processor", "qwen2_vl")
    spec = {"file_name": "d.parquet", "formatting": "sharegpt", "columns": {"messages": "conversations"}}
    spec["tags"] = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}
    (args.workdir / "dataset_info.json").write_text(json.dumps({"d": spec}))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    runs = [("local", 0)] + ([("ray", args.ray_workers)] if args.ray_workers else [])
    for executor, workers in runs:
        seconds, peaks = run_once(args.workdir, executor, workers)
        print(
            f"\n{executor}: {rows} samples in {seconds:.1f} s ({rows / seconds:.0f} samples/s); peak RSS per process:"
        )
        for name, rss in sorted(peaks.values(), key=lambda v: -v[1])[:8]:
            print(f"  {name:<16} {rss / MB:8.0f} MB  ({rss / file_bytes:.1%} of the file)")


if __name__ == "__main__":
    main()
