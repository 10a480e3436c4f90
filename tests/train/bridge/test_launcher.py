"""`train megatron` against Megatron-Bridge's real code (0.6.2, CPU): config, data, batch, model, finetune.

Runs in the Python 3.12 environment of ``.ci/bridge-env`` (Bridge installed ``--no-deps`` plus
the import-only stand-ins of `tests.train.bridge.standins`); skips where ``megatron.bridge`` is not
installed. For each family with a Bridge VLM recipe we test (Qwen2.5-VL, Ministral 3, Gemma 3), the
data is the family's example tokenized, packed (pack size 1024) and indexed; its ``model/`` config
is the ``--hf-model`` (no weights: the config build reads only the config).

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

#: example family -> (Bridge recipe, its model provider class)
FAMILIES = {
    "qwen2_5_vl": ("qwen25_vl_3b_sft_config", "Qwen25VLModelProvider"),
    "mistral3": ("ministral3_3b_sft_config", "Ministral3ModelProvider"),
    "gemma3": ("gemma3_vl_4b_sft_config", "Gemma3VLModelProvider"),
}
PACK_SIZE = 1024
TRAIN_ITERS = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def example(family: str, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The family's example, tokenized, packed and indexed: what `prep` writes for `train megatron`."""
    from prep.energon.index import index_dataset
    from prep.example.dataset import write_example_dataset
    from prep.run import LOCAL
    from prep.tokenize.stage import TokenizeConfig, run_tokenize
    from tests.shards.oracles import pack

    root = tmp_path_factory.mktemp(f"bridge_{family}")
    config = write_example_dataset(root, num_samples=8, seed=0, with_bad_rows=False, family=family)
    tokenized, packed = root / "tok", root / "packed"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(root / "processor"),
            output_dir=str(tokenized),
            datasets=("chat",),
            executor=LOCAL,
            rows_per_chunk=16,
            max_error_rate=0.5,  # image-only processors (Pixtral, Gemma 3) refuse the example's video rows
        )
    )
    pack([tokenized], packed, pack_size=PACK_SIZE, shard_size="3packs", pad_to_multiple_of=1)
    index_dataset(packed)
    recipe, provider = FAMILIES[family]
    return SimpleNamespace(
        family=family,
        recipe=recipe,
        provider=provider,
        root=root,
        packed=packed,
        processor=root / "processor",
        model=root / "model",
    )


def _train_config(example: SimpleNamespace, output: Path, **overrides: Any) -> Any:
    from train.recipes.megatron import MegatronTrainConfig

    options = dict(
        recipe=example.recipe,
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

    assert type(built.model).__name__ == example.provider
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

    typo = example.recipe.replace("_sft_", "_typo_")
    with pytest.raises(UsageError, match=example.recipe):
        build_config(_train_config(example, tmp_path, recipe=typo))


def test_context_parallel_refused_where_bridge_cannot(built, example):
    """On the recipe's real provider: Qwen2.5-VL cuts no row per CP rank, Gemma 3 VL's provider refuses CP."""
    from train.recipes.megatron import context_parallel_problem

    problem = context_parallel_problem(built.model, 2)
    if example.family == "mistral3":
        assert problem is None  # Ministral3Model slices the merged row per CP rank
    else:
        assert problem is not None and problem.startswith("--context-parallel 2: Megatron-Bridge's ")
    if example.family == "gemma3":  # the refusal we name is Bridge's own, at provide()
        built.model.context_parallel_size = 2
        with pytest.raises(ValueError, match="does not support context parallelism"):
            built.model.provide()
        built.model.context_parallel_size = 1


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


def _image_token_id(provider: Any) -> int:
    return int(provider.image_token_id)


def _image_tokens(family: str, fields: dict[str, torch.Tensor], provider: Any) -> list[int]:
    """Image placeholder tokens per image, from the pixel fields alone (the family's own arithmetic)."""
    if family == "qwen2_5_vl":  # one token per 2x2 merged patch of the grid
        return [int(g.prod()) // 4 for g in fields.get("image_grid_thw", [])]
    if family == "mistral3":  # Pixtral: one [IMG] per (patch x spatial merge) square of the resized image
        side = provider.hf_config.vision_config.patch_size * provider.hf_config.spatial_merge_size
        return [-(-int(h) // side) * -(-int(w) // side) for h, w in fields["image_sizes"]]
    return [provider.mm_tokens_per_image] * fields["pixel_values"].shape[0]  # Gemma 3: fixed soft tokens


def test_bridge_get_batch_and_packed_seq_params(bridge_batches, built, example, monkeypatch):
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
        rope_rows = (3, 1) if example.family == "qwen2_5_vl" else (1,)  # Qwen-VL mRoPE rows; 1-D rope
        assert position_ids.shape == (*rope_rows, tokens.shape[1])
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
            image_tokens = int((tokens == _image_token_id(built.model)).sum())
            assert image_tokens == sum(_image_tokens(example.family, fields, built.model))


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


class _MediaSplitter:
    """Hands each sample, in row order, its own media: the items (images or videos) whose placeholder
    tokens it holds. ``tokens_of(item)`` counts an item's placeholders; ``rows_of(item)`` its rows of
    ``row_keys`` fields (pixel rows concatenated over the row); ``item_keys`` fields have one entry per item.
    """

    def __init__(self, visual, token_id, items_key, tokens_of, rows_of=None, row_keys=(), item_keys=()) -> None:
        self.visual, self.token_id = visual, token_id
        self.items = list(visual[items_key]) if items_key in visual else []
        self.tokens_of, self.rows_of, self.row_keys, self.item_keys = tokens_of, rows_of, row_keys, item_keys
        self.next_item, self.next_row = 0, 0

    def take(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens, first = int((ids == self.token_id).sum()), self.next_item
        while tokens > 0:
            tokens -= self.tokens_of(self.items[self.next_item])
            self.next_item += 1
        assert tokens == 0, "a sample's placeholders are not whole items"
        mine = self.items[first : self.next_item]
        if not mine:
            return {}
        out = {key: self.visual[key][first : self.next_item] for key in self.item_keys}
        if self.rows_of is not None:
            rows = sum(self.rows_of(item) for item in mine)
            out.update({key: self.visual[key][self.next_row : self.next_row + rows] for key in self.row_keys})
            self.next_row += rows
        return out


def _splitters(family: str, visual: dict[str, torch.Tensor], provider: Any) -> list[_MediaSplitter]:
    if family == "qwen2_5_vl":  # pixel rows = t*h*w patches, tokens = t*h*w/4 (2x2 merge)
        rows, tokens = (lambda g: int(g.prod())), (lambda g: int(g.prod()) // 4)
        return [
            _MediaSplitter(visual, provider.image_token_id, "image_grid_thw", tokens, rows,
                           ("pixel_values",), ("image_grid_thw",)),
            _MediaSplitter(visual, provider.video_token_id, "video_grid_thw", tokens, rows,
                           ("pixel_values_videos",), ("video_grid_thw", "second_per_grid_ts")),
        ]  # fmt: skip
    side = provider.hf_config.vision_config.patch_size * provider.hf_config.spatial_merge_size
    return [  # mistral3: one padded image per pixel_values entry, its true size in image_sizes
        _MediaSplitter(visual, provider.image_token_id, "image_sizes",
                       lambda s: -(-int(s[0]) // side) * -(-int(s[1]) // side),
                       item_keys=("pixel_values", "image_sizes")),
    ]  # fmt: skip


def _configure_tiny_provider(family: str, provider: Any, example: SimpleNamespace) -> None:
    """What the converter leaves for the full-size checkpoints, set from the tiny config."""
    if family == "qwen2_5_vl":
        text = json.loads((example.model / "config.json").read_text())["text_config"]
        provider.mrope_section = text["rope_parameters"]["mrope_section"]  # the converter writes 7B's [16, 24, 24]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "mistral3"], scope="module")
def test_tiny_bridge_model_packed_losses_equal_each_sample_alone(example, monkeypatch):
    """Bridge's model of the family (non-TE layer spec, from the example's HF config through AutoBridge)
    on a packed row against each sample alone: per-token losses equal to 1e-5.

    Qwen2.5-VL: ``Qwen25VLModel`` (images, a video, text; mRoPE recomputed per sample by Bridge).
    Ministral 3: ``Ministral3Model`` (Pixtral images with their ``image_sizes``, 1-D rope).
    Gemma 3 is not here: Bridge 0.6.2 has no non-TE layer spec for it (docs/megatron-bridge.md).

    fp32 losses ~6-8 over a 2-layer, width-64 model: the two attention kernels differ by rounding
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
        assert type(provider).__name__ == example.provider
        _configure_tiny_provider(example.family, provider, example)
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

        def losses(**inputs: Any) -> torch.Tensor:
            with torch.no_grad():
                out = model(attention_mask=None, **inputs)
            return out[0] if isinstance(out, tuple) else out  # Ministral3Model: (losses, loss_mask)

        batches = _reference_batches(example)
        batch = max(batches, key=lambda b: (b["visual_inputs"] is not None, b["cu_seqlens_q"].numel()))
        cu = batch["cu_seqlens_q"].reshape(-1).tolist()
        assert len(cu) - 1 >= 3 and batch["visual_inputs"] is not None
        visual = _filter_visual_kwargs_for_model(model, batch["visual_inputs"].normalized_for_model())
        params = get_packed_seq_params(
            {k: batch[k] for k in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")}
        )
        common = dict(labels=batch["labels"], loss_mask=batch["loss_mask"])
        packed = losses(input_ids=batch["input_ids"], position_ids=batch["position_ids"], packed_seq_params=params,
                        **common, **visual)  # fmt: skip
        assert [a.calls for a in attention] == [[len(cu) - 1]] * len(attention)
        splitters = _splitters(example.family, visual, provider)
        worst, media = 0.0, 0
        for start, end in zip(cu[:-1], cu[1:]):
            ids = batch["input_ids"][:, start:end]
            own = {k: v for splitter in splitters for k, v in splitter.take(ids).items()}
            media += bool(own)
            alone = losses(
                input_ids=ids,
                position_ids=batch["position_ids"][..., start:end],
                labels=batch["labels"][:, start:end],
                loss_mask=batch["loss_mask"][:, start:end],
                **own,
            )
            mask = batch["loss_mask"][:, start:end] > 0
            assert mask.any()
            worst = max(worst, float((alone - packed[:, start:end])[mask].abs().max()))
        assert all(s.next_item == len(s.items) for s in splitters)  # every item went to one sample
        assert media >= 2
        assert worst <= 1e-5
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
