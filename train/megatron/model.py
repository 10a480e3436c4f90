"""A small megatron-core ``GPTModel`` with the Transformer Engine layer spec, from a config.

THD (packed) attention in megatron-core goes through Transformer Engine's
``DotProductAttention`` only: the local spec asserts ``packed_seq_params is None`` and the
rotary embedding is built on the current CUDA device. So the model needs CUDA, megatron-core
and Transformer Engine; `require_megatron_gpu` says which is missing and how to install it,
before any data is read.

The architecture is a Llama-style decoder (RMSNorm, SwiGLU, no biases, RoPE, untied output
layer) sized by `GPTConfig`; ``vocab_size`` comes from the tokenizer the data was tokenized
with and is padded to a multiple of 128 as Megatron-LM does. With images (`vlm_gpt_config`) the
width comes from the HF model's text config: the family's projector writes vectors of its hidden
size, and mRoPE (``position_embedding_type="mrope"``, Qwen2/2.5-VL) splits its head dimension
into the config's ``mrope_section`` (t, h, w), so ``2 * sum(mrope_section)`` must be the head size.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from train.megatron.params import MEGATRON_INSTALL_HINT, MegatronNotInstalledError

VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of the language model `train megatron` builds (random init from ``seed``)."""

    vocab_size: int  # the tokenizer's, before padding
    max_sequence_length: int  # longest row the model will see
    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    rotary_base: float = 10000
    num_query_groups: int | None = None  # grouped-query attention (None: as many as heads)
    kv_channels: int | None = None  # head size (None: hidden_size / num_attention_heads)
    mrope_section: tuple[int, ...] | None = None  # t/h/w rotary sections: position_embedding_type "mrope"
    context_parallel_size: int = 1

    @property
    def position_embedding_type(self) -> str:
        return "rope" if self.mrope_section is None else "mrope"

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def vlm_gpt_config(
    hf_config: Any,
    *,
    vocab_size: int,
    max_sequence_length: int,
    num_layers: int,
    mrope: bool,
    context_parallel_size: int = 1,
) -> GPTConfig:
    """The language model paired with the family's HF vision tower: the HF text config's width, ``num_layers`` deep.

    Args:
        hf_config: The HF VLM config (``config.json`` of ``--model-config``).
        vocab_size: The tokenizer's vocabulary (padded by `GPTConfig`).
        max_sequence_length: Longest row.
        num_layers: Depth (``--num-layers``).
        mrope: The family rotates with t/h/w sections (Qwen2/2.5-VL).
        context_parallel_size: Context-parallel size.

    Raises:
        ValueError: mRoPE sections that do not cover the head size.
    """
    text = hf_config.get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    base = float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
    section = None
    if mrope:
        section = tuple(int(x) for x in rope["mrope_section"])
        if 2 * sum(section) != head_dim:
            raise ValueError(f"mrope_section {list(section)} covers {2 * sum(section)} of {head_dim} head channels")
    return GPTConfig(
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        num_layers=num_layers,
        hidden_size=int(text.hidden_size),
        num_attention_heads=heads,
        rotary_base=base,
        num_query_groups=int(getattr(text, "num_key_value_heads", None) or heads),
        kv_channels=head_dim,
        mrope_section=section,
        context_parallel_size=context_parallel_size,
    )


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported; a missing parent package counts as missing, not an error."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def require_megatron_gpu() -> None:
    """Raise unless CUDA, megatron-core and Transformer Engine are all usable here.

    Raises:
        MegatronNotInstalledError: naming what is missing and the install command.
    """
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"a CUDA GPU (torch {torch.__version__} sees none)")
    if not is_installed("megatron.core"):
        missing.append("megatron-core")
    if not is_installed("transformer_engine"):
        missing.append("Transformer Engine (transformer_engine)")
    if missing:
        raise MegatronNotInstalledError(
            f"`train megatron` runs THD attention through Transformer Engine on CUDA; missing: "
            f"{', '.join(missing)}. Install: {MEGATRON_INSTALL_HINT}. On a machine without a GPU use `train hf`."
        )


def build_gpt_model(config: GPTConfig) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` (TE spec) on the current CUDA device, fp32 parameters.

    Megatron's parallel state must be initialised first (`train.recipes.megatron` does it) and
    ``model_parallel_cuda_manual_seed`` called, which seeds the initialisation.
    """
    require_megatron_gpu()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    transformer = TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        calculate_per_token_loss=True,  # loss_func returns sums; the loop divides by global tokens
        params_dtype=torch.float32,
        num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels,
        mrope_section=list(config.mrope_section) if config.mrope_section else None,
        context_parallel_size=config.context_parallel_size,
        apply_rope_fusion=False,  # TE's fused THD rope reads 1-D frequencies from 0 per sample; mRoPE's are per token
    )
    model = GPTModel(
        config=transformer,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=config.padded_vocab_size,
        max_sequence_length=config.max_sequence_length,
        position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base,
        share_embeddings_and_output_weights=False,
    )
    if config.mrope_section is not None:
        # megatron-core's mRoPE embedding would cut its per-token frequencies per CP rank as one
        # sequence; left whole, the THD rope (`_apply_rotary_pos_emb_thd`, frequencies of the whole
        # row) picks each sample's chunks of this rank, which is the layout of train.context_parallel
        model.rotary_pos_emb.cp_group = None
    return model.cuda(torch.cuda.current_device())
