r"""Peak memory of a training step against GPipe's O(N + L/K * N/M) formula.

Why: re-materialization is what lets GPipe train models whose activations
would not fit; its claim is that peak activation memory falls from O(N*L)
to O(N + L/K * N/M). This measures the peak bytes of one step per
configuration and prints them next to that formula with explicit constants.

How: TensorFlow's CPU allocator is switched to BFC
(TF_CPU_ALLOCATOR_USE_BFC=true, set before TensorFlow starts) so that
`tf.config.experimental.get_memory_info('CPU:0')` reports current and peak
bytes. All logical CPU devices share that one allocator, so the figure is the
TOTAL over the K devices (GPipe's formula per device times K for the
boundary term). Between configurations the peak is reset with
`reset_memory_stats`; each step is traced and run once before it is measured,
and the measured figure is peak minus the bytes resident before the step
(weights and earlier configurations' state), i.e. what the step itself adds.

Prediction (bytes), with b = bytes of one example's cell-boundary activation
(T*D*4), W = gradient bytes (one float32 per parameter), and c = bytes one
layer keeps per example without remat, calibrated from the plain Keras step:
c = (peak_keras - W) / (L*N):
  no remat:  W + sum_k inflight_k * (L/K) * (N/M) * c     (GPipe: W + L*N*c)
  remat:     W + sum_k inflight_k * (N/M) * b + A * (L/K) * (N/M) * c
where inflight_k is the most micro-batches whose activations cell k holds
at once (M for GPipe, K-k for 1F1B, K for ZB-H1, whose B keeps what W reads;
schedule.MaxInFlight) and A is how
many cells hold their internal activations (being recomputed) at once. Two
columns bracket the measurement: A = 1 (one cell recomputing anywhere: the
per-device formula's term once) and A = min(K, M) (the per-device formula
summed over every device that can be recomputing at the same time; the
ratio column uses this one, the honest total-over-devices prediction).

    python -m benchmarks.memory --output_json=/tmp/memory.json

A second table (CPU) measures the GradientTape path, `pipe(x)` under a tape
(Lingvo's idiom), against the train-step entry for the same pipeline
(remat GPipe). The tape's backward runs the schedule's B actions into one
gradient buffer per cell, so its peak should not grow with M (issue 11's
target: at most 1.3x from M=1 to M=16).

On a GPU (--device=auto picks it when one is visible), the K cells run on K
logical GPUs, each with its own allocator and a hard limit, so the peaks are
PER DEVICE (get_memory_info('GPU:k') for each k, reset between
configurations) and are compared with GPipe's per-device formula for that
device:
  no remat:  W_k + inflight_k * (L/K) * (N/M) * c
  remat:     W_k + inflight_k * (N/M) * b + (L/K) * (N/M) * c
with W_k the gradient bytes of cell k and c calibrated from the plain Keras
step on GPU:0. The table shows the most loaded device against its
prediction and the spread max/min over devices (equal cells should be
close; a large spread means something landed on the wrong device).

    python -m benchmarks.memory --device=gpu --output_json=/tmp/memory_gpu.json
"""

import gc
import os

os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchmarks import bench_lib  # pylint: disable=g-import-not-at-top
# pylint: disable=g-import-not-at-top
from tfpipe import device_names
from tfpipe.gpipe import schedule as schedule_lib

tf = bench_lib.tf

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_layers', 8, 'L: Transformer layers.')
flags.DEFINE_integer('num_cells', 4, 'K: cells (logical CPU devices).')
flags.DEFINE_integer('batch', 32, 'N: global batch size.')
flags.DEFINE_integer('seq', 64, 'Sequence length T.')
flags.DEFINE_integer('dim', 128, 'Model dim D (hidden 4*D).')
flags.DEFINE_list('micro_batches', ['1', '4', '16'], 'M values.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
bench_lib.DefineDeviceFlags()

_MIB = 1024.0 * 1024.0


def _Info():
  return tf.config.experimental.get_memory_info('CPU:0')


def _MeasureStep(step_fn):
  """Bytes the step adds on top of what is resident, after one warm-up run."""
  bench_lib._Sync(step_fn())  # pylint: disable=protected-access
  gc.collect()
  tf.config.experimental.reset_memory_stats('CPU:0')
  resident = _Info()['current']
  bench_lib._Sync(step_fn())  # pylint: disable=protected-access
  return _Info()['peak'] - resident


def _KerasStep(layer_params, x):
  model = tf.keras.Sequential([p.Copy().Instantiate() for p in layer_params])
  model(x[:1])

  @tf.function
  def Step():
    with tf.GradientTape() as tape:
      loss = bench_lib.Loss(model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)
  num_params = sum(int(tf.size(v)) for v in model.trainable_variables)
  return Step, num_params


def _Configs():
  return [('never', 'gpipe', 'graph'), ('always', 'gpipe', 'graph'),
          ('always', '1f1b', 'graph'), ('always', 'gpipe', 'threads'),
          ('always', '1f1b', 'threads'), ('never', '1f1b', 'graph'),
          ('never', 'zb_h1', 'graph')]


def _PipeSteps(layer_params, k, devices, shape, x):
  """Each measured configuration: (remat, schedule, executor, M, pipe, its
  train step)."""
  for remat, sched, executor in _Configs():
    for m in [int(v) for v in FLAGS.micro_batches]:
      pipe = bench_lib.MakePipe(layer_params, k, m, devices, remat, sched,
                                input_shape=shape, executor=executor)
      def step(pipe=pipe):
        return pipe.ComputeLossAndGradients(x, None, bench_lib.Loss)
      yield remat, sched, executor, m, pipe, step
      # The caller has dropped its references: free this pipe before the
      # next is built, so each measurement starts from the same memory.
      del pipe, step
      gc.collect()


def _TapeSteps(layer_params, k, devices, shape, x):
  """(M, pipe, tape step, train step) for remat GPipe at each M."""
  for m in [int(v) for v in FLAGS.micro_batches]:
    pipe = bench_lib.MakePipe(layer_params, k, m, devices, 'always', 'gpipe',
                              input_shape=shape)

    @tf.function
    def TapeStep(pipe=pipe):
      with tf.GradientTape() as tape:
        loss = bench_lib.Loss(pipe(x, training=True))
      return loss, tape.gradient(loss, pipe.trainable_variables)

    def TrainStep(pipe=pipe):
      return pipe.ComputeLossAndGradients(x, None, bench_lib.Loss)
    yield m, pipe, TapeStep, TrainStep
    del pipe, TapeStep, TrainStep
    gc.collect()


def _TapePathTable(layer_params, k, devices, shape, x):
  """Peak of the tape path and of the train-step entry at each M."""
  rows, results, first = [], [], None
  for m, pipe, tape_step, train_step in _TapeSteps(layer_params, k, devices,
                                                   shape, x):
    tape_peak = _MeasureStep(tape_step)
    train_peak = _MeasureStep(train_step)
    first = first or tape_peak
    rows.append([m, tape_peak / _MIB, train_peak / _MIB, tape_peak / first])
    results.append({'num_micro_batches': m, 'tape_peak_bytes': tape_peak,
                    'train_step_peak_bytes': train_peak})
    del pipe, tape_step, train_step
  print(f'\nGradientTape path, K={k}, remat GPipe: pipe(x) under a tape '
        'against ComputeLossAndGradients (target: tape peak at the largest M '
        'at most 1.3x its peak at the smallest)')
  print(bench_lib.FormatTable(
      ['M', 'tape path MiB', 'train step MiB', 'tape / tape at first M'],
      rows))
  return results


def _ConfigName(k, remat, sched, executor):
  return f'pipe K={k} {sched} remat={remat}' + (
      ' threads' if executor == 'threads' else '')


def _MeasurePerDevice(step_fn, names):
  """{name: bytes the step adds on that device}, after one warm-up run."""
  bench_lib._Sync(step_fn())  # pylint: disable=protected-access
  gc.collect()
  resident = {}
  for name in names:
    tf.config.experimental.reset_memory_stats(name)
    resident[name] = tf.config.experimental.get_memory_info(name)['current']
  bench_lib._Sync(step_fn())  # pylint: disable=protected-access
  return {name: tf.config.experimental.get_memory_info(name)['peak'] -
                resident[name] for name in names}


def PredictPerDevice(remat, inflight, cell_gradient_bytes, l, n, m, b, c):
  """GPipe's per-device bytes for each cell k (see the module docstring)."""
  k = len(cell_gradient_bytes)
  if remat == 'never':
    return [w + inflight[i] * (l / k) * (n / m) * c
            for i, w in enumerate(cell_gradient_bytes)]
  return [w + inflight[i] * (n / m) * b + (l / k) * (n / m) * c
          for i, w in enumerate(cell_gradient_bytes)]


def PerDeviceMain(devices, device_type='GPU'):
  """Per-device peaks on K logical devices against the per-device formula.

  Meant for GPUs. On logical CPU devices (device_type='CPU', used by the
  tests) every entry reads the one shared allocator, so only the code path
  is exercised, not the figures.
  """
  k = FLAGS.num_cells
  names = [device_names.AllocatorName(d) for d in devices[:k]]
  n, l = FLAGS.batch, FLAGS.num_layers
  layer_params, x = bench_lib.MakeModel('transformer', l, n, seq=FLAGS.seq,
                                        dim=FLAGS.dim)
  shape = (None,) + tuple(x.shape[1:])
  b = FLAGS.seq * FLAGS.dim * 4.0
  with tf.device(devices[0]):
    keras_step, num_params = _KerasStep(layer_params, x)
  w = 4.0 * num_params
  keras_peak = _MeasurePerDevice(keras_step, names[:1])[names[0]]
  c = (keras_peak - w) / (l * n)
  del keras_step
  gc.collect()
  print(f'plain Keras step on {names[0]}: {keras_peak / _MIB:.1f} MiB; W = '
        f'{w / _MIB:.2f} MiB; c = {c / 1024:.1f} KiB per layer per example')
  rows, results = [], []
  for remat, sched, executor, m, pipe, step in _PipeSteps(
      layer_params, k, devices, shape, x):
    peaks = _MeasurePerDevice(step, names)
    cell_w = [4.0 * sum(int(tf.size(v)) for v in cell.trainable_variables)
              for cell in pipe.cells]
    predicted = PredictPerDevice(
        remat, schedule_lib.MaxInFlight(pipe.Schedule(m)), cell_w, l, n,
        m, b, c)
    values = [peaks[name] for name in names]
    worst = max(range(k), key=lambda i: values[i])
    spread = max(values) / max(min(values), 1.0)
    name = _ConfigName(k, remat, sched, executor)
    print(f'  {name} M={m}: per device '
          f'{", ".join(f"{v / _MIB:.1f}" for v in values)} MiB')
    rows.append([name, m, values[worst] / _MIB, min(values) / _MIB, spread,
                 predicted[worst] / _MIB, values[worst] / predicted[worst]])
    results.append({'config': name, 'remat': remat, 'schedule': sched,
                    'executor': executor, 'num_micro_batches': m,
                    'peak_bytes_per_device': dict(zip(names, values)),
                    'predicted_bytes_per_device': dict(zip(names,
                                                           predicted)),
                    'max_over_min': spread})
    del pipe, step
  print(f'\nTransformer L={l}, N={n}, T={FLAGS.seq}, D={FLAGS.dim}, K={k} on '
        f'{bench_lib.DeviceLabel(device_type, k)}; peak = bytes one step '
        'adds on each device (its own allocator)')
  print(bench_lib.FormatTable(
      ['configuration', 'M', 'max device MiB', 'min device MiB', 'max/min',
       'pred. for max MiB', 'measured/pred.'], rows))
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'memory', 'device_type': device_type,
      'flags': FLAGS.flag_values_dict(), 'W_bytes': w,
      'b_bytes_per_example': b, 'c_bytes_per_layer_example': c,
      'keras_peak_bytes': keras_peak, 'results': results})


def main(argv):
  del argv
  k = FLAGS.num_cells
  device_type, devices = bench_lib.LocalDevices(
      k, FLAGS.device, FLAGS.logical_gpu_memory_mb)
  if device_type == 'GPU':
    PerDeviceMain(devices)
    return
  n, l = FLAGS.batch, FLAGS.num_layers
  layer_params, x = bench_lib.MakeModel('transformer', l, n, seq=FLAGS.seq,
                                        dim=FLAGS.dim)
  shape = (None,) + tuple(x.shape[1:])
  b = FLAGS.seq * FLAGS.dim * 4.0

  keras_step, num_params = _KerasStep(layer_params, x)
  w = 4.0 * num_params
  keras_peak = _MeasureStep(keras_step)
  c = (keras_peak - w) / (l * n)
  del keras_step
  print(f'plain Keras step: {keras_peak / _MIB:.1f} MiB; W = {w / _MIB:.2f} '
        f'MiB of gradients; calibrated c = {c / 1024:.1f} KiB per layer per '
        f'example; b = {b / 1024:.1f} KiB per example per boundary')

  rows = [['keras (no pipeline, no remat)', '-', keras_peak / _MIB,
           (w + l * n * c) / _MIB, (w + l * n * c) / _MIB, 1.0]]
  results = [{'config': 'keras', 'peak_bytes': keras_peak,
              'predicted_bytes': w + l * n * c}]
  for remat, sched, executor, m, pipe, step in _PipeSteps(
      layer_params, k, devices, shape, x):
    peak = _MeasureStep(step)
    inflight = schedule_lib.MaxInFlight(pipe.Schedule(m))
    if remat == 'never':
      predicted = low = w + sum(inflight) * (l / k) * (n / m) * c
    else:
      low = w + sum(inflight) * (n / m) * b + (l / k) * (n / m) * c
      predicted = low + (min(k, m) - 1) * (l / k) * (n / m) * c
    name = _ConfigName(k, remat, sched, executor)
    print(f'  {name} M={m}: {peak / _MIB:.1f} MiB (predicted '
          f'{low / _MIB:.1f} .. {predicted / _MIB:.1f})')
    rows.append([name, m, peak / _MIB, low / _MIB, predicted / _MIB,
                 peak / predicted])
    results.append({'config': name, 'remat': remat, 'schedule': sched,
                    'executor': executor,
                    'num_micro_batches': m, 'peak_bytes': peak,
                    'predicted_bytes_one_cell': low,
                    'predicted_bytes': predicted})
    del pipe, step
  rows[0][5] = keras_peak / (w + l * n * c)
  print(f'\nTransformer L={l}, N={n}, T={FLAGS.seq}, D={FLAGS.dim}, K={k}; '
        'peak = bytes one step adds (all logical devices share one BFC '
        'allocator: totals over devices)')
  print(bench_lib.FormatTable(
      ['configuration', 'M', 'peak MiB', 'pred. A=1 MiB',
       'pred. A=min(K,M) MiB', 'measured/pred.'],
      rows))
  tape_results = _TapePathTable(layer_params, k, devices, shape, x)
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'memory', 'flags': FLAGS.flag_values_dict(),
      'W_bytes': w, 'b_bytes_per_example': b, 'c_bytes_per_layer_example': c,
      'results': results, 'tape_path': tape_results})


if __name__ == '__main__':
  app.run(main)
