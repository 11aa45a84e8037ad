r"""Per-device peak memory on separate allocators: one worker process per cell.

Why: logical devices in one process share one allocator, so an op left
without a device (an optimizer update, an accumulation, a clip) costs
nothing in a CPU test and runs out of memory on GPU:0. Here each pipeline
cell lives in its own single-device `tf.distribute.Server` process, started
with TF_CPU_ALLOCATOR_USE_BFC=true, so each device's peak is its own
process's allocator peak, as it is for K GPUs. The controller (this
process) runs the real trainer step (`tfpipe.trainer.task`: the pipelined
forward and backward, global-norm clipping and Adam) with worker 0 as its
default device, as GPU:0 is on a GPU machine: whatever the step leaves
unplaced lands on worker 0 and shows up in its peak.

Two rows per executor:
  placed     the trainer as it is: every op on its cell's device.
  unplaced   the control: the same step with tfpipe.placement switched off
             and Keras' own update ops (the update as it was before
             placement.py; a fused kernel runs on its variable's device
             wherever it is created). Worker 0's peak then grows with the
             whole model, not its cell.

The model is an MLP of 2K equal 1024x1024 layers (two per cell), so equal
cells should show equal peaks. Reported: each worker's peak in-use bytes
during a step (variables, Adam slots and gradient buffers included), and
max/min over workers.

Safety: the gRPC servers listen on every interface, so the run re-executes
itself in a loopback-only network namespace (tfpipe.network_namespace, as
tfpipe.launcher does); workers are tfpipe.local_cluster children, killed at
exit, by a watchdog, and by the kernel if this process dies.

    python -m benchmarks.device_memory --output_json=/tmp/device_memory.json
"""

import atexit
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

from benchmarks import capped_workers
from tfpipe import network_namespace
from tfpipe import process_exit

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_cells', 4, 'K: cells, one worker process each.')
flags.DEFINE_integer('dim', 1024, 'Width of every layer.')
flags.DEFINE_integer('batch', 256, 'Batch size.')
flags.DEFINE_integer('num_micro_batches', 4, 'M.')
flags.DEFINE_list('executors', ['graph', 'threads'], 'Executors to measure.')
flags.DEFINE_integer('steps', 2, 'Steps before the measured one.')
flags.DEFINE_integer('total_timeout_s', 300, 'Watchdog for the whole run.')
flags.DEFINE_integer('startup_timeout_s', 120, 'Deadline for the workers to '
                     'serve.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
flags.DEFINE_string('measure_row', None, "Internal: measure one row, "
                    "'<executor>,<placed|unplaced>', in fresh workers.")

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKERS = []  # The CappedWorkers of this row.
MIB = 2.0**20


def _StartWorkers(num):
  """K single-device worker processes (benchmarks.capped_workers), each
  with its own counting allocator; this process is their controller."""
  workers = capped_workers.CappedWorkers(
      num, intra_op_threads=0, startup_timeout_s=FLAGS.startup_timeout_s,
      owner='device_memory')
  atexit.register(workers.Close)
  _WORKERS.append(workers)
  return workers


@contextlib.contextmanager
def _PlacementOff():
  """The control: the trainer's update with tfpipe.placement switched off."""
  from tfpipe import placement  # pylint: disable=g-import-not-at-top
  saved = (placement.FollowInputDevices, placement.FollowInputDevicesToTheEnd,
           placement.OnVariableDevices)
  placement.FollowInputDevices = contextlib.nullcontext
  placement.FollowInputDevicesToTheEnd = lambda: None
  placement.OnVariableDevices = lambda tensors, variables: list(tensors)
  try:
    yield
  finally:
    (placement.FollowInputDevices, placement.FollowInputDevicesToTheEnd,
     placement.OnVariableDevices) = saved


def _TaskParams(devices, executor, placed=True):
  from models import mlp  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
  p = task_lib.BaseTask.Params()
  p.model = mlp.Mlp.Params().Set(
      input_dim=FLAGS.dim, hidden_dim=FLAGS.dim,
      num_hidden_layers=2 * FLAGS.num_cells - 1, num_classes=FLAGS.dim)
  p.pipeline.Set(num_partitions=FLAGS.num_cells,
                 num_micro_batches=FLAGS.num_micro_batches, devices=devices,
                 executor=executor, balance='params')
  p.train.optimizer.fused = placed
  return p


def _Measure(devices, executor, placed):
  """Peak in-use bytes of each worker during one trainer step.

  The peak is the allocator's high-water mark, so it includes what lives
  through the step: the cell's variables, Adam's slots and the gradient
  buffers, as a device's memory limit would count them.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.device(devices[0]):
    task = _TaskParams(devices, executor, placed).Instantiate()
    x = tf.random.stateless_normal([FLAGS.batch, FLAGS.dim], seed=[1, 2])
    y = tf.random.stateless_uniform([FLAGS.batch], seed=[3, 4],
                                    maxval=FLAGS.dim, dtype=tf.int32)
    with contextlib.nullcontext() if placed else _PlacementOff():
      for _ in range(FLAGS.steps):
        float(task.TrainStep((x, y))['loss'])
      _WORKERS[0].Reset()
      float(task.TrainStep((x, y))['loss'])
  return _WORKERS[0].Peaks()


def _MeasureRow():
  """One row in fresh workers (so no row sees another's memory); prints JSON."""
  executor, update = FLAGS.measure_row.split(',')
  workers = _StartWorkers(FLAGS.num_cells)
  workers.Connect()
  peaks = _Measure(workers.devices, executor, update == 'placed')
  print('ROW' + json.dumps(peaks), flush=True)
  sys.stdout.flush()
  workers.Close()
  process_exit.ExitNow(0)


def main(argv):
  del argv
  network_namespace.EnterLoopbackNamespace('benchmarks.device_memory',
                                           sys.argv)
  watchdog = process_exit.ExitAfter(FLAGS.total_timeout_s,
                                    lambda: [w.Close() for w in _WORKERS])
  if FLAGS.measure_row:
    _MeasureRow()
    return
  rows = []
  start = time.time()
  for executor in FLAGS.executors:
    for update in ('placed', 'unplaced'):
      proc = subprocess.run(
          [sys.executable, '-m', 'benchmarks.device_memory',
           f'--measure_row={executor},{update}',
           f'--num_cells={FLAGS.num_cells}', f'--dim={FLAGS.dim}',
           f'--batch={FLAGS.batch}',
           f'--num_micro_batches={FLAGS.num_micro_batches}',
           f'--steps={FLAGS.steps}'],
          capture_output=True, text=True, cwd=_REPO_ROOT,
          timeout=FLAGS.total_timeout_s,
          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
      lines = [l for l in proc.stdout.splitlines() if l.startswith('ROW')]
      if proc.returncode or not lines:
        raise RuntimeError(f'{executor}/{update} failed:\n'
                           f'{proc.stderr[-3000:]}')
      peaks = json.loads(lines[-1][3:])
      rows.append({'executor': executor, 'update': update,
                   'peak_mib': [round(p / MIB, 1) for p in peaks],
                   'max_over_min': round(max(peaks) / min(peaks), 3),
                   # What a misplaced op shows: one device above the rest.
                   'max_over_median': round(
                       max(peaks) / statistics.median(peaks), 3),
                   'worker0_over_rest': round(
                       peaks[0] / (sum(peaks[1:]) / len(peaks[1:])), 3)})
  print(f'Per-device peak memory, K={FLAGS.num_cells} worker processes '
        f'(one BFC allocator each), MLP of {2 * FLAGS.num_cells} x '
        f'{FLAGS.dim}x{FLAGS.dim} layers, batch {FLAGS.batch}, '
        f'M={FLAGS.num_micro_batches}, Adam; {time.time() - start:.0f} s')
  print('(unplaced = control: the same trainer step with tfpipe.placement '
        'switched off; worker 0 is the default device, like GPU:0)')
  for row in rows:
    peaks = '  '.join(f'{p:7.1f}' for p in row['peak_mib'])
    print(f"  {row['executor']:8s} {row['update']:9s} MiB per worker: "
          f"{peaks}   max/min {row['max_over_min']:.2f}   worker 0 / rest "
          f"{row['worker0_over_rest']:.2f}")
  if FLAGS.output_json:
    with open(FLAGS.output_json, 'w') as f:
      json.dump({'rows': rows, 'num_cells': FLAGS.num_cells,
                 'dim': FLAGS.dim, 'batch': FLAGS.batch,
                 'num_micro_batches': FLAGS.num_micro_batches}, f, indent=2)
  watchdog.cancel()


if __name__ == '__main__':
  app.run(main)
