"""A small megatron-core ``GPTModel`` with the Transformer Engine layer spec, from a config.

THD (packed) attention in megatron-core goes through Transformer Engine's
``DotProductAttention`` only: the local spec asserts ``packed_seq_params is None`` and the
rotary embedding is built on the current CUDA device. So the model needs CUDA, megatron-core
and Transformer Engine; `require_megatron_gpu` says which is missing and how to install it,
before any data is read.

The architecture is a Llama-style decoder (RMSNorm, SwiGLU, no biases, RoPE, untied output
layer) sized by `GPTConfig`; ``vocab_size`` comes from the tokenizer the data was tokenized
with and is padded to a multiple of 128 as Megatron-LM does.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

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
    rotary_base: int = 10000

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


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
    )
    model = GPTModel(
        config=transformer,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=config.padded_vocab_size,
        max_sequence_length=config.max_sequence_length,
        position_embedding_type="rope",
        rotary_base=config.rotary_base,
        share_embeddings_and_output_weights=False,
    )
    return model.cuda(torch.cuda.current_device())
