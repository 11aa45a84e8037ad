r"""Where a pipelined step's time goes on worker processes, action by action.

Why: benchmarks/pipeline_efficiency.py --mode=grpc_graph gives one number per
M; to see what keeps it from ideal x the machine's ceiling, and to predict
K=4 and K=8 with the simulator, this measures each per-action cost on the
same K=2 single-threaded `tf.distribute.Server` workers on 127.0.0.1:

  remote call       one tiny function on a worker, called from the
                    controller (what executor='threads' pays per action),
                    and one spanning both workers (what a graph step pays
                    once).
  transfer          one micro-batch's activation (batch/M x dim floats)
                    from worker 0 to worker 1 inside one function (TF's
                    send/recv, worker to worker), against the same tensor
                    sent through the controller (two eager copies).
  instantiation     the first call of a new function over both workers
                    (trace, partition, register on the workers) against a
                    later call.
  compute           one cell (num_layers / 2 FC layers) forward, and forward
                    plus backward, on one worker at micro-batch batch/M,
                    times M, against the whole batch at once: the
                    micro-batch efficiency.
  contention        the same cell on both workers at once (one function over
                    both), against one alone:
                    the machine's ceiling for K=2.
  accumulation      adding one micro-batch's weight gradients into the
                    cell's buffers (assign_add on the worker).

Then the simulator (gpipe.schedule.Simulate) predicts the step time and
speed-up over M=1 for K=2, 4, 8 from these costs: each cell's forward and
backward scaled from the measured per-layer cost at that micro-batch size,
slowed down by the measured contention, plus one transfer per cross-device
dependency.

    python -m benchmarks.remote_action_costs --output_json=/tmp/costs.json
"""

import statistics
import sys
import time

from absl import app
from absl import flags

from tfpipe import network_namespace
from tfpipe import process_exit
from tfpipe import quiet

FLAGS = flags.FLAGS
flags.DEFINE_list('predict_num_cells', ['2', '4', '8'], 'K values the '
                  'simulator predicts (num_layers must split into them).')


def _Fastest(fn, reps):
  """The fastest of `reps` calls: on a shared machine other jobs only ever
  add time, so the minimum is the closest to the action's own cost."""
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return min(times)


def _Sync(t):
  return t.numpy()


def _Costs(devices, m):
  """{name: seconds} of each per-action cost at M micro-batches (K=2)."""
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  tf = bench_lib.tf
  reps = FLAGS.reps
  dim, batch = FLAGS.dim, FLAGS.batch
  rows = batch // m
  layers_per_cell = FLAGS.num_layers // 2
  costs = {}
  weights = []
  for d in devices:
    with tf.device(d):
      weights.append([tf.Variable(tf.random.normal([dim, dim], stddev=0.03))
                      for _ in range(layers_per_cell)])
  with tf.device(devices[0]):
    x_full = tf.random.normal([batch, dim])
    x_micro = tf.random.normal([rows, dim])

  # Remote call: one scalar add on worker 0; one on each worker.
  with tf.device(devices[0]):
    scalar = tf.constant(1.0)

  @tf.function
  def OneWorker(s):
    with tf.device(devices[0]):
      return s + 1.0

  @tf.function
  def BothWorkers(s):
    with tf.device(devices[0]):
      a = s + 1.0
    with tf.device(devices[1]):
      return a + 1.0
  for fn in (OneWorker, BothWorkers):
    _Sync(fn(scalar))
  costs['remote call, one worker'] = _Fastest(
      lambda: _Sync(OneWorker(scalar)), 4 * reps)
  costs['step function over both workers'] = _Fastest(
      lambda: _Sync(BothWorkers(scalar)), 4 * reps)

  # Transfer of a micro-batch's activation, worker to worker in a function.
  @tf.function
  def SendOver(x):
    with tf.device(devices[0]):
      y = x * 2.0
    with tf.device(devices[1]):
      return tf.reduce_sum(y[:1, :1])

  @tf.function
  def StayOn(x):
    with tf.device(devices[0]):
      y = x * 2.0
      return tf.reduce_sum(y[:1, :1])
  for fn in (SendOver, StayOn):
    _Sync(fn(x_micro))
  costs['transfer worker to worker'] = max(
      _Fastest(lambda: _Sync(SendOver(x_micro)), 4 * reps) -
      _Fastest(lambda: _Sync(StayOn(x_micro)), 4 * reps), 0.0)

  def ViaController():
    with tf.device('/job:controller/replica:0/task:0/device:CPU:0'):
      here = tf.identity(x_micro)
    with tf.device(devices[1]):
      return _Sync(tf.reduce_sum(tf.identity(here)[:1, :1]))
  ViaController()
  costs['transfer via controller'] = _Fastest(ViaController, 4 * reps)

  # Function instantiation: a new function over both workers, first call.
  def FirstCall():
    fn = tf.function(lambda x: SendOver.python_function(x) + 0.0)
    t = time.perf_counter()
    _Sync(fn(x_micro))
    return time.perf_counter() - t
  costs['first call of a new step function'] = sorted(
      FirstCall() for _ in range(3))[1]

  # Compute: one cell forward and forward+backward, M micro-batches.
  def CellFunctions(k):
    ws = weights[k]

    def Forward(h):
      for w in ws:
        h = tf.nn.relu(tf.matmul(h, w))
      return h

    # Calls that stay calls, run on the single-threaded executor, as the
    # engine runs a worker's actions (tfpipe/gpipe/cell_runtime.py).
    @tf.function(experimental_attributes={'_noinline': True})
    def F(x):
      with tf.device(devices[k]):
        return tf.reduce_sum(Forward(x)[:1, :1])

    @tf.function(experimental_attributes={'_noinline': True})
    def FB(x):
      with tf.device(devices[k]):
        with tf.GradientTape() as tape:
          tape.watch(x)
          y = tf.reduce_sum(Forward(x))
        grads = tape.gradient(y, [x] + ws)
        return tf.add_n([tf.reduce_sum(g[:1, :1]) for g in grads])

    def Caller(fn):
      # An eager call does not take the executor type; a call op traced
      # under it does.
      @tf.function
      def Call(x):
        with tf.device(devices[k]), SingleThreaded():
          return fn(x)
      return Call
    return Caller(F), Caller(FB), FB

  def Copy(x, k):
    with tf.device(devices[k]):
      return tf.identity(x)
  xs = [Copy(x_micro, k) for k in range(2)]
  fwd, fwd_bwd, _ = CellFunctions(0)

  def Call(fn, x):
    return _Sync(fn(x))
  for fn in (fwd, fwd_bwd):
    Call(fn, xs[0])
    Call(fn, x_full)
  costs['cell forward, micro-batch'] = _Fastest(lambda: Call(fwd, xs[0]),
                                               reps)
  costs['cell forward+backward, micro-batch'] = _Fastest(
      lambda: Call(fwd_bwd, xs[0]), reps)
  costs['cell forward+backward, whole batch / M'] = _Fastest(
      lambda: Call(fwd_bwd, x_full), reps) / m

  # Contention: the same cell on both workers at once, in one function over
  # both (as a pipeline step runs them; two controller threads issuing
  # eager calls would measure the controller too).
  both = [CellFunctions(k)[2] for k in range(2)]

  @tf.function
  def Both(x0, x1):
    with SingleThreaded():
      with tf.device(devices[0]):
        y0 = both[0](x0)
      with tf.device(devices[1]):
        y1 = both[1](x1)
      return y0 + y1
  _Sync(Both(*xs))
  costs['cell forward+backward, both workers at once'] = _Fastest(
      lambda: _Sync(Both(*xs)), reps)

  # Accumulation: one micro-batch's weight gradients into buffers.
  with tf.device(devices[0]):
    buffers = [tf.Variable(tf.zeros([dim, dim])) for _ in weights[0]]
    grads = [tf.random.normal([dim, dim]) for _ in weights[0]]

  @tf.function
  def Accumulate(gs):
    with tf.device(devices[0]):
      for b, g in zip(buffers, gs):
        b.assign_add(g, read_value=False)
      return tf.reduce_sum(buffers[0][:1, :1])

  @tf.function
  def NoAccumulate(gs):
    with tf.device(devices[0]):
      return tf.reduce_sum(gs[0][:1, :1])
  for fn in (Accumulate, NoAccumulate):
    _Sync(fn(grads))
  costs['gradient accumulation, one cell'] = max(
      _Fastest(lambda: _Sync(Accumulate(grads)), 4 * reps) -
      _Fastest(lambda: _Sync(NoAccumulate(grads)), 4 * reps), 0.0)
  return costs


def SingleThreaded():
  """Where calls run on the single-threaded executor, as the engine's on a
  worker's CPU."""
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from tfpipe.gpipe import cell_runtime
  return tf.experimental.function_executor_type(
      cell_runtime.SINGLE_THREADED_EXECUTOR)


def Predict(costs_by_m, num_cells, num_layers, schedule='gpipe'):
  """{M: (predicted step s, speed-up over M=1)} for K cells of the model.

  `costs_by_m` holds _Costs' measurements for each M (1 among them), made
  on a 2-cell split of `num_layers` layers. Each of the K cells holds
  num_layers / K layers: its forward and backward
  are the measured per-layer costs at that micro-batch size (a 2-cell
  model's cell, divided by its layers), slowed by the contention when M > 1
  (with M = 1 no two devices ever compute at once), plus, when
  M > 1, the measured gradient accumulation. Each cross-device dependency
  adds the measured worker-to-worker transfer, and the step the one-call
  cost of a step function over the workers. The contention is one factor,
  the median over M of (both workers at once / one alone): a single
  measurement of it swings with other jobs on a shared machine.
  """
  # pylint: disable=g-import-not-at-top
  from tfpipe.gpipe import schedule as schedule_lib
  layers_per_cell = num_layers // 2
  contention = statistics.median(
      c['cell forward+backward, both workers at once'] /
      c['cell forward+backward, micro-batch'] for c in costs_by_m.values())
  result = {}
  for m, costs in sorted(costs_by_m.items()):
    slowdown = 1.0 if m == 1 else contention
    per_layer_f = costs['cell forward, micro-batch'] / layers_per_cell
    per_layer_fb = (costs['cell forward+backward, micro-batch'] /
                    layers_per_cell)
    layers = num_layers / num_cells
    f = per_layer_f * layers * slowdown
    b = (per_layer_fb - per_layer_f) * layers * slowdown + costs[
        'gradient accumulation, one cell'] * (m > 1) * layers / layers_per_cell
    sched = schedule_lib.MakeSchedule(schedule, num_cells, m)
    sim = schedule_lib.Simulate(
        sched, [f] * num_cells, [b] * num_cells,
        transfer_cost=costs['transfer worker to worker'])
    result[m] = sim.makespan + costs['step function over both workers']
  base = result[min(result)]
  return {m: (t, base / t) for m, t in result.items()}


def main(argv):
  del argv
  network_namespace.EnterLoopbackNamespace('benchmarks.remote_action_costs',
                                           sys.argv)
  quiet.ImportTensorFlow()
  watchdog = process_exit.ExitAfter(FLAGS.total_timeout_s,
                                    pipeline_efficiency.CHILDREN.Close)
  try:
    jobs = pipeline_efficiency.StartWorkers(2)
    # pylint: disable=g-import-not-at-top
    from benchmarks import bench_lib
    from tfpipe import device_names
    from tfpipe import servers
    servers.ConnectToCluster(bench_lib.tf.train.ClusterSpec(jobs))
    devices = device_names.WorkerDevices(2, 2)
    ms = sorted({1, *[int(v) for v in FLAGS.micro_batches]})
    costs_by_m = {m: _Costs(devices, m) for m in ms}
  finally:
    pipeline_efficiency.CHILDREN.Close()
    watchdog.cancel()
  from benchmarks import bench_lib  # pylint: disable=g-import-not-at-top
  names = list(costs_by_m[ms[0]])
  print(f'\nPer-action costs, K=2 worker processes (intra-op threads 1, '
        f'inter-op {FLAGS.worker_inter_op_threads}) on 127.0.0.1; '
        f'{FLAGS.num_layers} x FC({FLAGS.dim}), batch {FLAGS.batch}, a cell '
        f'is {FLAGS.num_layers // 2} layers; ms, fastest of {FLAGS.reps}+ '
        'calls')
  print(bench_lib.FormatTable(
      ['cost'] + [f'M={m} (micro-batch {FLAGS.batch // m})' for m in ms],
      [[n] + [costs_by_m[m][n] * 1e3 for m in ms] for n in names]))
  predictions = {}
  rows = []
  for k in [int(v) for v in FLAGS.predict_num_cells]:
    if FLAGS.num_layers % k:
      continue
    predictions[k] = Predict(costs_by_m, k, FLAGS.num_layers, FLAGS.schedule)
    for m, (t, speedup) in predictions[k].items():
      ideal = k * m / (m + k - 1)
      rows.append([f'K={k} M={m}', t * 1e3, speedup, ideal, speedup / ideal])
  print(f'\nSimulator ({FLAGS.schedule}) from these costs: predicted step '
        'time and speed-up over M=1')
  print(bench_lib.FormatTable(['config', 'predicted ms', 'speed-up',
                               'ideal K*M/(M+K-1)', 'of ideal'], rows))
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'remote_action_costs', 'flags': FLAGS.flag_values_dict(),
      'costs_s': {str(m): c for m, c in costs_by_m.items()},
      'predictions': {str(k): {str(m): {'step_s': t, 'speedup': s}
                               for m, (t, s) in p.items()}
                      for k, p in predictions.items()}})


if __name__ == '__main__':
  # pipeline_efficiency's flags (--dim, --batch, the workers' threads) are
  # this program's too. It is imported only here: its --mode clashes with the
  # trainer's in a process that imports both, as the test suite does.
  from benchmarks import pipeline_efficiency  # pylint: disable=g-import-not-at-top
  app.run(main)
