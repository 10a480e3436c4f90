"""`train megatron` as a command where Megatron-Bridge is not installed (the main CI environment).

What it does with Bridge installed is tested against Bridge's real code in ``tests/bridge``.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from packvlm.errors import ExitCode
from packvlm.optional import is_installed
from train.cli import main as train_main
from train.recipes.megatron import MegatronTrainConfig, megatron_command


def test_cli_help_documents_flags():
    result = CliRunner().invoke(megatron_command, ["--help"])
    assert result.exit_code == 0, result.output
    for field in MegatronTrainConfig.__dataclass_fields__:
        flag = "--" + field.replace("_", "-")
        assert flag in result.output, flag


@pytest.mark.skipif(is_installed("megatron.bridge"), reason="this environment has Megatron-Bridge")
def test_without_bridge_exits_3_with_the_install_line(tmp_path):
    args = ["--recipe", "qwen25_vl_7b_sft_config", "--hf-model", str(tmp_path), "--data", str(tmp_path / "none")]
    result = CliRunner().invoke(train_main, ["megatron", *args, "--output", str(tmp_path / "out")])
    assert result.exit_code == ExitCode.RESOURCE == 3, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "megatron-bridge" in lines[0] and "pip install 'packvlm[bridge]'" in lines[0], lines
    assert not (tmp_path / "out").exists()  # nothing written before the check
