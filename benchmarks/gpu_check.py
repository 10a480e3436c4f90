"""GPU correctness check of the packed varlen path: a packed row equals each sample alone, on CUDA.

    python benchmarks/gpu_check.py prepare --out .gpucheck   # CPU, where Energon is installed
    python benchmarks/gpu_check.py run --data .gpucheck      # on the GPU machine

``prepare`` builds, per family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; tiny random configs of
`families.example.model`), the conversations of `tests.train.models` plus one larger image
through the *real* processor alone (the truth), packs them as `prep pack` stores them and
encodes the pack with `train.encoder.PackEncoder` (slots unpadded and padded to 8). It saves
the `PackedBatch` fields and the per-sample processor outputs, so the GPU machine needs
neither Energon nor PyAV.

``run`` first checks torch's ``varlen_attn`` (present? the keywords `train.attention` passes?
against per-sample SDPA on random bf16 GQA inputs), then per family and mode (fp32 weights,
bf16 weights, fp32 weights under bf16 autocast - what `train hf` runs on a GPU):
``packed_forward`` with ``select_attention("cuda")`` versus each sample alone through the
same weights with stock "sdpa", the model computing its own rope index. Printed: max |diff|
of per-token losses (fp32 should be <= 1e-5), each path against the fp32 truth (for the
half-precision modes the alone run's own distance is the noise floor), the max |diff| of
fp32 gradients relative to their largest value (packed summed loss versus the sum of
per-sample summed losses), and how many varlen kernel calls the packed pass made.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import platform
import sys
from dataclasses import fields
from pathlib import Path

import torch

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PADS = (1, 8)
FP32_TOLERANCE = 1e-5
DEVICE = "cuda"  # `run --device cpu` is a dry run of the comparison (no kernel check)


def prepare(out: Path) -> None:
    """CPU side: truth inputs and encoded packs for every family, saved under ``out``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.train.models
    from families.processor import load_processor
    from tests.train.models import CONVERSATIONS, Conversation, make_family, pack_samples, process
    from train.batch import PackedBatch
    from train.encoder import PackEncoder

    larger = Conversation(((448, 336),), "Describe this photo in detail.", "A smooth gradient. " * 40)
    for name in FAMILIES:
        family = make_family(name, out / name)
        processor = load_processor(str(family.processor_dir)).processor
        samples = [process(processor, c) for c in (*CONVERSATIONS, larger)]
        encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
        packs = {}
        for pad in PADS:
            batch = encoder.encode(pack_samples(samples, family.processor_dir, pad_to_multiple_of=pad))
            packs[pad] = {f.name: getattr(batch, f.name) for f in fields(PackedBatch)}
            packs[pad]["vision"] = batch.vision_inputs()  # float32 pixels (bit-equal to the processor's)
        # The pack's pixels must be the processor's own, sample after sample; stored once.
        alone = [s.inputs["pixel_values"] for s in samples if "pixel_values" in s.inputs]
        if not all(torch.equal(p["vision"]["pixel_values"], torch.cat(alone)) for p in packs.values()):
            raise AssertionError(f"{name}: encoded pixel_values differ from the processor's per-sample outputs")
        for p in packs.values():
            p["vision"] = {k: v for k, v in p["vision"].items() if k != "pixel_values"}
        truth = [{"inputs": {k: v.clone() for k, v in s.inputs.items() if k != "pixel_values"}, "labels": s.labels}
                 for s in samples]  # fmt: skip
        torch.save({"packs": packs, "samples": truth, "pixel_values": torch.cat(alone).clone()}, out / f"{name}.pt")
        lengths = [int(s.input_ids.shape[1]) for s in samples]
        print(f"{name}: samples {lengths}, row {packs[1]['input_ids'].shape[1]} / {packs[8]['input_ids'].shape[1]}")


class KernelCounter:
    """Wraps torch.nn.attention.varlen.varlen_attn (looked up at call time by train.attention)."""

    def __init__(self) -> None:
        self.calls = 0
        try:
            import torch.nn.attention.varlen as varlen
        except ImportError:  # torch before 2.13: nothing to count
            return
        self.module, self.original = varlen, varlen.varlen_attn

        @functools.wraps(self.original)  # keeps the signature train.attention inspects
        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        varlen.varlen_attn = counted


class FlexCounter:
    """Counts flex_attention calls of `train.attention` (the document-mask path where torch has no varlen kernel)."""

    def __init__(self) -> None:
        import train.attention as attention

        self.calls = 0
        original = attention.flex_attention_forward

        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        attention.flex_attention_forward = counted


def per_sample_sdpa(q, k, v, cu: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal SDPA per slice of [T, H, D] tensors, computed in ``dtype``, returned in fp32."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1).to(dtype) for t in (q, k, v))
        attended = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        out.append(attended.float())
    return torch.cat([o.transpose(0, 1) for o in out])


def kernel_check(counter: KernelCounter) -> bool:
    """The registered "packvlm_varlen" function on random bf16 GQA rows vs per-sample SDPA."""
    from train.attention import packed_attention_forward

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        print(f"varlen_attn: MISSING in torch {torch.__version__} ({exc})")
        return False
    print(f"varlen_attn signature (torch {torch.__version__}): {inspect.signature(varlen_attn)}")
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 7, 300, 1000, 2048, 37, 803]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 16, 128, generator=gen).to(DEVICE).bfloat16()
    k, v = (torch.randn(cu[-1], 2, 128, generator=gen).to(DEVICE).bfloat16() for _ in range(2))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    module = torch.nn.Module().eval()
    module.is_causal = True
    counter.calls = 0
    try:
        out, _ = packed_attention_forward(
            module, *(t.transpose(0, 1)[None] for t in (q, k, v)), None, scaling=128**-0.5,
            cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=max(lengths), max_length_k=max(lengths),
        )  # fmt: skip
    except TypeError as exc:
        print(f"packvlm_varlen's kernel call fails on this torch: {exc}")
        return False
    truth = per_sample_sdpa(q, k, v, cu)
    bf16 = per_sample_sdpa(q, k, v, cu, torch.bfloat16)
    print(
        f"packvlm_varlen (bf16, lengths {lengths}, 16 q / 2 kv heads, d 128; varlen kernel calls: {counter.calls})"
        f" vs per-sample fp32 SDPA: max |diff| {float((out[0].float() - truth).abs().max()):.2e}"
        f" (per-sample bf16 SDPA vs the same truth: {float((bf16 - truth).abs().max()):.2e})"
    )
    return counter.calls == 1


def load_case(data: Path, name: str) -> dict:
    """The saved case with pixel_values put back: whole in each pack, split by sample for the truth."""
    case = torch.load(data / f"{name}.pt", weights_only=False)
    pixels, start = case.pop("pixel_values"), 0
    for pack in case["packs"].values():
        pack["vision"]["pixel_values"] = pixels
    for sample in case["samples"]:
        grids = sample["inputs"].get("image_grid_thw")
        if grids is not None:
            count = int(grids.prod(-1).sum())
            sample["inputs"]["pixel_values"] = pixels[start : start + count]
            start += count
    return case


def alone_losses(
    model, samples: list[dict], dtype: torch.dtype, grads: bool, autocast: bool = False
) -> tuple[list[torch.Tensor], dict]:
    """Each sample alone through stock "sdpa": per-token losses, and summed-loss gradients."""
    from train.loss import per_token_losses, token_loss_sum

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    losses, total = [], {}
    try:
        for sample in samples:
            inputs = {k: v.to(DEVICE) for k, v in sample["inputs"].items()}
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
            model.zero_grad(set_to_none=True)
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                logits = model(**inputs, attention_mask=None, use_cache=False).logits
            labels = sample["labels"].to(DEVICE)
            losses.append(per_token_losses(logits, labels)[0].detach().float())
            if grads:
                token_loss_sum(logits, labels)[0].backward()
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        total[n] = total[n] + p.grad.float() if n in total else p.grad.float().clone()
    finally:
        model.zero_grad(set_to_none=True)
        model.set_attn_implementation(previous)
    return losses, total


def packed_losses(
    model, fields_: dict, dtype: torch.dtype, grads: bool, autocast: bool = False
) -> tuple[torch.Tensor, dict, object]:
    from train.batch import PackedBatch
    from train.forward import packed_forward
    from train.loss import per_token_losses, token_loss_sum

    batch = PackedBatch(**fields_).to(DEVICE)
    if batch.pixel_values is not None:
        vision = {**batch.vision, "pixel_values": batch.pixel_values.to(dtype)}
        batch = PackedBatch(**{**{f.name: getattr(batch, f.name) for f in fields(PackedBatch)}, "vision": vision})
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        logits = packed_forward(model, batch)
    losses = per_token_losses(logits, batch.labels)[0].detach().float()
    total = {}
    if grads:
        token_loss_sum(logits, batch.labels)[0].backward()
        total = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return losses, total, batch


def scatter(losses: list[torch.Tensor], batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Alone losses laid out on the packed row [T-1], and the mask of positions with a target."""
    row = torch.zeros(batch.num_tokens - 1, device=DEVICE)
    for start, values in zip(batch.cu_seqlens_padded[:-1].tolist(), losses):
        row[start : start + values.numel()] = values
    return row, batch.labels[0, 1:] != -100


def grad_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over all parameters, relative to the largest |b| (summed losses: grads grow with tokens)."""
    if a.keys() != b.keys():
        return float("nan")
    scale = max(float(b[n].abs().max()) for n in b)
    return max(float((a[n] - b[n]).abs().max()) for n in a) / scale


def run(data: Path) -> int:
    import transformers

    from train.attention import select_attention
    from train.models import load_model

    gpu = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "CPU dry run"
    print(
        f"machine: {platform.platform()} | {gpu} | python {platform.python_version()} | torch {torch.__version__}"
        f" (CUDA {torch.version.cuda}) | transformers {transformers.__version__}"
    )
    from train.attention import needs_document_mask

    counter = KernelCounter()
    kernel_ok = kernel_check(counter) if DEVICE == "cuda" else True
    attn = select_attention(DEVICE)
    flex = FlexCounter()
    document_mask = DEVICE == "cuda" and needs_document_mask(DEVICE, attn)
    if document_mask:  # torch before 2.13: packed rows take flex_attention with a document mask instead
        kernel_ok = True
    print(
        f"select_attention('cuda') -> {attn}" + (" + flex_attention document mask (no varlen kernel)" * document_mask)
    )
    failures = 0
    print(f"\n  {'family':<11}{'mode':<10}{'pad':>4}{'kernel calls':>13}{'max |dloss|':>13}{'vs fp32 truth':>15}"
          f"{'alone vs fp32':>15}{'rel |dgrad|':>13}")  # fmt: skip
    for name in FAMILIES:
        case = load_case(data, name)
        model32 = load_model(data / name / "model", seed=0, attn_implementation=attn, device=DEVICE).train()
        model16 = copy.deepcopy(model32).to(torch.bfloat16)
        truth32, grads32 = alone_losses(model32, case["samples"], torch.float32, grads=True)
        # mode -> (model, pixel dtype, autocast, the alone losses of the same mode)
        modes = {
            "fp32": (model32, torch.float32, False, truth32),
            "bf16": (model16, torch.bfloat16, False, alone_losses(model16, case["samples"], torch.bfloat16, False)[0]),
            "autocast": (model32, torch.float32, True, alone_losses(model32, case["samples"], torch.float32, False,
                                                                    autocast=True)[0]),
        }  # fmt: skip
        for pad in PADS:
            for mode, (model, dtype, autocast, same) in modes.items():
                counter.calls = flex.calls = 0
                is32 = mode == "fp32"
                try:
                    packed, grads, batch = packed_losses(
                        model, case["packs"][pad], dtype, grads=is32, autocast=autocast
                    )
                except Exception as exc:  # report and go on with the other cases
                    print(f"  {name:<11}{mode:<10}{pad:>4}  FAILED: {type(exc).__name__}: {exc}")
                    failures += 1
                    continue
                truth_row, mask = scatter(truth32, batch)
                same_row, _ = scatter(same, batch)
                d_same = float((packed - same_row)[mask].abs().max())
                d_truth = float((packed - truth_row)[mask].abs().max())
                d_alone = float((same_row - truth_row)[mask].abs().max())
                d_grad = grad_diff(grads, grads32) if is32 else float("nan")
                if is32 and max(d_same, d_grad) > FP32_TOLERANCE:
                    failures += 1
                calls = counter.calls + flex.calls
                if not is32 and DEVICE == "cuda" and calls == 0:
                    failures += 1  # a half-precision packed row must run a kernel (varlen, or flex without one)
                print(
                    f"  {name:<11}{mode:<10}{pad:>4}{calls:>13}{d_same:>13.2e}{d_truth:>15.2e}"
                    f"{d_alone:>15.2e}{d_grad:>13.2e}"
                )
    print(
        "\nmax |dloss|: packed vs each sample alone in the same mode (stock sdpa); vs fp32 truth: the packed row"
        " against fp32 alone; alone vs fp32: the alone run of the mode against fp32 alone (its bf16 noise floor);"
        " modes: fp32 weights, bf16 weights, fp32 weights under bf16 autocast (what `train hf` runs on GPU);"
        " rel |dgrad|: fp32 packed summed-loss gradients vs the sum of per-sample ones, max |diff| / max |grad|."
    )
    print(f"result: {'PASS' if failures == 0 and kernel_ok else 'FAIL'} ({failures} failing cases, fp32 bound "
          f"{FP32_TOLERANCE:g}; varlen kernel usable: {kernel_ok})")  # fmt: skip
    return 1 if failures or not kernel_ok else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="CPU: build the packs and truths").add_argument("--out", type=Path, required=True)
    run_parser = sub.add_parser("run", help="GPU: compare")
    run_parser.add_argument("--data", type=Path, required=True)
    run_parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: dry run, no kernel")
    args = parser.parse_args()
    if args.command == "prepare":
        args.out.mkdir(parents=True, exist_ok=True)
        prepare(args.out)
        sys.exit(0)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("No CUDA device: this check runs the CUDA varlen path and needs one. Nothing run.")
        sys.exit(0)
    global DEVICE
    DEVICE = args.device
    sys.exit(run(args.data))


if __name__ == "__main__":
    main()
