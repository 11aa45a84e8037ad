r"""What a device holds of the gradients its neighbour sends, with and
without the runtime's hand-over (gpipe/dispatch.HandOver).

Why: in one graph a receive has no inputs, so it pulls a tensor from the
other device as soon as it is made. When a device's backwards are slower
than the next device's, every gradient that device sends would wait on the
slow one, up to M of them, where the memory model counts one. The runtime
sends each gradient on only once its taker is one action away from using
it. This measures both, side by side, on two worker processes: the first
cell `--slow_layers` FC layers, the second one, GPipe, each worker's
allocator read around each step (the peak above the step's start), and the
step time, configurations alternated.

    python -m benchmarks.gradient_handover --output_json=/tmp/handover.json
"""

import statistics
import sys
import time

from absl import app
from absl import flags

from tfpipe import network_namespace
from tfpipe import process_exit

FLAGS = flags.FLAGS
flags.DEFINE_integer('dim', 1024, 'Width of every FC layer.')
flags.DEFINE_integer('slow_layers', 7, 'FC layers of the first cell (the '
                     'second has one).')
flags.DEFINE_integer('micro_batch', 512, 'Examples per micro-batch: the '
                     'gradient handed over is micro_batch x dim floats.')
flags.DEFINE_integer('num_micro_batches', 8, 'M.')
flags.DEFINE_enum('schedule', 'gpipe', ['gpipe', '1f1b'], 'The schedule.')
flags.DEFINE_enum('remat_policy', 'always', ['always', 'except_last', 'never'],
                  'Re-materialization.')
flags.DEFINE_integer('steps', 3, 'Measured steps per configuration and trial.')
flags.DEFINE_integer('trials', 2, 'Fresh workers per configuration.')
flags.DEFINE_integer('total_timeout_s', 1200, 'Watchdog for the whole run.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')

_MIB = 2.0**20
CONFIGURATIONS = ('hand-over', 'at once')


def _Measure(hand_over):
  """[(per-device peak over the step's start in MiB, seconds)] per step, on
  one set of fresh workers."""
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  from benchmarks import capped_workers
  from tfpipe import gpipe
  from tfpipe import layers
  from tfpipe.gpipe import dispatch
  # pylint: enable=g-import-not-at-top
  tf = bench_lib.tf
  params = [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=FLAGS.dim, output_dims=FLAGS.dim,
      activation='tanh', random_seed=i) for i in range(FLAGS.slow_layers + 1)]
  original = dispatch.HandOver
  # The graph is traced here, in the controller: without the hand-over a
  # gradient goes to its taker as soon as it is made.
  dispatch.HandOver = original if hand_over else (lambda value, *_: value)
  steps = []
  workers = capped_workers.CappedWorkers(2, owner='gradient_handover')
  try:
    workers.Connect()
    cells = gpipe.PartitionSequentialLayers(
        params, 2, balance=[FLAGS.slow_layers, 1])
    pipe = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=FLAGS.num_micro_batches,
        devices=workers.devices, schedule=FLAGS.schedule,
        remat_policy=FLAGS.remat_policy).Instantiate()
    x = tf.random.stateless_normal(
        [FLAGS.micro_batch * FLAGS.num_micro_batches, FLAGS.dim], [1, 2])
    step = tf.function(
        lambda x: pipe.ComputeLossAndGradients(x, None, bench_lib.Loss).loss)
    float(step(x))  # Traced, and the workers' first allocations made.
    for _ in range(FLAGS.steps):
      workers.Reset()
      start = workers.Current()
      t = time.perf_counter()
      float(step(x))
      seconds = time.perf_counter() - t
      steps.append(([(p - s) / _MIB for p, s in zip(workers.Peaks(), start)],
                    seconds))
  finally:
    workers.Close()
    dispatch.HandOver = original
  return steps


def main(argv):
  del argv
  network_namespace.EnterLoopbackNamespace('benchmarks.gradient_handover',
                                           sys.argv)
  watchdog = process_exit.ExitAfter(FLAGS.total_timeout_s)
  from benchmarks import bench_lib  # pylint: disable=g-import-not-at-top
  results = {name: [] for name in CONFIGURATIONS}
  # Alternated, one trial at a time, so both see the same machine.
  for _ in range(FLAGS.trials):
    for name in CONFIGURATIONS:
      results[name] += _Measure(name == 'hand-over')
  watchdog.cancel()
  gradient_mib = FLAGS.micro_batch * FLAGS.dim * 4 / _MIB
  print(f'\nTwo workers: cell 0 {FLAGS.slow_layers} x FC({FLAGS.dim}), cell '
        f'1 one; {FLAGS.schedule} M={FLAGS.num_micro_batches}, micro-batch '
        f'{FLAGS.micro_batch} (a gradient handed over: {gradient_mib:.1f} '
        f'MiB), remat {FLAGS.remat_policy}; {FLAGS.trials} trial(s) x '
        f'{FLAGS.steps} steps each, alternated')
  rows = []
  for name in CONFIGURATIONS:
    peaks = [p for p, _ in results[name]]
    seconds = [s for _, s in results[name]]
    rows.append([name] + [
        f'{min(p[d] for p in peaks):.1f}-{max(p[d] for p in peaks):.1f}'
        for d in range(2)] + [statistics.median(seconds) * 1e3])
  print(bench_lib.FormatTable(
      ['gradients sent', 'device 0 peak MiB', 'device 1 peak MiB',
       'median step ms'], rows))
  medians = {name: statistics.median(s for _, s in results[name])
             for name in CONFIGURATIONS}
  device0 = {name: statistics.median(p[0] for p, _ in results[name])
             for name in CONFIGURATIONS}
  print(f'device 0 median peak, hand-over / at once: '
        f'{device0["hand-over"] / device0["at once"]:.2f}x; step time: '
        f'{medians["hand-over"] / medians["at once"]:.2f}x')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'gradient_handover', 'flags': FLAGS.flag_values_dict(),
      'environment': bench_lib.Environment(),
      'steps': {name: [{'peak_mib': p, 'seconds': s} for p, s in steps]
                for name, steps in results.items()}})


if __name__ == '__main__':
  app.run(main)
