#!/usr/bin/env bash
# packvlm on one GPU, in under 8 minutes: every `gpu`-marked test, then a real-size training shape.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu_suite.sh          # from the repository root
#
# Needs a CUDA torch (2.11 or newer), transformers, triton; peft, megatron-energon and the prep
# stack are used where importable. No flash-attn, no Transformer Engine, no network. Each part
# runs under its own `timeout` and inside a global budget (SUITE_BUDGET_S, default 470 s); a
# failing part is recorded and the suite goes on. Results in $OUT:
#
#   env.txt, env.json          machine, versions, which optional packages import
#   pytest-gpu.txt, .xml       every test marked gpu (pytest -m gpu)
#   gpu_check.txt              Qwen2/2.5/3-VL packed rows == each sample alone on CUDA (benchmarks/gpu_check.py),
#                              from $GPU_CHECK_DATA (default .gpucheck) when present
#   bench_train_real.{json,md} Qwen2.5-VL-3B config, random init, 8192-token packs: packed vs padded,
#                              tokens/s, MFU, peak memory (benchmarks/bench_train_real.py)
#   train_hf.{json,txt}        `train hf` itself at that size on `prep example` data (when the prep
#                              stack imports), with --sharding full --activation-checkpointing when
#                              `train hf --help` lists them, and peak GPU memory from nvidia-smi; with
#                              --no-final-checkpoint (steps, eval and memory are what it reports)
#   plan.txt                   `train hf --plan` for the same shape, when the command has it
#   summary.md, summary.json   one table of all of it, and each part's exit status
#
# ONLY_PARTS="env train_hf_data train_hf plan" runs only the named parts (a rerun within the device budget).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-suite-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline
PY=${PYTHON:-python}
BUDGET=${SUITE_BUDGET_S:-470}
CONFIG=benchmarks/configs/qwen2_5_vl_3b
WORK=$(mktemp -d)
STATUS="$OUT/status.tsv"
: > "$STATUS"

# part NAME SECONDS CMD...: run CMD under timeout (capped by what is left of the budget); log and record rc
part() {
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY_PARTS:-}" ] && [[ " $ONLY_PARTS " != *" $name "* ]]; then
    echo -e "$name\tskipped\tnot in ONLY_PARTS" >> "$STATUS"; return 0
  fi
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 15 ]; then echo -e "$name\tskipped\tno time left" >> "$STATUS"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo -e "$name\t$rc\t$((SECONDS - start))s" >> "$STATUS"
  tail -n 25 "$OUT/$name.txt"
  return 0
}

# 0. wheels the image lacks (benchmarks/gpu_wheels.sh writes .gpuwheels/; carry it): Energon's stack, LMDB, PyAV
if compgen -G ".gpuwheels/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-deps --no-index --target "$WORK/site" .gpuwheels/*.whl > "$OUT/wheels.txt" 2>&1 \
    && export PYTHONPATH=$PYTHONPATH:$WORK/site
  echo -e "wheels\t$?\t.gpuwheels" >> "$STATUS"
fi

# 1. environment: versions, optional packages, the attention path packed rows take here
part env 40 "$PY" - "$OUT" <<'EOF'
import importlib, json, platform, shutil, subprocess, sys
out = sys.argv[1]
info = {"python": platform.python_version(), "platform": platform.platform(), "cc": shutil.which("cc") or shutil.which("gcc")}
for name in ["torch", "transformers", "peft", "triton", "megatron.energon", "ray", "numba", "pyarrow", "flash_attn",
             "fla", "liger_kernel", "tensorboard", "wandb", "prep.pack.core", "train.recipes.hf", "train.forward"]:
    try:
        module = importlib.import_module(name)
        info[name] = getattr(module, "__version__", "ok")
    except Exception as exc:
        info[name] = f"MISSING: {type(exc).__name__}: {exc}"[:200]
import torch
info["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
try:
    from torch.nn.attention.varlen import varlen_attn
    import inspect
    info["varlen_attn"] = str(inspect.signature(varlen_attn))
except ImportError as exc:
    info["varlen_attn"] = f"MISSING ({exc})"
try:
    from train.attention import needs_document_mask, select_attention
    implementation = select_attention("cuda")
    info["packed_attention"] = implementation + (" + flex document mask" if needs_document_mask("cuda", implementation) else "")
except Exception as exc:
    info["packed_attention"] = f"?: {exc}"
try:
    info["nvidia-smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as exc:
    info["nvidia-smi"] = str(exc)
json.dump(info, open(f"{out}/env.json", "w"), indent=2)
for k, v in info.items():
    print(f"{k}: {v}")
EOF

# 2. every gpu-marked test (only the files that hold one: a missing optional package elsewhere
#    cannot stop the collection)
mapfile -t GPU_FILES < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu" tests --include='test_*.py' | sort)
part pytest-gpu "${PYTEST_LIMIT:-150}" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$OUT/pytest-gpu.xml" "${GPU_FILES[@]}"

# 2b. packed == each sample alone on this GPU for the Qwen-VL families (benchmarks/gpu_check.py); its inputs are
#     made where Megatron-Energon imports: `python benchmarks/gpu_check.py prepare --out .gpucheck` (17 MB),
#     carried to the GPU machine as an ignored folder
GPU_CHECK_DATA=${GPU_CHECK_DATA:-.gpucheck}
HAS_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$HAS_CUDA" != 1 ]; then
  echo -e "gpu_check\tskipped\tno CUDA device" >> "$STATUS"
elif [ ! -d "$GPU_CHECK_DATA" ] && "$PY" -c "import megatron.energon" 2>/dev/null; then
  part gpu_check_prepare 90 "$PY" benchmarks/gpu_check.py prepare --out "$WORK/gpucheck"
  GPU_CHECK_DATA=$WORK/gpucheck
fi
if [ "$HAS_CUDA" != 1 ]; then
  :
elif [ -d "$GPU_CHECK_DATA" ]; then
  part gpu_check "${GPU_CHECK_LIMIT:-90}" "$PY" benchmarks/gpu_check.py run --data "$GPU_CHECK_DATA"
else
  echo -e "gpu_check\tskipped\tno $GPU_CHECK_DATA (prepare it where megatron-energon imports and carry it)" >> "$STATUS"
fi

# 3. real-size shape, Python benchmark (no loader): packed vs padded, MFU, peak memory
part bench_train_real "${BENCH_LIMIT:-200}" "$PY" benchmarks/bench_train_real.py --config "$CONFIG" --pack-size 8192 \
  --packs "${BENCH_PACKS:-6}" --warmup "${BENCH_WARMUP:-2}" --out "$OUT"

# 4. `train hf` itself at that size (needs the prep stack and Energon on this machine)
HELP=$("$PY" -m train.cli hf --help 2>/dev/null || true)
HF_FLAGS=()
if grep -q -- "--sharding" <<<"$HELP"; then HF_FLAGS+=(--sharding full); fi
if grep -q -- "--activation-checkpointing" <<<"$HELP"; then HF_FLAGS+=(--activation-checkpointing); fi
# the run is measured by its steps, eval and peak memory: no final 3.75B checkpoint (~60 GB of fp32 weights +
# AdamW state written by DCP) and so no OUT/final export, which ran past the part's limit on the H200
HF_RUN_FLAGS=()
if grep -q -- "--no-final-checkpoint" <<<"$HELP"; then HF_RUN_FLAGS+=(--no-final-checkpoint);
elif grep -q -- "--no-final-export" <<<"$HELP"; then HF_RUN_FLAGS+=(--no-final-export); fi
if [ -z "${SKIP_TRAIN_HF:-}" ] && [ "$HAS_CUDA" = 1 ] && [ -n "$HELP" ] && "$PY" -c "import megatron.energon, prep.pack.core" 2>/dev/null; then
  part train_hf_data 90 bash -c "
    set -e
    $PY -m prep.cli example $WORK/ex --family qwen2_5_vl --num-samples ${HF_SAMPLES:-600} --no-bad-rows
    $PY -m prep.cli tokenize --dataset-config $WORK/ex/dataset_info.json --processor $WORK/ex/processor \
      --output $WORK/tok --dataset chat --max-error-rate 1.0 --executor local
    $PY -m prep.cli pack $WORK/tok --output $WORK/packed --pack-size 8192 --shard-size 2packs --executor local
    $PY -m prep.cli energon-index $WORK/packed --split-ratio 0.8,0.2,0
    $PY benchmarks/bench_train_real.py shaped-model $CONFIG $WORK/ex/model $WORK/model"
  ( peak=0; while sleep 1; do m=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
      [ -n "$m" ] && [ "$m" -gt "$peak" ] && peak=$m && echo "$peak" > "$OUT/train_hf_peak_mib.txt"; done ) &
  SAMPLER=$!
  part train_hf 150 "$PY" -m train.cli hf --data "$WORK/packed" --model "$WORK/model" --processor "$WORK/ex/processor" \
    --output "$WORK/run" --max-steps "${HF_STEPS:-8}" --num-workers 4 --lr 1e-5 --eval-every "${HF_STEPS:-8}" "${HF_FLAGS[@]}" \
    "${HF_RUN_FLAGS[@]}"
  kill "$SAMPLER" 2>/dev/null
  cp "$WORK/run/metrics.jsonl" "$OUT/train_hf_metrics.jsonl" 2>/dev/null
  cp "$WORK/run/eval.jsonl" "$OUT/train_hf_eval.jsonl" 2>/dev/null
else
  echo -e "train_hf\tskipped\tSKIP_TRAIN_HF set, no CUDA, or train hf / megatron-energon do not import here (env.txt)" >> "$STATUS"
fi

# 5. the memory plan for the same shape, when `train hf --plan` exists
if grep -q -- "--plan" <<<"$HELP"; then
  part plan 40 "$PY" -m train.cli hf --plan --model "$CONFIG" --gpu-memory 80GB --plan-world-size 1 \
    --data "$WORK/packed" --processor "$WORK/ex/processor" --output "$WORK/plan" --max-steps 1 "${HF_FLAGS[@]}"
else
  echo -e "plan\tskipped\ttrain hf has no --plan in this tree" >> "$STATUS"
fi

# 6. summary
"$PY" - "$OUT" "${HF_FLAGS[*]:-}" <<'EOF'
import json, sys
from pathlib import Path
out, flags = Path(sys.argv[1]), sys.argv[2]
status = [line.split("\t") for line in (out / "status.tsv").read_text().splitlines() if line]
summary = {"parts": {name: {"rc": rc, "note": note} for name, rc, note in status}, "train_hf_flags": flags}
lines = ["# packvlm GPU suite", "", "| part | exit | time / note |", "|---|---|---|"]
lines += [f"| {name} | {rc} | {note} |" for name, rc, note in status]
if (out / "env.json").is_file():
    env = json.loads((out / "env.json").read_text())
    summary["env"] = env
    lines += ["", f"GPU {env.get('gpu')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers "
              f"{env.get('transformers')}; packed attention: {env.get('packed_attention')}"]
check = out / "gpu_check.txt"
if check.is_file():
    verdict = [ln for ln in check.read_text().splitlines() if ln.startswith("result:")]
    summary["gpu_check"] = verdict[-1] if verdict else "no result line"
    lines += ["", f"gpu_check (packed == alone, Qwen-VL families): {summary['gpu_check']}"]
tests = out / "pytest-gpu.txt"
if tests.is_file():
    tail = [ln for ln in tests.read_text().splitlines()
            if " in " in ln and any(w in ln for w in (" passed", " failed", " error", " skipped"))]
    summary["pytest_gpu"] = tail[-1] if tail else "no result line"
    lines += ["", f"gpu tests: {summary['pytest_gpu']}"]
if (out / "bench_train_real.md").is_file():
    lines += ["", "## Real-size step (benchmarks/bench_train_real.py)", "", (out / "bench_train_real.md").read_text()]
metrics = out / "train_hf_metrics.jsonl"
if metrics.is_file():
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    timed = rows[2:] or rows
    rate = sum(r["num_real_tokens"] for r in timed) / sum(r["num_tokens"] / r["tokens_per_s"] for r in timed)
    peak = (out / "train_hf_peak_mib.txt").read_text().strip() if (out / "train_hf_peak_mib.txt").is_file() else "?"
    summary["train_hf"] = {"steps": len(rows), "real_tokens_per_s": rate, "peak_mib_nvidia_smi": peak,
                           "last_loss": rows[-1]["loss"] if rows else None}
    lines += ["", f"## train hf ({flags or 'no sharding flags in this tree'})", "",
              f"{len(rows)} steps, real tokens/s after 2 warm-up steps {rate:,.0f}, peak GPU memory (nvidia-smi) "
              f"{peak} MiB, last loss {rows[-1]['loss']:.4f}"]
evals = out / "train_hf_eval.jsonl"
if evals.is_file():
    lines += [f"eval: {evals.read_text().strip()}"]
if (out / "plan.txt").is_file():
    lines += ["", "## train hf --plan", "", "```", (out / "plan.txt").read_text().strip()[-3000:], "```"]
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
rm -rf "$WORK"
echo "gpu suite done in ${SECONDS}s; results in $OUT"
exit 0
