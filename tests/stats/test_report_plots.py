"""The stats report as a reader sees it: log-axis length plots with the pack size marked, error
bars inside their frame, checked on matplotlib's laid-out artists and in a real headless browser.

Truths: the tokenized Arrow parts read with plain pyarrow (where the samples lie), matplotlib's
own window extents after layout (what is inside the axes), and Chromium's rendering of the
report file: a screenshot plus the DOM it computed (images decoded at their size, no overflow).
Screenshots are kept in ``PACKVLM_SCREENSHOTS`` when set (CI artifacts, or to look at them).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from prep.cli import main
from schemas.layout import SAMPLES_DIR
from tests.stats.conftest import PACK_SIZE

pytest.importorskip("matplotlib")
from prep.stats import plots  # noqa: E402  (needs matplotlib)
from prep.stats.collect import collect_stats  # noqa: E402
from prep.stats.read import read_input  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome", "headless_shell")
IMG = re.compile(r'<figure id="(\w+)"><img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
WIDTH_PX = int(plots.FIGSIZE[0] * plots.DPI)


def _lengths(tokenized: Path) -> np.ndarray:
    tables = [pa.ipc.open_file(pa.OSFile(str(p), "rb")).read_all() for p in sorted((tokenized / SAMPLES_DIR).glob("*"))]
    return np.concatenate([t.column("num_tokens").to_numpy() for t in tables])


def _extent(artist, fig):
    return artist.get_window_extent(fig.canvas.get_renderer())


def test_sample_lengths_spread_over_a_log_axis_with_the_pack_size_marked(tokenized):
    lengths = _lengths(tokenized)
    assert lengths.max() > 10 * np.median(lengths)  # the example's long outlier: what squashed a linear axis
    stats = collect_stats(read_input(str(tokenized)), 50)
    groups = {name: g.lengths["num_tokens"] for name, g in stats.datasets.items()}
    fig = plots.draw_figure(partial(plots._lengths, groups=groups, title="Total tokens", pack_size=PACK_SIZE))
    (ax,) = fig.axes
    assert ax.get_xscale() in ("log", "symlog")
    marker = [line for line in ax.get_lines() if tuple(line.get_xdata()) == (PACK_SIZE, PACK_SIZE)]
    assert len(marker) == 1 and marker[0].get_linestyle() == "--"
    label = next(t for t in ax.texts if "pack size 4,096" in t.get_text())
    assert f"longest {int(lengths.max()):,} does not fit" in label.get_text()
    box = _extent(ax, fig)
    assert box.x0 <= _extent(label, fig).x0 and _extent(label, fig).x1 <= box.x1  # the label stays in the frame
    # where the median and the longest sample land, in pixels: a linear axis put the median within the
    # first 5 % of the width (421 of 15,331 tokens); a log axis puts it a fifth or more in
    x_of = ax.transData.transform
    median_px, longest_px = x_of((float(np.median(lengths)), 0))[0], x_of((float(lengths.max()), 0))[0]
    assert median_px - box.x0 > 0.2 * box.width and longest_px <= box.x1 + 1
    assert all(np.isfinite(line.get_xdata()).all() for line in ax.get_lines())


def test_error_bars_and_their_counts_stay_inside_the_frame_clear_of_the_legend(tokenized):
    stats = collect_stats(read_input(str(tokenized)), 50)
    assert stats.overall is not None and stats.overall.errors
    fig = plots.draw_figure(partial(plots._errors, datasets=stats.datasets, overall=stats.overall))
    (ax,) = fig.axes
    frame = _extent(ax, fig)
    bars = [_extent(p, fig) for p in ax.patches]
    counts = [_extent(t, fig) for t in ax.texts]
    assert bars and len(counts) == len(stats.overall.errors_by_reason)
    for box in bars + counts:
        assert frame.x0 - 0.5 <= box.x0 and box.x1 <= frame.x1 + 0.5, (box, frame)
    legend = _extent(ax.get_legend(), fig)
    assert frame.x0 <= legend.x0 and legend.x1 <= frame.x1 and frame.y0 <= legend.y0
    assert not any(legend.overlaps(box) for box in bars + counts)


def _browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _chromium(browser: str, page: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,6000"]
    return subprocess.run(
        [browser, *flags, *args, page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    )


PROBE = """<script>
window.addEventListener("load", () => {
  const root = document.documentElement;
  const out = [...document.images].map(
    i => `${i.closest("figure").id}:${i.naturalWidth}x${i.naturalHeight}:${i.width}`);
  document.body.setAttribute("data-probe", out.join(" ") + ` overflow:${root.scrollWidth > root.clientWidth}`);
});
</script></body>"""


@pytest.mark.skipif(_browser() is None, reason="no chromium binary on PATH (.ci/browser installs it)")
def test_the_report_renders_in_a_real_browser(packed, tmp_path):
    browser = _browser()
    assert browser is not None
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["stats", str(packed), "--output", str(out)])
    assert result.exit_code == 0, result.output
    html = (out / "report.html").read_text(encoding="utf-8")
    keys = [key for key, _ in IMG.findall(html)]
    assert {"tokens_total", "errors_by_reason", "pack_fill"} <= set(keys)
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", PROBE, 1), encoding="utf-8")
    dom = _chromium(browser, probe, "--virtual-time-budget=5000", "--dump-dom").stdout
    found = re.search(r'data-probe="([^"]*)"', dom)
    assert found, dom[-2000:]
    entries = found.group(1).split()
    assert entries[-1] == "overflow:false"  # nothing wider than the window
    images = dict(e.split(":", 1) for e in entries[:-1])
    assert list(images) == keys
    for key, size in images.items():
        natural, shown = size.rsplit(":", 1)
        assert natural == f"{WIDTH_PX}x{int(plots.FIGSIZE[1] * plots.DPI)}", key  # decoded, as drawn
        assert 0 < int(shown) <= WIDTH_PX, key
    shot = Path(os.environ.get("PACKVLM_SCREENSHOTS") or tmp_path) / "stats-report.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    _chromium(browser, out / "report.html", f"--screenshot={shot}")
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3]
    assert pixels.shape[1] == 1280
    blue = np.all(np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.02, axis=-1)  # matplotlib's first colour
    assert blue.sum() > 2000, "the plots were not painted"
    assert base64.b64encode(png)  # kept for a person to look at (PACKVLM_SCREENSHOTS)
