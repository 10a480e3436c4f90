"""The contracts in `schemas/` against real stage outputs: typed manifests, the plan that
`prep shards` alone turns into shards, versions refused by name, and README kept in step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from prep.cli import main
from schemas import energon
from schemas.docs import FORMATS_DOC, readme_block, render_formats
from schemas.layout import MANIFEST_FILE
from schemas.manifest import (
    SHARDS_MANIFEST_FILE,
    ManifestError,
    ManifestVersionError,
    PackManifest,
    TokenizeManifest,
    read_manifest,
)
from schemas.media_ref import MediaRef
from schemas.packed import PACKED_SCHEMA_VERSION, IncompleteShardsError, PackMeta, read_packed_output
from schemas.plan import PLAN_FILE, read_plan
from tests.shards.oracles import read_packed, tokenized_dir, tokenized_rows


@pytest.fixture(scope="module")
def tok(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_dir(example_dir, tmp_path_factory)


def _pack(tok: Path, out: Path, *extra: str) -> None:
    args = ["pack", str(tok), "--output", str(out), "--pack-size", "1024", "--shard-size", "3packs"]
    args += ["--max-oversize-rate", "1"]
    result = CliRunner().invoke(main, [*args, "--executor", "local", *extra])
    assert result.exit_code == 0, result.output


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_readme_format_reference_is_generated_from_schemas() -> None:
    assert readme_block(FORMATS_DOC.read_text(encoding="utf-8")) == render_formats(), "run `python -m schemas.docs`"


def test_energon_names_are_energons_own() -> None:
    """`schemas.energon` spells Energon's file names without importing Energon; they must stay its names."""
    from megatron.energon.flavors.webdataset import config

    assert energon.META_DIR == config.MAIN_FOLDER_NAME
    assert energon.SPLIT_YAML == config.SPLIT_YAML_FILENAME
    assert energon.INFO_JSON == config.INFO_JSON_FILENAME
    assert energon.INDEX_SQLITE == config.INDEX_SQLITE_FILENAME


def test_media_ref_round_trip() -> None:
    for text in ("/d/a.jpg", "/d/x.lmdb::k/0001.png", "/d/x.lmdb::"):
        assert MediaRef.parse(text).format() == text
    ref = MediaRef.parse("imgs.lmdb::a/b.jpg", "/data")
    assert (ref.path, ref.key, ref.name, ref.is_lmdb) == ("/data/imgs.lmdb", "a/b.jpg", "b.jpg", True)
    assert MediaRef.parse("/abs/c.png", "/data") == MediaRef(path="/abs/c.png")


def test_tokenize_manifest_is_typed_and_round_trips(tok: Path) -> None:
    raw = json.loads((tok / MANIFEST_FILE).read_text())
    manifest = read_manifest(tok / MANIFEST_FILE, TokenizeManifest)
    assert manifest.to_json() == raw
    rows = tokenized_rows(tok)
    assert manifest.rows.samples == len(rows)
    assert manifest.tokens.total == sum(r["num_tokens"] for r in rows.values())


def test_wrong_stage_unknown_version_and_malformed_manifests_are_named(tok: Path, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="written by `prep tokenize`.*`prep pack`"):
        read_manifest(tok / MANIFEST_FILE, PackManifest)
    raw = json.loads((tok / MANIFEST_FILE).read_text())
    (tmp_path / "v9.json").write_text(json.dumps({**raw, "schema_version": 9}))
    with pytest.raises(ManifestVersionError, match="version 9, this packvlm reads version 1"):
        read_manifest(tmp_path / "v9.json", TokenizeManifest)
    del raw["rows"]["errors"]
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=r"rows: missing field 'errors'"):
        read_manifest(tmp_path / "bad.json", TokenizeManifest)


def test_pack_size_is_stored_once_and_older_versions_still_read(tok: Path, tmp_path: Path) -> None:
    """Pack manifest v4 and pack json v3 hold no repeated pack_size; a v3 manifest and v2 pack json (which
    repeat it) read as the same records, and a manifest whose copies disagree is refused."""
    out = tmp_path / "packed"
    _pack(tok, out)
    raw = json.loads((out / MANIFEST_FILE).read_text())
    assert raw["schema_version"] == 4 and "pack_size" not in raw["packs"]
    assert raw["pack_size"] == raw["config"]["pack_size"] == 1024
    current = PackManifest.from_json(raw)
    v3 = {**raw, "schema_version": 3, "packs": {**raw["packs"], "pack_size": 1024}}
    assert PackManifest.from_json(v3) == current
    with pytest.raises(ManifestError, match=r"packs.pack_size 2048 differs from pack_size 1024"):
        PackManifest.from_json({**v3, "packs": {**raw["packs"], "pack_size": 2048}})
    with pytest.raises(ManifestError, match=r"config.pack_size 512 differs from pack_size 1024"):
        PackManifest.from_json({**raw, "config": {**raw["config"], "pack_size": 512}})

    meta = json.loads(next(iter(read_packed(out).values()))["json"])
    assert meta["version"] == PACKED_SCHEMA_VERSION == 3 and "pack_size" not in meta
    assert PackMeta.from_json({**meta, "version": 2, "pack_size": 1024}) == PackMeta.from_json(meta)
    with pytest.raises(ValueError, match="pack json version 1 unsupported"):
        PackMeta.from_json({**meta, "version": 1})


def test_plan_holds_every_packed_sample_once_and_shards_follow_it(tok: Path, tmp_path: Path) -> None:
    out = tmp_path / "packed"
    _pack(tok, out)
    plan, rows = read_plan(out / PLAN_FILE)
    output = read_packed_output(out)
    manifest = output.manifest
    ids = rows.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)) == manifest.samples.packed
    assert set(ids) | {o.sample_id for o in manifest.oversize} == set(tokenized_rows(tok))
    assert plan.num_packs == manifest.packs.packs == output.shards.num_packs
    assert max(rows.column("pack").to_pylist()) == plan.num_packs - 1
    packs = read_packed(out)
    for p, key in enumerate(sorted(packs)):
        meta = json.loads(packs[key]["json"])
        planned = rows.filter(pa.compute.equal(rows.column("pack"), p)).column("sample_id").to_pylist()
        assert [s["sample_id"] for s in meta["samples"]] == planned
    assert [s.packs for s in output.shards.shards] == [
        b - a for a, b in zip(plan.shard_offsets, plan.shard_offsets[1:])
    ]


def test_plan_only_then_prep_shards_equals_prep_pack(tok: Path, tmp_path: Path) -> None:
    _pack(tok, tmp_path / "full")
    _pack(tok, tmp_path / "split", "--plan-only")
    assert not list((tmp_path / "split" / "shards").glob("*.tar"))
    with pytest.raises(IncompleteShardsError, match="run `prep shards"):
        read_packed_output(tmp_path / "split")
    result = CliRunner().invoke(main, ["shards", str(tmp_path / "split"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert _tree(tmp_path / "split") == _tree(tmp_path / "full")
    # a deleted shard is rewritten byte-identically from the plan alone
    (tmp_path / "split" / "shards" / "shard-000001.tar").unlink()
    (tmp_path / "split" / SHARDS_MANIFEST_FILE).unlink()
    result = CliRunner().invoke(main, ["shards", str(tmp_path / "split"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert _tree(tmp_path / "split") == _tree(tmp_path / "full")


def test_prep_shards_refuses_inputs_changed_since_planning(tok: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tok"
    shutil.copytree(tok, copy)
    _pack(copy, tmp_path / "packed", "--plan-only")
    manifest = copy / MANIFEST_FILE
    manifest.write_text(manifest.read_text().replace('"seed"', '"seed" ', 1))
    result = CliRunner().invoke(main, ["shards", str(tmp_path / "packed"), "--executor", "local"])
    assert result.exit_code == 1 and "changed or vanished since the plan was made" in result.output
    result = CliRunner().invoke(main, ["shards", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["shards", str(tmp_path / "empty")])
    assert result.exit_code != 0 and "run `prep pack` first" in result.output


def test_prep_shards_refuses_a_plan_whose_pack_size_differs_from_the_manifests(tok: Path, tmp_path: Path) -> None:
    """Issue 28: the plan header's pack_size cuts the shards, the manifest's is what train reads."""
    out = tmp_path / "packed"
    _pack(tok, out, "--plan-only")
    raw = json.loads((out / MANIFEST_FILE).read_text())
    assert raw["pack_size"] == read_plan(out / PLAN_FILE)[0].pack_size == 1024
    raw["pack_size"] = raw["config"]["pack_size"] = 2048  # both copies, so the manifest itself reads
    (out / MANIFEST_FILE).write_text(json.dumps(raw))
    result = CliRunner().invoke(main, ["shards", str(out), "--executor", "local"])
    assert result.exit_code == 2, result.output
    assert "has pack_size 1024 but" in result.output and "has 2048" in result.output
    assert "rerun `prep pack` into a new directory" in result.output
    assert not list((out / "shards").glob("*.tar"))  # refused before writing
    raw["pack_size"] = raw["config"]["pack_size"] = 1024  # agreeing again: shards are written
    (out / MANIFEST_FILE).write_text(json.dumps(raw))
    result = CliRunner().invoke(main, ["shards", str(out), "--executor", "local"])
    assert result.exit_code == 0, result.output
