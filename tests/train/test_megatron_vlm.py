"""`train megatron` with images: the batch -> PackedSeqParams, decoder_input scatter, mRoPE rows, CP cut.

CPU truths, all independent of the code under test:

- hand-computed rows for a pack of a text-only, a one-image and a two-image sample with slot
  padding (which row of ``decoder_input`` gets which image embedding, on the whole row and on
  each context-parallel rank);
- the Hugging Face model itself, each sample alone through the real processor: its
  ``get_image_features`` and the ``inputs_embeds`` its language model receives (for Qwen2.5-VL,
  Mistral 3 and LLaVA-OneVision), and its own mRoPE rotation of a probe query, against
  megatron-core's THD rope (`_apply_rotary_pos_emb_thd`, the code attention runs) fed our
  ``[3, 1, T]`` rows, at CP 1 and on both ranks of CP 2.

The `gpu` tests run the real megatron-core GPTModel (Transformer Engine spec) with the family's HF
vision tower: packed per-sample losses and gradients equal each sample alone (bf16 tolerance),
CP 2 equals CP 1 on two GPUs. They are skipped without CUDA + Transformer Engine.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from tests.train.megatron_batches import HAS_GPU_STACK, HAS_MEGATRON, PAD, make_batch
from tests.train.models import CONVERSATIONS, Sample, make_family, pack_samples, process, tiny_model
from train.batch import IGNORE_INDEX, PackedBatch
from train.context_parallel import partition_index
from train.dataset import TrainConfigError
from train.encoder import PackEncoder
from train.megatron.model import vlm_gpt_config
from train.megatron.step import shift_labels
from train.megatron.vision import HFVisionEncoder, MediaTokenMismatchError, media_rows, scatter_media
from train.megatron.vlm import MegatronVLM, get_vlm_batch
from train.recipes.megatron import MediaInPackError, MegatronTrainConfig, plan_model, text_only

pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed"),
    pytest.mark.filterwarnings("ignore:Apex is not installed"),
]
IMG = 99
# text-only (3 tokens), one image of 2 tokens, two images of 1 and 2 tokens; slots padded to 4
HAND_SAMPLES = [
    ([1, 2, 3], [IGNORE_INDEX, 2, 3]),
    ([4, IMG, IMG, 5], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 5]),
    ([6, IMG, 7, IMG, IMG, 8], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 8]),
]
#   row   [1 2 3 P | 4 I I 5 | 6 I 7 I I 8 P P]
#   index  0 1 2 3   4 5 6 7   8 9 ...        15
IMAGE_ROWS = [[5, 6], [9], [11, 12]]  # image k -> its rows
CP2_INDEX = {0: [0, 3, 4, 7, 8, 9, 14, 15], 1: [1, 2, 5, 6, 10, 11, 12, 13]}  # chunks r and 3-r of each slot


def hand_batch() -> PackedBatch:
    batch = make_batch(HAND_SAMPLES, pad_to_multiple_of=4, multimodal=True)
    return dataclasses.replace(batch, num_media=3)


class StubVision:
    """Three images' embeddings: image k of n_k tokens -> rows ``1000 * (k + 1) + j``."""

    image_token_id = IMG

    def embeddings(self, vision):
        rows = [1000.0 * (k + 1) + j for k, image in enumerate(IMAGE_ROWS) for j in range(len(image))]
        return [(IMG, torch.tensor(rows).view(-1, 1).expand(-1, 2))]


class StubLanguageModel(torch.nn.Module):
    """megatron-core's GPTModel shape: ``embedding(input_ids, position_ids) -> [T, 1, H]``; records calls."""

    def __init__(self, embed=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.embed = embed
        self.calls: list[dict] = []

    def embedding(self, input_ids, position_ids):
        if self.embed is not None:
            return self.embed(input_ids).transpose(0, 1)
        return input_ids.float().t().unsqueeze(-1).expand(-1, -1, 2)  # token id in every channel

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return self.weight * torch.arange(kwargs["labels"].shape[1], dtype=torch.float32).view(1, -1)


def test_media_rows_and_scatter_hand_values():
    batch = hand_batch()
    assert media_rows(batch.input_ids, IMG).tolist() == [r for rows in IMAGE_ROWS for r in rows]
    vlm = MegatronVLM(StubLanguageModel(), StubVision(), mrope=True)  # type: ignore[arg-type]
    merged = vlm.decoder_input(batch.input_ids, {"pixel_values": torch.zeros(1)})
    assert merged.shape == (16, 1, 2)
    expected = [1, 2, 3, PAD, 4, 1000, 1001, 5, 6, 2000, 7, 3000, 3001, 8, PAD, PAD]
    assert merged[:, 0, 0].tolist() == expected
    for rank, index in CP2_INDEX.items():
        assert partition_index(batch.cu_seqlens_padded, 2, rank).tolist() == index
        cut = vlm.decoder_input(batch.input_ids, {"pixel_values": torch.zeros(1)}, torch.tensor(index))
        assert cut[:, 0, 0].tolist() == [expected[i] for i in index]  # rank 1 holds images 0 and 2, rank 0 image 1
    assert vlm.decoder_input(batch.input_ids, {})[:, 0, 0].tolist()[5] == IMG  # no vision keywords: tokens as text


def test_scatter_refuses_a_count_mismatch():
    batch = hand_batch()
    embeds = torch.zeros(16, 1, 2)
    with pytest.raises(MediaTokenMismatchError, match="5 placeholder tokens 99 but the vision tower gave 4"):
        scatter_media(embeds, batch.input_ids, [(IMG, torch.ones(4, 2))])


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")
@pytest.mark.parametrize("cp_rank", [None, 0, 1])
def test_vlm_batch_hand_values(cp_rank):
    batch = hand_batch()
    cp = 1 if cp_rank is None else 2
    mb = get_vlm_batch(batch, mrope=True, context_parallel_size=cp, context_parallel_rank=cp_rank or 0)
    labels, loss_mask = shift_labels(batch)
    index = list(range(16)) if cp_rank is None else CP2_INDEX[cp_rank]
    assert mb.tokens.tolist() == batch.input_ids.tolist()  # whole row: the merge needs every placeholder
    assert mb.labels.tolist() == [[labels[0, i].item() for i in index]]
    assert mb.loss_mask.tolist() == [[loss_mask[0, i].item() for i in index]]
    assert (mb.cp_index is None) == (cp_rank is None)
    # mRoPE rows: [3, 1, T], the whole row (megatron-core's THD rope picks this rank's chunks)
    assert mb.position_ids.shape == (3, 1, 16) and torch.equal(mb.position_ids, batch.position_ids[1:])
    params = mb.packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 3, 7, 13] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 16]
    assert params.max_seqlen_q == 8
    text = get_vlm_batch(batch, mrope=False)
    assert text.position_ids.shape == (1, 16) and torch.equal(text.position_ids, batch.position_ids[0])


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")
def test_vlm_forward_binds_to_gpt_model_forward():
    from megatron.core.models.gpt import GPTModel

    language_model = StubLanguageModel()
    vlm = MegatronVLM(language_model, StubVision(), mrope=True)  # type: ignore[arg-type]
    batch = hand_batch()
    output = vlm(get_vlm_batch(batch, mrope=True, context_parallel_size=2, context_parallel_rank=1))
    kwargs = language_model.calls[0]
    bound = inspect.signature(GPTModel.forward).bind(object(), **kwargs)
    assert bound.arguments["input_ids"] is None and bound.arguments["attention_mask"] is None
    assert bound.arguments["decoder_input"].shape == (8, 1, 2)
    assert output.shape == kwargs["labels"].shape == kwargs["loss_mask"].shape == (1, 8)


# ---------------------------------------------------------------- the real families on CPU


@dataclasses.dataclass
class FamilySetup:
    name: str
    model: torch.nn.Module  # the HF model (its vision weights copied into `vision`)
    vision: HFVisionEncoder
    samples: list[Sample]
    encoder: PackEncoder
    processor_dir: Path
    model_dir: Path


@pytest.fixture(scope="module", params=["qwen2_5_vl", "mistral3", "llava_onevision"])
def family(request, tmp_path_factory) -> FamilySetup:
    torch.manual_seed(0)
    made = make_family(request.param, tmp_path_factory.mktemp(request.param))
    from families.processor import load_processor

    processor = load_processor(str(made.processor_dir)).processor
    conversations = CONVERSATIONS[:3]  # text-only, one image, two images
    if request.param == "llava_onevision":  # small tiles: 1 + 1 crop each
        conversations = tuple(
            dataclasses.replace(c, image_sizes=((40, 30),) * len(c.image_sizes)) for c in conversations
        )
    samples = [process(processor, c) for c in conversations]
    model = tiny_model(made, attn_implementation="sdpa")
    vision = HFVisionEncoder(model.config)
    result = vision.load_state_dict(
        {k: v for k, v in model.state_dict().items() if k.startswith("model.")}, strict=False
    )
    assert not result.missing_keys  # every vision weight is the HF model's
    encoder = PackEncoder.from_pretrained(str(made.processor_dir), str(made.model_dir))
    return FamilySetup(request.param, model, vision, samples, encoder, made.processor_dir, made.model_dir)


def hf_inputs_embeds(model, sample: Sample) -> torch.Tensor:
    """What the HF model's language model receives for ``sample`` alone: ``inputs_embeds`` [L, H]."""
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"].detach()

    handle = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**sample.inputs, attention_mask=torch.ones_like(sample.input_ids), use_cache=False)
    finally:
        handle.remove()
    return captured["embeds"][0]


def test_vision_embeddings_are_the_hf_models(family):
    for sample in family.samples[1:]:
        vision = {k: v for k, v in sample.inputs.items() if k not in ("input_ids", "mm_token_type_ids")}
        ((token_id, ours),) = family.vision.embeddings(vision)
        theirs = family.model.model.get_image_features(**vision, return_dict=True).pooler_output
        assert token_id == family.model.config.image_token_id
        torch.testing.assert_close(ours, torch.cat(list(theirs)), rtol=0, atol=0)


@pytest.mark.parametrize("cp", [1, 2])
def test_decoder_input_rows_equal_the_hf_models_inputs_embeds_per_sample(family, cp):
    """The packed row's decoder_input, slot by slot, is what the HF model feeds its language model for
    each sample alone; cut per CP rank, each rank holds exactly its rows of it."""
    batch = family.encoder.encode(pack_samples(family.samples, family.processor_dir, pad_to_multiple_of=2 * cp))
    assert batch.num_media == 3
    language_model = StubLanguageModel(embed=family.model.get_input_embeddings())
    vlm = MegatronVLM(language_model, family.vision, mrope=family.name == "qwen2_5_vl")
    with torch.no_grad():
        merged = vlm.decoder_input(batch.input_ids, batch.vision_inputs())
        for start, sample in zip(batch.cu_seqlens_padded.tolist(), family.samples):
            alone = hf_inputs_embeds(family.model, sample)
            torch.testing.assert_close(merged[start : start + alone.shape[0], 0], alone, rtol=0, atol=1e-6)
        if cp == 2:
            rows = []
            for rank in range(cp):
                index = partition_index(batch.cu_seqlens_padded, cp, rank)
                cut = vlm.decoder_input(batch.input_ids, batch.vision_inputs(), index)
                torch.testing.assert_close(cut, merged[index], rtol=0, atol=0)
                rows += index.tolist()
            assert sorted(rows) == list(range(batch.num_tokens))


class FakeCPGroup:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")
@pytest.mark.parametrize("cp", [1, 2])
def test_mrope_rows_rotate_like_the_hf_model_through_megatron_cores_thd_rope(monkeypatch, tmp_path, cp):
    """Our [3, 1, T] rows through megatron-core's MultimodalRotaryEmbedding and its THD rope (the
    attention's code path, per CP rank) rotate a probe query exactly as the HF model rotates each
    sample alone with its own get_rope_index."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb

    torch.manual_seed(0)
    made = make_family("qwen2_5_vl", tmp_path)
    from families.processor import load_processor

    processor = load_processor(str(made.processor_dir)).processor
    samples = [process(processor, c) for c in CONVERSATIONS]
    model = tiny_model(made, attn_implementation="sdpa")
    batch = PackEncoder.from_pretrained(str(made.processor_dir), str(made.model_dir)).encode(
        pack_samples(samples, made.processor_dir, pad_to_multiple_of=4)
    )
    gpt = vlm_gpt_config(model.config, vocab_size=10, max_sequence_length=batch.num_tokens, num_layers=1, mrope=True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # mcore builds inv_freq on the CUDA device
    rope = MultimodalRotaryEmbedding(kv_channels=gpt.kv_channels, rotary_percent=1.0, rotary_base=gpt.rotary_base)
    mb = get_vlm_batch(batch, mrope=True)
    freqs = rope(mb.position_ids, list(gpt.mrope_section))  # [T, 1, 1, head_dim]
    assert freqs.shape == (batch.num_tokens, 1, 1, gpt.kv_channels)
    heads = 2
    probe = torch.randn(batch.num_tokens, heads, gpt.kv_channels, dtype=torch.float64).float()
    truth = probe.clone()
    text = model.model.language_model
    for start, sample in zip(batch.cu_seqlens_padded.tolist(), samples):
        n = sample.input_ids.shape[1]
        grid = sample.inputs.get("image_grid_thw")
        positions, _ = model.model.get_rope_index(sample.input_ids, sample.inputs["mm_token_type_ids"], grid)
        q = probe[start : start + n].transpose(0, 1)[None]  # [1, heads, n, d]
        cos, sin = text.rotary_emb(q, positions)
        truth[start : start + n] = apply_rotary_pos_emb(q, q, cos, sin)[0][0].transpose(0, 1)
    real = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for a, b, start in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist(), batch.cu_seqlens_padded):
        real[int(start) : int(start) + b - a] = True
    for rank in range(cp):
        index = partition_index(batch.cu_seqlens_padded, cp, rank)
        got = _apply_rotary_pos_emb_thd(
            probe[index], mb.packed_seq_params.cu_seqlens_q_padded, freqs, cp_group=FakeCPGroup(cp, rank)
        )
        keep = real[index]  # slot padding has no HF truth
        torch.testing.assert_close(got[keep], truth[index][keep], rtol=0, atol=1e-5)
    # mutation: rows continuing across samples (one long sequence) rotate differently
    continuing = torch.arange(batch.num_tokens).view(1, 1, -1).expand(3, 1, -1)
    wrong = _apply_rotary_pos_emb_thd(
        probe,
        mb.packed_seq_params.cu_seqlens_q_padded,
        rope(continuing, list(gpt.mrope_section)),
        cp_group=FakeCPGroup(1, 0),
    )
    assert (wrong[real] - truth[real]).abs().max() > 1e-2


# ---------------------------------------------------------------- the recipe's choice


def _config(tmp_path, **overrides):
    return MegatronTrainConfig(data=tmp_path, processor=tmp_path, output=tmp_path / "out", max_steps=1, **overrides)


@pytest.mark.parametrize(
    ("name", "mrope", "hidden", "heads", "groups", "head_dim"),
    [("qwen2_5_vl", True, 64, 4, 2, 16), ("mistral3", False, 64, 4, 2, 16), ("llava_onevision", False, 64, 4, 2, 16)],
)
def test_images_train_with_the_hf_width(tmp_path, name, mrope, hidden, heads, groups, head_dim):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(make_family(name, tmp_path).model_dir)
    plan = plan_model(_config(tmp_path), config)
    assert plan.vision and plan.mrope == mrope
    gpt = vlm_gpt_config(config, vocab_size=1000, max_sequence_length=64, num_layers=3, mrope=mrope)
    assert (gpt.hidden_size, gpt.num_attention_heads, gpt.num_query_groups, gpt.kv_channels) == (
        hidden,
        heads,
        groups,
        head_dim,
    )
    assert gpt.num_layers == 3 and gpt.padded_vocab_size == 1024
    assert gpt.position_embedding_type == ("mrope" if mrope else "rope")
    assert gpt.mrope_section == ((2, 3, 3) if mrope else None)  # the example's rope_parameters
    assert plan_model(_config(tmp_path, hidden_size=hidden), config).vision  # the same width may be given
    with pytest.raises(TrainConfigError, match=r"--hidden-size 256.*\(64\)"):
        plan_model(_config(tmp_path, hidden_size=256), config)
    ignored = plan_model(_config(tmp_path, ignore_media=True), config)
    assert not ignored.vision and ignored.text_reason == "--ignore-media"


def test_images_are_no_longer_refused_but_text_only_runs_still_refuse_them(tmp_path):
    from transformers import AutoConfig

    with_image = hand_batch()
    qwen = plan_model(
        _config(tmp_path), AutoConfig.from_pretrained(make_family("qwen2_5_vl", tmp_path / "q").model_dir)
    )
    assert qwen.vision  # the loop then hands every micro-batch, media included, to MegatronVLM
    gemma = plan_model(_config(tmp_path), AutoConfig.from_pretrained(make_family("gemma3", tmp_path / "g").model_dir))
    assert not gemma.vision and "bidirectionally" in gemma.text_reason
    with pytest.raises(MediaInPackError, match=r"gemma3.*bidirectionally.*--ignore-media"):
        list(text_only([with_image], ignore_media=False, reason=gemma.text_reason))
    assert list(text_only([with_image], ignore_media=True)) == [with_image]  # --ignore-media keeps its meaning


# ---------------------------------------------------------------- GPU: megatron-core + TE + the HF tower

GPU_ATOL = 3e-2  # bf16 autocast: THD kernel vs the ordinary causal kernel, vision tower in bf16
GPU_GRAD_RTOL = 5e-2


@pytest.fixture(scope="module")
def gpu_vlm(tmp_path_factory):
    """A builder of MegatronVLM (GPT 2 layers + the family's HF tower) in megatron-core's parallel state."""
    if not HAS_GPU_STACK:
        pytest.skip("needs a CUDA GPU, megatron-core and Transformer Engine")
    from tests.train.megatron_batches import megatron_parallel_state
    from train.megatron.model import build_gpt_model

    def build(setup: FamilySetup) -> MegatronVLM:
        mrope = setup.name == "qwen2_5_vl"
        config = vlm_gpt_config(
            setup.model.config, vocab_size=4096, max_sequence_length=8192, num_layers=2, mrope=mrope
        )
        torch.manual_seed(0)
        vision = HFVisionEncoder(setup.model.config).cuda()
        return MegatronVLM(build_gpt_model(config), vision, mrope=mrope)

    with megatron_parallel_state():
        yield build


def _losses(model: MegatronVLM, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    from train.megatron.vlm import vlm_forward_step

    with torch.autocast("cuda", dtype=torch.bfloat16):
        output, loss_fn = vlm_forward_step(iter([batch]), model)
    return output, loss_fn(output)[0]


@pytest.mark.gpu
def test_packed_vlm_losses_and_gradients_equal_each_sample_alone_on_gpu(family, gpu_vlm):
    model = gpu_vlm(family)
    packed = family.encoder.encode(pack_samples(family.samples, family.processor_dir, pad_to_multiple_of=8))
    output, loss = _losses(model, packed)
    loss.backward()
    packed_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    mask = get_vlm_batch(packed).loss_mask[0]
    for start, sample in zip(packed.cu_seqlens_padded.tolist(), family.samples):
        alone = family.encoder.encode(pack_samples([sample], family.processor_dir, pad_to_multiple_of=8))
        single, single_loss = _losses(model, alone)
        single_loss.backward()
        n = sample.input_ids.shape[1]
        keep = mask[start : start + n].bool().cuda()
        torch.testing.assert_close(
            output[0, start : start + n].float()[keep], single[0, :n].float()[keep], atol=GPU_ATOL, rtol=0
        )
    for name, param in model.named_parameters():
        if param.grad is None:
            assert name not in packed_grads
            continue
        scale = param.grad.abs().max().clamp(min=1e-3)
        assert ((packed_grads[name] - param.grad).abs().max() / scale).item() < GPU_GRAD_RTOL, name


def _cp_worker(rank: int, name: str, processor_dir: str, model_dir: str, samples: list, port: int, out: str) -> None:
    """Process ``rank`` of two: CP 2 per-token losses of this rank's tokens (rank 0 also saves the weights)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from transformers import AutoConfig

    from train.megatron.model import build_gpt_model
    from train.megatron.vlm import vlm_forward_step

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    hf_config, mrope = AutoConfig.from_pretrained(model_dir), name == "qwen2_5_vl"
    gpt = vlm_gpt_config(
        hf_config, vocab_size=4096, max_sequence_length=8192, num_layers=2, mrope=mrope, context_parallel_size=2
    )
    torch.manual_seed(0)
    model = MegatronVLM(build_gpt_model(gpt), HFVisionEncoder(hf_config).cuda(), mrope=mrope)
    if rank == 0:
        torch.save(model.state_dict(), Path(out) / "weights.pt")
    dist.barrier()
    model.load_state_dict(torch.load(Path(out) / "weights.pt", weights_only=False))  # one init for both ranks
    batch = PackEncoder.from_pretrained(processor_dir, model_dir).encode(
        pack_samples(samples, processor_dir, pad_to_multiple_of=8)
    )
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        losses, _ = vlm_forward_step(iter([batch]), model, context_parallel_size=2, context_parallel_rank=rank)
    torch.save(losses.float().cpu(), Path(out) / f"rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallel 2 needs two GPUs")
def test_context_parallel_two_equals_one_on_two_gpus(family, gpu_vlm, tmp_path):
    """Each CP rank's losses equal the CP 1 model's (same weights) at that rank's tokens."""
    import torch.multiprocessing as mp

    from train.recipes.megatron import _free_port

    args = (family.name, str(family.processor_dir), str(family.model_dir), family.samples, _free_port(), str(tmp_path))
    mp.spawn(_cp_worker, args=args, nprocs=2, join=True)
    model = gpu_vlm(family)
    model.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=False))
    batch = family.encoder.encode(pack_samples(family.samples, family.processor_dir, pad_to_multiple_of=8))
    with torch.no_grad():
        whole, _ = _losses(model, batch)
    mask = get_vlm_batch(batch).loss_mask[0].bool()
    for rank in range(2):
        index = partition_index(batch.cu_seqlens_padded, 2, rank)
        got = torch.load(tmp_path / f"rank{rank}.pt")[0]
        keep = mask[index]
        torch.testing.assert_close(got[keep], whole[0, index.cuda()].float().cpu()[keep], atol=GPU_ATOL, rtol=0)
