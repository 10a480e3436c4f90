"""Per-step numbers: one JSONL line per optimizer step and one plain-text log line.

The JSONL file is the run's trace (format in :mod:`schemas.train`): a step can be checked
from outside, down to the packs it read. On resume the lines of steps after the checkpoint
are dropped first, so the file reads as if the run had never stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from packvlm.atomic import write_bytes_atomic
from train.batch import PackedBatch
from train.distributed import DistContext, gather_objects


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """What one optimizer step did, summed over its micro-batches and ranks."""

    step: int
    loss: float  # token-weighted mean over the step's label tokens, all ranks
    num_label_tokens: int
    num_tokens: int  # row lengths, slot padding included
    num_real_tokens: int  # tokens that belong to a sample
    lr: float
    grad_norm: float
    tokens_per_s: float
    pack_keys: list[list[str]]  # per rank, in consumption order
    media: list[int]  # per rank: images + videos
    vision_patches: list[int]  # per rank

    @property
    def real_token_fraction(self) -> float:
        return self.num_real_tokens / self.num_tokens if self.num_tokens else 0.0

    def log_line(self, max_steps: int) -> str:
        return (
            f"step {self.step}/{max_steps} loss {self.loss:.4f} lr {self.lr:.2e} grad_norm {self.grad_norm:.3f} "
            f"label_tokens {self.num_label_tokens} tokens/s {self.tokens_per_s:,.0f} "
            f"real {100 * self.real_token_fraction:.2f}% media/rank {self.media} patches/rank {self.vision_patches}"
        )


def collect_step_metrics(
    *,
    step: int,
    micro: list[PackedBatch],
    ctx: DistContext,
    loss_sum: float,
    num_label_tokens: int,
    lr: float,
    grad_norm: float,
    started: float,
) -> StepMetrics:
    """This rank's share of a step, gathered from every rank in one collective and summed.

    Args:
        loss_sum: this rank's summed token loss (the step's ``loss`` is the global sum / ``num_label_tokens``).
        num_label_tokens: label tokens of the whole global batch (already reduced).
        started: ``time.perf_counter()`` at the start of the step.
    """
    local = (
        [key for b in micro for key in b.pack_keys],
        sum(b.num_media for b in micro),
        sum(b.num_vision_patches for b in micro),
        float(loss_sum),
        sum(b.num_tokens for b in micro),
        sum(b.num_real_tokens for b in micro),
    )
    ranks = gather_objects(local, ctx)
    num_tokens = sum(r[4] for r in ranks)
    elapsed = max(time.perf_counter() - started, 1e-9)
    return StepMetrics(
        step=step,
        loss=sum(r[3] for r in ranks) / max(num_label_tokens, 1),
        num_label_tokens=int(num_label_tokens),
        num_tokens=num_tokens,
        num_real_tokens=sum(r[5] for r in ranks),
        lr=float(lr),
        grad_norm=float(grad_norm),
        tokens_per_s=num_tokens / elapsed,
        pack_keys=[r[0] for r in ranks],
        media=[r[1] for r in ranks],
        vision_patches=[r[2] for r in ranks],
    )


class MetricsWriter:
    """Appends StepMetrics lines; ``truncate_after`` rewinds the file to a resumed step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Keep only the lines of steps <= ``step`` (atomically: temp file + rename)."""
        if not self.path.is_file():
            return
        kept = [ln for ln in self.path.read_text(encoding="utf-8").splitlines() if json.loads(ln)["step"] <= step]
        write_bytes_atomic(self.path, "".join(f"{ln}\n" for ln in kept).encode("utf-8"))

    def write(self, metrics: StepMetrics) -> None:
        row = asdict(metrics) | {"real_token_fraction": round(metrics.real_token_fraction, 6)}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")


def read_metrics(path: Path) -> list[dict]:
    """All lines of a metrics file, in step order (for tests and tooling)."""
    return [json.loads(ln) for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
