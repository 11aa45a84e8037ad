"""PipeliningLayer: K cells on K devices, M micro-batches, one synchronous gradient.

    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=8,
        devices=['/CPU:0', '/CPU:1'], remat_policy='always', schedule='gpipe')
    pipe = p.Instantiate()
    y = pipe(x)                                     # forward, any mode
    out = pipe.ComputeLossAndGradients(x, labels, loss_fn)   # training step

Every entry point runs on one runtime (runtime.py), which interprets the
schedule for both passes:

* `ComputeLossAndGradients` runs every action, with the loss applied on the
  last cell per micro-batch (the full output is never gathered), so 1F1B
  bounds the activations in flight.
* `pipe(x)` under a `tf.GradientTape` (Lingvo's and Keras' `fit` idiom) runs
  the forward actions and registers the pipeline's backward with the tape:
  when the tape asks for the gradient, the backward actions run, recompute
  per the remat policy and accumulate the weight gradients into per-variable
  buffers, so memory does not grow with M.
* `pipe(x)` without a tape (inference) runs only the forward actions.

Placement is decided at construction: cell k and all of its variables are
created (and, for lazily-built Keras layers, built) under
`tf.device(devices[k])`, and everything the runtime emits for cell k (the
forward, the backward, the gradient accumulators) runs there. Only cell
outputs and their gradients cross devices.

`executor` picks how actions are issued (dispatch.py): 'graph' issues them
inline, so a traced step is one graph that an accelerator's runtime
overlaps; 'threads' issues each device's actions from its own thread, so
the cells on local CPU devices overlap where one graph's would run one
after another; it pays only for large actions (dispatch.ChooseExecutor). Inside a
tf.function both are inline. Both give the same losses, gradients and
statistics.
"""

import collections
import math

import tensorflow as tf

from tfpipe import base_layer
from tfpipe import device_names
from tfpipe import initial_values
from tfpipe import placement
from tfpipe.gpipe import cell_devices
from tfpipe.gpipe import dispatch as dispatch_lib
from tfpipe.gpipe import microbatch
from tfpipe.gpipe import partition
from tfpipe.gpipe import runtime as runtime_lib
from tfpipe.gpipe import schedule as schedule_lib
from tfpipe.gpipe import tape_path
from tfpipe.gpipe import tied_variables
from tfpipe.layers import core as layers_core

EXECUTORS = ('auto', 'graph', 'threads')
_MAX_COMPILED_STEPS = 4

# How a worker that cannot allocate a tensor sent to it fails the step; the
# error says nothing of memory (tfpipe/out_of_memory.py).
_RECEIVE_FAILED = 'unable to parse tensor proto'


def CellError(pipeline_name, cells, k, x, error):
  """A ValueError naming cell k, its input's shapes and the likely fix."""
  source = (f'the output of cell {k - 1} ({cells[k - 1].name})'
            if k else 'the pipeline input')
  shapes = microbatch.ShapesText(x)
  text = str(error).lower()
  if _RECEIVE_FAILED in text:
    return ValueError(
        f'{pipeline_name}: cell {k} ({cells[k].name}) could not receive '
        f'{source} (shapes {shapes}): its device most likely ran out of '
        'memory (a worker that cannot allocate a tensor sent to it fails '
        'this way). --mode=inspect_model predicts each device\'s peak; more '
        'partitions, more micro-batches, remat_policy=\'always\' or '
        'balance=\'memory\' lower it. '
        f'Cause: {type(error).__name__}: {error}')
  hint = (' Check that the cells\' layers fit each other (e.g. input_dims).'
          if 'shape' in text or 'dimension' in text else '')
  if microbatch.UNKNOWN_RANK in tf.nest.flatten(shapes):
    hint += (' An input of unknown rank (e.g. a tf.py_function\'s output) '
             'can be given its shape with tf.ensure_shape in the cell before.')
  return ValueError(
      f'{pipeline_name}: cell {k} ({cells[k].name}) failed on {source} with '
      f'shapes {shapes}.{hint} Cause: {type(error).__name__}: {error}')


def _Shapes(structure):
  """The shapes of a structure's tensors (None leaves stay None)."""
  return tf.nest.map_structure(
      lambda t: None if t is None else tuple(t.shape), structure)


def _Offsets(sizes):
  """Index of each part's first example, from the parts' sizes."""
  offsets, total = [], 0
  for size in sizes:
    offsets.append(tf.cast(total, tf.int64))
    total = total + size
  return offsets


class PipeliningLayer(base_layer.BaseLayer):
  """Pipelines a list of cells over devices with micro-batching (GPipe)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('cell_tpl', [], 'Params of the cells in order, e.g. from '
             'PartitionSequentialLayers; cell k runs on devices[k].')
    p.Define('num_partitions', None, 'K, for builders that cut a layer list '
             'into cell_tpl (the trainer\'s task, PartitionSequentialLayers); '
             'None: cell_tpl already holds the cells.')
    p.Define('balance', 'flops', 'How such a builder balances the cut: '
             "'params', 'flops', 'memory', 'time', or a list of layer counts "
             'per cell.')
    p.Define('num_micro_batches', 1, 'M: micro-batches each batch is split '
             'into; ignored when micro_batch_size is set.')
    p.Define('micro_batch_size', None, 'Examples per micro-batch; the '
             'alternative to num_micro_batches (needs a static batch size).')
    p.Define('batch_dim', 0, 'Axis of every input leaf that holds the batch.')
    p.Define('devices', None, 'One device name per cell (R*K with replicas); '
             'None uses all GPUs, else TPU cores, else CPU devices.')
    p.Define('round_robin_placement', False, 'Allow fewer devices than cells '
             'by placing cell k on devices[k % len(devices)] (implied by '
             "schedule='interleaved_1f1b').")
    p.Define('remat_policy', 'always', "Re-materialization: 'always', "
             "'except_last' (last micro-batch keeps activations) or 'never'.")
    p.Define('schedule', 'gpipe', "Order of actions per device: 'gpipe' "
             "(fill-drain), '1f1b' (bounds activations in flight), "
             "'interleaved_1f1b' (K/D cells per device, placed round-robin: "
             "about 1/v of 1F1B's bubble) or 'zb_h1' (zero bubble: weight "
             "gradients fill the bubbles; about 1/3 of 1F1B's, same memory).")
    p.Define('num_replicas', 1, 'R: data-parallel copies of the pipeline; '
             'devices then lists R*K devices, replica by replica, and the '
             'batch is split R ways before micro-batching.')
    p.Define('compile_step', True, 'Run ComputeLossAndGradients inside a '
             'tf.function when it is called eagerly with executor=\'graph\'.')
    p.Define('executor', 'auto', "How actions are issued: 'graph' inline, "
             'so a traced step is one graph (GPU and TPU runtimes overlap its '
             "cells); 'threads' from one thread per device when called "
             'eagerly, which overlaps the cells on local CPU devices; '
             "'auto' picks 'threads' only for large actions on local CPU "
             "devices, else 'graph' (see dispatch.ChooseExecutor).")
    return p

  @classmethod
  def CheckParams(cls, p, prefix=None):
    """Raises ValueError naming the bad setting; needs no device or tensor.

    The one check of a pipeline's settings: the layer runs it when built,
    and the trainer runs it on `task.pipeline` before TensorFlow starts.

    Args:
      p: PipeliningLayer params (cell_tpl may still be empty in a template).
      prefix: how the params are named in messages (default: p.name).
    """
    where = prefix or p.name

    def Bad(name, requirement, flag=None):
      hint = f' (the trainer\'s --{flag})' if flag else ''
      return ValueError(f'{where}.{name} {requirement}{hint}. Received: '
                        f'{name}={p.Get(name)!r}')

    def IsCount(value):
      return isinstance(value, int) and not isinstance(value, bool) and (
          value >= 1)
    if p.micro_batch_size is None and not IsCount(p.num_micro_batches):
      raise Bad('num_micro_batches', 'must be an int >= 1',
                'num_micro_batches')
    if p.micro_batch_size is not None and not IsCount(p.micro_batch_size):
      raise Bad('micro_batch_size', 'must be an int >= 1, or None to use '
                'num_micro_batches')
    if p.num_partitions is not None and not IsCount(p.num_partitions):
      raise Bad('num_partitions', 'must be an int >= 1', 'num_partitions')
    if not IsCount(p.num_replicas):
      raise Bad('num_replicas', 'must be an int >= 1', 'num_replicas')
    if p.remat_policy not in runtime_lib.REMAT_POLICIES:
      raise Bad('remat_policy', 'must be one of '
                f'{list(runtime_lib.REMAT_POLICIES)}', 'remat_policy')
    if p.schedule not in schedule_lib.SCHEDULES:
      raise Bad('schedule', f'must be one of {sorted(schedule_lib.SCHEDULES)}',
                'schedule')
    if p.executor not in EXECUTORS:
      raise Bad('executor', f'must be one of {list(EXECUTORS)}', 'executor')
    if isinstance(p.balance, (list, tuple)):
      if not all(IsCount(c) for c in p.balance) or (
          p.num_partitions is not None and len(p.balance) != p.num_partitions):
        raise Bad('balance', 'as a list must give one layer count >= 1 per '
                  f'cell (num_partitions={p.num_partitions})', 'balance')
    elif p.balance not in partition.BALANCE_METHODS:
      raise Bad('balance', f'must be one of {list(partition.BALANCE_METHODS)}'
                ' or a list of layer counts per cell', 'balance')
    if p.cell_tpl and p.num_partitions is not None and (
        len(p.cell_tpl) != p.num_partitions):
      raise ValueError(
          f'{where}: cell_tpl holds {len(p.cell_tpl)} cells but '
          f'num_partitions={p.num_partitions}; leave num_partitions None when '
          'you give the cells.')

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if not p.cell_tpl:
      raise ValueError(f'{p.name}: cell_tpl is empty; give the params of at '
                       'least one cell (see gpipe.PartitionSequentialLayers).')
    self.CheckParams(p)
    num_cells = len(p.cell_tpl)
    interleaved = p.schedule == 'interleaved_1f1b'
    all_devices = cell_devices.ResolveDevices(
        p.devices, num_cells * p.num_replicas,
        p.round_robin_placement or interleaved)
    # Replica r runs cell k on replica_devices[r][k]. Variables live with
    # replica 0; other replicas read them there and their gradients are
    # summed into one update, so the replicas can never drift apart.
    self._replica_devices = [
        all_devices[r * num_cells:(r + 1) * num_cells]
        for r in range(p.num_replicas)]
    if interleaved:
      for devices in self._replica_devices:
        unique = list(dict.fromkeys(devices))
        try:
          schedule_lib.VirtualStages(num_cells,
                                     [unique.index(d) for d in devices])
        except ValueError as e:
          raise ValueError(f'{p.name}: {e}') from e
    self._cell_devices = self._replica_devices[0]
    self.cells = []
    for k, cell_p in enumerate(p.cell_tpl):
      cell_p = cell_p.Copy()
      if 'name' in cell_p and not cell_p.name:
        cell_p.name = f'cell{k}'
      with tf.device(self._cell_devices[k]), initial_values.ComputedHere():
        self.cells.append(cell_p.Instantiate())
    unbound = layers_core.BindTiedEmbeddings(self.cells)
    if unbound:
      raise ValueError(
          f'{p.name}: layer {unbound[0].p.name!r} has tied_embedding='
          f'{unbound[0].p.tied_embedding!r}, but no cell holds an '
          'EmbeddingLayer of that name. Name the embedding layer so, or set '
          'tied_embedding=None.')
    with tf.device(self._cell_devices[0]):
      self._step_counter = self.add_weight(
          name='step_counter', shape=(), dtype='int64', initializer='zeros',
          trainable=False)
    self._runtime = None
    self._tied = None
    self._executors = {}
    self._threads = dispatch_lib.Threads(name=p.name)
    # One compiled step per loss_fn, the latest few: a tf.function keeps
    # every trace, and a caller may pass a new closure each step.
    self._compiled_steps = collections.OrderedDict()
    # Batch norm's deferred statistics, applied eagerly: one traced update
    # per device (base_layer.DeferredStatsCollector).
    self._stats_updates = {}

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
    """[replica][cell] device names."""
    return [list(r) for r in self._replica_devices]

  def DeviceMeshText(self):
    """The (replicas, cells) device mesh as a printable table."""
    return device_names.DeviceMeshText(
        [d for devices in self._replica_devices for d in devices],
        self.num_replicas)

  @tf.autograph.experimental.do_not_convert
  def build(self, input_shape):
    shape = input_shape
    for k, cell in enumerate(self.cells):
      with tf.device(self._cell_devices[k]), initial_values.ComputedHere():
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

  # ---- the runtime and how its actions are issued -------------------------

  @property
  def runtime(self):
    """The PipelineRuntime that runs every entry point (created on first use)."""
    if self._runtime is None:
      cells = self._tied.RuntimeCells() if self._tied else self.cells
      self._runtime = runtime_lib.PipelineRuntime(
          cells, self._replica_devices, self.p.schedule,
          self.p.remat_policy,
          lambda k, x, e: CellError(self.p.name, self.cells, k, x, e))
    return self._runtime

  def Schedule(self, num_micro_batches, replica=0):
    """The validated schedule that a step with M micro-batches runs."""
    return self.runtime.Schedule(num_micro_batches, replica)

  def SetThreadsDispatcher(self, dispatcher):
    """Replaces the dispatcher used by executor='threads' (e.g. one whose
    device threads run their ops one at a time; see benchmarks/bench_lib)."""
    self._threads = dispatcher

  def ResolvedExecutor(self, inputs):
    """The executor a step on `inputs` uses: p.executor, 'auto' resolved.

    'auto' is decided once per batch shape from the devices and the cells'
    cost model (dispatch.ChooseExecutor); the cost model is the params' FPropMeta, so
    nothing runs to decide it.
    """
    if self.p.executor != 'auto':
      return self.p.executor
    shape = _Shapes(inputs)
    key = repr(shape)
    if key not in self._executors:
      if len(self._executors) >= _MAX_COMPILED_STEPS * 4:
        self._executors.clear()  # Shapes that keep changing: stay bounded.
      self._executors[key] = dispatch_lib.ChooseExecutor(
          [d for devices in self._replica_devices for d in devices],
          self._ForwardFlopsPerAction(shape))
    return self._executors[key]

  def _ForwardFlopsPerAction(self, input_shape):
    batch = base_layer.BatchDim(input_shape)
    if batch is None:
      return None
    try:
      costs = self.CellCosts(input_shape)
    except ValueError:
      return None
    if not costs or any(c.flops <= 0 for c in costs):
      return None  # Cells without a cost model (e.g. Keras cells).
    num_micro = (math.ceil(batch / self.p.micro_batch_size)
                 if self.p.micro_batch_size else self.p.num_micro_batches)
    return sum(c.flops for c in costs) / len(costs) / max(num_micro, 1)

  def _Dispatcher(self, inputs):
    """Threads when chosen and eager; inline otherwise (always in a graph)."""
    if tf.executing_eagerly() and self.ResolvedExecutor(inputs) == 'threads':
      return self._threads
    return dispatch_lib.Inline()

  # ---- splitting the batch -------------------------------------------------

  def _Shards(self, inputs, targets, step):
    """Splits the batch R ways, then each shard into micro-batches.

    Returns ([runtime.MicroBatches per replica], N). The scales n_m / N are
    relative to the WHOLE batch, so summing every replica's weighted losses
    and gradients gives the full-batch mean; the offsets too, so randomness
    drawn per example does not depend on R or M. Inputs are split on their
    first cell's device, targets on their last cell's.
    """
    p = self.p
    num_replicas = p.num_replicas
    with tf.device(self._cell_devices[0]):
      if num_replicas > 1:
        shards, shard_sizes, batch_size = microbatch.Split(
            (inputs, targets), num_replicas, p.batch_dim)
        shard_offsets = _Offsets(shard_sizes)
      else:
        shards, batch_size, shard_offsets = [(inputs, targets)], None, [0]
    result = []
    for r, (shard_inputs, shard_targets) in enumerate(shards):
      devices = self._replica_devices[r]
      with tf.device(devices[0]):
        micro, sizes, shard_size = microbatch.Split(
            shard_inputs, p.num_micro_batches, p.batch_dim,
            p.micro_batch_size)
      micro_targets = None
      if shard_targets is not None:
        with tf.device(devices[-1]):
          micro_targets, _, _ = microbatch.Split(
              shard_targets, p.num_micro_batches, p.batch_dim,
              p.micro_batch_size)
      if batch_size is None:
        batch_size = shard_size
      with tf.device(devices[0]):
        offsets = [shard_offsets[r] + o for o in _Offsets(sizes)]
        seeds = self._Seeds(step, len(micro), r)
      with tf.device(devices[-1]):
        scales = microbatch.Weights(sizes, batch_size)
      result.append(runtime_lib.MicroBatches(micro, micro_targets, scales,
                                             seeds, offsets, sizes))
    return result, batch_size

  def _Seeds(self, step, num_micro_batches, replica=0):
    base = tf.cast(step, tf.int64) * 1000003 + (self.p.random_seed or 0)
    return [tf.stack([base, tf.constant(replica * 65536 + m, tf.int64)])
            for m in range(num_micro_batches)]

  def _NextStep(self, training):
    with tf.device(self._cell_devices[0]):
      step = tf.identity(self._step_counter)
      if training:
        self._step_counter.assign_add(1)
    return step

  def _MergeOutputs(self, outputs):
    with tf.device(self._cell_devices[-1]):
      return microbatch.Merge([y for per_replica in outputs
                               for y in per_replica], self.p.batch_dim)

  # ---- entry points ------------------------------------------------------
  # Entry points (and build) are marked do_not_convert: their Python control
  # flow is trace-time logic, and a caller's tf.function, whose autograph
  # converts what it calls recursively, would otherwise rewrite it (seen as
  # order-dependent failures inside converted Keras build wrappers).

  @tf.autograph.experimental.do_not_convert
  def FProp(self, inputs, training=None):
    training = bool(training)
    tied = self.TiedVariables(inputs)
    tied.Refresh()
    step = self._NextStep(training)
    shards, _ = self._Shards(inputs, None, step)
    collector = base_layer.DeferredStatsCollector(
        self._stats_updates) if training else None
    if tape_path.WillDifferentiate(inputs, self._CellVariables(), training):
      outputs = tape_path.Forward(
          self.runtime, inputs, shards, training, collector,
          lambda: self._Dispatcher(inputs),
          (self._cell_devices[0], self._cell_devices[-1]), self.p.batch_dim,
          tied)
    else:
      outputs = self._MergeOutputs(self.runtime.Forward(
          shards, training, collector, self._Dispatcher(inputs)))
    if collector is not None:
      collector.Apply()
    return outputs

  @tf.autograph.experimental.do_not_convert
  def ComputeLossAndGradients(self, inputs, targets, loss_fn, training=True,
                              step=None, record_times=False):
    """One pipelined forward+backward over the batch.

    Args:
      inputs: the first cell's input: a tensor or nested structure.
      targets: anything with the same batch dimension (or None), split like
        the inputs and handed to loss_fn with each micro-batch.
      loss_fn: `loss_fn(outputs, targets)` for one micro-batch on the last
        cell's device; returns the micro-batch's mean loss (or per-example
        losses), optionally as `(loss, {'metric': value})`; or a sum and
        the weight it sums over, `(loss_sum, weight)` or `(loss_sum, weight,
        {'metric': sum})`, e.g. for padded tokens (see loss.ParseLoss).
      training: run layers in training mode (dropout, batch-norm stats).
      step: int seeding this step's random ops; default: an internal counter
        (saved with the layer's variables) that advances each call.
      record_times: also return each action's measured (start, end)
        timestamps in `action_times` (keys are Actions, or (replica, Action)
        pairs when num_replicas > 1).

    Returns:
      LossAndGradients(loss, gradients, metrics): the exact loss over the
      batch, gradients aligned with `self.trainable_variables`, and the
      metrics, weighted like the loss. Deferred batch-norm statistics are
      applied.
    """
    if not self.built:
      self.build(_Shapes(inputs))
    if (self.p.compile_step and tf.executing_eagerly() and
        self.ResolvedExecutor(inputs) == 'graph'):
      if loss_fn not in self._compiled_steps:
        self._compiled_steps[loss_fn] = tf.function(
            self._CompiledStep, reduce_retracing=True, autograph=False)
        while len(self._compiled_steps) > _MAX_COMPILED_STEPS:
          self._compiled_steps.popitem(last=False)
      self._compiled_steps.move_to_end(loss_fn)
      # The trainable set is an argument, so that freezing a layer retraces.
      return self._compiled_steps[loss_fn](
          inputs, targets, loss_fn, training, step, record_times,
          self._TrainableKey())
    return self._ComputeLossAndGradients(inputs, targets, loss_fn, training,
                                         step, record_times)

  def _CompiledStep(self, inputs, targets, loss_fn, training, step,
                    record_times, trainable_key=None):
    del trainable_key  # Only a tf.function's cache key.
    # The returned gradients stay on their cells' devices (not copied to the
    # default device by tf.function's output identities).
    placement.FollowInputDevicesToTheEnd()
    return self._ComputeLossAndGradients(inputs, targets, loss_fn, training,
                                         step, record_times)

  def _TrainableKey(self):
    return tuple(id(v) for v in self._CellVariables())

  @tf.autograph.experimental.do_not_convert
  def _ComputeLossAndGradients(self, inputs, targets, loss_fn, training, step,
                               record_times):
    tied = self.TiedVariables(inputs)
    tied.Refresh()
    if step is None:
      step = self._NextStep(training)
    shards, batch_size = self._Shards(inputs, targets, step)
    collector = base_layer.DeferredStatsCollector(
        self._stats_updates) if training else None
    with tf.device(self._cell_devices[-1]):
      batch_size = tf.cast(batch_size, tf.float32)
    result = self.runtime.ForwardBackward(
        shards, batch_size, loss_fn, training, collector,
        self._Dispatcher(inputs), record_times)
    if collector is not None:
      collector.Apply()
    return result._replace(gradients=tied.Fold(result.gradients))

  def _trackable_children(self, save_type='checkpoint', **kwargs):
    """Checkpoints name each layer by its own name, not by its cell.

    So a checkpoint restores under any K (a different cut moves a layer to
    another cell, not to another name). Cells that are not sequential
    containers of uniquely named layers keep their `cells/<k>` names.
    """
    children = super()._trackable_children(save_type, **kwargs)
    layers = {}
    for cell in self.cells:
      for layer in getattr(cell, 'sub', None) or [None]:
        if layer is None or layer.name in layers:
          return children
        layers[layer.name] = layer
    children = {key: value for key, value in children.items()
                if not key.startswith('cells')}
    children.update({f'layers/{name}': layer
                     for name, layer in layers.items()})
    return children

  def _CellVariables(self):
    """The cells' trainable variables, each once: what gradients align with."""
    if self._tied is not None:
      return self._tied.CellVariables()
    seen = {}
    for cell in self.cells:
      for v in cell.trainable_variables:
        seen.setdefault(id(v), v)
    return list(seen.values())

  def TiedVariables(self, inputs=None):
    """The variables a cell reads from another cell, each given a copy.

    Found on first use by tracing the cells once on `inputs`' shapes
    (tied_variables.py); later calls return what was found.

    Args:
      inputs: the pipeline input (tensors or tf.TensorSpecs, any batch size);
        needed on the first call only.
    """
    if self._tied is None:
      if inputs is None:
        raise ValueError(f'{self.p.name}: TiedVariables needs the pipeline '
                         'input (or its tf.TensorSpecs) on its first call.')
      if not self.built:
        self.build(tf.nest.map_structure(lambda t: tuple(t.shape), inputs))
      self._tied = tied_variables.Find(
          self.cells, self._cell_devices,
          tied_variables.MicroBatchSpec(inputs, self.p),
          lambda k, x, e: CellError(self.p.name, self.cells, k, x, e))
      if self._tied.ties:
        self._runtime = None  # Its stages must see the copies.
    return self._tied

  @classmethod
  def FPropMeta(cls, p, input_shape):
    return base_layer.SumCosts(partition.LayerCosts(p.cell_tpl, input_shape))

  def CellCosts(self, input_shape):
    """FPropMeta of each cell, chaining shapes: for inspection and simulation."""
    return partition.LayerCosts(self.p.cell_tpl, input_shape)
