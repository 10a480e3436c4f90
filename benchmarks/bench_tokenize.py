"""prep tokenize's closed-form path vs the full HF processor on decoded images.

Both paths see the same generated image-heavy samples in the same run:
  ours       header-only image sizes + one template render + one tokenizer call + splice
  reference  decode every image (transformers.load_image) + processor(text, images), which is
             what pipelines that "count by processing" do
It prints samples/s of each, the ratio, and mismatches (ours vs reference input_ids; must be 0),
then the whole stage under --executor auto (the default), local, and Ray at 1 and 2 actors on
this machine, each in a fresh process: rows/s (start-up included) and peak PSS of the process
tree (driver plus every Ray process; shared pages counted once). ``--family`` repeats the
comparison for example processors of other families (``prep example --family`` choices, or
``all``) and ends with one table row per family. Families whose processor takes video get a
second row, ``F (video)``: 1-2 synthetic clips per sample (PyAV-written MPEG-4, 3-10 s,
320x240 to 854x480), counted from the container header by the closed form, against the real
processor decoding each clip (transformers' PyAV reader) at the dataset's default sampling
(2 fps); the closed form is timed as the median of 5 passes between fifths of the reference, each
sample's expansion text counted as new (real clips differ in length; these 4 repeat). The real video processors need
torchvision: without it that reference prints n/a, as the image reference does for
torchvision-only image processors. Each family's line ``reference classes`` names the image
and video processor classes (and backend: PIL or torchvision) that served the reference, which
is what its ratio is against.

    python benchmarks/bench_tokenize.py --num-samples 200
    python benchmarks/bench_tokenize.py --family all --num-samples 40 --skip-executors
    python benchmarks/bench_tokenize.py --executors-only --num-samples 400 --actors 1 2
    python benchmarks/bench_tokenize.py --family kimi_k25 --num-samples 0 --num-video-samples 12 --skip-executors
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
from typing import Any

import numpy as np
import psutil
from PIL import Image

SIZES = [(640, 480), (1024, 768), (1280, 720), (1920, 1080), (800, 1200), (2048, 1536)]


def make_dataset(root: Path, num_samples: int, seed: int) -> Path:
    """Image-heavy ShareGPT JSONL: 1-3 smooth JPEG photos per sample, multi-turn text.

    Every image is a file of its own with a size of its own (the width and height of one of
    :data:`SIZES` each moved by up to 10 %): a real dataset's samples do not share image files, and
    a worker that remembers anything per file or per size must not be flattered here."""
    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True)
    counts = [int(rng.integers(1, 4)) for _ in range(num_samples)]
    paths = []
    for i in range(sum(counts)):
        base_w, base_h = SIZES[int(rng.integers(0, len(SIZES)))]
        w, h = (int(round(b * rng.uniform(0.9, 1.1))) for b in (base_w, base_h))
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([(xx * (i % 24 + 1)) % 256, (yy * 3) % 256, (xx + yy + 40 * i) % 256], -1).astype(np.uint8)
        img = np.clip(img + rng.integers(0, 12, img.shape), 0, 255).astype(np.uint8)
        path = media / f"img{i}.jpg"
        Image.fromarray(img).save(path, quality=90)
        paths.append(path.name)
    rows = []
    taken = 0
    for i, k in enumerate(counts):
        imgs, taken = paths[taken : taken + k], taken + k
        turns = [
            {"role": "user", "content": "<image>" * k + f"Describe picture set {i} in detail."},
            {
                "role": "assistant",
                "content": "It shows " + " ".join(["colourful gradients"] * int(rng.integers(5, 40))),
            },
            {"role": "user", "content": "And the mood?"},
            {"role": "assistant", "content": "Calm."},
        ]
        rows.append({"messages": turns, "images": imgs})
    return write_dataset(root, rows)


def write_dataset(root: Path, rows: list[dict[str, object]]) -> Path:
    """``rows`` as ShareGPT JSONL beside its ``dataset_info.json`` (media under ``root/media``)."""
    with open(root / "bench.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    config = {"bench": {"file_name": "bench.jsonl", "formatting": "sharegpt", "media_dir": "media"}}
    (root / "dataset_info.json").write_text(json.dumps(config))
    return root / "dataset_info.json"


# (frames, fps, width, height): 10 s at 30 fps, 5 s at 24 fps, 3 s at 25 fps, 5 s at NTSC 29.97 fps
CLIPS = [(300, 30.0, 640, 360), (120, 24.0, 480, 272), (75, 25.0, 320, 240), (150, 30000 / 1001, 854, 480)]


def make_video_dataset(root: Path, num_samples: int, seed: int) -> Path:
    """Video ShareGPT JSONL: 1-2 clips per sample (one in five has two), multi-turn text."""
    from prep.example.media import write_video

    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True)
    names = []
    for i, (frames, fps, width, height) in enumerate(CLIPS):
        write_video(media / f"clip{i}.mp4", frames, fps, width, height, seed=i)
        names.append(f"clip{i}.mp4")
    rows = []
    for i in range(num_samples):
        k = 2 if i % 5 == 4 else 1
        videos = [names[int(j)] for j in rng.integers(0, len(names), k)]
        turns = [
            {"role": "user", "content": "<video>" * k + f"What happens in clip set {i}?"},
            {"role": "assistant", "content": "It shows " + " ".join(["moving stripes"] * int(rng.integers(5, 40)))},
            {"role": "user", "content": "And at the end?"},
            {"role": "assistant", "content": "They stop."},
        ]
        rows.append({"messages": turns, "videos": videos})
    return write_dataset(root, rows)


def video_path_of(processor_dir: Path) -> str | None:
    """How ``prep tokenize`` counts this family's video: "closed form", "processor" (no closed form: the
    real processor runs), or None where the processor takes no video."""
    from families.counter import MediaRejected
    from families.processor import load_processor
    from families.registry import find_counter
    from packvlm.sample_error import SampleError
    from schemas.dataset_config import VideoSampling
    from schemas.media import VideoMeta

    bundle = load_processor(str(processor_dir))
    factory = find_counter(bundle.processor_class)
    counter = factory(bundle) if factory else None
    if counter is None or not getattr(counter, "counts_video", True):
        return "processor" if _has_video_slot(bundle.processor_class) else None
    try:
        counter.count_video(VideoMeta(num_frames=60, fps=30.0, width=320, height=240), VideoSampling())
    except SampleError:  # the family takes images only
        return None
    except MediaRejected:
        return "processor" if _has_video_slot(bundle.processor_class) else None
    return "closed form"


def _has_video_slot(processor_class: str) -> bool:
    """The processor class takes a video processor (Idefics3Processor, sharing SmolVLM's counter, does not)."""
    import transformers

    try:
        return "video_processor" in getattr(transformers, processor_class).get_attributes()
    except (AttributeError, ImportError):  # torchvision-gated class without torchvision: assume it may
        return True


def reference_classes(processor_dir: Path) -> tuple[str, str]:
    """The image and video processor classes the real processor runs here, each with its backend."""
    from families.processor import load_processor

    processor = load_processor(str(processor_dir)).processor

    def name(part: object) -> str:
        if part is None:
            return "none here"
        return f"{type(part).__name__} ({getattr(part, 'backend', None) or 'backend n/a'})"

    return name(getattr(processor, "image_processor", None)), name(getattr(processor, "video_processor", None))


@dataclass(frozen=True)
class PathComparison:
    samples: int
    ours_per_s: float
    reference_per_s: float | None  # None: the real processor cannot run here
    mismatches: int
    # CPU seconds of the process (all threads) per sample: on a loaded machine a multi-threaded
    # processor gets several shares of the cores where the one-threaded closed form gets one
    ours_cpu_s: float = 0.0
    reference_cpu_s: float | None = None


def compare_paths(config_path: Path, processor_dir: Path, ours_repeats: int = 5) -> PathComparison:
    """Closed form vs the real processor on the same samples; ours is the median of ``ours_repeats`` passes,
    taken between shares of the reference.

    Before each sample the tokenizer forgets what it remembers per media item (counter answers,
    image headers: :meth:`SampleTokenizer.forget_media`), as for a dataset whose files
    and sizes are all new (the bench's clips repeat, and every pass after the first sees the same
    images again); it keeps the chat template's shape cache, as a worker over a real dataset does
    (a few conversation shapes, many samples)."""
    from families.processor import load_processor
    from prep.sources.formats.sharegpt import to_conversation
    from prep.sources.records import decode_record, plan_chunks, read_chunk
    from prep.tokenize.core import SampleTokenizer
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
    # a pass of ours, then a share of the reference, ours_repeats times: both see the same stretch of a
    # shared machine's load, and ours runs back to back as in a pipeline (not after each processor call)
    ours, ref, passes, cpu_passes, t_ref, cpu_ref = [], [], [], [], 0.0, 0.0
    unavailable: str | None = None
    shares = np.array_split(np.arange(len(convs)), ours_repeats)
    for share in shares:
        t0, c0 = time.perf_counter(), time.process_time()
        ours = [_tokenize(tok, c, spec.video) for c in convs]
        passes.append(time.perf_counter() - t0)
        cpu_passes.append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in share.tolist() if unavailable is None else []:
            try:
                ref.append(reference_input_ids(bundle, tok.for_template(convs[i]), spec.video, tok.lmdb))
            except ReferenceUnavailable as exc:
                unavailable = str(exc)
                break
        t_ref += time.perf_counter() - t0
        cpu_ref += time.process_time() - c0
    t_ours, cpu_ours = float(np.median(passes)), float(np.median(cpu_passes))
    n = len(convs)
    kinds = sorted({m.kind for c in convs for m in c.media})
    items = ", ".join(f"{k}s: {sum(m.kind == k for c in convs for m in c.media)}" for k in kinds)
    print(f"samples: {n}, {items}, tokens: {sum(map(len, ours)):,}")
    print(f"ours (closed form):          {n / t_ours:10.1f} samples/s")
    if unavailable is not None:
        print(f"reference: cannot run here ({unavailable})")
        return PathComparison(
            samples=n, ours_per_s=n / t_ours, reference_per_s=None, mismatches=0, ours_cpu_s=cpu_ours / n
        )
    mismatches = sum(a != b for a, b in zip(ours, ref, strict=True))
    print(f"reference (decode+process):  {n / t_ref:10.1f} samples/s")
    print(f"speed-up: {t_ref / t_ours:.1f}x (CPU time {cpu_ref / cpu_ours:.1f}x)   mismatches: {mismatches}")
    return PathComparison(
        samples=n,
        ours_per_s=n / t_ours,
        reference_per_s=n / t_ref,
        mismatches=mismatches,
        ours_cpu_s=cpu_ours / n,
        reference_cpu_s=cpu_ref / n,
    )


def _tokenize(tok: Any, conv: Any, sampling: Any) -> list[int]:
    tok.forget_media()
    return list(tok.tokenize(conv, sampling).input_ids)


EXECUTOR_CHILD = """
import sys, time
from prep.run import ExecutorConfig
from prep.tokenize.stage import TokenizeConfig, run_tokenize
config, processor, out, executor, workers = sys.argv[1:6]
start = time.perf_counter()
manifest = run_tokenize(TokenizeConfig(
    dataset_config=config, processor=processor, output_dir=out, rows_per_chunk=int(sys.argv[6]),
    executor=ExecutorConfig(executor=executor, num_workers=int(workers) or None),
))
print("ROWS", manifest.rows.samples, time.perf_counter() - start)
"""


def tree_pss(root: psutil.Process) -> int:
    """Proportional set size of a process and its descendants (shared pages counted once in total)."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


@dataclass(frozen=True)
class ExecutorRun:
    label: str
    rows: int
    seconds: float  # the stage call, start-up included
    wall_s: float  # the whole process: imports, Ray start and shutdown
    peak_pss: int


def run_executor(config: Path, processor: Path, out: Path, executor: str, workers: int, chunk: int) -> ExecutorRun:
    """The stage in a fresh process; memory = peak PSS of the process tree, sampled every 0.1 s."""
    import subprocess
    import sys

    args = [str(config), str(processor), str(out), executor, str(workers), str(chunk)]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", EXECUTOR_CHILD, *args], stdout=subprocess.PIPE, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        peak = max(peak, tree_pss(root))
        time.sleep(0.1)
    wall = time.perf_counter() - start
    stdout = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise RuntimeError(f"{executor} run failed ({proc.returncode})")
    rows, seconds = next(line.split()[1:] for line in stdout.splitlines() if line.startswith("ROWS"))
    label = executor if executor != "ray" else f"ray, {workers or 'default'} actor(s)"
    return ExecutorRun(label=label, rows=int(rows), seconds=float(seconds), wall_s=wall, peak_pss=peak)


def compare_executors(
    config_path: Path, processor_dir: Path, root: Path, actors: list[int], chunk: int, repeats: int
) -> None:
    """`prep tokenize` under auto (the default), local and Ray at each actor count, each in a fresh process."""
    from prep.run import ExecutorConfig, resolve_executor

    choice = resolve_executor(ExecutorConfig(), num_tasks=2)
    print(f"\nauto picks {choice.name} here ({choice.reason})")
    plan = [("local", 0), ("auto", 0), *(("ray", n) for n in actors)]
    best: dict[tuple[str, int], ExecutorRun] = {}
    for r in range(repeats):  # interleaved, best rows/s of each: the machine may be shared
        for executor, n in plan:
            run = run_executor(config_path, processor_dir, root / f"out-{executor}{n}-{r}", executor, n, chunk)
            if (executor, n) not in best or run.seconds < best[executor, n].seconds:
                best[executor, n] = run
    runs = [best[key] for key in plan]
    local = runs[0]
    print("| executor | rows/s (stage, start-up incl.) | x local | stage s | process s | peak PSS (tree) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        rate = r.rows / r.seconds
        print(
            f"| {r.label} | {rate:.1f} | {rate / (local.rows / local.seconds):.2f} | {r.seconds:.1f} | "
            f"{r.wall_s:.1f} | {r.peak_pss / 1e9:.2f} GB |"
        )


def main() -> None:
    from families.registry import example_families, example_family

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=200)
    parser.add_argument(
        "--num-video-samples", type=int, default=12, help="video samples per family whose processor takes video"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-executors", action="store_true")
    parser.add_argument("--executors-only", action="store_true", help="skip the closed form vs processor comparison")
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2], help="Ray actor counts to compare")
    parser.add_argument("--rows-per-chunk", type=int, default=25, help="rows per tokenize task")
    parser.add_argument("--repeats", type=int, default=2, help="executor runs per setting (best kept)")
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
    rows: list[tuple[str, str, PathComparison]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = make_dataset(root / "images", args.num_samples, args.seed)
        wants_video = args.num_video_samples > 0 and not args.executors_only
        video_config = make_video_dataset(root / "videos", args.num_video_samples, args.seed) if wants_video else None
        for family in [] if args.executors_only else families:
            print(f"\n== {family} ==")
            processor = example_family(family).build_processor(root / f"processor-{family}")
            image_class, video_class = reference_classes(processor)
            print(f"reference classes: image {image_class}, video {video_class}")
            if args.num_samples:
                rows.append((family, image_class, compare_paths(config, processor)))
            path = video_path_of(processor) if video_config is not None else None
            if path == "closed form" and video_config is not None:
                print(f"-- {family} (video) --")
                rows.append(
                    (
                        f"{family} (video)",
                        video_class,
                        compare_paths(video_config, processor),
                    )
                )
            elif path == "processor":
                print(f"-- {family} (video): no closed form, prep tokenize runs the real processor --")
        if not args.skip_executors:
            processor = example_family(families[0]).build_processor(root / "processor")
            compare_executors(config, processor, root, args.actors, args.rows_per_chunk, args.repeats)
    if not rows:
        return
    print(
        "\n| family | closed form samples/s | real processor samples/s | speed-up | CPU ms/sample: closed form | "
        "real processor | CPU ratio | mismatches | reference class |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for family, served_by, r in rows:
        ref = "n/a" if r.reference_per_s is None else f"{r.reference_per_s:.1f}"
        ratio = "n/a" if r.reference_per_s is None else f"{r.ours_per_s / r.reference_per_s:.0f}x"
        cpu_ref = "n/a" if r.reference_cpu_s is None else f"{r.reference_cpu_s * 1e3:.0f}"
        cpu_ratio = "n/a" if r.reference_cpu_s is None else f"{r.reference_cpu_s / r.ours_cpu_s:.0f}x"
        print(
            f"| {family} | {r.ours_per_s:.1f} | {ref} | {ratio} | {r.ours_cpu_s * 1e3:.2f} | {cpu_ref} | {cpu_ratio} | "
            f"{r.mismatches} | {served_by} |"
        )


if __name__ == "__main__":
    main()
