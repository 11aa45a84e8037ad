#!/usr/bin/env bash
# On the device machine, from the repository root, after install_tf.sh:
#   bash .device-stage/install.d/checks.sh SECONDS [STEP...]
# Runs the GPU checks (all, or the STEPs named) in this order, each under its
# own limit and all within SECONDS; one log ($OUT/checks.log) and the
# scripts' JSON/PNG in $OUT (at most 8 files come back). Limits are what the
# H200 run of 2026-11-26 needed or more (benchmarks/RESULTS.md, section GPU).
set -u
END=$(( $(date +%s) + ${1:-480} )); shift
WANT=" $* "
. /tmp/site/env.sh
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/checks.log
step() {  # name limit command...
  local name=$1 limit=$2; shift 2
  [ "$WANT" = "  " ] || [[ "$WANT" == *" $name "* ]] || return 0
  local left=$(( END - $(date +%s) ))
  if [ $left -lt 25 ]; then echo "=== $name: NOT RUN (out of time)" | tee -a $LOG; return 99; fi
  [ $limit -gt $left ] && limit=$left
  echo "=== $name (limit ${limit}s): $*" | tee -a $LOG
  local t0=$(date +%s)
  timeout -k 5 $limit "$@" >> $LOG 2>&1; local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a $LOG
  return $rc
}
{ nvidia-smi -L; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|L2|L3'; } >> $LOG 2>&1
# Adam's and SGD's fused kernels (trainer/optimizer.py) on the GPU: the
# tests' unplaced variables go to GPU:0, so each kernel runs there.
step fused_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/trainer/optimizer_test.py
step readme 150 python3 -m tfpipe.trainer --model=lm.TinyTransformerLm --logdir=/tmp/tfpipe_lm
# AmoebaNet-D on the GPU (needs the CUDA 12 cuDNN: stage_cudnn.sh), then the
# LM and the MLP at K=4, whose later cells' profiles now hold their input
# gradient and whose received inputs are kept only where a backward reads them.
step mma_amoeba4 230 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=amoebanet \
  --num_cells=4 --parallel=12 --logical_gpu_memory_mb=1024 --output_json=$OUT/mma_amoeba4.json
step mma_lm4 170 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=transformer_lm \
  --num_cells=4 --parallel=12 --logical_gpu_memory_mb=1024 --output_json=$OUT/mma_lm4.json
step mma_mlp4 110 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=mlp \
  --num_cells=4 --parallel=10 --logical_gpu_memory_mb=1024 --output_json=$OUT/mma_mlp4.json
# The same LM and AmoebaNet-D with the cells profiled on one logical GPU of
# 2 GiB, one allocator region as the measured GPUs are, instead of one that
# grows (the sixth run's M=1 rows were over-predicted by 15-24%).
step mma_lm4_one_region 170 python3 -m benchmarks.memory_model_accuracy --device=gpu \
  --models=transformer_lm --num_cells=4 --parallel=12 --logical_gpu_memory_mb=1024 \
  --gpu_profile_memory_mb=2048 --output_json=$OUT/mma_lm4_one_region.json
step mma_amoeba4_one_region 230 python3 -m benchmarks.memory_model_accuracy --device=gpu \
  --models=amoebanet --num_cells=4 --parallel=12 --logical_gpu_memory_mb=1024 \
  --gpu_profile_memory_mb=2048 --output_json=$OUT/mma_amoeba4_one_region.json
step mma_amoeba2 200 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=amoebanet \
  --num_cells=2 --parallel=12 --logical_gpu_memory_mb=1024 --output_json=$OUT/mma_amoeba2.json
# Each configuration in a fresh process on fresh logical GPUs of 1 GiB, 8
# at once (memory_model_accuracy --process_per_configuration): the MLP whose
# devices hold the allocator slack of a fresh build, then the LM.
step mma_fresh_mlp 260 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=mlp \
  --parallel=8 --logical_gpu_memory_mb=1024 --output_json=$OUT/mma_fresh_mlp.json
# The MLP at K=1 and 2 with the slack fix (K=4 was 18 of 18 with it).
step mma_fresh_mlp12 200 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=mlp \
  --num_cells=1,2 --parallel=8 --logical_gpu_memory_mb=1024 --output_json=$OUT/mma_fresh_mlp12.json
step mma_fresh_lm 200 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=transformer_lm \
  --num_cells=2,4 --parallel=8 --logical_gpu_memory_mb=1024 --output_json=$OUT/mma_fresh_lm.json
# About 10 s per configuration on the H200 (tracing dominates).
step mma_gpu 300 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=transformer_lm,mlp \
  --num_cells=4 --remat_policies=always,never --output_json=$OUT/mma_gpu.json
# The MLP at K=4, whose devices 1-3 held one 1024x1024 tensor more than
# predicted on 2026-11-26 (the allocator slack of a fresh device's build).
step mma_gpu_mlp 260 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=mlp \
  --num_cells=4 --output_json=$OUT/mma_gpu_mlp.json
step mma_gpu_lm4 200 python3 -m benchmarks.memory_model_accuracy --device=gpu --models=transformer_lm \
  --num_cells=4 --remat_policies=always,never --output_json=$OUT/mma_gpu_lm4.json
step oom_gpu 120 python3 -m tfpipe.trainer --model=lm.SmallTransformerLm --logdir=/tmp/oom --num_partitions=2 \
  --num_micro_batches=1 --remat_policy=never --logical_gpu_memory_mb=40 --max_steps=2
step inspect_gpu 60 python3 -m tfpipe.trainer --model=lm.SmallTransformerLm --mode=inspect_model --num_partitions=2 \
  --num_micro_batches=1 --remat_policy=never --device_memory_mb=40
# --plan=auto profiling on GPU:0 (in a subprocess), not yet run on a GPU.
step plan_gpu 150 python3 -m tfpipe.trainer --model=mlp.TinyMlp \
  "--model_params_override=task.model.hidden_dim: 512; task.model.num_hidden_layers: 8" \
  --logdir=/tmp/plan_gpu --plan=auto --device_memory_mb=25 --num_devices=2 --logical_gpu_memory_mb=25 --max_steps=2
step memory_gpu 300 python3 -m benchmarks.memory --device=gpu --output_json=$OUT/memory_gpu.json
step eff_k4 100 env CUDA_VISIBLE_DEVICES= python3 -m benchmarks.pipeline_efficiency --mode=grpc_graph \
  --dim=1024 --batch=2048 --num_cells=4 --micro_batches=1,8 --reps=3 --output_json=$OUT/eff_k4.json
step eff_k8 100 env CUDA_VISIBLE_DEVICES= python3 -m benchmarks.pipeline_efficiency --mode=grpc_graph \
  --dim=1024 --batch=2048 --num_cells=8 --micro_batches=1,8 --reps=3 --output_json=$OUT/eff_k8.json
# K=8 where its micro-batches are 512 rows (2048 at M=8 were 256: 0.809).
step eff_k8_b4096 150 env CUDA_VISIBLE_DEVICES= python3 -m benchmarks.pipeline_efficiency --mode=grpc_graph \
  --dim=1024 --batch=4096 --num_cells=8 --micro_batches=1,8 --reps=3 --output_json=$OUT/eff_k8_b4096.json
# The lead for the MLP's one-tensor under-prediction on GPU:1-3 (RESULTS.md,
# section GPU): does a device keep memory after its first matmul?
step first_matmul 60 python3 -c "
import tensorflow as tf
gpu = tf.config.list_physical_devices('GPU')[0]
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=4096)] * 2)
for n, rows in (('GPU:0', 8), ('GPU:1', 128)):
  with tf.device(n):
    w = tf.random.normal([1024, 1024]); x = tf.random.normal([rows, 1024])
    before = tf.config.experimental.get_memory_info(n)['current']
    y = tf.matmul(x, w); float(tf.reduce_sum(y)); del y
    after = tf.config.experimental.get_memory_info(n)['current']
  print(n, rows, 'rows: kept after the first matmul', (after - before) / 2**20, 'MiB')
"
# What a fresh logical GPU holds after the build, beyond its variables and
# slots (the allocator slack that memory_profile.BuildSlack measures).
step slack_probe 90 python3 tools/gpu_device/slack_probe.py
step timeline_gpu 90 python3 -m benchmarks.timeline --device=gpu --dim=1024 --seq=256 --batch=16 --num_cells=4 \
  --output_png=$OUT/timeline_gpu.png
step overhead_gpu 300 python3 -m benchmarks.overhead --device=gpu --models=transformer --dim=1024 --seq=256 \
  --batch=16 --output_json=$OUT/overhead_gpu.json
grep -E "^(ERROR|Final|Machine ceiling)|^\| |within" $LOG | tail -40
echo "=== all done" | tee -a $LOG
