"""How much GPU memory a `train hf` run needs, per GPU, from the model's config alone (``--plan``).

Nothing is loaded and no GPU is needed: `model_shape` builds the model on the meta device to
count its parameters exactly (per `train.trainable` group, per FSDP unit, LoRA adapters from
the real target layers); `plan_memory` is a pure function of that shape and the run's
`PlanInputs`. Notation: P all parameters (+ adapters), Pt those that train (P minus frozen
groups; with LoRA the adapters only), S the shard group (``none`` 1, ``full`` the world size,
``hybrid`` the GPUs of one node), c the compute bytes (bf16 2, fp32 4), U the largest FSDP unit
(a decoder layer or vision block), R the root's parameters (embeddings, head, norms, patch
embedding, projector: every parameter outside a unit), T the tokens of one micro-batch (pack
size x packs per micro-batch), L decoder layers, h / I / kv the text hidden, MLP (x top-k for
MoE) and key-value widths, V the vocabulary::

    parameters   4 P / S                 fp32 master weights, sharded
    compute      sharded: c (R + 2 U)    units all-gathered in compute dtype: the root for the
                                         whole step, the running unit and the prefetched next
                 none + bf16: 2 P        autocast's bf16 copy of every weight, kept for backward
    gradients    4 Pt / S                fp32, reduce-scattered (frozen parameters: none)
                 + sharded: (c + 4) Ut   the unit being reduced (compute and fp32 copies): Ut the
                                         largest unit's trainable part (its adapters with LoRA)
    optimizer    8 Pt / S                AdamW exp_avg + exp_avg_sq in fp32 (frozen: none)
    activations  no checkpointing:  L T a
                 checkpointing:     L T h c + T a     layer inputs, plus one layer recomputed
                 + T h c x 2 + 4 x 256 V 4            embeddings out / final norm, the chunked
                                                      loss head (`train.chunked_loss`)
    step         foreach AdamW: 4 Pt / S              the optimizer step's temporaries: CUDA's
                 single-tensor: 3 x 4 Wt / S          default foreach AdamW makes one fp32
                                                      ``sqrt(exp_avg_sq)`` per trainable
                                                      tensor, all at once; the per-tensor
                                                      loop (CPU, or CPU offload) two for the
                                                      tensor it updates plus the previous
                                                      one's ``denom``: Wt the largest tensor

The total is the larger of the two peaks of a step (from the second step on, when the AdamW
state exists): forward + backward (parameters + compute + gradients + optimizer +
activations) and the optimizer step (parameters + gradients + optimizer + step, after the
activations and gathered copies are freed). A 3.75B model on one H200 peaked at 70.4 GiB in
the optimizer step (nvidia-smi, CUDA context included) where the step's term gives 69.9 GiB.

with ``a`` the bytes one token leaves per decoder layer for backward, as autograd's saved tensors
of a transformers Qwen2 decoder layer measure (`tests/train/test_plan.py`, within 1 %): two
RMSNorms keep their input and output, attention its q, k, v, output and o_proj's input, the
gated MLP gate, up, SiLU and product (4 I); no T^2 term (varlen / flash attention)::

    a = 4 (8 h + 2 kv + 4 I)                    fp32
    a = 2 (10 h + 2 kv + 4 I)                   bf16 (RMSNorm keeps an fp32 copy of its input)

(4 I becomes 2 I for an ungated fc1 / act / fc2 MLP, as in Qwen2-VL's vision blocks; a fused
``qkv`` projection, as in Qwen-VL vision blocks, keeps its output too: + 3 h. Both measured the
same way, within 1 %.)

``--cpu-offload`` moves parameters, gradients and optimizer state to host memory (reported
as ``host``); the GPU keeps the compute copies and activations. Vision-tower activations depend
on the images of a pack and are not in the total: the plan prints their cost per 1,000 patches
(``vision_patches`` adds them). A run FITS when the total is at most ``gpu_memory`` minus
`RESERVE_FRACTION` (CUDA context, NCCL buffers, allocator fragmentation).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from packvlm.errors import UsageError
from train.trainable import GROUPS, Group

Sharding = Literal["none", "full", "hybrid"]
SHARDINGS: tuple[Sharding, ...] = ("none", "full", "hybrid")
Precision = Literal["bf16", "fp32"]
GiB = 1 << 30
RESERVE_FRACTION = 0.10
LOSS_CHUNK = 256  # train.chunked_loss.DEFAULT_CHUNK_SIZE: label positions per chunk
LOSS_COPIES = 4  # fp32 [chunk, V] logits live at once in the chunked loss (about 3.5)
_UNIT = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")
_GATES = frozenset({"gate_proj", "gate_up_proj"})
_SIZE = re.compile(r"^\s*([0-9.]+)\s*(GB|GIB|G|MB|MIB|M|TB|TIB|T)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerShape:
    """Widths of one transformer layer, what its activations scale with."""

    hidden: int
    intermediate: int  # MLP width actually computed per token (x top-k experts for MoE)
    kv: int  # key/value width (num_kv_heads x head_dim)
    gated: bool = True  # gate/up/down MLP (keeps 4 I); False: fc1/act/fc2 (keeps 2 I), e.g. Qwen2-VL's vision
    fused_qkv: bool = False  # one qkv projection whose output is kept too (+3 h): Qwen-VL vision blocks


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the plan needs of a model, counted on the meta device (`model_shape`)."""

    name: str
    group_params: dict[Group, int]
    lora_params: int  # adapter parameters at the planned rank (0: no LoRA)
    unit_params: int  # largest FSDP unit (decoder layer / vision block)
    group_unit_params: dict[Group, int]  # largest unit of each group (0: the group has none)
    unit_lora_params: int = 0  # adapter parameters of the unit with the most
    group_largest_tensor: dict[Group, int] = field(default_factory=dict)  # elements of each group's largest tensor
    lora_largest_tensor: int = 0  # elements of the largest adapter matrix
    root_params: int  # parameters outside every unit
    num_layers: int
    text: LayerShape
    vocab_size: int
    vision_blocks: int = 0
    vision: LayerShape | None = None

    @property
    def num_params(self) -> int:
        return sum(self.group_params.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    """The run being planned."""

    world_size: int = 1
    gpus_per_node: int = 8
    sharding: Sharding = "full"
    precision: Precision = "bf16"
    freeze: tuple[Group, ...] = ()
    lora_rank: int = 0
    tokens_per_microbatch: int = 8192
    activation_checkpointing: bool = True
    cpu_offload: bool = False
    foreach_optimizer: bool = True  # AdamW's default on CUDA; False on CPU (its per-tensor loop)
    gpu_memory_bytes: int | None = None
    vision_patches: int = 0  # image patches per micro-batch through the vision tower (0: not counted)

    @property
    def shard_size(self) -> int:
        if self.sharding == "none":
            return 1
        if self.sharding == "hybrid":
            return min(self.gpus_per_node, self.world_size)
        return self.world_size


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPlan:
    """Bytes per GPU (``host``: per rank in host memory, with CPU offload)."""

    shape: ModelShape
    inputs: PlanInputs
    trainable_params: int
    parameters: int
    compute: int
    gradients: int
    optimizer: int
    activations: int
    vision_per_1k_patches: int
    optimizer_step: int = 0  # AdamW's temporaries during optimizer.step() (on the GPU; offload: in host)
    transient_gradients: int = 0  # the unit being reduced, in ``gradients``; gone by the optimizer step
    host: int = 0
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The larger of the step's two peaks (module docstring)."""
        return max(self.training_peak, self.step_peak)

    @property
    def training_peak(self) -> int:
        """Forward + backward: every resident byte plus activations and gathered copies."""
        return self.parameters + self.compute + self.gradients + self.optimizer + self.activations

    @property
    def step_peak(self) -> int:
        """The optimizer step: state plus AdamW's temporaries (activations and gathered units freed)."""
        return self.parameters + self.gradients - self.transient_gradients + self.optimizer + self.optimizer_step

    @property
    def fits(self) -> bool | None:
        if self.inputs.gpu_memory_bytes is None:
            return None
        return self.total <= self.inputs.gpu_memory_bytes * (1 - RESERVE_FRACTION)


def parse_memory(text: str) -> int:
    """``80GB`` / ``80GiB`` / ``141G`` / ``512MB`` -> bytes; GB means GiB, as GPU memory is quoted."""
    match = _SIZE.match(text)
    if match is None:
        raise UsageError(f"--gpu-memory {text!r}: give a size such as 80GB or 141GiB")
    unit = (match.group(2) or "GB").upper().rstrip("B").rstrip("I")
    return int(float(match.group(1)) * {"M": 1 << 20, "G": GiB, "T": 1 << 40}[unit])


def activation_bytes_per_token(layer: LayerShape, precision: Precision) -> int:
    """``a``: bytes one token keeps for backward in one layer (module docstring)."""
    h, kv, mlp = layer.hidden, layer.kv, (4 if layer.gated else 2) * layer.intermediate
    qkv = 3 * h if layer.fused_qkv else 0
    if precision == "fp32":
        return 4 * (8 * h + 2 * kv + mlp + qkv)
    return 2 * (10 * h + 2 * kv + mlp + qkv)


def plan_memory(shape: ModelShape, inputs: PlanInputs) -> MemoryPlan:
    """Per-GPU memory of the run ``inputs`` describes (formulas in the module docstring)."""
    c = 2 if inputs.precision == "bf16" else 4
    s = inputs.shard_size
    sharded = inputs.sharding != "none"
    frozen = sum(shape.group_params[g] for g in set(inputs.freeze))
    all_params = shape.num_params + shape.lora_params
    trainable = shape.lora_params if inputs.lora_rank else shape.num_params - frozen
    parameters, gradients, optimizer = 4 * all_params // s, 4 * trainable // s, 8 * trainable // s
    if sharded:
        compute = c * (shape.root_params + 2 * shape.unit_params)
        if inputs.lora_rank:
            unit_trainable = shape.unit_lora_params
        else:
            unit_trainable = max((n for g, n in shape.group_unit_params.items() if g not in inputs.freeze), default=0)
        transient_grads = (c + 4) * unit_trainable
    else:
        compute = 2 * all_params if inputs.precision == "bf16" else 0
        transient_grads = 0
    t = inputs.tokens_per_microbatch
    per_layer = activation_bytes_per_token(shape.text, inputs.precision)
    if inputs.activation_checkpointing:
        activations = shape.num_layers * t * shape.text.hidden * c + t * per_layer
    else:
        activations = shape.num_layers * t * per_layer
    activations += 2 * t * shape.text.hidden * c + LOSS_COPIES * LOSS_CHUNK * shape.vocab_size * 4
    vision_1k = 0
    if shape.vision is not None:
        per_patch = activation_bytes_per_token(shape.vision, inputs.precision)
        kept = shape.vision.hidden * c * shape.vision_blocks + per_patch
        vision_1k = 1000 * (kept if inputs.activation_checkpointing else shape.vision_blocks * per_patch)
        activations += vision_1k * inputs.vision_patches // 1000
    if inputs.lora_rank:
        largest = shape.lora_largest_tensor
    else:
        largest = max((n for g, n in shape.group_largest_tensor.items() if g not in inputs.freeze), default=0)
    foreach = inputs.foreach_optimizer and not inputs.cpu_offload  # offload: the step runs on the host
    step = 4 * trainable // s if foreach else 3 * 4 * -(-largest // s)
    host = 0
    if inputs.cpu_offload:
        host = parameters + gradients + optimizer + step
        parameters = gradients = optimizer = step = 0
    return MemoryPlan(
        shape=shape,
        inputs=inputs,
        trainable_params=trainable,
        parameters=parameters,
        compute=compute,
        gradients=gradients + transient_grads,
        optimizer=optimizer,
        activations=activations,
        vision_per_1k_patches=vision_1k,
        optimizer_step=step,
        transient_gradients=transient_grads,
        host=host,
    )


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f} GiB"


def render(plan: MemoryPlan) -> str:
    """The ``--plan`` report: one line per kind of memory, then FITS / DOES NOT FIT."""
    shape, inputs = plan.shape, plan.inputs
    groups = ", ".join(f"{g} {shape.group_params[g] / 1e9:.2f}B" for g in GROUPS if shape.group_params[g])
    what = f"LoRA rank {inputs.lora_rank}" if inputs.lora_rank else "full fine-tuning"
    if inputs.freeze:
        what += f", frozen: {', '.join(inputs.freeze)}"
    c = "bf16 compute, fp32 master weights" if inputs.precision == "bf16" else "fp32"
    lines = [
        f"model      {shape.name}: {shape.num_params / 1e9:.2f}B parameters ({groups})",
        f"training   {what}: {plan.trainable_params / 1e9:.3f}B parameters train",
        f"run        {inputs.world_size} GPU(s), sharding {inputs.sharding} (shard group {inputs.shard_size}), {c}, "
        f"activation checkpointing {'on' if inputs.activation_checkpointing else 'off'}, "
        f"cpu offload {'on' if inputs.cpu_offload else 'off'}, {inputs.tokens_per_microbatch:,} tokens per micro-batch",
        "per GPU",
        f"  parameters   {_gib(plan.parameters)}",
        f"  compute      {_gib(plan.compute)}   (gathered / autocast copies)",
        f"  gradients    {_gib(plan.gradients)}",
        f"  optimizer    {_gib(plan.optimizer)}   (AdamW m + v, fp32)",
        f"  activations  {_gib(plan.activations)}",
        f"  step         {_gib(plan.optimizer_step)}   (AdamW's temporaries in optimizer.step())",
        f"  total        {_gib(plan.total)}   (the larger peak: forward + backward {plan.training_peak / GiB:.2f}, "
        f"optimizer step {plan.step_peak / GiB:.2f})",
    ]
    if plan.host:
        lines.append(f"  host (offloaded parameters, gradients, optimizer, step) {_gib(plan.host)} per rank")
    if plan.vision_per_1k_patches:
        extra = f"{plan.vision_per_1k_patches / GiB:.3f} GiB per 1,000 image patches in a micro-batch"
        lines.append(f"  vision tower activations: +{extra} ({'counted' if inputs.vision_patches else 'not counted'})")
    if plan.fits is not None and inputs.gpu_memory_bytes is not None:
        usable = inputs.gpu_memory_bytes * (1 - RESERVE_FRACTION)
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        lines.append(f"{verdict} in {inputs.gpu_memory_bytes / GiB:.0f} GiB ({usable / GiB:.1f} GiB usable)")
    return "\n".join(lines)


def _text_layer(config: Any) -> LayerShape:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = getattr(config, "intermediate_size", None)
    if getattr(config, "num_experts_per_tok", None) and getattr(config, "moe_intermediate_size", None):
        inter = config.moe_intermediate_size * config.num_experts_per_tok + int(
            getattr(config, "shared_expert_intermediate_size", 0) or 0
        )
    return LayerShape(hidden=hidden, intermediate=int(inter or 4 * hidden), kv=kv)


def _vision_layer(config: Any, leaves: frozenset[str]) -> tuple[int, LayerShape] | None:
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    hidden = getattr(vision, "embed_dim", None) or getattr(vision, "hidden_size", None)  # Qwen2-VL: embed_dim
    blocks = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", None)
    if not hidden or not blocks:
        return None
    inter = getattr(vision, "intermediate_size", None) or int(getattr(vision, "mlp_ratio", 4) * hidden)
    gated, fused = bool(leaves & _GATES), "qkv" in leaves
    return int(blocks), LayerShape(
        hidden=int(hidden), intermediate=int(inter), kv=int(hidden), gated=gated, fused_qkv=fused
    )


def _unit_of(module_name: str) -> str | None:
    match = _UNIT.match(f"{module_name}.")
    return match.group(1) if match else None


def model_shape(config: Any, *, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> ModelShape:
    """Count ``config``'s model on the meta device (no weights, no memory): groups, units, adapters."""
    import torch

    from train.lora import target_modules
    from train.models import auto_class
    from train.trainable import group_sizes, is_multimodal, parameter_group

    with torch.device("meta"):
        model = auto_class(config).from_config(config)
    units: Counter[str] = Counter()
    unit_groups: dict[str, Group] = {}
    root = 0
    for name, param in model.named_parameters():
        match = _UNIT.match(name)
        if match:
            units[match.group(1)] += param.numel()
            unit_groups[match.group(1)] = parameter_group(name, multimodal=is_multimodal(model))
        else:
            root += param.numel()
    group_units = {g: max((n for u, n in units.items() if unit_groups[u] == g), default=0) for g in GROUPS}
    largest: dict[Group, int] = dict.fromkeys(GROUPS, 0)
    for name, param in model.named_parameters():
        group = parameter_group(name, multimodal=is_multimodal(model))
        largest[group] = max(largest[group], param.numel())
    lora = 0
    lora_largest = 0
    unit_lora: Counter[str] = Counter()
    if lora_rank:
        modules = dict(model.named_modules())
        for target in target_modules(model, lora_targets):
            layer = modules[target]
            adapters = lora_rank * (layer.in_features + layer.out_features)
            lora += adapters
            lora_largest = max(lora_largest, lora_rank * max(layer.in_features, layer.out_features))
            match = _UNIT.match(f"{target}.")
            unit_lora[match.group(1) if match else target] += adapters
    text = config.get_text_config()
    vision_leaves = frozenset(
        name.rsplit(".", 1)[-1]
        for name, _ in model.named_modules()
        if unit_groups.get(_unit_of(name) or "") == "vision"
    )
    vision = _vision_layer(config, vision_leaves)
    return ModelShape(
        name=type(model).__name__,
        group_params=group_sizes(model),
        lora_params=lora,
        unit_params=max(units.values(), default=0),
        group_unit_params=group_units,
        unit_lora_params=max(unit_lora.values(), default=0),
        group_largest_tensor=largest,
        lora_largest_tensor=lora_largest,
        root_params=root,
        num_layers=int(text.num_hidden_layers),
        text=_text_layer(text),
        vocab_size=int(text.vocab_size),
        vision_blocks=vision[0] if vision else 0,
        vision=vision[1] if vision else None,
    )
