r"""Pipeline speed-up against micro-batch count on exclusive devices.

Why: GPipe's throughput claim (Table 2) assumes devices that each run one op
at a time, so micro-batches on different stages overlap and the bubble is
(K-1)/(M+K-1). Logical CPU devices in one process are NOT exclusive: all run
on one shared thread pool, so a "pipeline" there is just more parallelism.
To measure pipelining as an accelerator would see it, each stage here is a
separate single-threaded TensorFlow server process (`tf.distribute.Server`,
intra- and inter-op threads = 1) on 127.0.0.1, and cell k is placed on
`/job:worker/task:k/device:CPU:0`. The driver (this process) connects to the
cluster and runs the pipelined step as one tf.function; activations cross
processes over gRPC.

Reported: median step time per M, the measured speed-up over M=1 next to the
ideal K*M/(M+K-1) (equal stages, free transfers) and to GPipe Table 2 /
torchgpipe, plus the measured bubble of one recorded step at the largest M.

Safety: servers bind to 127.0.0.1 only; every wait has a deadline; worker
processes are terminated in `finally` and at exit; a watchdog ends the run
if it exceeds --total_timeout_s.

    python -m benchmarks.pipeline_efficiency --output_json=/tmp/eff.json
"""

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_cells', 2, 'K: stages (worker processes).')
flags.DEFINE_list('micro_batches', ['1', '2', '4', '8'], 'M values.')
flags.DEFINE_integer('num_layers', 8, 'FC layers (dim x dim matmuls).')
flags.DEFINE_integer('dim', 512, 'Width of the FC layers.')
flags.DEFINE_integer('batch', 512, 'Global batch size.')
flags.DEFINE_integer('reps', 7, 'Timed repetitions per configuration.')
flags.DEFINE_integer('worker_inter_op_threads', 1, 'Inter-op threads of each '
                     'worker. 1 is strictly one op at a time, but then a '
                     "stage's sends wait behind its next compute op; 2 lets "
                     'sends and receives proceed while the schedule\'s '
                     'control dependencies still serialize the actions.')
flags.DEFINE_integer('startup_timeout_s', 90, 'Deadline for workers to listen.')
flags.DEFINE_integer('total_timeout_s', 540, 'Watchdog for the whole run.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
# Internal: set when this file runs as a worker process.
flags.DEFINE_string('worker_cluster', None, 'Worker: cluster spec JSON.')
flags.DEFINE_integer('worker_task', None, 'Worker: task index.')

_PROCS = []
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _RunWorker():
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config = tf.compat.v1.ConfigProto(
      intra_op_parallelism_threads=1,
      inter_op_parallelism_threads=FLAGS.worker_inter_op_threads)
  cluster = tf.train.ClusterSpec(json.loads(FLAGS.worker_cluster))
  server = tf.distribute.Server(cluster, job_name='worker',
                                task_index=FLAGS.worker_task, config=config,
                                start=True)
  server.join()


def _FreePort():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _KillWorkers():
  for p in _PROCS:
    if p.poll() is None:
      p.terminate()
  for p in _PROCS:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()


def _StartWorkers(num):
  hosts = [f'127.0.0.1:{_FreePort()}' for _ in range(num)]
  spec = {'worker': hosts}
  atexit.register(_KillWorkers)
  for k in range(num):
    _PROCS.append(subprocess.Popen(
        [sys.executable, '-m', 'benchmarks.pipeline_efficiency',
         f'--worker_cluster={json.dumps(spec)}', f'--worker_task={k}',
         f'--worker_inter_op_threads={FLAGS.worker_inter_op_threads}'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=_REPO_ROOT))
  deadline = time.time() + FLAGS.startup_timeout_s
  for host in hosts:
    port = int(host.split(':')[1])
    while True:
      if any(p.poll() is not None for p in _PROCS):
        raise RuntimeError('A worker process exited during start-up.')
      try:
        with socket.create_connection(('127.0.0.1', port), timeout=1):
          break
      except OSError:
        if time.time() > deadline:
          raise TimeoutError(f'Worker {host} did not listen within '
                             f'{FLAGS.startup_timeout_s}s.') from None
        time.sleep(0.5)
  return spec


def _Watchdog():
  def Fire():
    print(f'watchdog: run exceeded {FLAGS.total_timeout_s}s; stopping.',
          flush=True)
    _KillWorkers()
    os._exit(3)  # pylint: disable=protected-access
  t = threading.Timer(FLAGS.total_timeout_s, Fire)
  t.daemon = True
  t.start()
  return t


def _Measure(spec):
  """Connects to the workers and times the pipeline for each M."""
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  from tfpipe import gpipe
  from tfpipe import layers
  from tfpipe import timeline
  tf = bench_lib.tf
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(spec), rpc_layer='grpc')
  tf.config.experimental_connect_to_cluster(
      resolver, make_master_device_default=False)
  k = FLAGS.num_cells
  devices = [f'/job:worker/replica:0/task:{i}/device:CPU:0' for i in range(k)]
  layer_params = [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=FLAGS.dim, output_dims=FLAGS.dim)
                  for i in range(FLAGS.num_layers)]
  cells = gpipe.PartitionSequentialLayers(layer_params, k, balance='params')
  with tf.device(devices[0]):
    x = tf.random.stateless_normal([FLAGS.batch, FLAGS.dim], seed=[1, 2])
  pipes, steps = {}, {}
  for m in [int(v) for v in FLAGS.micro_batches]:
    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=m, devices=devices,
        remat_policy='never')
    pipes[m] = p.Instantiate()
    steps[f'M={m}'] = (lambda s=bench_lib.PipeTrainStep(pipes[m]): s(x))
  samples = bench_lib.TimeAlternating(steps, FLAGS.reps, log=print)
  last_m = max(pipes)
  tl = timeline.RecordStep(pipes[last_m], x, None, bench_lib.Loss)
  return samples, tl


def main(argv):
  del argv
  if FLAGS.worker_cluster:
    _RunWorker()
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  watchdog = _Watchdog()
  try:
    spec = _StartWorkers(FLAGS.num_cells)
    samples, tl = _Measure(spec)
  finally:
    _KillWorkers()
    watchdog.cancel()
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  k = FLAGS.num_cells
  med = {name: bench_lib.Median(v) for name, v in samples.items()}
  base = med['M=1']
  gpipe_t2 = {1: '1 / 1', 4: '1.07 / 1.7', 32: '1.21 / 1.8'}
  rows, results = [], []
  for name, t in med.items():
    m = int(name.split('=')[1])
    ideal = k * m / (m + k - 1)
    speedup = base / t
    rows.append([name, t * 1e3, speedup, ideal, speedup / ideal,
                 gpipe_t2.get(m, '')])
    results.append({'num_micro_batches': m, 'median_s': t,
                    'samples_s': samples[name], 'speedup': speedup,
                    'ideal_speedup': ideal, 'fraction_of_ideal':
                        speedup / ideal})
  print(f'\nK={k} worker processes (intra-op threads 1, inter-op '
        f'{FLAGS.worker_inter_op_threads}) over gRPC on 127.0.0.1; '
        f'{FLAGS.num_layers} x FC({FLAGS.dim}), batch {FLAGS.batch}, no '
        f'remat; median of {FLAGS.reps} alternating reps')
  print(bench_lib.FormatTable(
      ['config', 'median ms', 'speed-up vs M=1', 'ideal K*M/(M+K-1)',
       'of ideal', 'GPipe T2 K=2 Amoeba/Transf.'], rows))
  print('torchgpipe (P40, AmoebaNet-D) n=2: m=32 gives 1.773x over m=1; '
        'REFERENCE plain TF over gRPC, K=2: 57/46/52/61 ms at M=1/2/4/8.')
  print(f'\nOne recorded step at M={tl.schedule.num_micro_batches}:')
  print(tl.Text())
  print(tl.Summary())
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'pipeline_efficiency', 'flags': FLAGS.flag_values_dict(),
      'results': results, 'timeline': tl.AsDict()})


if __name__ == '__main__':
  app.run(main)
