#!/usr/bin/env bash
# GPU check of the learner and the rollout engines, in two parts (README "Running on GPUs").
#
#   experiments/gpu_check.sh A              GPU box with JAX+CUDA, no Ray, no vLLM (the lent machine)
#   experiments/gpu_check.sh A --cpu-smoke  the same steps, tiny and short, on CPU (shows the script works)
#   experiments/gpu_check.sh B              GPU node with the vllm extra (pip install 'laminar-jax[vllm]')
#   experiments/gpu_check.sh M              the learner on the GPU (issue 13): MFU and attention (lent machine)
#
# Part A: the learner bench on the GPU; the JAX engine bench (decode tokens/s at concurrency 1..256,
# seconds per in-place version switch); JAX engine vs learner log-prob parity in bf16 (and fp32).
# JSON under experiments/results/gpu/ (the smoke run: experiments/results/gpu/cpu_smoke/).
# Part B: the same engine bench and parity with vLLM next to JAX, then a short
# `laminar train rollout.engine=vllm` with the learner and one vLLM rollout sharing one GPU:
# learner.memory_fraction (LEARNER_MEM, default 0.35: the learner's XLA preallocation and Ray GPU
# share) and rollout.gpu_memory_utilization (ROLLOUT_MEM, default 0.5, with a Ray share of
# ROLLOUT_GPUS=0.5); the config refuses a pair that sums past 1. SHARED_GPU=0 runs the rollout on
# its own GPU instead (ROLLOUT_GPUS=1.0).
# Part M: the learner's train step on a Qwen2.5-0.5B-shaped model (random init) in bf16, cuDNN
# attention: tokens/s and MFU (bench_learner.py, 8 x 2048 packed tokens); then bench_attention.py,
# cudnn vs blockwise vs naive, memory and step time at T = 1K..16K on the 100m preset in bf16. Fits
# one 10-minute command (limits 300 + 270 s): GPU_OUT=$OUT experiments/gpu_check.sh M
# Needs only what the working tree brings (PYTHONPATH=repo root). Every step has its own time
# limit and a failed or timed-out step does not stop the others; the script exits 1 if any failed.
# Part A fits one 10-minute command of the lent machine (limits 150 + 300 + 120 s, plus start-up):
#   GPU_OUT=$OUT experiments/gpu_check.sh A 2>&1 | tee $OUT/gpu_check.log
# (GPU_OUT: where the JSON goes; the device tool brings back only what is under its $OUT.)
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:-A}"; SMOKE="${2:-}"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${GPU_OUT:-experiments/results/gpu}"
if [[ "$SMOKE" == "--cpu-smoke" ]]; then
  export JAX_PLATFORMS=cpu; OUT=$OUT/cpu_smoke
  MODELS=tiny; LEVELS=1,4; NEW=8; REPEATS=1; STEPS=1; SW=2
  MFU_MODEL=tiny; MFU_SHAPE=tiny=4x256; MFU_ARGS=(--peak-tflops 1); ATT=(--presets tiny --impls blockwise,naive --lengths 1024,2048 --dtype float32)
else
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
  MODELS=tiny,100m; LEVELS=1,4,16,64,256; NEW=64; REPEATS=2; STEPS=3; SW=3
  MFU_MODEL=qwen0.5b; MFU_SHAPE=qwen0.5b=8x2048; MFU_ARGS=()
  ATT=(--presets 100m --impls cudnn,blockwise,naive --lengths 1024,2048,4096,8192,16384 --dtype bfloat16)
fi
mkdir -p "$OUT"
FAILED=()
# step NAME LIMIT_S CMD...: run CMD under a time limit; record a failure and go on
step() {
  local name="$1" limit="$2"; shift 2
  echo; echo "== $name (limit ${limit} s)"; local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  [[ $rc == 0 ]] || FAILED+=("$name (rc $rc)")
}

if [[ "$PART" == "A" ]]; then
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  step "learner bench" 150 "$PY" experiments/bench_learner.py --models "$MODELS" --steps "$STEPS" \
      --out "$OUT/bench_learner.json"
  # jax: the engine on the relay's served layout; jaxdec: on the learner's decoder layout (decode
  # speed of both); switches: served vs decoder vs generic, counted bytes (host + host-to-device)
  step "JAX engine bench (decode tok/s vs concurrency, in-place switch s/GB and counted bytes)" 300 \
      "$PY" experiments/bench_engine.py --engines jax,jaxdec --models "${MODELS##*,}" --concurrency "$LEVELS" \
      --new-tokens "$NEW" --repeats "$REPEATS" --threads 0 --switches "$SW" --switch-baseline \
      --out "$OUT/bench_engine_jax.json"
  step "JAX engine vs learner log-probs (bf16, fp32)" 120 "$PY" experiments/engine_parity.py --engines jax \
      --model "${MODELS##*,}" --dtypes bfloat16,float32 --out "$OUT/engine_parity_jax.json"
elif [[ "$PART" == "M" ]]; then
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  step "learner MFU ($MFU_MODEL, bf16, attention auto = cudnn on GPU)" 300 "$PY" experiments/bench_learner.py \
      --models "$MFU_MODEL" --dtype bfloat16 --shape "$MFU_SHAPE" --steps 5 "${MFU_ARGS[@]}" --out "$OUT/bench_learner_mfu.json"
  step "attention: memory and fwd+bwd step time per length" 270 "$PY" experiments/bench_attention.py "${ATT[@]}" \
      --time-max-tokens 131072 --naive-time-max-gb 40 --skip-packing --out "$OUT/bench_attention.json"
elif [[ "$PART" == "B" ]]; then
  "$PY" -c "import vllm, ray; print('vllm', vllm.__version__, 'ray', ray.__version__)" || exit 2
  step "vLLM + JAX engine bench" 900 "$PY" experiments/bench_engine.py --engines jax,vllm --models "${MODELS##*,}" \
      --concurrency "$LEVELS" --new-tokens "$NEW" --repeats "$REPEATS" --threads 0 --switches "$SW" --switch-baseline \
      --out "$OUT/bench_engine_vllm.json"
  step "vLLM and JAX engines vs learner log-probs" 600 "$PY" experiments/engine_parity.py --engines jax,vllm \
      --model "${MODELS##*,}" --dtypes bfloat16,float32 --out "$OUT/engine_parity_vllm.json"
  if [[ "${SHARED_GPU:-1}" == "1" ]]; then
    SHARE=(learner.memory_fraction="${LEARNER_MEM:-0.35}" rollout.gpu_memory_utilization="${ROLLOUT_MEM:-0.5}")
    ROLLOUT_GPUS="${ROLLOUT_GPUS:-0.5}"
  else
    SHARE=(); ROLLOUT_GPUS="${ROLLOUT_GPUS:-1.0}"
  fi
  step "laminar train rollout.engine=vllm (learner + vLLM rollout: ${SHARE[*]:-own GPUs})" 900 "$PY" -m laminar_jax.cli \
      train configs/default.yaml run.name=gpu_vllm run.out_dir=/tmp/laminar-gpu-check run.steps=10 \
      data.task=arithmetic rollout.engine=vllm rollout.num_rollouts=1 \
      rollout.accelerators_per_rollout="$ROLLOUT_GPUS" "${SHARE[@]}" model.dtype=bfloat16 model.rollout_dtype=bfloat16
  OUT="$OUT" "$PY" - <<'PYEOF' || FAILED+=("train_vllm summary")
import json
import os
from laminar_jax.analysis import load_run
run = load_run("/tmp/laminar-gpu-check/gpu_vllm")
m = run.metrics
keys = [k for k in m.columns if k.startswith("mismatch/vllm/")]
assert set(run.trajectories.engine) == {"vllm"}, "the run's rollouts were not vLLM"
out = {k: float(m[k].mean()) for k in keys} | {"reward_first": float(m.reward_mean.iloc[0]),
                                              "reward_last": float(m.reward_mean.iloc[-1])}
json.dump(out, open(os.path.join(os.environ["OUT"], "train_vllm.json"), "w"), indent=2)
print(out)
PYEOF
else
  echo "usage: $0 A [--cpu-smoke] | B" >&2; exit 2
fi
echo; echo "results in $OUT"
if (( ${#FAILED[@]} )); then printf 'FAILED: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all steps passed"
