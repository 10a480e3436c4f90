"""What `prep` and `train` print: one ``error:`` line per failure, log lines apart from progress bars.

Truths: click's and torch's own exceptions (a real usage error, a real DataLoader worker's
wrapped error), and the bytes a real subprocess writes to stderr with a tqdm bar running.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader, IterableDataset

from packvlm.cli import one_line
from packvlm.errors import ExitCode
from packvlm.optional import MissingPackageError, is_installed
from prep.cli import main as prep_main
from train.cli import main as train_main

USAGE_CASES = [
    (prep_main, ["pack", "."], "missing option '--output'", "prep pack --help"),
    (prep_main, ["pack", ".", "--output", "o", "--pack-size", "many"], "'many' is not a valid integer", "prep pack"),
    (prep_main, ["stats", "."], None, None),  # a real usage error of ours (no manifest): same shape
    (prep_main, ["tokenize", "--nope"], "no such option '--nope'", "prep tokenize --help"),
    (prep_main, ["--bogus"], "no such option '--bogus'", "prep --help"),
    (train_main, ["hf", "--data", "d"], "missing option", "train hf --help"),
    (train_main, ["hf", "--max-steps", "0"], "--max-steps", "train hf --help"),
]


@pytest.mark.parametrize(("cli", "args", "says", "points_to"), USAGE_CASES)
def test_every_usage_error_is_one_error_line_with_exit_2(cli, args, says, points_to, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, args, prog_name="prep" if cli is prep_main else "train")
    assert result.exit_code == ExitCode.USAGE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and re.match(r"^error: [a-z-]", lines[0]), result.output
    assert "Usage:" not in result.output and "Error:" not in result.output
    if says is not None:
        assert says in lines[0] and points_to in lines[0]


class _Raises(IterableDataset):
    def __iter__(self):
        raise MissingPackageError("video packs need torchvision, which is not installed: pip install torchvision")


def test_an_error_from_a_dataloader_worker_prints_as_its_own_message():
    with pytest.raises(MissingPackageError) as err:
        next(iter(DataLoader(_Raises(), num_workers=1, batch_size=None)))
    wrapped = str(err.value)
    assert "DataLoader worker process" in wrapped and "Traceback" in wrapped  # what torch hands back
    assert one_line(wrapped) == "video packs need torchvision, which is not installed: pip install torchvision"
    assert one_line("line one\n  line two") == "line one line two"


_BAR_AND_LOGS = textwrap.dedent(
    """
    import logging, time
    from tqdm import tqdm
    from packvlm.console import configure_logging
    configure_logging()
    bar = tqdm(total=3, desc="train", file=__import__("sys").stderr, mininterval=0)
    for step in range(3):
        bar.update(1)
        logging.getLogger("train.recipes.hf").info("step %d done", step)
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger("megatron.energon").warning("a library warning")
    bar.close()
    """
)


def test_log_lines_never_share_a_line_with_a_progress_bar_and_library_info_is_quiet():
    err = subprocess.run(
        [sys.executable, "-c", _BAR_AND_LOGS], capture_output=True, text=True, check=True, timeout=120
    ).stderr
    segments = re.split(r"[\r\n]", err)  # a terminal shows each \r- or \n-separated segment on its own
    for step in range(3):
        assert f"INFO train.recipes.hf: step {step} done" in segments, err
    assert sum(s == "WARNING megatron.energon: a library warning" for s in segments) == 3
    assert "fontManager" not in err  # another library's INFO line is not the command's output
    assert any(s.startswith("train: ") for s in segments)  # the bar itself was drawn


def test_configure_logging_leaves_a_host_programs_logging_alone():
    root = logging.getLogger()
    before = list(root.handlers), root.level
    assert root.handlers  # pytest's capture: a host with handlers
    from packvlm.console import configure_logging

    configure_logging(verbose=True)
    assert (list(root.handlers), root.level) == before


@pytest.mark.skipif(is_installed("torchvision"), reason="torchvision is installed: nothing to note")
def test_loading_a_processor_without_torchvision_warns_nothing(processor_dirs, caplog):
    from families.processor import load_processor

    with caplog.at_level(logging.DEBUG):
        load_processor(str(processor_dirs["qwen2_vl"]))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "torchvision" in r.getMessage()]
