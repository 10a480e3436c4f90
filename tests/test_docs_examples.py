"""Every shell example marked runnable in README.md and docs/*.md runs as written (issue 27).

A block is runnable when the line before its opening fence is ``<!-- runnable -->`` or its
info string says so (````bash runnable``). README's blocks run first, in order, in one empty
folder (the Quickstart: example data, tokenize, pack, index, stats, train); each docs page then
runs its blocks in order in a copy of that folder, so a page may use ``./example-data`` and
``./example-out``. Each block runs with ``bash -euo pipefail -x``: the first failing command
fails the test, named, with its output. Truth: the exit status of the commands themselves.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^(`{3,})\s*(\S*)(.*)$")
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def runnable_blocks(path: Path) -> list[Block]:
    """The runnable shell blocks of a Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        ticks, lang, rest = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(ticks)), len(lines))
        previous = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marked = previous == MARKER or "runnable" in rest.split()
        if marked and lang in ("bash", "sh", "shell", "console"):
            blocks.append(Block(path=path, line=i + 1, code="\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # prep / train of this env
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    env.update(RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_block(block: Block, cwd: Path) -> None:
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-x", "-c", block.code],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-4000:]
        pytest.fail(f"{block} exits {result.returncode} as written:\n{block.code}\n--- output (end) ---\n{tail}")


DOC_PAGES = [page for page in sorted((ROOT / "docs").glob("*.md")) if runnable_blocks(page)]


def test_runnable_blocks_are_found_by_marker_or_info_string(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- runnable -->\n```bash\necho a\n```\n```bash runnable\necho b\n```\n```bash\necho c\n```\n"
        "<!-- runnable -->\n\n```json\n{}\n```\n",
        encoding="utf-8",
    )
    assert [b.code for b in runnable_blocks(page)] == ["echo a\n", "echo b\n"]
    assert [b.line for b in runnable_blocks(page)] == [2, 5]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where README's runnable blocks ran, in order."""
    if shutil.which("prep", path=_env()["PATH"]) is None:
        pytest.skip("the `prep` console script is not installed (pip install -e .)")
    folder = tmp_path_factory.mktemp("readme")
    blocks = runnable_blocks(ROOT / "README.md")
    assert len(blocks) >= 5, "README's Quickstart is marked runnable"
    for block in blocks:
        run_block(block, folder)
    return folder


def test_readme_quickstart_runs_as_written(quickstart):
    assert (quickstart / "example-out" / "run" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("page", DOC_PAGES, ids=[p.name for p in DOC_PAGES])  # pages that mark a block
def test_docs_examples_run_as_written(page, quickstart, tmp_path):
    blocks = runnable_blocks(page)
    folder = tmp_path / "work"
    shutil.copytree(quickstart, folder, symlinks=True)
    for block in blocks:
        run_block(block, folder)
