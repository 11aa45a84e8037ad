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
  no remat:  W + L*N*c                                     (O(N*L))
  remat:     W + sum_k inflight_k * (N/M) * b + A * (L/K) * (N/M) * c
where inflight_k is the most micro-batches whose boundary activation cell k
holds at once (M for GPipe, K-k for 1F1B; schedule.MaxInFlight) and A is how
many cells hold their internal activations (being recomputed) at once. Two
columns bracket the measurement: A = 1 (one cell recomputing anywhere: the
per-device formula's term once) and A = min(K, M) (the per-device formula
summed over every device that can be recomputing at the same time; the
ratio column uses this one, the honest total-over-devices prediction).

    python -m benchmarks.memory --output_json=/tmp/memory.json
"""

import gc
import os

os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchmarks import bench_lib  # pylint: disable=g-import-not-at-top
# pylint: disable=g-import-not-at-top
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


def main(argv):
  del argv
  k = FLAGS.num_cells
  devices = bench_lib.SplitCpu(k)
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
  configs = [('never', 'gpipe', 'graph'), ('always', 'gpipe', 'graph'),
             ('always', '1f1b', 'graph'), ('always', 'gpipe', 'threads'),
             ('always', '1f1b', 'threads')]
  for remat, sched, executor in configs:
    for m in [int(v) for v in FLAGS.micro_batches]:
      pipe = bench_lib.MakePipe(layer_params, k, m, devices, remat, sched,
                                input_shape=shape, executor=executor)
      def step(pipe=pipe):
        return pipe.ComputeLossAndGradients(x, None, bench_lib.Loss)
      peak = _MeasureStep(step)
      if remat == 'never':
        predicted = low = w + l * n * c
      else:
        inflight = schedule_lib.MaxInFlight(pipe.Executor(m).schedule)
        low = w + sum(inflight) * (n / m) * b + (l / k) * (n / m) * c
        predicted = low + (min(k, m) - 1) * (l / k) * (n / m) * c
      name = f'pipe K={k} {sched} remat={remat}' + (
          ' threads' if executor == 'threads' else '')
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
      gc.collect()
  rows[0][5] = keras_peak / (w + l * n * c)
  print(f'\nTransformer L={l}, N={n}, T={FLAGS.seq}, D={FLAGS.dim}, K={k}; '
        'peak = bytes one step adds (all logical devices share one BFC '
        'allocator: totals over devices)')
  print(bench_lib.FormatTable(
      ['configuration', 'M', 'peak MiB', 'pred. A=1 MiB',
       'pred. A=min(K,M) MiB', 'measured/pred.'],
      rows))
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'memory', 'flags': FLAGS.flag_values_dict(),
      'W_bytes': w, 'b_bytes_per_example': b, 'c_bytes_per_layer_example': c,
      'results': results})


if __name__ == '__main__':
  app.run(main)
