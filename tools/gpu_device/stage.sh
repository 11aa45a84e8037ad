#!/usr/bin/env bash
# Stages TensorFlow 2.21's GPU build for the lent device machine (Python 3.12,
# no TensorFlow, no package index; 64 MiB per call), from the repository root:
#
#   bash tools/gpu_device/stage.sh        # here: about 10 minutes on 2 cores
#
# Why not the wheels as they are: 47 calls of 60 MiB. Installed and packed
# with xz, TensorFlow, cuBLAS, the CUDA runtime and the Python dependencies
# are 820 MB, 14 calls. The other CUDA 12 libraries stay here: the device
# image has CUDA 13's, which install_tf.sh links under the names TensorFlow
# opens, and none of checks.sh's models calls them (no convolution, FFT or
# solver). With TFPIPE_DEVICE_CUDNN=1 the CUDA 12 cuDNN is carried too, for
# convolutions such as AmoebaNet-D's (about 10 calls more); stage_cudnn.sh
# stages it apart instead, without packing TensorFlow again (9 calls).
#
# Then, on the device, one call per folder, back to back (the machine stays
# warm 30 s; a call costs about 4 s), carrying `.device-stage/A.NN.d`:
#
#   mkdir -p /tmp/gst && cp .device-stage/A.NN.d/* /tmp/gst/
#
# and, with the last one, carrying also `.device-stage/install.d`:
#
#   bash .device-stage/install.d/install_tf.sh && bash .device-stage/install.d/checks.sh SECONDS
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WHEELS=${TFPIPE_DEVICE_WHEELS:-/tmp/tfpipe_device_wheels}  # a download cache
BUILD=/tmp/tfpipe_device_site
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform any)
PACKAGES=(tensorflow==2.21.0 'nvidia-cublas-cu12<13,>=12.5.3.2' 'nvidia-cuda-runtime-cu12<13,>=12.5.82'
          keras==3.15.1 astunparse==1.6.3 gast==0.7.0 google_pasta==0.2.0 termcolor==3.3.0 namex==0.1.0
          optree==0.20.0 protobuf==7.36.2 flatbuffers==25.12.19 ml_dtypes==0.6.0 h5py==3.14.0 wrapt==2.5.2)
if [ "${TFPIPE_DEVICE_CUDNN:-0}" = 1 ]; then PACKAGES+=('nvidia-cudnn-cu12<10,>=9.3.0.75'); fi
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WHEELS" "${PACKAGES[@]}"
rm -rf "$BUILD" && mkdir -p "$BUILD"
python3 -m pip install -q --no-deps --no-compile --no-cache-dir --no-index --find-links "$WHEELS" \
  "${PLAT[@]}" --target "$BUILD/site" "${PACKAGES[@]}"
tar -C "$BUILD/site" -cf - . | xz -T0 -6 > "$BUILD/A.tar.xz"
grep -qx '/.device-stage/' .git/info/exclude 2>/dev/null || echo '/.device-stage/' >> .git/info/exclude
rm -rf .device-stage && mkdir -p .device-stage/install.d .device-stage/tmp
cp "$HERE/install_tf.sh" "$HERE/checks.sh" .device-stage/install.d/
split -b 62000000 -d -a 2 "$BUILD/A.tar.xz" .device-stage/tmp/A.tar.xz.
for f in .device-stage/tmp/*; do d=.device-stage/A.${f##*.}.d; mkdir -p "$d"; mv "$f" "$d/"; done
rmdir .device-stage/tmp
ls -d .device-stage/A.*.d | wc -l | xargs echo "folders to carry, in order:"
