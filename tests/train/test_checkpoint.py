"""`train.checkpoint`, `train.global_order`, `train.export` on tiny models, in one process and on 2 gloo ranks.

Truths: the trained model in memory (weights, optimizer state, logits), the full tensors
an FSDP2-sharded model gathers (``DTensor.full_tensor``), brute-force counting of stream
positions, and plain transformers loading an exported directory.
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, Qwen2Config

from schemas.train import CHECKPOINTS_DIR, LATEST_FILE, LEGACY_TRAINER_STATE_FILE, checkpoint_name
from train.checkpoint import (
    CheckpointError,
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    read_model_state,
    save_checkpoint,
)
from train.distributed import DistContext
from train.export import ExportError, export_checkpoint
from train.global_order import DataPosition, GlobalOrder, epoch_order, microbatch_positions
from train.run_dir import claim_run_dir

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
VOCAB = 96


def _tiny_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_tiny_config(), attn_implementation="eager")


def _ids(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int = 0, idle: str | None = None
) -> None:
    """``idle``: a parameter left without a gradient (as a vision tower on text-only steps)."""
    for step in steps:
        ids = _ids(step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        if idle is not None:
            model.get_parameter(idle).grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _state(step: int, world_size: int = 1) -> TrainerState:
    return TrainerState(
        step=step,
        world_size=world_size,
        global_batch_packs=world_size,
        data=DataPosition(consumed=step, num_packs=9, seed=0),
    )


def _save(out: Path, model, optimizer, step: int, ctx: DistContext = CTX) -> Path:
    return save_checkpoint(
        out,
        ctx,
        model=model,
        optimizer=optimizer,
        processor_dir=out / "none",
        state=_state(step, ctx.world_size),
        loader_state=None,
    )


def _adam_states(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]


# --- the global order: one stream, sliced per rank ------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("packs", [1, 2, 3])
def test_ranks_take_disjoint_slices_that_tile_the_stream(world_size, packs):
    start, micro = 7, 5
    taken = [
        p
        for rank in range(world_size)
        for j in range(micro)
        for p in microbatch_positions(start, j, rank=rank, world_size=world_size, packs=packs, end=None)
    ]
    assert sorted(taken) == list(range(start, start + micro * world_size * packs))  # each position once, no gap


def test_a_run_resumed_on_other_world_sizes_reads_every_pack_once_per_epoch():
    """2 ranks for 3 steps, then 1 rank (grad_accum 2), then 3 ranks: the packs read, in stream order,
    are the one-rank run's, and every epoch holds each of the 11 packs exactly once."""
    num_packs, seed = 11, 4
    order = GlobalOrder(seed, num_packs)

    def segment(position: int, world_size: int, grad_accum: int, steps: int) -> tuple[int, list[int]]:
        read = []
        for step in range(steps):
            step_start = position + step * world_size * grad_accum
            for j in range(grad_accum):
                for rank in range(world_size):
                    read += list(
                        microbatch_positions(step_start, j, rank=rank, world_size=world_size, packs=1, end=None)
                    )
        return position + steps * world_size * grad_accum, read

    position, stream = 0, []
    for world_size, grad_accum, steps in [(2, 1, 3), (1, 2, 4), (3, 1, 3)]:
        position, read = segment(position, world_size, grad_accum, steps)
        stream += read
    assert stream == list(range(position)) and position == 23  # the stream itself, in order
    packs = [order.pack_index(p) for p in stream]
    epochs = [packs[i : i + num_packs] for i in range(0, len(packs), num_packs)]
    for epoch in epochs[:2]:
        assert Counter(epoch) == Counter(range(num_packs))
    assert epochs[0] != epochs[1] and len(set(epochs[2])) == len(epochs[2])


def test_the_epoch_order_depends_on_seed_and_epoch_only():
    assert sorted(epoch_order(0, 0, 50)) == list(range(50))
    assert (epoch_order(0, 0, 50) == epoch_order(0, 0, 50)).all()
    assert not (epoch_order(0, 0, 50) == epoch_order(0, 1, 50)).all()
    assert not (epoch_order(0, 0, 50) == epoch_order(1, 0, 50)).all()
    assert sorted(epoch_order(-3, 2, 7)) == list(range(7))  # any int seed


# --- save / load in one process -------------------------------------------------------------------


def test_a_checkpoint_restores_weights_optimizer_and_rng_exactly(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, range(3))
    path = _save(tmp_path, model, optimizer, 3)
    rng_after_save = torch.rand(4)
    fresh = _model(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = load_checkpoint(path, CTX, model=fresh, optimizer=fresh_optimizer)
    assert state == _state(3)
    assert torch.equal(torch.rand(4), rng_after_save)  # the RNG as it was when saved
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(_adam_states(optimizer), _adam_states(fresh_optimizer)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _train(model, optimizer, range(3, 5))  # continuing is bit-identical too
    _train(fresh, fresh_optimizer, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_a_parameter_without_optimizer_state_gets_none_back(tmp_path):
    """AdamW gives a parameter state at its first gradient; one that had none when saved must start
    fresh after a resume too (not a step count from the zero-gradient step get_state_dict takes)."""
    idle = "model.layers.1.mlp.down_proj.weight"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, range(2), idle=idle)
    path = _save(tmp_path, model, optimizer, 2)
    fresh = _model(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(path, CTX, model=fresh, optimizer=fresh_optimizer)
    assert (
        not fresh_optimizer.state.get(fresh.get_parameter(idle))
        and optimizer.state.get(model.get_parameter(idle)) is None
    )
    _train(model, optimizer, range(2, 4))  # now it learns: from step 1 of its own in both
    _train(fresh, fresh_optimizer, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_to_resume(tmp_path, monkeypatch):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, range(1))
    claim_run_dir(tmp_path, fingerprint={}, command="train hf", resume=False, ctx=CTX)
    _save(tmp_path, model, optimizer, 1)
    weights_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, optimizer, range(1, 2))
    import train.checkpoint as checkpoint_module

    real_save = checkpoint_module.dcp.save

    def killed(state_dict, **kwargs):
        real_save(state_dict, **kwargs)  # the shards are written, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, model, optimizer, 2)
    monkeypatch.undo()
    root = tmp_path / CHECKPOINTS_DIR
    assert (root / f".tmp-{checkpoint_name(2)}").is_dir() and not (root / checkpoint_name(2)).exists()
    # --resume: the claim clears the half-written directory and picks the previous checkpoint
    path = claim_run_dir(tmp_path, fingerprint={}, command="train hf", resume=True, ctx=CTX)
    assert path == root / checkpoint_name(1) and sorted(p.name for p in root.iterdir()) == [LATEST_FILE, path.name]
    fresh = _model(seed=1)
    assert load_checkpoint(path, CTX, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters())).step == 1
    assert all(torch.equal(weights_at_1[k], v) for k, v in fresh.state_dict().items())


def test_a_layout_1_checkpoint_is_refused_by_name(tmp_path):
    old = tmp_path / CHECKPOINTS_DIR / checkpoint_name(5)
    old.mkdir(parents=True)
    (old / LEGACY_TRAINER_STATE_FILE).write_bytes(b"")
    (old / "model.safetensors").write_bytes(b"")
    (tmp_path / CHECKPOINTS_DIR / LATEST_FILE).write_text(f"{old.name}\n")
    with pytest.raises(CheckpointError, match="older packvlm .*layout 1.* start a new --output"):
        latest_checkpoint(tmp_path)
    (old / "trainer_state.json").write_text(json.dumps({"version": 3}))
    (old / "state").mkdir()
    from train.checkpoint import load_trainer_state

    with pytest.raises(CheckpointError, match="layout version 3, this packvlm reads 2"):
        load_trainer_state(old)


# --- export ---------------------------------------------------------------------------------------


def test_export_loads_in_plain_transformers_with_the_trained_logits(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, range(3))
    path = _save(tmp_path, model, optimizer, 3)
    out = export_checkpoint(path, tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(loaded) is type(model) and loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    ids = _ids(99)
    with torch.no_grad():
        # the same weights through the same ops in the same process: equal bit for bit
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(ExportError, match="exists"):
        export_checkpoint(path, out)
    half = AutoModelForCausalLM.from_pretrained(export_checkpoint(path, tmp_path / "bf16", dtype="bfloat16"))
    assert (
        all(torch.equal(half.state_dict()[k], v.to(torch.bfloat16)) for k, v in model.state_dict().items())
        and half.dtype == torch.bfloat16
    )
    assert read_model_state(path).keys() == model.state_dict().keys()


# --- FSDP2 on 2 gloo ranks: DCP reshards 1 -> 2 -> 1 ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sharded_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ctx = DistContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
        model = _shard(_model(seed=7))  # other weights than the checkpoint's: the load must replace them
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        single = Path(root) / "single"
        assert load_checkpoint(latest_checkpoint(single), ctx, model=model, optimizer=optimizer).step == 2
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        exp_avg = {name: optimizer.state[p]["exp_avg"].full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"weights": full, "exp_avg": exp_avg}, Path(root) / "loaded_on_2.pt")
        _train(model, optimizer, range(2, 4), rank=rank)  # each rank its own data: gradients averaged by FSDP
        _save(Path(root) / "sharded", model, optimizer, 4, ctx)
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        exp_avg = {name: optimizer.state[p]["exp_avg"].full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"weights": full, "exp_avg": exp_avg}, Path(root) / "trained_on_2.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_checkpoints_reshard_between_one_and_two_ranks(tmp_path):
    """1 process saves; 2 FSDP2 ranks load it (each its shards), train, save sharded; 1 process loads that."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, range(2))
    _save(tmp_path / "single", model, optimizer, 2)
    mp.start_processes(_sharded_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    loaded = torch.load(tmp_path / "loaded_on_2.pt")
    by_param = {name: optimizer.state[p]["exp_avg"] for name, p in model.named_parameters()}
    for name, param in model.named_parameters():  # 1 -> 2: the shards hold exactly the saved tensors
        assert torch.equal(loaded["weights"][name], param.detach()), name
        assert torch.equal(loaded["exp_avg"][name], by_param[name]), name
    trained = torch.load(tmp_path / "trained_on_2.pt")
    fresh = _model(seed=3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    path = latest_checkpoint(tmp_path / "sharded")
    assert load_checkpoint(path, CTX, model=fresh, optimizer=fresh_optimizer).world_size == 2
    fresh_avg = {name: fresh_optimizer.state[p]["exp_avg"] for name, p in fresh.named_parameters()}
    for name, param in fresh.named_parameters():  # 2 -> 1: the whole tensors the sharded run held
        assert torch.equal(trained["weights"][name], param.detach()), name
        assert torch.equal(trained["exp_avg"][name], fresh_avg[name]), name
    assert not torch.equal(trained["weights"]["model.norm.weight"], loaded["weights"]["model.norm.weight"])


def test_per_rank_loader_state_resumes_only_on_its_world_size(tmp_path):
    """--sampling buffer keeps Energon's per-rank state: another number of ranks is refused, naming the fix."""
    from train.checkpoint import load_loader_state

    saved_on_two = TrainerState(step=4, world_size=2, global_batch_packs=2, data=None)
    with pytest.raises(CheckpointError, match="saved on 2 ranks with --sampling buffer.*resume on 2 ranks"):
        load_loader_state(tmp_path, saved_on_two, CTX)
    global_position = _state(4, world_size=2)  # --sampling epoch: the same bytes for any rank of any world
    assert load_loader_state(tmp_path, global_position, CTX) == DataPosition(consumed=4, num_packs=9, seed=0).to_bytes()


def test_keep_last_deletes_older_checkpoints_once_a_new_one_is_complete(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2, 3, 4):
        save_checkpoint(
            tmp_path, CTX, model=model, optimizer=optimizer, processor_dir=tmp_path, state=_state(step),
            loader_state=None, keep_last=2,
        )  # fmt: skip
    root = tmp_path / CHECKPOINTS_DIR
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, checkpoint_name(3), checkpoint_name(4)]
    assert latest_checkpoint(tmp_path) == root / checkpoint_name(4)


def test_train_export_command_writes_once_and_names_what_is_wrong(tmp_path):
    from click.testing import CliRunner

    from train.cli import main

    model = _model()
    path = _save(tmp_path, model, torch.optim.AdamW(model.parameters()), 1)
    runner = CliRunner()
    done = runner.invoke(main, ["export", str(path), "--to", str(tmp_path / "out")])
    assert done.exit_code == 0 and (tmp_path / "out" / "model.safetensors").is_file(), done.output
    again = runner.invoke(main, ["export", str(path), "--to", str(tmp_path / "out")])
    assert again.exit_code == 2 and "exists; remove it or choose another directory" in again.output
    not_one = runner.invoke(main, ["export", str(tmp_path), "--to", str(tmp_path / "other")])
    assert not_one.exit_code == 2 and "is not a complete checkpoint" in not_one.output
    assert not (tmp_path / "other").exists()
