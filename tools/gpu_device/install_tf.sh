#!/usr/bin/env bash
# On the device machine, once the chunks of stage.sh are in /tmp/gst: unpacks
# them into /tmp/site and writes /tmp/site/env.sh (PYTHONPATH, library path,
# quiet logs), then checks that TensorFlow runs a matmul on the GPU (exit 2 if
# it sees none). TensorFlow registers a GPU only if it can open cuDNN, cuFFT,
# cuRAND, cuSOLVER and cuSPARSE too; those are taken from the image's CUDA 13
# libraries, under the CUDA 12 names TensorFlow asks for where they differ.
# That is enough for models without convolutions, FFTs or solvers. For
# convolutions (AmoebaNet-D), stage_cudnn.sh stages the CUDA 12 cuDNN as
# B.* chunks, unpacked here beside TensorFlow and found first.
set -u
mkdir -p /tmp/site/compat
if [ ! -f /tmp/site/.unpacked ]; then
  cat /tmp/gst/A.tar.xz.* | xz -dc -T0 | tar -C /tmp/site -xf - || { echo "unpacking failed"; exit 1; }
  # The CUDA 12 cuDNN, where stage_cudnn.sh staged it (B.*: two xz streams of tar archives).
  if ls /tmp/gst/B.tar.xz.* >/dev/null 2>&1; then
    cat /tmp/gst/B.tar.xz.* | xz -dc -T0 | tar -C /tmp/site -xif - || { echo "unpacking cuDNN failed"; exit 1; }
  fi
  touch /tmp/site/.unpacked && rm -rf /tmp/gst
fi
for pair in libcudnn.so.9:libcudnn.so.9 libcufft.so.11:libcufft.so.12 libcurand.so.10:libcurand.so.10 \
            libcusolver.so.11:libcusolver.so.12 libcusparse.so.12:libcusparse.so.12 libnvJitLink.so.12:libnvJitLink.so.13; do
  want=${pair%%:*}; have=${pair##*:}
  ls /tmp/site/nvidia/*/lib/$want >/dev/null 2>&1 && continue
  f=$(find /opt /usr/local /usr/lib -name "$have" 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "no $want and no image $have"; continue; }
  ln -sf "$f" /tmp/site/compat/$want
  echo "image library for $want: $f"
done
img=$(find /opt /usr/local -type d -path '*nvidia*' -name lib 2>/dev/null | tr '\n' ':')
libs=$(ls -d /tmp/site/nvidia/*/lib 2>/dev/null | tr '\n' ':')
cat > /tmp/site/env.sh <<ENV
export PYTHONPATH=/tmp/site:\$PWD\${PYTHONPATH:+:\$PYTHONPATH}
export LD_LIBRARY_PATH=${libs}/tmp/site/compat:${img}\${LD_LIBRARY_PATH:-}
export TF_CPP_MIN_LOG_LEVEL=\${TF_CPP_MIN_LOG_LEVEL:-2} PYTHONUNBUFFERED=1
ENV
. /tmp/site/env.sh
rm -f /tmp/site/.gpu_ok
TF_CPP_MIN_LOG_LEVEL=1 python3 -c "
import tensorflow as tf
g = tf.config.list_physical_devices('GPU'); print('tensorflow', tf.__version__, g)
if g:
  with tf.device('/GPU:0'):
    a = tf.random.normal([1024, 1024]); print('matmul on', (a @ a).device, float(tf.reduce_sum(a @ a)) != 0)
  open('/tmp/site/.gpu_ok', 'w').write('ok')
" 2>&1 | grep -v -i "numa\|computation placer\|absl::InitializeLog" | tail -20
[ -f /tmp/site/.gpu_ok ] || { echo "TensorFlow sees no GPU"; exit 2; }
