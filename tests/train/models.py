"""Test helpers for packed-vs-alone checks: tiny models, real-processor samples, packs, truths.

The truth is independent of the packing code: each conversation goes through the *real*
processor alone (``processor(text=..., images=...)``: input ids, ``mm_token_type_ids``, pixel
values, grids) and through the model alone with transformers' stock attention ("sdpa"),
an all-ones ``attention_mask`` (one unpadded row, as the processor returns it: the Omni
thinkers compute their mRoPE index only when given a mask) and ``use_cache=False``, the model
computing its own rope index. The
pack is built from the same processor outputs and the same encoded image bytes, as
`prep pack` would store them, and goes through the code under test (`PackEncoder`,
`packed_forward`, `token_loss_sum`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedModel
from transformers.image_utils import load_image

from families.counter import MediaCount
from families.processor import ProcessorBundle, load_processor
from families.registry import example_family, find_counter
from prep.example.media import make_image_bytes
from schemas.packed import LoadedPack, PackedMedia, PackedMediaItem, PackedSampleMeta, PackMeta
from train.batch import IGNORE_INDEX
from train.loss import per_token_losses, token_loss_sum
from train.models import load_model

#: the patch-grid (mRoPE) families the shared equivalence test proves
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "glm46v", "qwen2_5_omni", "qwen3_omni_moe")
REFERENCE_ATTENTION = "sdpa"  # transformers' stock attention: one sample, no packing involved


@dataclass(frozen=True)
class Conversation:
    """One user turn (images first, then text) and the assistant reply the loss is taken on."""

    image_sizes: tuple[tuple[int, int], ...]
    question: str
    answer: str

    def image_bytes(self) -> list[bytes]:
        return [make_image_bytes(w, h, seed=10 * w + h) for w, h in self.image_sizes]


#: text-only, one image, two images of different shapes, text-only (a sample may end on text)
CONVERSATIONS = (
    Conversation((), "Hello there, how are you today?", "Fine, thanks for asking."),
    Conversation(((56, 56),), "What is in the picture?", "A pattern of colours."),
    Conversation(((112, 84), (84, 56)), "Compare these two images.", "The first one is wider than the second."),
    Conversation((), "Count to three.", "One, two, three."),
)


@dataclass(frozen=True)
class Sample:
    """What the real processor returns for one conversation, plus its loss mask."""

    conversation: Conversation
    inputs: dict[str, torch.Tensor]  # input_ids [1, L], mm_token_type_ids, pixel_values, image_grid_thw
    loss_mask: torch.Tensor  # uint8 [L]: 1 on the assistant reply (everything after the prompt)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs["input_ids"]

    @property
    def labels(self) -> torch.Tensor:
        """Unshifted labels [1, L]: the ids where the loss mask is 1, else IGNORE_INDEX."""
        return torch.where(self.loss_mask.bool()[None], self.input_ids, IGNORE_INDEX)


@dataclass(frozen=True)
class Family:
    name: str
    processor_dir: Path
    model_dir: Path


def make_family(name: str, root: Path) -> Family:
    """Processor directory and config-only tiny model directory of example family ``name`` under ``root``."""
    family = example_family(name)
    if family.build_model is None:
        raise ValueError(f"example family {name!r} writes no model")
    processor_dir = family.build_processor(root / "processor")
    return Family(name, processor_dir, family.build_model(root / "model", processor_dir))


def tiny_model(family: Family, attn_implementation: str = "packvlm_varlen", seed: int = 0) -> PreTrainedModel:
    """The tiny random model in train mode (dropout is 0 in these configs)."""
    model = load_model(family.model_dir, seed=seed, attn_implementation=attn_implementation)
    return model.train()


def turns(media: Sequence[str], question: str, answer: str) -> tuple[list[dict], list[dict]]:
    """(user turn: a placeholder per ``media`` kind, "image" or "video", then ``question``; the reply)."""
    user = {"role": "user", "content": [*({"type": kind} for kind in media), {"type": "text", "text": question}]}
    return [user], [{"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def _plain_text(turn: dict) -> dict:
    """A turn without media as a plain string, as `prep.sources.formats.content` gives it."""
    content = turn["content"]
    if all(c["type"] == "text" for c in content):
        return {**turn, "content": "".join(c["text"] for c in content)}
    return turn


def _render(processor: object, user: list[dict], reply: list[dict]) -> tuple[str, str]:
    """(whole conversation, prompt with generation header) by the processor's own template.

    Content lists first (every template here takes them for media turns); a template that fails
    on a content list in a text turn (pixtral-12b's ``message["content"] + eos_token``) gets
    plain strings there, as `prep` hands them to it.
    """
    try:
        full = processor.apply_chat_template(user + reply, tokenize=False)
    except TypeError:
        user, reply = [_plain_text(t) for t in user], [_plain_text(t) for t in reply]
        full = processor.apply_chat_template(user + reply, tokenize=False)
    return full, processor.apply_chat_template(user, tokenize=False, add_generation_prompt=True)


def processed(processor: Any, user: list[dict], reply: list[dict], **kwargs: Any) -> tuple[Any, torch.Tensor]:
    """The real processor (``kwargs``: its media and options) on the whole conversation and on its
    prompt alone: the whole conversation's output and its loss mask, 1 after the prompt."""
    full_text, prompt_text = _render(processor, user, reply)
    full = processor(text=[full_text], **kwargs)
    prompt = processor(text=[prompt_text], **kwargs)
    num_prompt = prompt["input_ids"].shape[1]
    if not torch.equal(full["input_ids"][0, :num_prompt], prompt["input_ids"][0]):
        raise AssertionError("the prompt is not a prefix of the conversation; the loss mask would be wrong")
    loss_mask = torch.zeros(full["input_ids"].shape[1], dtype=torch.uint8)
    loss_mask[num_prompt:] = 1
    return full, loss_mask


def model_inputs(output: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """What the model takes of a processor output: its tensors but the attention mask (one unpadded row)."""
    return {k: v for k, v in output.items() if isinstance(v, torch.Tensor) and k != "attention_mask"}


def process(processor: object, conversation: Conversation) -> Sample:
    """Run the real processor on one conversation (images decoded as transformers loads them)."""
    images = [load_image(Image.open(io.BytesIO(data))) for data in conversation.image_bytes()]
    kwargs = {"images": images} if images else {}
    user, reply = turns(["image"] * len(images), conversation.question, conversation.answer)
    full, loss_mask = processed(processor, user, reply, return_tensors="pt", **kwargs)
    return Sample(conversation, model_inputs(full), loss_mask)


def media_item(
    kind: str,
    data: bytes,
    *,
    sample: int,
    grid_thw: tuple[int, int, int],
    member: str,
    frame_indices=(),
    num_tokens: int | None = None,
    num_tiles: int = 1,
) -> PackedMediaItem:
    """A media item as the cooker gives it (``num_tokens`` default: a Qwen-VL grid merged 2x2)."""
    t, h, w = grid_thw
    meta = PackedMedia(
        kind=kind,
        ref=f"/media/{member}",
        member=member,
        sample=sample,
        grid_thw=grid_thw,
        num_tokens=t * h * w // 4 if num_tokens is None else num_tokens,
        frame_indices=tuple(frame_indices),
        num_tiles=num_tiles,
    )
    return PackedMediaItem(meta=meta, data=data)


def stored_image(bundle: ProcessorBundle, data: bytes, *, sample: int, member: str) -> PackedMediaItem:
    """The item `prep tokenize` + `prep pack` store for an image: the family's counter on its header size."""
    counter = find_counter(bundle.processor_class)
    if counter is None:
        raise ValueError(f"no counter for {bundle.processor_class}")
    width, height = load_image(Image.open(io.BytesIO(data))).size
    return counted_item(data, counter(bundle).count_image(width, height), sample=sample, member=member)


def counted_item(data: bytes, count: MediaCount, *, sample: int, member: str) -> PackedMediaItem:
    """The item `prep tokenize` + `prep pack` store for an image or a video the counter planned."""
    return media_item(
        count.kind,
        data,
        sample=sample,
        grid_thw=(count.grid_t, count.grid_h, count.grid_w),
        member=member,
        frame_indices=count.frame_indices,
        num_tokens=count.num_tokens,
        num_tiles=count.num_tiles,
    )


def loaded_pack(
    *,
    key: str,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    lengths: list[int],
    sample_ids: list[str],
    media: list[PackedMediaItem],
    pad_to_multiple_of: int = 1,
) -> LoadedPack:
    """The `LoadedPack` the cooker gives for samples of these lengths, concatenated in order."""
    slots = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in lengths]
    samples = tuple(
        PackedSampleMeta(
            input=0,
            sample_id=sample_id,
            dataset="test",
            num_tokens=n,
            media=tuple(k for k, m in enumerate(media) if m.meta.sample == i),
        )
        for i, (sample_id, n) in enumerate(zip(sample_ids, lengths))
    )
    meta = PackMeta(
        key=key,
        num_tokens=int(sum(lengths)),
        cu_seqlens=tuple(int(x) for x in np.cumsum([0, *lengths])),
        cu_seqlens_padded=tuple(int(x) for x in np.cumsum([0, *slots])),
        samples=samples,
        media=tuple(m.meta for m in media),
    )
    return LoadedPack(
        meta=meta,
        input_ids=np.asarray(input_ids, dtype=np.int32),
        loss_mask=np.asarray(loss_mask, dtype=np.uint8),
        media=tuple(media),
    )


def pack_samples(
    samples: list[Sample],
    processor_dir: Path | str,
    *,
    pad_to_multiple_of: int = 1,
    key: str = "pack-00000000",
) -> LoadedPack:
    """The `LoadedPack` the cooker would give for these samples (what `prep pack` stores).

    Each image's stored grid / tiles / tokens come from the family's closed-form counter
    (`families/<name>/counter.py`), as `prep tokenize` computes them.
    """
    bundle = load_processor(str(processor_dir))
    media = []
    for index, sample in enumerate(samples):
        for data in sample.conversation.image_bytes():
            media.append(stored_image(bundle, data, sample=index, member=f"img{len(media):04d}.jpg"))
    return samples_pack(samples, media, key=key, pad_to_multiple_of=pad_to_multiple_of)


def samples_pack(
    samples: Sequence[Sample], media: list[PackedMediaItem], *, key: str, pad_to_multiple_of: int = 1
) -> LoadedPack:
    """`loaded_pack` of these samples in order (ids ``sample-<i>``), holding ``media``."""
    return loaded_pack(
        key=key,
        input_ids=np.concatenate([s.input_ids[0].numpy() for s in samples]),
        loss_mask=np.concatenate([s.loss_mask.numpy() for s in samples]),
        lengths=[s.input_ids.shape[1] for s in samples],
        sample_ids=[f"sample-{i}" for i in range(len(samples))],
        media=media,
        pad_to_multiple_of=pad_to_multiple_of,
    )


@dataclass(frozen=True)
class Truth:
    """Each sample alone: per-token losses [L-1] and the sum of the summed-loss gradients."""

    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]


def grads_of(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference(model: PreTrainedModel, samples: list[Sample]) -> Truth:
    """Run every sample alone through ``model`` with stock attention (see module docstring)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(REFERENCE_ATTENTION)
    losses, grads = [], {}
    try:
        for sample in samples:
            model.zero_grad(set_to_none=True)
            logits = model(**sample.inputs, attention_mask=torch.ones_like(sample.input_ids), use_cache=False).logits
            losses.append(per_token_losses(logits, sample.labels)[0].detach())
            token_loss_sum(logits, sample.labels)[0].backward()
            for name, grad in grads_of(model).items():
                grads[name] = grads[name] + grad if name in grads else grad
    finally:
        model.zero_grad(set_to_none=True)
        model.set_attn_implementation(previous)
    return Truth(losses, grads)


def scatter_truth(truth: Truth, cu_seqlens_padded: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The per-token loss row [T-1] a correct packed forward must give: each sample's own
    losses in its slot, 0 where the target is a pad or the next sample's (masked) first token."""
    row = torch.zeros(num_tokens - 1)
    for start, losses in zip(cu_seqlens_padded[:-1].tolist(), truth.losses):
        row[start : start + losses.numel()] = losses
    return row


def max_grad_diff(packed: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> float:
    if packed.keys() != truth.keys():
        raise AssertionError(f"parameters with gradients differ: {sorted(packed.keys() ^ truth.keys())}")
    return max(float((packed[n] - truth[n]).abs().max()) for n in truth)


def max_grad_error(packed: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> float:
    """Largest ``|packed - truth| / (1 + |truth|)`` over every gradient element.

    ``<= tol`` is ``torch.allclose(packed, truth, rtol=tol, atol=tol)``: summed-loss gradients
    reach ~100 on some tiny models (GLM-4.xV), where fp32 summation order alone moves an element
    by a few 1e-5 (relative ~5e-7) although the packed losses are bit-identical.
    """
    if packed.keys() != truth.keys():
        raise AssertionError(f"parameters with gradients differ: {sorted(packed.keys() ^ truth.keys())}")
    return max(float(((packed[n] - truth[n]).abs() / (1 + truth[n].abs())).max()) for n in truth)
