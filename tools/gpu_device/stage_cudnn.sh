#!/usr/bin/env bash
# Stages the CUDA 12 cuDNN for the lent device machine, beside stage.sh's
# TensorFlow (A.*), for models with convolutions (AmoebaNet-D). From the
# repository root:
#
#   bash tools/gpu_device/stage_cudnn.sh   # here: about 5 minutes on 2 cores
#
# The wheel is 717 MB of zip; its libraries packed with xz are 519 MB, 9
# calls (stage.sh's TFPIPE_DEVICE_CUDNN=1 packs it with TensorFlow instead,
# about 10 minutes more here). Two xz streams, the RNN and attention library
# (libcudnn_adv) apart, concatenated: `xz -dc` reads both, `tar -i` both
# archives. Then, on the device, one call per folder after the A.* calls,
# carrying `.device-stage/B.NN.d`:
#
#   mkdir -p /tmp/gst && cp .device-stage/B.NN.d/* /tmp/gst/
#
# install_tf.sh unpacks them into /tmp/site/nvidia/cudnn, where TensorFlow
# finds cuDNN before the image's CUDA 13 one.
set -euo pipefail
WHEELS=${TFPIPE_DEVICE_WHEELS:-/tmp/tfpipe_device_wheels}
BUILD=/tmp/tfpipe_device_cudnn
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WHEELS" 'nvidia-cudnn-cu12<10,>=9.3.0.75'
WHEEL=$(ls "$WHEELS"/nvidia_cudnn_cu12-*.whl | tail -1)
rm -rf "$BUILD" && mkdir -p "$BUILD/main" "$BUILD/adv"
python3 - "$WHEEL" "$BUILD" <<'PY'
import sys, zipfile
wheel, build = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
  for name in z.namelist():
    if name.startswith('nvidia/'):
      z.extract(name, f"{build}/{'adv' if 'libcudnn_adv' in name else 'main'}")
PY
for part in main adv; do tar -C "$BUILD/$part" -cf - nvidia | xz -T0 -6 > "$BUILD/$part.tar.xz"; done
grep -qx '/.device-stage/' .git/info/exclude 2>/dev/null || echo '/.device-stage/' >> .git/info/exclude
rm -rf .device-stage/B.*.d .device-stage/tmpB && mkdir -p .device-stage/tmpB
cat "$BUILD/main.tar.xz" "$BUILD/adv.tar.xz" | split -b 62000000 -d -a 2 - .device-stage/tmpB/B.tar.xz.
for f in .device-stage/tmpB/*; do d=.device-stage/B.${f##*.}.d; mkdir -p "$d"; mv "$f" "$d/"; done
rmdir .device-stage/tmpB
ls -d .device-stage/B.*.d | wc -l | xargs echo "cuDNN folders to carry after the A.* ones:"
