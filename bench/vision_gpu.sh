#!/usr/bin/env bash
# Image-text training on one GPU (bench/vision_train_gpu.py): images of four sizes packed into each `k3 train` step
# through the tower's varlen path; img/s, MFU of the step and the profile's tower / language-model split in
# OUT/vision_train/results.json, the log in OUT/vision_train.log. At most 4 minutes (a hard timeout; training
# itself stops after 150 s with the steps it ran).
#
#   bash bench/vision_gpu.sh "$OUT"
#   bash bench/vision_gpu.sh OUT --cpu-check      # the script's logic on the CPU at toy shapes
set -u
OUT=${1:?give the output folder}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 235 python bench/vision_train_gpu.py --out "$OUT/vision_train" "$@" > "$OUT/vision_train.log" 2>&1
status=$?
tail -n 40 "$OUT/vision_train.log"
exit $status
