"""PipeliningLayer: K cells on K devices, M micro-batches, one synchronous gradient.

    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=8,
        devices=['/CPU:0', '/CPU:1'], remat_policy='always', schedule='gpipe')
    pipe = p.Instantiate()
    y = pipe(x)                                     # forward, any mode
    out = pipe.ComputeLossAndGradients(x, labels, loss_fn)   # training step

`pipe(x)` is an ordinary Keras call: under a `tf.GradientTape` the gradient
flows through TensorFlow's autodiff (re-materialized per cell), which is what
Keras' `fit` needs. `ComputeLossAndGradients` drives both passes itself along
the schedule, applies the loss on the last cell per micro-batch (the full
output is never gathered), and so lets 1F1B bound the activations in flight.

Placement is decided at construction: cell k and all of its variables are
created (and, for lazily-built Keras layers, built) under
`tf.device(devices[k])`, and run there. Only cell outputs cross devices.

Two executors run ComputeLossAndGradients. 'graph' (the default) traces the
whole step, every action unrolled, as one graph: it works inside any
tf.function, and Keras' fit, but TensorFlow 2.21 runs one graph's stages one
after another on CPU devices and gRPC workers. 'threads' calls one traced
function per action from one Python thread per device, so stages overlap,
and traces each cell once instead of once per action (inside a tf.function
it emits those same functions into the one graph). Both give the same
losses, gradients and statistics.
"""

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.gpipe import cell as cell_lib
from tfpipe.gpipe import executor as executor_lib
from tfpipe.gpipe import microbatch
from tfpipe.gpipe import partition
from tfpipe.gpipe import schedule as schedule_lib
from tfpipe.gpipe import threaded_executor

EXECUTORS = ('graph', 'threads')


def DefaultDevices():
  """All GPUs, else all TPU cores, else all (logical) CPU devices."""
  for kind in ('GPU', 'TPU', 'CPU'):
    devices = tf.config.list_logical_devices(kind)
    if devices:
      return [d.name for d in devices]
  return ['/CPU:0']


def _CanonicalDevice(name):
  spec = tf.DeviceSpec.from_string(name)
  if spec.job is None:
    spec = spec.replace(job='localhost', replica=0, task=0)
  return spec.to_string()


def ResolveDevices(devices, num_cells, round_robin_placement=False):
  """Checks device names and returns one device per cell.

  Raises:
    ValueError: naming an unknown device, or saying how to place more cells
      than there are devices.
  """
  devices = list(devices) if devices is not None else DefaultDevices()
  if not devices:
    raise ValueError('devices is empty; list one device per cell or pass None.')
  known = {_CanonicalDevice(d.name): d.name
           for d in tf.config.list_logical_devices()}
  for d in devices:
    try:
      canonical = _CanonicalDevice(d)
    except ValueError as e:
      raise ValueError(f'devices: cannot parse device name {d!r}: {e}') from e
    if canonical not in known:
      raise ValueError(
          f'devices: unknown device {d!r}. Available devices: '
          f'{sorted(known.values())}. On CPU, split the CPU into logical '
          'devices with tf.config.set_logical_device_configuration (or the '
          "trainer's --num_devices); for remote devices connect to the "
          'cluster first.')
  if len(devices) < num_cells and not round_robin_placement:
    raise ValueError(
        f'{num_cells} cells need {num_cells} devices but devices lists '
        f'{len(devices)}: {devices}. Use fewer partitions, list more devices, '
        'or set round_robin_placement=True to place cell k on '
        'devices[k % len(devices)].')
  return [devices[k % len(devices)] for k in range(num_cells)]


class PipeliningLayer(base_layer.BaseLayer):
  """Pipelines a list of cells over devices with micro-batching (GPipe)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('cell_tpl', [], 'Params of the cells in order, e.g. from '
             'PartitionSequentialLayers; cell k runs on devices[k].')
    p.Define('num_micro_batches', 1, 'M: micro-batches each batch is split '
             'into; ignored when micro_batch_size is set.')
    p.Define('micro_batch_size', None, 'Examples per micro-batch; the '
             'alternative to num_micro_batches (needs a static batch size).')
    p.Define('batch_dim', 0, 'Axis of every input leaf that holds the batch.')
    p.Define('devices', None, 'One device name per cell; None uses all GPUs, '
             'else TPU cores, else CPU devices.')
    p.Define('round_robin_placement', False, 'Allow fewer devices than cells '
             'by placing cell k on devices[k % len(devices)].')
    p.Define('remat_policy', 'always', "Re-materialization: 'always', "
             "'except_last' (last micro-batch keeps activations) or 'never'.")
    p.Define('schedule', 'gpipe', "Order of actions per device: 'gpipe' "
             "(fill-drain) or '1f1b' (bounds activations in flight).")
    p.Define('num_replicas', 1, 'R: data-parallel copies of the pipeline; '
             'devices then lists R*K devices, replica by replica, and the '
             'batch is split R ways before micro-batching.')
    p.Define('compile_step', True, 'Run ComputeLossAndGradients inside a '
             'tf.function when it is called eagerly (graph executor only).')
    p.Define('executor', 'graph', "How ComputeLossAndGradients runs: 'graph' "
             "traces the whole step as one graph; 'threads' calls one traced "
             'function per action from one thread per device when called '
             'eagerly, so stages overlap on runtimes that run one graph '
             'serially (CPU, gRPC), and traces each cell once; it needs '
             "remat_policy='always'.")
    p.Define('serialize_device_ops', False, "With executor='threads': each "
             "device's thread runs its ops one at a time (TensorFlow's "
             'single-threaded executor), as an accelerator does, instead of '
             'sharing the inter-op thread pool.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if not p.cell_tpl:
      raise ValueError(f'{p.name}: cell_tpl is empty; give the params of at '
                       'least one cell (see gpipe.PartitionSequentialLayers).')
    if p.micro_batch_size is None and (
        not isinstance(p.num_micro_batches, int) or p.num_micro_batches < 1):
      raise ValueError(f'{p.name}: num_micro_batches must be >= 1. Received: '
                       f'num_micro_batches={p.num_micro_batches}')
    if p.micro_batch_size is not None and p.micro_batch_size < 1:
      raise ValueError(f'{p.name}: micro_batch_size must be >= 1. Received: '
                       f'micro_batch_size={p.micro_batch_size}')
    if p.remat_policy not in executor_lib.REMAT_POLICIES:
      raise ValueError(
          f'{p.name}: unknown remat_policy {p.remat_policy!r}; expected one '
          f'of {list(executor_lib.REMAT_POLICIES)}.')
    if p.schedule not in schedule_lib.SCHEDULES:
      raise ValueError(f'{p.name}: unknown schedule {p.schedule!r}; expected '
                       f'one of {sorted(schedule_lib.SCHEDULES)}.')
    if p.executor not in EXECUTORS:
      raise ValueError(f'{p.name}: unknown executor {p.executor!r}; expected '
                       f'one of {list(EXECUTORS)}.')
    if p.executor == 'threads' and p.remat_policy != 'always':
      raise ValueError(
          f"{p.name}: executor='threads' recomputes every cell in its "
          "backward pass, so it needs remat_policy='always'; received "
          f"remat_policy={p.remat_policy!r}. Set remat_policy='always' or "
          "use executor='graph'.")
    if not isinstance(p.num_replicas, int) or p.num_replicas < 1:
      raise ValueError(f'{p.name}: num_replicas must be >= 1. Received: '
                       f'num_replicas={p.num_replicas}')
    num_cells = len(p.cell_tpl)
    all_devices = ResolveDevices(p.devices, num_cells * p.num_replicas,
                                 p.round_robin_placement)
    # Replica r runs cell k on replica_devices[r][k]. Variables live with
    # replica 0; other replicas read them there and their gradients are
    # summed into one update, so the replicas can never drift apart.
    self._replica_devices = [
        all_devices[r * num_cells:(r + 1) * num_cells]
        for r in range(p.num_replicas)]
    self._cell_devices = self._replica_devices[0]
    self.cells = []
    for k, cell_p in enumerate(p.cell_tpl):
      cell_p = cell_p.Copy()
      if 'name' in cell_p and not cell_p.name:
        cell_p.name = f'cell{k}'
      with tf.device(self._cell_devices[k]):
        self.cells.append(cell_p.Instantiate())
    with tf.device(self._cell_devices[0]):
      self._step_counter = self.add_weight(
          name='step_counter', shape=(), dtype='int64', initializer='zeros',
          trainable=False)
    self._executors = {}
    self._threaded_executors = {}
    self._compiled_step = None

  @property
  def cell_devices(self):
    """The device of each cell."""
    return list(self._cell_devices)

  @property
  def num_cells(self):
    return len(self.cells)

  @property
  def num_replicas(self):
    return self.p.num_replicas

  @property
  def device_mesh(self):
    """[replica][stage] device names."""
    return [list(r) for r in self._replica_devices]

  def DeviceMeshText(self):
    """The (replicas, stages) device mesh as a printable table."""
    rows = [f'device mesh: {self.num_replicas} replica(s) x {self.num_cells} '
            'stage(s)']
    for r, devices in enumerate(self._replica_devices):
      rows.append(f'  replica {r}: ' + '  '.join(
          f'[{k}] {d}' for k, d in enumerate(devices)))
    return '\n'.join(rows)

  def build(self, input_shape):
    shape = input_shape
    for k, cell in enumerate(self.cells):
      with tf.device(self._cell_devices[k]):
        try:
          if not cell.built:
            cell.build(shape)
          if k + 1 < len(self.cells) and not self.cells[k + 1].built:
            shape = cell.compute_output_shape(shape)
        except (ValueError, TypeError) as e:
          source = f'the output of cell {k - 1}' if k else 'the pipeline input'
          raise ValueError(
              f'{self.p.name}: cell {k} ({cell.name}) cannot be built on '
              f'{source} with shape {shape}: {e}') from e

  def Executor(self, num_micro_batches, replica=0):
    """The graph executor (and validated schedule) for M micro-batches, cached.

    FProp always uses it; ComputeLossAndGradients uses it unless
    executor='threads'. Both kinds run the same schedule.
    """
    key = (replica, num_micro_batches)
    if key not in self._executors:
      self._executors[key] = executor_lib.PipelineExecutor(
          self.cells, self._replica_devices[replica],
          self._Schedule(num_micro_batches, replica), self.p.remat_policy,
          name=self.p.name)
    return self._executors[key]

  def ThreadedExecutor(self, num_micro_batches, replica=0):
    """The thread-per-device executor for M micro-batches, cached."""
    key = (replica, num_micro_batches)
    if key not in self._threaded_executors:
      self._threaded_executors[key] = threaded_executor.ThreadedPipelineExecutor(
          self.cells, self._replica_devices[replica],
          self._Schedule(num_micro_batches, replica), name=self.p.name,
          serialize_device_ops=self.p.serialize_device_ops,
          concurrent_devices=len(set(d for devices in self._replica_devices
                                     for d in devices)))
    return self._threaded_executors[key]

  def _Schedule(self, num_micro_batches, replica):
    devices = self._replica_devices[replica]
    unique = list(dict.fromkeys(devices))
    return schedule_lib.MakeSchedule(self.p.schedule, self.num_cells,
                                     num_micro_batches,
                                     [unique.index(d) for d in devices])

  def _Split(self, inputs, targets=None):
    """Splits the batch R ways, then each shard into micro-batches.

    Returns a list over replicas of (micro_inputs, micro_targets, weights),
    with weights n_m / N relative to the WHOLE batch, so summing every
    replica's weighted losses and gradients gives the full-batch mean.
    """
    p = self.p
    if p.num_replicas > 1:
      shards, _, batch_size = microbatch.Split(
          (inputs, targets), p.num_replicas, p.batch_dim)
    else:
      shards = [(inputs, targets)]
      batch_size = None
    result = []
    for shard_inputs, shard_targets in shards:
      micro, sizes, shard_size = microbatch.Split(
          shard_inputs, p.num_micro_batches, p.batch_dim, p.micro_batch_size)
      micro_targets = None
      if shard_targets is not None:
        micro_targets, _, _ = microbatch.Split(
            shard_targets, p.num_micro_batches, p.batch_dim,
            p.micro_batch_size)
      if batch_size is None:
        batch_size = shard_size
      result.append((micro, micro_targets, microbatch.Weights(sizes,
                                                              batch_size)))
    return result, batch_size

  def _Seeds(self, step, num_micro_batches, replica=0):
    base = tf.cast(step, tf.int64) * 1000003 + (self.p.random_seed or 0)
    return [tf.stack([base, tf.constant(replica * 65536 + m, tf.int64)])
            for m in range(num_micro_batches)]

  def _NextStep(self, training):
    step = tf.identity(self._step_counter)
    if training:
      self._step_counter.assign_add(1)
    return step

  @tf.autograph.experimental.do_not_convert
  def FProp(self, inputs, training=None):
    training = bool(training)
    shards, _ = self._Split(inputs)
    step = self._NextStep(training)
    collector = base_layer.DeferredStatsCollector() if training else None
    outputs = []
    for r, (micro, _, _) in enumerate(shards):
      seeds = self._Seeds(step, len(micro), r)
      outputs.extend(self.Executor(len(micro), r).Forward(
          micro, training, seeds, collector))
    if collector is not None:
      collector.Apply()
    with tf.device(self._cell_devices[-1]):
      return microbatch.Merge(outputs, self.p.batch_dim)

  def ComputeLossAndGradients(self, inputs, targets, loss_fn, training=True,
                              step=None, record_times=False):
    """One pipelined forward+backward over the batch.

    Args:
      inputs: the first cell's input: a tensor or nested structure.
      targets: anything with the same batch dimension (or None), split like
        the inputs and handed to loss_fn with each micro-batch.
      loss_fn: `loss_fn(outputs, targets)` for one micro-batch on the last
        cell's device; returns the micro-batch's mean loss (or per-example
        losses), optionally as `(loss, {'metric': value})`.
      training: run layers in training mode (dropout, batch-norm stats).
      step: int seeding this step's random ops; default: an internal counter
        (saved with the layer's variables) that advances each call.
      record_times: also return each action's measured (start, end)
        timestamps in `action_times` (keys are Actions, or (replica, Action)
        pairs when num_replicas > 1).

    Returns:
      LossAndGradients(loss, gradients, metrics): the exact mean loss over the
      batch, gradients aligned with `self.trainable_variables`, and the
      example-weighted metrics. Deferred batch-norm statistics are applied.
    """
    if not self.built:
      self.build(tf.nest.map_structure(lambda t: tuple(t.shape), inputs))
    if self.p.executor == 'threads':
      return self._ComputeLossAndGradients(inputs, targets, loss_fn, training,
                                           step, record_times)
    if (self.p.compile_step and tf.executing_eagerly()):
      if self._compiled_step is None:
        self._compiled_step = tf.function(self._ComputeLossAndGradients,
                                          reduce_retracing=True,
                                          autograph=False)
      return self._compiled_step(inputs, targets, loss_fn, training, step,
                                 record_times)
    return self._ComputeLossAndGradients(inputs, targets, loss_fn, training,
                                         step, record_times)

  @tf.autograph.experimental.do_not_convert
  def _ComputeLossAndGradients(self, inputs, targets, loss_fn, training, step,
                               record_times):
    self._CheckNoSharedVariables()
    shards, batch_size = self._Split(inputs, targets)
    if step is None:
      step = self._NextStep(training)
    collector = base_layer.DeferredStatsCollector() if training else None
    results = []
    if self.p.executor == 'threads':
      # Every replica's threads start before any is waited for.
      waits = [self.ThreadedExecutor(len(micro), r).Start(
          micro, micro_targets, weights, batch_size, loss_fn, training,
          self._Seeds(step, len(micro), r), collector, record_times)
               for r, (micro, micro_targets, weights) in enumerate(shards)]
      results = [wait() for wait in waits]
    else:
      for r, (micro, micro_targets, weights) in enumerate(shards):
        results.append(self.Executor(len(micro), r).ForwardBackward(
            micro, micro_targets, weights, batch_size, loss_fn, training,
            self._Seeds(step, len(micro), r), collector, record_times))
    if collector is not None:
      collector.Apply()
    if len(results) == 1:
      return results[0]
    with tf.device(self._cell_devices[-1]):
      loss = tf.add_n([res.loss for res in results])
      metrics = {name: tf.add_n([res.metrics[name] for res in results])
                 for name in results[0].metrics}
    gradients = []
    for i, v in enumerate(self._CellVariables()):
      with tf.device(v.value.device):
        gradients.append(tf.add_n([res.gradients[i] for res in results]))
    times = None
    if record_times:
      times = {(r, a): t for r, res in enumerate(results)
               for a, t in res.action_times.items()}
    return executor_lib.LossAndGradients(loss, gradients, metrics, times)

  def _CellVariables(self):
    return [v for cell in self.cells for v in cell.trainable_variables]

  def _CheckNoSharedVariables(self):
    owners = {}
    for k, cell in enumerate(self.cells):
      for v in cell.trainable_variables:
        key = id(v)
        if key in owners and owners[key] != k:
          raise ValueError(
              f'{self.p.name}: variable {v.path} is used by cell '
              f'{owners[key]} and cell {k}. Cells on different devices cannot '
              'share variables; give each cell its own (e.g. untie embeddings).')
        owners[key] = k

  @classmethod
  def FPropMeta(cls, p, input_shape):
    return base_layer.SumCosts(partition.LayerCosts(p.cell_tpl, input_shape))

  def CellCosts(self, input_shape):
    """FPropMeta of each cell, chaining shapes: for inspection and simulation."""
    return partition.LayerCosts(self.p.cell_tpl, input_shape)
