"""`train megatron` against Megatron-Bridge's real code (0.6.2, CPU): config, data, batch, finetune.

Runs in the Python 3.12 environment of ``.ci/bridge-env`` (Bridge installed ``--no-deps`` plus
the import-only stand-ins of `tests.train.bridge.standins`); skips where ``megatron.bridge`` is not
installed. Data: the example (family qwen2_5_vl) tokenized, packed (pack size 1024) and indexed;
its ``model/`` config is the ``--hf-model`` (no weights: the config build reads only the config).

Truths: Bridge's own ``runtime_config_update`` (what ``finetune`` runs first: mixed precision,
data-parallel size, ``ConfigContainer.validate``); the packs read back through Energon with our
task encoder and no shuffle (every batch Bridge's data build yields must be one of them, field by
field); Bridge's ``get_batch`` / ``get_packed_seq_params`` on those batches; ``finetune`` up to its
CUDA assertion.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip(
        "megatron.bridge is not installed (Python 3.12 env of .ci/bridge-env runs these)", allow_module_level=True
    )

from tests.train.bridge import standins  # noqa: E402

standins.install()

pytestmark = [
    pytest.mark.bridge,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

RECIPE = "qwen25_vl_3b_sft_config"
PACK_SIZE = 1024
TRAIN_ITERS = 4


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The qwen2_5_vl example, tokenized, packed and indexed: what `prep` writes for `train megatron`."""
    from prep.energon.index import index_dataset
    from prep.example.dataset import write_example_dataset
    from prep.run import LOCAL
    from prep.tokenize.stage import TokenizeConfig, run_tokenize
    from tests.shards.oracles import pack

    root = tmp_path_factory.mktemp("bridge_example")
    config = write_example_dataset(root, num_samples=8, seed=0, with_bad_rows=False, family="qwen2_5_vl")
    tokenized, packed = root / "tok", root / "packed"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(root / "processor"),
            output_dir=str(tokenized),
            datasets=("chat",),
            executor=LOCAL,
            rows_per_chunk=16,
        )
    )
    pack([tokenized], packed, pack_size=PACK_SIZE, shard_size="3packs", pad_to_multiple_of=1)
    index_dataset(packed)
    return SimpleNamespace(root=root, packed=packed, processor=root / "processor", model=root / "model")


def _train_config(example: SimpleNamespace, output: Path, **overrides: Any) -> Any:
    from train.recipes.megatron import MegatronTrainConfig

    options = dict(
        recipe=RECIPE,
        hf_model=str(example.model),
        processor=str(example.processor),
        data=example.packed,
        output=output,
        train_iters=TRAIN_ITERS,
        num_workers=0,
    )
    return MegatronTrainConfig(**{**options, **overrides})


@pytest.fixture(scope="module")
def built(example: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from train.recipes.megatron import build_config

    return build_config(_train_config(example, tmp_path_factory.mktemp("bridge_out")))


def _reference_batches(example: SimpleNamespace) -> list[dict[str, Any]]:
    """Every pack through Energon with our task encoder, in order (micro-batch 1, no shuffle)."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from train.bridge import BridgeTaskEncoder

    dataset = get_train_dataset(
        str(example.packed),
        batch_size=1,
        task_encoder=BridgeTaskEncoder(str(example.processor), str(example.model)),
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        packing_buffer_size=None,
        split_part="train",
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
    )
    return list(get_savable_loader(dataset))


def _assert_same_batch(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        other = theirs[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), key
        elif value is not None and hasattr(value, "__dict__"):
            assert vars(value).keys() == vars(other).keys(), key
            for name, tensor in vars(value).items():
                assert (tensor is None and vars(other)[name] is None) or torch.equal(tensor, vars(other)[name]), name
        else:
            assert value == other, key


def test_config_passes_bridge_validation(built, example):
    """The launcher's ConfigContainer goes through what finetune runs first, unchanged where we set it."""
    from megatron.bridge.training.config import runtime_config_update

    from train.bridge_data import PackedDatasetConfig

    assert type(built.model).__name__ == "Qwen25VLModelProvider"
    text = json.loads((example.model / "config.json").read_text())["text_config"]
    assert built.model.hidden_size == text["hidden_size"]  # --hf-model read in place of the recipe's hub id
    assert built.model.num_layers == text["num_hidden_layers"]
    assert isinstance(built.dataset, PackedDatasetConfig)
    assert built.scheduler.lr_warmup_iters < TRAIN_ITERS  # the recipe's 500 would be capped by Bridge
    runtime_config_update(built)  # raises on an invalid config
    assert built.model.seq_length == built.dataset.seq_length == PACK_SIZE
    assert built.train.micro_batch_size == built.dataset.micro_batch_size == 1
    assert built.train.train_iters == built.scheduler.lr_decay_iters == TRAIN_ITERS
    assert built.model.calculate_per_token_loss and not built.ddp.average_in_collective
    assert built.checkpoint.load == built.checkpoint.save
    assert built.validation.eval_iters == 0
    assert built.scheduler.lr_warmup_steps == built.scheduler.lr_warmup_iters * built.train.global_batch_size


def test_warmup_not_below_train_iters_is_refused(example, tmp_path):
    from train.dataset import TrainConfigError
    from train.recipes.megatron import build_config

    with pytest.raises(TrainConfigError, match="--warmup-iters"):
        build_config(_train_config(example, tmp_path, warmup_iters=TRAIN_ITERS))


def test_unknown_recipe_names_close_ones(example, tmp_path):
    from packvlm.errors import UsageError
    from train.recipes.megatron import build_config

    with pytest.raises(UsageError, match="qwen25_vl_3b_sft_config"):
        build_config(_train_config(example, tmp_path, recipe="qwen25_vl_3b_typo_config"))


@pytest.fixture(scope="module")
def bridge_batches(built, example) -> list[dict[str, Any]]:
    """Batches from Bridge's own dataset build (its provider lookup and protocol adapter)."""
    from megatron.bridge.data.loaders import build_train_valid_test_datasets
    from megatron.bridge.data.utils import get_dataset_provider

    train, valid, test = build_train_valid_test_datasets(built, get_dataset_provider(built.dataset))
    assert valid is None and test is None
    count = len(_reference_batches(example))
    return [next(train) for _ in range(count)]  # Energon's train loader is endless; one epoch's worth


def test_bridge_dataset_build_yields_our_batches(bridge_batches, example):
    reference = _reference_batches(example)
    assert len(reference) >= 3
    for batch in bridge_batches:
        twins = [r for r in reference if torch.equal(r["input_ids"], batch["input_ids"])]
        assert twins, "a batch that is none of the packs"
        _assert_same_batch(batch, twins[0])
    assert any(batch["visual_inputs"] is not None for batch in bridge_batches)


def test_bridge_get_batch_and_packed_seq_params(bridge_batches, built, monkeypatch):
    """Bridge's vlm_step.get_batch (through get_batch_from_iterator) and get_packed_seq_params, real code.

    ``Tensor.cuda`` is an identity here, as in Bridge's own CPU unit tests.
    """
    from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params
    from megatron.bridge.training.vlm_step import get_batch

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, non_blocking=False: self)
    one_stage = SimpleNamespace(pp=SimpleNamespace(rank=lambda: 0, size=lambda: 1))
    for batch in bridge_batches:
        tokens, labels, loss_mask, attention_mask, position_ids, packed, visual = get_batch(
            iter([batch]), built, pg_collection=one_stage
        )
        assert torch.equal(tokens, batch["input_ids"]) and torch.equal(labels, batch["labels"])
        assert torch.equal(loss_mask, batch["loss_mask"]) and torch.equal(position_ids, batch["position_ids"])
        assert attention_mask is None
        assert position_ids.shape == (3, 1, tokens.shape[1])  # Qwen-VL mRoPE rows
        params = get_packed_seq_params(packed)
        assert params.qkv_format == "thd"
        cu = batch["cu_seqlens_q"].reshape(-1).to(torch.int32)
        assert torch.equal(params.cu_seqlens_q, cu) and torch.equal(params.cu_seqlens_kv, cu)
        padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        assert int(padded[-1]) == tokens.shape[1] <= PACK_SIZE  # the row holds its packs' tokens, no more
        lengths = cu[1:] - cu[:-1]
        assert params.max_seqlen_q == int(lengths.max())
        if visual is not None:
            fields = visual.normalized_for_model()
            assert fields["pixel_values"].shape[0] == int(fields["image_grid_thw"].prod(dim=1).sum())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stop; with CUDA finetune would train")
def test_finetune_is_reached_and_stops_at_its_cuda_check(example, tmp_path, monkeypatch):
    """run() builds the config and calls Bridge's finetune, which stops at initialize.py's CUDA assert."""
    from train.recipes import megatron

    calls: list[str] = []
    real = megatron.build_config
    monkeypatch.setattr(megatron, "build_config", lambda config: calls.append("build") or real(config))
    monkeypatch.setattr(megatron, "export_hf", lambda config: calls.append("export"))
    with pytest.raises(AssertionError, match="^Megatron requires CUDA.$"):
        megatron.run(_train_config(example, tmp_path))
    assert calls == ["build"]


class PerSampleAttention(torch.nn.Module):
    """Where Transformer Engine's THD attention would run: causal attention inside each sample.

    Without ``packed_seq_params`` (a sample alone) megatron-core's own local attention runs.
    """

    def __init__(self, local: torch.nn.Module) -> None:
        super().__init__()
        self.local = local
        self.calls: list[int] = []

    def forward(self, q, k, v, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return self.local(q, k, v, attention_mask, attn_mask_type, attention_bias, None)
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        self.calls.append(len(cu) - 1)
        out = torch.zeros_like(q)  # [T, heads, dim]: megatron-core squeezes the batch for THD
        repeat = q.shape[1] // k.shape[1]
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks, vs = (
                x[start:end].repeat_interleave(r, 1).transpose(0, 1) for x, r in ((q, 1), (k, repeat), (v, repeat))
            )
            attended = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=self.local.softmax_scale
            )
            out[start:end] = attended.transpose(0, 1)
        return out


def _media_splitter(visual: dict[str, torch.Tensor], token_id: int, pixels: str, grids: str, extra: str | None = None):
    """Hands each sample, in row order, its own media rows (pixel rows = t*h*w, tokens = t*h*w/4)."""
    remaining = list(visual.get(grids, torch.zeros(0, 3, dtype=torch.long)))
    state = {"row": 0, "count": 0}

    def take(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens, mine = int((ids == token_id).sum()), []
        while tokens > 0:
            mine.append(remaining.pop(0))
            tokens -= int(mine[-1].prod()) // 4
        if not mine:
            return {}
        rows = sum(int(g.prod()) for g in mine)
        out = {pixels: visual[pixels][state["row"] : state["row"] + rows], grids: torch.stack(mine)}
        if extra is not None:
            out[extra] = visual[extra][state["count"] : state["count"] + len(mine)]
        state["row"] += rows
        state["count"] += len(mine)
        return out

    return take


def test_tiny_bridge_qwen25_vl_packed_losses_equal_each_sample_alone(example, monkeypatch):
    """Bridge's Qwen25VLModel (non-TE layer spec, from the example's HF config through AutoBridge) on a
    packed row (images, a video, text) against each sample alone: per-token losses equal to 1e-5.

    fp32 losses ~8 over a 2-layer, width-64 model: the two attention kernels differ by rounding
    (~1e-7 relative), far below 1e-5; a row whose attention leaks across samples moves by ~0.1.
    """
    import contextlib
    import socket

    import megatron.core.fusions.fused_softmax as fused_softmax
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params
    from megatron.bridge.training.vlm_step import _filter_visual_kwargs_for_model
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    # megatron-core's CPU gaps: rotary / causal mask on the current CUDA device, the attention dropout rng
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(
        fused_softmax, "get_default_causal_mask", lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    )
    monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        torch.manual_seed(0)
        provider = AutoBridge.from_hf_pretrained(str(example.model)).to_megatron_provider(load_weights=False)
        text = json.loads((example.model / "config.json").read_text())["text_config"]
        provider.mrope_section = text["rope_parameters"]["mrope_section"]  # the converter writes 7B's [16, 24, 24]
        provider.transformer_layer_spec = local_layer_spec
        provider.use_cpu_initialization = True
        provider.params_dtype, provider.bf16, provider.fp16 = torch.float32, False, False
        provider.finalize()
        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        model = provider.provide(pre_process=True, post_process=True).eval()
        attention = []
        for layer in model.language_model.decoder.layers:
            attention.append(PerSampleAttention(layer.self_attention.core_attention))
            layer.self_attention.core_attention = attention[-1]

        batches = _reference_batches(example)
        batch = max(batches, key=lambda b: b["cu_seqlens_q"].numel())
        cu = batch["cu_seqlens_q"].reshape(-1).tolist()
        assert len(cu) - 1 >= 3 and batch["visual_inputs"] is not None
        visual = _filter_visual_kwargs_for_model(model, batch["visual_inputs"].normalized_for_model())
        assert {"pixel_values", "pixel_values_videos"} <= visual.keys()
        params = get_packed_seq_params(
            {k: batch[k] for k in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")}
        )
        common = dict(attention_mask=None, labels=batch["labels"], loss_mask=batch["loss_mask"])
        with torch.no_grad():
            packed = model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                packed_seq_params=params,
                **common,
                **visual,
            )
        assert [a.calls for a in attention] == [[len(cu) - 1]] * len(attention)
        config = provider
        images = _media_splitter(visual, config.image_token_id, "pixel_values", "image_grid_thw")
        videos = _media_splitter(
            visual, config.video_token_id, "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"
        )
        worst, media = 0.0, 0
        for start, end in zip(cu[:-1], cu[1:]):
            ids = batch["input_ids"][:, start:end]
            own = {**images(ids), **videos(ids)}
            media += bool(own)
            with torch.no_grad():
                alone = model(
                    input_ids=ids,
                    position_ids=batch["position_ids"][:, :, start:end],
                    attention_mask=None,
                    labels=batch["labels"][:, start:end],
                    loss_mask=batch["loss_mask"][:, start:end],
                    **own,
                )
            mask = batch["loss_mask"][:, start:end] > 0
            assert mask.any()
            worst = max(worst, float((alone - packed[:, start:end])[mask].abs().max()))
        assert media >= 2
        assert worst <= 1e-5
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
