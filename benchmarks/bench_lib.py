"""Shared pieces of the benchmarks: models, timing, tables and JSON.

Why one module: every benchmark must compare configurations on the same
model and batch, time them the same way (alternating repetitions, medians)
and report the same way (a printed table and a JSON file), so that ratios
between scripts mean the same thing.

Logical devices must be configured before TensorFlow initialises its
runtime; `LocalDevices` (CPU or GPU, --device) or `SplitCpu` is called by
each script right after flag parsing. TensorFlow is imported here, quietly
(tfpipe.quiet: its C++ start-up log shows only with --verbosity=1).
"""

import json
import os
import platform
import statistics
import sys
import time

from absl import app
from absl import flags

from tfpipe import device_names
from tfpipe import devices as devices_lib
from tfpipe import quiet

tf = quiet.ImportTensorFlow()

from tfpipe import gpipe  # pylint: disable=g-import-not-at-top
from tfpipe import layers  # pylint: disable=g-import-not-at-top


def SplitCpu(num_devices):
  """Splits the CPU into `num_devices` logical devices (before TF starts)."""
  cpus = tf.config.list_physical_devices('CPU')
  try:
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError:
    pass  # Runtime already initialised; keep what exists.
  return [d.name for d in tf.config.list_logical_devices('CPU')]


def DefineDeviceFlags(memory_flag=True):
  """--device and --logical_gpu_memory_mb, for scripts that also run on GPUs."""
  flags.DEFINE_enum('device', 'auto', ['auto', 'cpu', 'gpu'],
                    'Where to run: logical CPU devices, logical GPUs (the '
                    'GPUs split as needed), or auto (gpu when one is '
                    'visible).')
  if not memory_flag:
    return
  flags.DEFINE_integer('logical_gpu_memory_mb', None,
                       'Memory of each logical GPU, MiB (default: each '
                       'GPU\'s memory, less a reserve, shared evenly).',
                       lower_bound=1)


def ChooseDeviceType(device='auto'):
  """'CPU' or 'GPU' for --device (hiding the GPUs for cpu), or UsageError."""
  try:
    return devices_lib.ChooseDeviceType(device, flag='--device')
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def LocalDevices(num_devices, device='auto', memory_limit_mb=None):
  """(device type, logical device names) for a run on `num_devices` devices.

  CPU: the CPU split into num_devices logical devices (SplitCpu). GPU: the
  visible GPUs split into num_devices logical GPUs (tfpipe.devices), with
  one line saying how. Call before TensorFlow's runtime starts.

  Raises:
    app.UsageError: --device=gpu without a GPU, or a split that cannot be
      made (naming the flag to change).
  """
  try:
    with quiet.QuietStderr(quiet.ShowStartupLog(quiet.VerbosityFromArgv())):
      device_type = devices_lib.ChooseDeviceType(device, flag='--device')
      if device_type == 'CPU':
        if memory_limit_mb is not None:
          raise ValueError(f'--logical_gpu_memory_mb={memory_limit_mb} sets '
                           'the memory of logical GPUs, but this run is on '
                           f'the CPU (--device={device}); leave it unset.')
        return 'CPU', SplitCpu(num_devices)
      split, names = devices_lib.SplitLocalDevices(
          'GPU', num_devices, memory_limit_mb=memory_limit_mb,
          memory_name='--logical_gpu_memory_mb')
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if split is not None:
    print(split.Describe(f'{num_devices} devices needed'), flush=True)
  return 'GPU', names


def DeviceLabel(device_type, num_devices):
  """'4 logical CPU devices' or '4 logical GPUs', for table captions."""
  return (f'{num_devices} logical CPU devices' if device_type == 'CPU' else
          f'{num_devices} logical GPUs')


def InterOpThreadsNeeded(num_devices):
  """Inter-op threads that SerializeDeviceOps needs for `num_devices`.

  A function call waits in an inter-op thread for its body, which the
  single-threaded executor runs in a second one; with fewer than two per
  concurrently calling device (plus one for eager work) the calls starve
  each other and the step hangs.
  """
  return 2 * num_devices + 1


def _UseSingleThreadedExecutor():
  """Makes this thread's function calls run their ops one at a time, inline."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  context.context().function_call_options.executor_type = (
      'SINGLE_THREADED_EXECUTOR')


def SerializeDeviceOps(pipe, concurrent_devices=None):
  """Makes each device of `pipe` run its ops one at a time, as an accelerator.

  Logical CPU devices share one thread pool, so without this two actions of
  different devices (or of one device) run at the same time and a pipeline
  looks better or worse than on exclusive devices. With it, each device
  thread of executor='threads' runs its function calls on TensorFlow's
  single-threaded executor. Call after SplitCpu and before the first step.

  Raises:
    ValueError: too few inter-op threads (the step would hang), or a cell
      whose variables live on another device (its functions would span two
      devices, whose parts the single-threaded executor waits on forever).
  """
  from tfpipe.gpipe import dispatch  # pylint: disable=g-import-not-at-top
  name = pipe.p.name
  num_devices = concurrent_devices or len(
      {d for devices in pipe.device_mesh for d in devices})
  threads = (tf.config.threading.get_inter_op_parallelism_threads() or
             os.cpu_count() or 1)
  needed = InterOpThreadsNeeded(num_devices)
  if threads < needed:
    raise ValueError(
        f'{name}: serializing the ops of {num_devices} devices needs at least '
        f'{needed} inter-op threads, but TensorFlow has {threads}. Call '
        f'tf.config.threading.set_inter_op_parallelism_threads({needed}) '
        'before TensorFlow starts.')
  for r, devices in enumerate(pipe.device_mesh):
    for k, (cell, device) in enumerate(zip(pipe.cells, devices)):
      for v in cell.variables:
        if not device_names.SameDevice(v.value.device, device):
          raise ValueError(
              f'{name}: serialized device ops need every variable of a cell '
              f"on that cell's device, but cell {k} ({cell.name}) of replica "
              f'{r} runs on {device} and its variable {v.path} lives on '
              f'{v.value.device} (replicas read replica 0\'s variables). Use '
              'one replica.')
  pipe.SetThreadsDispatcher(dispatch.Threads(
      name=name, thread_initializer=_UseSingleThreadedExecutor))
  return pipe


def TransformerLayerParams(num_layers, dim=256, heads=4, hidden=1024):
  return [layers.TransformerLayer.Params().Set(
      name=f'xf{i}', input_dim=dim, num_heads=heads, hidden_dim=hidden)
          for i in range(num_layers)]


def ConvLayerParams(num_layers, channels=32, in_channels=3):
  out = [layers.Conv2DLayer.Params().Set(
      name='conv0', filter_shape=(3, 3, in_channels, channels))]
  out += [layers.Conv2DLayer.Params().Set(
      name=f'conv{i}', filter_shape=(3, 3, channels, channels))
          for i in range(1, num_layers)]
  return out


def MakeModel(kind, num_layers, batch, seq=64, dim=256, image=32, heads=4,
              hidden=None):
  """(layer params, input tensor) for 'transformer', 'conv' or 'mlp'.

  The Transformer's feed-forward width is `hidden` (default 4 * dim).
  """
  if kind == 'transformer':
    x = tf.random.stateless_normal([batch, seq, dim], seed=[1, 2])
    return TransformerLayerParams(num_layers, dim=dim, heads=heads,
                                  hidden=hidden or 4 * dim), x
  if kind == 'conv':
    x = tf.random.stateless_normal([batch, image, image, 3], seed=[1, 2])
    return ConvLayerParams(num_layers), x
  if kind == 'mlp':
    x = tf.random.stateless_normal([batch, dim], seed=[1, 2])
    return [layers.FCLayer.Params().Set(name=f'fc{i}', input_dims=dim,
                                        output_dims=dim, activation='relu')
            for i in range(num_layers)], x
  raise ValueError(f'Unknown model kind {kind!r}; expected transformer, conv '
                   'or mlp.')


def Loss(y, unused_targets=None):
  return tf.reduce_mean(tf.square(y))


def Sgd(variables, gradients, lr=1e-3):
  """Plain SGD, applied where each variable lives (no optimizer slots)."""
  for v, g in zip(variables, gradients):
    with tf.device(v.value.device):
      v.assign_sub(lr * g)


def _DeviceOf(variable):
  """The device of a Keras or a tf.Variable."""
  value = variable.value
  return (value() if callable(value) else value).device


class Adam:
  """Adam whose slots and update live on each variable's device.

  Why not a Keras optimizer: the benchmarks measure per-device memory, and
  this keeps the two slots per parameter next to their variable by
  construction, whatever the optimizer's own placement does.
  """

  def __init__(self, variables, lr=1e-4, beta_1=0.9, beta_2=0.999,
               epsilon=1e-7):
    self.variables = list(variables)
    self.lr, self.beta_1, self.beta_2, self.epsilon = (lr, beta_1, beta_2,
                                                       epsilon)
    self.slots = []
    for v in self.variables:
      with tf.device(_DeviceOf(v)):
        self.slots.append((tf.Variable(tf.zeros_like(v), trainable=False),
                           tf.Variable(tf.zeros_like(v), trainable=False)))
    with tf.device('/CPU:0'):
      self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False)

  def Apply(self, gradients):
    """One update; call inside a tf.function."""
    t = tf.cast(self.iterations.assign_add(1), tf.float32)
    scale = self.lr * tf.sqrt(1 - self.beta_2**t) / (1 - self.beta_1**t)
    for v, (m, s), g in zip(self.variables, self.slots, gradients):
      with tf.device(_DeviceOf(v)):
        m.assign(self.beta_1 * m + (1 - self.beta_1) * g)
        s.assign(self.beta_2 * s + (1 - self.beta_2) * tf.square(g))
        v.assign_sub(scale * m / (tf.sqrt(s) + self.epsilon))


def MakePipe(layer_params, num_cells, num_micro_batches, devices, remat,
             schedule='gpipe', input_shape=None, executor='graph',
             serialize_device_ops=False, **pipe_params):
  """A PipeliningLayer over the first num_cells devices; extra params as given.

  With serialize_device_ops, each device runs its ops one at a time
  (SerializeDeviceOps; executor='threads').
  """
  cells = gpipe.PartitionSequentialLayers(
      layer_params, num_cells, balance='flops' if input_shape else 'params',
      input_shape=input_shape)
  p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches,
      devices=list(devices[:num_cells]), remat_policy=remat,
      schedule=schedule, executor=executor, **pipe_params)
  pipe = p.Instantiate()
  if serialize_device_ops:
    SerializeDeviceOps(pipe)
  return pipe


def PipeTrainStep(pipe, x=None, update=None):
  """One pipelined forward+backward and an update (SGD by default).

  For executor='graph' the whole step is a tf.function of x. For
  executor='threads' the pipelined part runs eagerly (it dispatches its own
  traced functions) and only the update is traced; pass x then, and call the
  result with no arguments.

  Args:
    pipe: the PipeliningLayer.
    x: the input, for executor='threads'.
    update: update(variables, gradients), traced; default Sgd.
  """
  update = update or Sgd
  executor = pipe.p.executor
  if executor == 'auto' and x is not None:
    executor = pipe.ResolvedExecutor(x)
  if executor == 'threads':
    traced_update = tf.function(
        lambda grads: update(pipe.trainable_variables, grads))

    def ThreadedStep():
      out = pipe.ComputeLossAndGradients(x, None, Loss)
      traced_update(out.gradients)
      return out.loss
    return ThreadedStep

  @tf.function
  def Step(x):
    out = pipe.ComputeLossAndGradients(x, None, Loss)
    update(pipe.trainable_variables, out.gradients)
    return out.loss
  return Step


def TimeAlternating(steps, reps, warmup=2, log=None):
  """Times each named step `reps` times, configurations interleaved.

  Alternating (A B C A B C ...) rather than (A A A B B B) spreads the load of
  a shared machine evenly over the configurations. Every call syncs by
  reading its result back.

  Returns:
    {name: list of seconds}.
  """
  for name, fn in steps.items():
    t = time.perf_counter()
    for _ in range(warmup):
      _Sync(fn())
    if log:
      log(f'  warmed up {name} in {time.perf_counter() - t:.1f}s')
  samples = {name: [] for name in steps}
  for _ in range(reps):
    for name, fn in steps.items():
      t = time.perf_counter()
      _Sync(fn())
      samples[name].append(time.perf_counter() - t)
  return samples


def _Sync(result):
  tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, 'numpy') else t,
                        result)


def Median(xs):
  return statistics.median(xs)


def FormatTable(header, rows):
  """Left-aligned first column, right-aligned others, markdown pipes."""
  cells = [list(map(str, header))] + [[_Fmt(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = []
  for j, r in enumerate(cells):
    parts = [r[0].ljust(widths[0])] + [
        c.rjust(w) for c, w in zip(r[1:], widths[1:])]
    lines.append('| ' + ' | '.join(parts) + ' |')
    if j == 0:
      lines.append('|' + '|'.join('-' * (w + 2) for w in widths) + '|')
  return '\n'.join(lines)


def _Fmt(c):
  if isinstance(c, float):
    return f'{c:.3f}' if abs(c) < 100 else f'{c:.1f}'
  return str(c)


def Environment():
  return {
      'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'),
      'command': ' '.join([os.path.basename(sys.executable)] + sys.argv),
      'tensorflow': tf.__version__,
      'python': platform.python_version(),
      'cpu_count': os.cpu_count(),
      'gpus': [tf.config.experimental.get_device_details(g).get(
          'device_name', g.name)
               for g in tf.config.list_physical_devices('GPU')],
      'load_average': os.getloadavg() if hasattr(os, 'getloadavg') else None,
  }


def WriteJson(path, payload):
  if not path:
    return
  payload = dict(payload)
  payload.setdefault('environment', Environment())
  with open(path, 'w') as f:
    json.dump(payload, f, indent=2, default=float)
  print(f'wrote {path}')
