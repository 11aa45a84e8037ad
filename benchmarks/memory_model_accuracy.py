r"""The memory model against each device's measured peak, over a grid.

Why: the planner and `--mode=inspect_model` say whether a configuration
fits before it runs; that is only worth something if the predicted peak of
every device is close to what its allocator really reaches. Issue 20's bar:
within 15%.

How: K worker processes (benchmarks.capped_workers), each one device with
its own BFC allocator, run the trainer's real step (tfpipe.trainer.task:
the pipelined forward and backward, global-norm clipping and Adam), with
this process as their controller. Each configuration gets fresh workers
(one that ran other configurations first peaks a few percent higher every
time: TensorFlow's runtime keeps some of each). One step traces and warms
up; then each worker's peak is reset, two steps run, and each worker's
peak is read. The prediction comes from gpipe.memory_model, fed by
one profiled step per distinct cell (gpipe.memory_profile) at the smallest
and the largest micro-batch size of the grid; sizes in between are
interpolated, as the planner does.

The grid: a Transformer LM, AmoebaNet-D and an MLP; K in {1, 2, 4}; M in
{1, 4, 8}; remat_policy always, except_last and never; schedules gpipe and
1f1b.

    python -m benchmarks.memory_model_accuracy --output_json=/tmp/bench/memory_model_accuracy.json

One run's measured peaks are one draw: which chunk the allocator hands a
request depends on what happened to be free, and identical runs moved a
device's peak by 7% (median) and up to 46%. --repeats=N measures each
configuration N times on fresh workers and compares the prediction with
each device's median; the summary also counts it against each device's
largest run, the peak a hard limit must hold (accuracy_rows.Summary).

With --device=gpu the devices are logical GPUs of the GPU, each with its own
allocator and a hard limit (--logical_gpu_memory_mb). Each K's cells are
profiled on the GPU in a subprocess, so the profile counts what the GPU's
kernels and libraries take. Each configuration's step then runs in a fresh
process on K fresh logical GPUs (--parallel processes at once, each with its
own), with the batch on the CPU as a controller's is, and each device's
peak is read from its own allocator. A real run's devices are fresh: on an
H200, a logical GPU that had built and freed another cell held 4 MiB less
after the MLP's build than a fresh one (the allocator slack,
gpipe/allocator_slack.py), so measuring every configuration on the same
devices (--noprocess_per_configuration, faster) errs after the first.

    python -m benchmarks.memory_model_accuracy --device=gpu --output_json=/tmp/bench/memory_model_accuracy_gpu.json

The engine decides what a forward keeps; this benchmark is the check to
re-run after changing it (nothing in the model is fitted to it).
"""

import gc
import json
import os
import sys
import time

os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchmarks import accuracy_rows  # pylint: disable=g-import-not-at-top
from benchmarks import capped_workers  # pylint: disable=g-import-not-at-top
from tfpipe import network_namespace  # pylint: disable=g-import-not-at-top
from tfpipe import process_exit  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_list('models', ['transformer_lm', 'amoebanet', 'mlp'],
                  'Models of the grid (keys of MODELS).')
flags.DEFINE_list('num_cells', ['1', '2', '4'], 'K values.')
flags.DEFINE_list('micro_batches', ['1', '4', '8'], 'M values.')
flags.DEFINE_list('remat_policies', ['always', 'except_last', 'never'],
                  'Remat policies.')
flags.DEFINE_list('schedules', ['gpipe', '1f1b'], 'Schedules.')
flags.DEFINE_integer('measured_steps', 2, 'Steps whose peak is measured, '
                     'after one warm-up step.')
flags.DEFINE_integer('repeats', 1, 'With --device=cpu: measure each '
                     'configuration this many times, each on fresh workers; '
                     'a row\'s measured peaks are then each device\'s median '
                     'over the runs (`measured_runs` holds them all): one '
                     'run\'s peaks move by 7% per device (median) and up to '
                     '46% between identical runs (benchmarks/RESULTS.md); '
                     'the summary also counts rows against each device\'s '
                     'largest run.',
                     lower_bound=1)
flags.DEFINE_integer('profile_runs', 3, 'With --device=cpu: the fresh '
                     'processes that profile each remat mode and '
                     'micro-batch size of each distinct cell, whose median '
                     'predicts (the trainer\'s --memory_profile_runs).',
                     lower_bound=1)
flags.DEFINE_float('tolerance', 0.15, 'The bar: |predicted/measured - 1|.')
flags.DEFINE_integer('total_timeout_s', 5400, 'Watchdog for the whole run.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
flags.DEFINE_string('predict_from', None, 'A JSON this benchmark wrote: '
                    'predicts its measured configurations again from its '
                    'stored profiles with the current memory model, '
                    'without measuring (the measurements do not depend on '
                    'the model).')
flags.DEFINE_enum('device', 'cpu', ['cpu', 'gpu'], 'cpu: capped worker '
                  'processes, one per device; gpu: logical GPUs of this '
                  'process\'s GPU, each with its own allocator.')
flags.DEFINE_integer('logical_gpu_memory_mb', None, 'With --device=gpu: the '
                     'memory of each logical GPU, MiB (default: the GPU\'s '
                     'memory, less a reserve, shared evenly).', lower_bound=1)
flags.DEFINE_integer('worker_memory_mb', None, 'With --device=cpu: each '
                     'worker\'s hard limit, MiB. A capped worker\'s '
                     'allocator is one region of it, as a GPU\'s is '
                     '(tfpipe.memory_limit.OpenOneRegion); uncapped workers '
                     'grow by regions.', lower_bound=1)
flags.DEFINE_integer('gpu_profile_memory_mb', None, 'With --device=gpu: '
                     'profile the cells on one logical GPU of this many MiB, '
                     'one allocator region as the measured devices are, '
                     'instead of on an allocator that grows '
                     '(memory_profile.ProfileRequest.gpu_memory_mb).',
                     lower_bound=1)
flags.DEFINE_bool('process_per_configuration', True, 'With --device=gpu: '
                  'each configuration\'s step in a fresh process on K fresh '
                  'logical GPUs, as a real run\'s devices are; false: every '
                  'configuration in this process on the same logical GPUs '
                  '(not fresh after the first).')
flags.DEFINE_integer('parallel', 4, 'With --device=gpu and '
                     '--process_per_configuration: configurations measured '
                     'at once, each process on logical GPUs of its own.',
                     lower_bound=1)
flags.DEFINE_string('measure_request', None, 'Internal: measure the '
                    'configuration pickled at this path on fresh logical '
                    'GPUs and pickle the peaks to the path + ".out".')
flags.DEFINE_bool('reprofile', False, 'With --predict_from: profile the '
                  'cells again with the current profiler instead of using '
                  'the stored profiles.')


# name: (registered experiment, params overrides). Small enough to run the
# whole grid on 2 cores; each has at least 4 layers to cut.
MODELS = {
    'transformer_lm': ('lm.SmallTransformerLm', {}),
    'amoebanet': ('image.TinyAmoebaNetD', {'task.model.num_filters': 32}),
    'mlp': ('mlp.SmallMlp', {'task.model.hidden_dim': 1024,
                             'task.model.num_hidden_layers': 6}),
}


def ExperimentParams(model):
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  name, overrides = MODELS[model]
  p = model_registry.GetParams(name, 'Train')
  p.Set(**overrides)
  return p


def _Measure(p, workers, batch, num_cells, previous=None):
  """Each worker's peak over the measured steps, on `workers` (fresh).

  `previous`, the last configuration's workers, are stopped once this
  process is no longer their controller: connecting to new workers closes
  the contexts on the old ones, and each one already stopped logged an
  'Unable to close remote context ... Connection refused' error.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  workers.WaitUntilServing()
  # Functions of the previous configuration (or of profiling) are removed
  # from the context when collected; collect them before the context is
  # rebuilt for new workers (TensorFlow fails on a removal in between).
  gc.collect()
  try:
    workers.Connect()
  finally:
    if previous:
      previous.Close()
  p = p.Copy()
  p.task.pipeline.devices = workers.devices
  task = p.task.Instantiate()
  inputs, targets = tf.nest.map_structure(tf.convert_to_tensor, batch)
  float(task.TrainStep((inputs, targets))['loss'])
  workers.Reset()
  for _ in range(FLAGS.measured_steps):
    float(task.TrainStep((inputs, targets))['loss'])
  peaks = workers.Peaks()[:num_cells]
  del task
  gc.collect()
  return peaks


def _MeasureInProcess(p, devices, batch):
  """Each device's peak over the measured steps, above what it held before
  the task was built, with the step running in this process."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfpipe.gpipe import memory_profile  # pylint: disable=g-import-not-at-top
  gc.collect()
  names = [memory_profile.AllocatorName(d) for d in devices]
  before = [tf.config.experimental.get_memory_info(n)['current']
            for n in names]
  p = p.Copy()
  p.task.pipeline.devices = list(devices)
  task = p.task.Instantiate()
  with tf.device('/CPU:0'):
    inputs, targets = tf.nest.map_structure(tf.convert_to_tensor, batch)
  float(task.TrainStep((inputs, targets))['loss'])
  for n in names:
    tf.config.experimental.reset_memory_stats(n)
  for _ in range(FLAGS.measured_steps):
    float(task.TrainStep((inputs, targets))['loss'])
  peaks = [tf.config.experimental.get_memory_info(n)['peak'] - b
           for n, b in zip(names, before)]
  del task
  gc.collect()
  return peaks


def RunModelInProcess(model, devices, rows, log, save=None):
  """RunModel on devices of this process (logical GPUs): each K's cells
  profiled once on devices[-1], each configuration's step on devices[:K].
  `save` gets the profiles so far after each row (a run cut short by a
  device lease keeps what it measured)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  example, sizes = _ExampleAndSizes(model)
  profiles = {}
  for p in _Configurations(model):
    k = p.task.pipeline.num_partitions
    if k not in profiles:
      start = time.time()
      # What the profile places by default (the optimizer's counters) goes
      # to the spare device too, so devices[:K] start fresh.
      with tf.device(devices[-1]):
        profiles[k] = memory_report.Profile(memory_report.ProfileRequest(
            p, micro_batch_sizes=sizes, example=example, device=devices[-1]))
      log(f'{model} K={k}: profiled its cells on {devices[-1]} at '
          f'micro-batch sizes {sizes} in {time.time() - start:.0f}s')
    start = time.time()
    measured = _MeasureInProcess(p, devices[:k], example)
    _AddRun(model, p, measured, time.time() - start, profiles[k], example,
            rows, log)
    if save:
      save({str(k): [c.ToDict() for c in cells]
            for k, cells in profiles.items()})
  return {str(k): [c.ToDict() for c in cells]
          for k, cells in profiles.items()}


def RunModelPerProcess(model, rows, log, save=None):
  """RunModel on the GPU, each configuration in a fresh process on fresh
  logical GPUs (--parallel at once); each K's cells profiled on the GPU in
  a subprocess first. This process never touches the GPU."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  example, sizes = _ExampleAndSizes(model)
  configurations = list(_Configurations(model))
  profiles = {}

  def SlackLines(line):
    """The profile's line on the slack (or on why it was not measured)."""
    if 'slack' in line:
      log(f'  {line}')
  for p in configurations:
    k = p.task.pipeline.num_partitions
    if k not in profiles:
      start = time.time()
      request = memory_report.ProfileRequest(
          p, micro_batch_sizes=sizes, example=example, device='/GPU:0')
      request.gpu_memory_mb = FLAGS.gpu_profile_memory_mb
      profiles[k] = memory_report.Profile(request, log=SlackLines,
                                          in_subprocess=True)
      log(f'{model} K={k}: profiled its cells on a GPU at micro-batch sizes '
          f'{sizes} in {time.time() - start:.0f}s')
  with concurrent.futures.ThreadPoolExecutor(FLAGS.parallel) as pool:
    futures = [pool.submit(_MeasureInFreshProcess, p, example)
               for p in configurations]
    for p, future in zip(configurations, futures):
      measured, seconds = future.result()
      _AddRun(model, p, measured, seconds,
              profiles[p.task.pipeline.num_partitions], example, rows, log)
      if save:
        save({str(k): [c.ToDict() for c in cells]
              for k, cells in profiles.items()})
  return {str(k): [c.ToDict() for c in cells]
          for k, cells in profiles.items()}


def _MeasureInFreshProcess(p, example):
  """(each device's peak, seconds): `p`'s step measured by a fresh process
  (python -m benchmarks.memory_model_accuracy --measure_request)."""
  import pickle  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  start = time.time()
  with tempfile.TemporaryDirectory(prefix='mma_gpu_') as tmp:
    path = os.path.join(tmp, 'request.pickle')
    with open(path, 'wb') as f:
      pickle.dump({'params': p, 'example': example}, f)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.memory_model_accuracy',
         '--device=gpu', f'--measure_request={path}',
         f'--logical_gpu_memory_mb={_GpuMemoryMb()}',
         f'--measured_steps={FLAGS.measured_steps}'],
        env=env, capture_output=True, text=True, check=False,
        timeout=FLAGS.total_timeout_s)
    if proc.returncode or not os.path.exists(path + '.out'):
      raise RuntimeError('measuring on fresh logical GPUs failed: ' + (
          proc.stderr.strip().splitlines() or ['no output'])[-1])
    with open(path + '.out', 'rb') as f:
      return pickle.load(f), time.time() - start


def _GpuMemoryMb():
  """Each fresh logical GPU's memory: the flag, else 2 GiB (room for every
  configuration of the grid, times --parallel processes of K)."""
  return FLAGS.logical_gpu_memory_mb or 2048


def _MeasureRequest(path):
  """--measure_request: one configuration on K fresh logical GPUs."""
  import pickle  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    request = pickle.load(f)
  p = request['params']
  # A limit makes each a logical GPU of that size, even at K=1.
  _, devices = bench_lib.LocalDevices(p.task.pipeline.num_partitions, 'gpu',
                                      _GpuMemoryMb())
  peaks = _MeasureInProcess(p, devices, request['example'])
  with open(path + '.out', 'wb') as f:
    pickle.dump(peaks, f)


def _ExampleAndSizes(model):
  """The model's example batch, and the micro-batch sizes its cells are
  profiled at: the grid's smallest and largest (the planner's way)."""
  from tfpipe.gpipe import memory_model  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  base = ExperimentParams(model)
  batch = memory_report.ReplicaBatchSize(base)
  micro = [int(m) for m in FLAGS.micro_batches]
  return memory_report.ExampleBatch(base), sorted(
      {min(memory_model.MicroBatchSizes(batch, m))
       for m in (max(micro), min(micro))})


def _Configurations(model):
  base = ExperimentParams(model)
  for k in [int(k) for k in FLAGS.num_cells]:
    for schedule in FLAGS.schedules:
      for remat in FLAGS.remat_policies:
        for m in [int(m) for m in FLAGS.micro_batches]:
          p = base.Copy()
          p.task.pipeline.Set(num_partitions=k, num_micro_batches=m,
                              schedule=schedule, remat_policy=remat)
          yield p


def RunModel(model, rows, log, save=None):
  """Profiles each K's cells once, then measures every configuration, each
  on fresh workers: a worker that ran other configurations before peaks
  higher (TensorFlow's runtime keeps some of each), which a real run, one
  configuration per worker, never sees. The next configuration's workers
  start while one is measured."""
  example, sizes = _ExampleAndSizes(model)
  profiles = {}
  configurations = [p for p in _Configurations(model)
                    for _ in range(FLAGS.repeats)]
  pending = previous = None
  try:
    for i, p in enumerate(configurations):
      pending, previous = _RunOne(model, i, p, configurations, pending,
                                  previous, profiles, sizes, example, rows, log)
      if save:  # Each row kept as it is measured.
        save({str(k): [c.ToDict() for c in cells]
              for k, cells in profiles.items()})
  finally:
    for workers in (pending, previous):
      if workers:
        workers.Close()
  return {str(k): [c.ToDict() for c in cells]
          for k, cells in profiles.items()}


def _GridModes():
  """The remat modes the grid's predictions read (a K's profile serves
  every configuration of that K): each mode is processes of its own."""
  from tfpipe.gpipe import memory_model  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  used = {mode for remat in FLAGS.remat_policies for m in FLAGS.micro_batches
          for mode in memory_report.RematModes(remat, int(m))}
  return tuple(mode for mode in (memory_model.REMAT, memory_model.NO_REMAT)
               if mode in used)


def _WorkerProfileRequest(p, sizes, example, modes=None):
  """The profile request of p's cells at `sizes`, as the grid's capped
  workers run them, in `modes` (default: the grid's)."""
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  return memory_report.ProfileRequest(
      p, micro_batch_sizes=sizes, example=example,
      intra_op_threads=capped_workers.INTRA_OP_THREADS,
      single_threaded_calls=capped_workers.SINGLE_THREADED_CALLS,
      allocator_slack=FLAGS.worker_memory_mb is not None,
      profile_runs=FLAGS.profile_runs, modes=modes or _GridModes())


def _RunOne(model, i, p, configurations, pending, previous, profiles, sizes,
            example, rows, log):
  """Measures configuration i; returns the next one's workers (started) and
  its own (to stop once the next has connected; see _Measure)."""
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  k = p.task.pipeline.num_partitions
  if k not in profiles:
    start = time.time()
    profiles[k] = memory_report.Profile(_WorkerProfileRequest(p, sizes,
                                                              example))
    log(f'{model} K={k}: profiled its cells at micro-batch sizes {sizes} '
        f'in {time.time() - start:.0f}s')
  workers = pending or capped_workers.CappedWorkers(
      k, memory_mb=FLAGS.worker_memory_mb, owner='memory_model_accuracy',
      wait=False)
  pending = None
  if i + 1 < len(configurations):
    pending = capped_workers.CappedWorkers(
        configurations[i + 1].task.pipeline.num_partitions,
        memory_mb=FLAGS.worker_memory_mb, owner='memory_model_accuracy',
        wait=False)
  start = time.time()
  try:
    measured = _Measure(p, workers, example, k, previous)
  except BaseException:
    for started in (workers, pending):
      if started:
        started.Close()
    raise
  _AddRun(model, p, measured, time.time() - start, profiles[k], example,
          rows, log)
  return pending, workers


def _AddRun(model, p, measured, seconds, profiles, example, rows, log):
  """One measured run of a configuration, into `rows` (accuracy_rows.AddRun:
  with --repeats, each device's median), logged once all its runs are in."""
  row, complete = accuracy_rows.AddRun(
      rows, accuracy_rows.NewRow(model, p.task.pipeline, measured, seconds),
      FLAGS.repeats)
  _Predict(row, p, profiles, example)
  if complete:
    log(accuracy_rows.FormatRow(row, FLAGS.tolerance))


def _Predict(row, p, profiles, example):
  """Adds the memory model's prediction and its worst error to `row`."""
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  accuracy_rows.SetPrediction(
      row, memory_report.PredictPeaks(p, profiles, example))


def _ProfileAgain(base, example, by_k, log):
  """Each K's cells profiled again, at the sizes of the stored profiles, in
  both remat modes (the stored rows' policies are not the flags')."""
  from tfpipe.gpipe import memory_model  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  profiles = {}
  for k, cells in by_k.items():
    sizes = sorted({m['micro_batch_size'] for m in cells[0]['measurements']})
    p = base.Copy()
    p.task.pipeline.num_partitions = int(k)
    start = time.time()
    profiles[k] = [c.ToDict() for c in memory_report.Profile(
        _WorkerProfileRequest(p, sizes, example,
                              modes=(memory_model.REMAT,
                                     memory_model.NO_REMAT)))]
    log(f'K={k}: profiled again in {time.time() - start:.0f}s')
  return profiles


def PredictAgain(path, log):
  """The rows of an earlier run, predicted again from its stored profiles."""
  from tfpipe.gpipe import memory_model  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    earlier = json.load(f)
  rows = []
  for model, by_k in earlier['profiles'].items():
    base = ExperimentParams(model)
    example = memory_report.ExampleBatch(base)
    if FLAGS.reprofile:
      by_k = _ProfileAgain(base, example, by_k, log)
      earlier['profiles'][model] = by_k
    for row in earlier['rows']:
      if row['model'] != model:
        continue
      p = base.Copy()
      p.task.pipeline.Set(num_partitions=row['num_cells'],
                          num_micro_batches=row['num_micro_batches'],
                          schedule=row['schedule'],
                          remat_policy=row['remat_policy'])
      profiles = [memory_model.CellProfile.FromDict(c)
                  for c in by_k[str(row['num_cells'])]]
      row = dict(row)
      _Predict(row, p, profiles, example)
      rows.append(row)
      log(accuracy_rows.FormatRow(row, FLAGS.tolerance))
  return rows, earlier['profiles']


def _Write(bench_lib, rows, profiles):
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'memory_model_accuracy', 'rows': rows,
      'profiles': profiles,
      'models': {m: list(MODELS[m]) for m in FLAGS.models},
      'flags': {name: FLAGS[name].value for name in (
          'models', 'num_cells', 'micro_batches', 'remat_policies',
          'schedules', 'measured_steps', 'repeats', 'tolerance', 'device',
          'process_per_configuration', 'parallel',
          'gpu_profile_memory_mb')}})


def main(argv):
  del argv
  if FLAGS.measure_request:
    _MeasureRequest(FLAGS.measure_request)
    process_exit.ExitNow(0)
  if FLAGS.device == 'gpu' and FLAGS.repeats > 1:
    raise app.UsageError('--repeats measures each configuration on fresh '
                         'capped workers: it needs --device=cpu.')
  if FLAGS.device == 'cpu':
    for name in ('logical_gpu_memory_mb', 'gpu_profile_memory_mb'):
      if FLAGS[name].value is not None:
        raise app.UsageError(f'--{name} sets the memory of logical GPUs; '
                             'it needs --device=gpu.')
    if FLAGS.repeats > 1 and FLAGS.predict_from:
      raise app.UsageError('--repeats measures again; --predict_from only '
                           'predicts the stored rows: drop one of them.')
    network_namespace.EnterLoopbackNamespace(
        'benchmarks.memory_model_accuracy', sys.argv)
  watchdog = process_exit.ExitAfter(FLAGS.total_timeout_s)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  from benchmarks import bench_lib  # pylint: disable=g-import-not-at-top
  bench_lib.tf.get_logger().setLevel('ERROR')
  devices = None
  per_process = (FLAGS.device == 'gpu' and FLAGS.process_per_configuration
                 and not FLAGS.predict_from)
  if per_process:  # The GPU is the measuring processes'.
    from tfpipe import devices as devices_lib  # pylint: disable=g-import-not-at-top
    try:
      devices_lib.ChooseDeviceType('gpu', flag='--device')
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    bench_lib.tf.config.set_visible_devices([], 'GPU')
  elif FLAGS.gpu_profile_memory_mb is not None:
    # The other GPU paths profile on a logical GPU of this process, one
    # region already; the flag would change nothing there.
    raise app.UsageError('--gpu_profile_memory_mb sets the GPU profile of '
                         '--process_per_configuration, without '
                         '--predict_from; drop it or use those.')
  elif FLAGS.device == 'gpu' and not FLAGS.predict_from:
    _, devices = bench_lib.LocalDevices(
        max(int(k) for k in FLAGS.num_cells) + 1, 'gpu',
        FLAGS.logical_gpu_memory_mb)
  start = time.time()
  rows = []
  profiles = {}
  for line in accuracy_rows.HEADER:
    print(line)
  log = lambda line: print(line, flush=True)
  if FLAGS.predict_from:
    rows, profiles = PredictAgain(FLAGS.predict_from, log)
  else:
    for model in FLAGS.models:
      save = lambda done, m=model: _Write(bench_lib, rows,
                                          dict(profiles, **{m: done}))
      if per_process:
        profiles[model] = RunModelPerProcess(model, rows, log, save)
      elif devices:
        profiles[model] = RunModelInProcess(model, devices, rows, log, save)
      else:
        profiles[model] = RunModel(model, rows, log, save)
  worst = max(rows, key=lambda r: abs(r['worst_error']))
  print(f'{accuracy_rows.Summary(rows, FLAGS.tolerance)}; worst '
        f'{100 * worst["worst_error"]:+.1f}% ({worst["model"]} '
        f'K={worst["num_cells"]} M={worst["num_micro_batches"]} '
        f'{worst["schedule"]} {worst["remat_policy"]}); '
        f'{time.time() - start:.0f} s')
  _Write(bench_lib, rows, profiles)
  watchdog.cancel()
  process_exit.ExitNow(0)


if __name__ == '__main__':
  app.run(main)
