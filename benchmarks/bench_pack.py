"""Benchmark the pack planner against common packers on the same lengths, in one run.

    python benchmarks/bench_pack.py --sizes 1000000 10000000 --pack-sizes 4096 8192

Packers: ours (`plan_packs`: counting sort + BFD + shuffle, end to end), FFD, next fit
(input order), windowed FFD (1,000 samples, LLaMA-Factory/TRL) and NeMo Automodel's heap
worst fit at its default ``packing_ratio`` 1.0 (and at 0.9, an option a user may set), both
re-implemented here in numba (NeMo is not installed). At 1.0 NeMo's whole-dataset greedy
gives our pack count: the differences are speed (NeMo's own Python code took 153 s at 10M
on this machine, ~30x ours; the numba rows time the algorithm, not NeMo's code) and that we
pack exact token counts where NeMo packs estimated ones. Samples longer than the pack size
are dropped for every packer alike. Targets (issue 3): ours within 0.01 % of LB2 on the lognormal and
mixed sets, and no slower than 2x `numpy.argsort` of the same lengths. Times exclude
numba compilation (every packer is warmed up on a small array first).

    python benchmarks/bench_pack.py --memory 100000000

``--memory N`` measures `plan_packs` alone on N lognormal lengths (int32, the tokenized
``num_tokens`` column's type, generated in chunks so no float64 copy inflates the peak) in a
fresh subprocess: peak RSS (``ru_maxrss``), RSS before the call (interpreter, numba and the
lengths themselves), seconds and the ratio to `numpy.argsort` of the same array timed after
the peak was read. Targets (issue 21): < 2 GB peak and <= 1x argsort at 100M.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
from machine import cpu_model

from prep.pack.baselines import ffd_pack, heap_worst_fit_pack, next_fit_pack, windowed_ffd_pack
from prep.pack.bounds import lower_bound_l2
from prep.pack.core import plan_packs
from prep.pack.verify import verify_plan

Packer = Callable[[np.ndarray, int], int]
BOUND_TARGET_PCT = 0.01
ARGSORT_TARGET = 2.0
MEMORY_TARGET_BYTES = 2 * 10**9
MEMORY_ARGSORT_TARGET = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    dataset: str
    num_samples: int
    pack_size: int
    packer: str
    num_packs: int
    lb2: int
    efficiency: float
    seconds: float

    @property
    def gap_pct(self) -> float:
        return 100.0 * (self.num_packs - self.lb2) / self.lb2


def lognormal(rng: np.random.Generator, n: int) -> np.ndarray:
    """Chat-style lengths: median 600, sigma 1.0."""
    return np.exp(rng.normal(np.log(600), 1.0, n))


def mixed(rng: np.random.Generator, n: int) -> np.ndarray:
    """50 % short (median 150), 35 % medium (median 1,000), 15 % long (2,000-8,192)."""
    short, medium = int(0.5 * n), int(0.35 * n)
    parts = [
        np.exp(rng.normal(np.log(150), 0.6, short)),
        np.exp(rng.normal(np.log(1000), 0.5, medium)),
        rng.uniform(2000, 8192, n - short - medium),
    ]
    return rng.permutation(np.concatenate(parts))


def long_heavy(rng: np.random.Generator, n: int) -> np.ndarray:
    """40 % short (median 300), 60 % long (median 3,000): many items over C/2."""
    short = int(0.4 * n)
    parts = [
        np.exp(rng.normal(np.log(300), 0.8, short)),
        np.exp(rng.normal(np.log(3000), 0.5, n - short)),
    ]
    return rng.permutation(np.concatenate(parts))


DATASETS = {"lognormal": lognormal, "mixed": mixed, "long_heavy": long_heavy}


def make_lengths(name: str, n: int, seed: int) -> np.ndarray:
    raw = DATASETS[name](np.random.default_rng(seed), n)
    return np.clip(raw, 16, 8192).astype(np.int64)


def ours(lengths: np.ndarray, pack_size: int) -> int:
    return plan_packs(lengths, pack_size=pack_size, seed=0).num_packs


PACKERS: dict[str, Packer] = {
    "ours (BFD)": ours,
    "FFD": lambda x, c: ffd_pack(x, c)[1],
    "next fit": lambda x, c: next_fit_pack(x, c)[1],
    "windowed FFD 1k": lambda x, c: windowed_ffd_pack(x, c, 1000)[1],
    "NeMo heap WF 1.0": lambda x, c: heap_worst_fit_pack(x, c, 1.0)[1],  # NeMo Automodel's default ratio
    "NeMo heap WF 0.9": lambda x, c: heap_worst_fit_pack(x, c, 0.9)[1],  # a user's option, not the default
}
SLOW = {"windowed FFD 1k", "NeMo heap WF 1.0", "NeMo heap WF 0.9"}
HONEST_NOTE = (
    "NeMo Automodel's default packing_ratio is 1.0: its whole-dataset greedy then packs as tightly as ours. "
    "What differs is speed (its rows here are our numba re-implementation of its algorithm; NeMo's own Python "
    "code took 153 s at 10M on this machine, ~30x ours) and counts: we pack exact token counts (the real "
    "processor's), NeMo packs estimated ones. Its 0.9 row is an option a user sets, not its default."
)


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def warm_up() -> None:
    small = make_lengths("lognormal", 2000, seed=1)
    for packer in PACKERS.values():
        packer(small[small <= 4096], 4096)


def run_case(name: str, n: int, pack_size: int, repeats: int, skip: set[str]) -> tuple[list[Row], float, int]:
    lengths = make_lengths(name, n, seed=0)
    fit = lengths[lengths <= pack_size]
    lb2 = lower_bound_l2(fit, pack_size)
    argsort_s, _ = best_time(lambda: np.argsort(fit), repeats)
    stable_s, _ = best_time(lambda: np.argsort(fit, kind="stable"), repeats)
    verify_plan(plan_packs(fit, pack_size=pack_size), fit, pack_size)
    rows = []
    for packer_name, packer in PACKERS.items():
        if packer_name in skip:
            continue
        tries = repeats if packer_name == "ours (BFD)" else 1
        seconds, num_packs = best_time(lambda p=packer: p(fit, pack_size), tries)
        efficiency = float(fit.sum()) / (int(num_packs) * pack_size)
        rows.append(
            Row(
                dataset=name,
                num_samples=n,
                pack_size=pack_size,
                packer=packer_name,
                num_packs=int(num_packs),
                lb2=lb2,
                efficiency=efficiency,
                seconds=seconds,
            )
        )
    return rows, (argsort_s, stable_s), lengths.size - fit.size


def print_machine() -> None:
    print(
        f"machine: {platform.platform()} | {cpu_model()} | "
        f"cpu_count={os.cpu_count()} | python {platform.python_version()} | "
        f"numpy {np.__version__} | numba {numba.__version__} | all packers single-threaded"
    )


def print_case(rows: list[Row], sorts: tuple[float, float], dropped: int) -> None:
    argsort_s, stable_s = sorts
    first = rows[0]
    print(
        f"\n{first.dataset}  n={first.num_samples:,}  pack_size={first.pack_size}  "
        f"LB2={first.lb2:,}  dropped(>pack_size)={dropped:,}  argsort={argsort_s:.3f}s"
        f"  stable argsort={stable_s:.3f}s"
    )
    print(f"  {'packer':<20}{'packs':>12}{'gap LB2 %':>11}{'effic.':>9}{'seconds':>9}{'x argsort':>11}")
    for row in rows:
        print(
            f"  {row.packer:<20}{row.num_packs:>12,}{row.gap_pct:>11.4f}"
            f"{row.efficiency:>9.4f}{row.seconds:>9.3f}{row.seconds / argsort_s:>11.2f}"
        )


def check_targets(results: list[tuple[list[Row], tuple[float, float]]]) -> None:
    print("\ntargets (ours):")
    for rows, (argsort_s, stable_s) in results:
        row = next(r for r in rows if r.packer == "ours (BFD)")
        label = f"{row.dataset} n={row.num_samples:,} C={row.pack_size}"
        bound = (
            "n/a (long-heavy)"
            if row.dataset == "long_heavy"
            else ("PASS" if row.gap_pct <= BOUND_TARGET_PCT else "FAIL")
        )
        speed = "PASS" if row.seconds <= ARGSORT_TARGET * argsort_s else "FAIL"
        print(
            f"  {label:<36} gap {row.gap_pct:.4f} % -> {bound:<17} "
            f"time {row.seconds / argsort_s:.2f}x argsort -> {speed} "
            f"({row.seconds / stable_s:.2f}x stable argsort)"
        )


def chunked_lognormal(n: int, seed: int, chunk: int = 1 << 20) -> np.ndarray:
    """`lognormal` lengths clipped to [16, 8192] as int32, built chunk by chunk (bounded temporaries)."""
    rng, out = np.random.default_rng(seed), np.empty(n, np.int32)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        out[start:stop] = np.clip(lognormal(rng, stop - start), 16, 8192)
    return out


def rss_child(n: int, pack_size: int) -> None:
    """In a fresh process: RSS before, peak RSS and seconds of `plan_packs`, then argsort's seconds."""
    plan_packs(make_lengths("lognormal", 2000, seed=1), pack_size=pack_size)  # numba: compile or load once
    lengths = chunked_lognormal(n, seed=0)
    with open("/proc/self/statm") as statm:
        before = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    start = time.perf_counter()
    plan = plan_packs(lengths, pack_size=pack_size, seed=0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    packs, lb2 = plan.num_packs, plan.lb2
    del plan
    start = time.perf_counter()
    np.argsort(lengths)
    argsort_s = time.perf_counter() - start
    print(
        json.dumps(
            {"before": before, "peak": peak, "seconds": seconds, "argsort": argsort_s, "packs": packs, "lb2": lb2}
        )
    )


def memory_case(n: int, pack_size: int) -> None:
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(n), str(pack_size)], check=True, capture_output=True, text=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    gap = 100.0 * (got["packs"] - got["lb2"]) / got["lb2"]
    ratio = got["seconds"] / got["argsort"]
    verdict = "PASS" if got["peak"] < MEMORY_TARGET_BYTES and ratio <= MEMORY_ARGSORT_TARGET else "FAIL"
    print(
        f"plan_packs n={n:,} C={pack_size} int32: peak RSS {got['peak'] / 1e9:.2f} GB (before the call "
        f"{got['before'] / 1e9:.2f} GB: interpreter, numba, lengths), {got['seconds']:.2f} s = {ratio:.2f}x argsort "
        f"({got['argsort']:.2f} s), {gap:.4f} % over LB2 -> {verdict} (< {MEMORY_TARGET_BYTES / 1e9:.0f} GB, "
        f"<= {MEMORY_ARGSORT_TARGET:.0f}x argsort)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--pack-sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--repeats", type=int, default=3, help="best-of for ours and argsort")
    parser.add_argument(
        "--slow-max",
        type=int,
        default=None,
        help="run windowed/heap baselines only up to this many samples",
    )
    parser.add_argument("--quick", action="store_true", help="100k samples, one repeat")
    parser.add_argument("--memory", type=int, nargs="+", help="peak RSS of plan_packs at these sizes, then exit")
    parser.add_argument("--rss-child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    if args.memory:
        print_machine()
        for n in args.memory:
            memory_case(n, args.pack_sizes[-1])
        return
    sizes, repeats = ([100_000], 1) if args.quick else (args.sizes, args.repeats)
    print_machine()
    warm_up()
    results = []
    for n in sizes:
        skip = set()
        if args.slow_max is not None and n > args.slow_max:
            skip = SLOW
            print(f"\nNOTE: n={n:,} > --slow-max {args.slow_max:,}: skipping {sorted(skip)}")
        for name in args.datasets:
            for pack_size in args.pack_sizes:
                rows, sorts, dropped = run_case(name, n, pack_size, repeats, skip)
                print_case(rows, sorts, dropped)
                results.append((rows, sorts))
    check_targets(results)
    print(f"\nnote: {HONEST_NOTE}")


if __name__ == "__main__":
    main()
