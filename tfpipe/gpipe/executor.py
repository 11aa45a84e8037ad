"""Runs a schedule: placement, re-materialization, order and gradient accumulation.

The executor walks the schedule's actions in one global order that respects
each device's list (`schedule.Validate` returns it) and emits, per action:

  F(m, k)  cell k on micro-batch m, under `tf.device(devices[k])`, recorded by
           its own `tf.GradientTape`. With re-materialization the cell runs
           inside `tf.recompute_grad`, so the tape keeps only the cell's input
           (the boundary activation) and the cell is recomputed at B(m, k).
  B(m, k)  `tape.gradient` of cell k's output for micro-batch m, seeded with
           the gradient that B(m, k+1) produced for that output; it yields the
           gradient for cell k's input (sent on to B(m, k-1)) and for cell k's
           variables (added to the accumulator).

Inside a `tf.function` each action gets a control dependency on the previous
action of the same device, so the runtime keeps the schedule's order (that is
what bounds 1F1B's memory) while different devices still overlap. Eagerly,
emitting in the global order is the order.

Random ops see a seed unique to (step, micro-batch), entered inside the
recomputed function, so a recompute draws the same dropout mask. Layers that
defer statistics (batch norm) record them during the forward only; a
recompute records nothing, and the merged statistics are applied once per
step.
"""

import collections
import contextlib

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.gpipe import schedule as schedule_lib

REMAT_POLICIES = ('always', 'except_last', 'never')

LossAndGradients = collections.namedtuple(
    'LossAndGradients', ['loss', 'gradients', 'metrics', 'action_times'],
    defaults=[None])
LossAndGradients.__doc__ = (
    'Result of a pipelined training step: the exact full-batch mean loss, '
    'gradients aligned with the pipeline\'s trainable_variables, metrics, and '
    '(when recorded) {Action: (start, end)} float64 timestamp tensors.')


# Errors a cell raises when its layers do not fit its input.
CELL_ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)


def CellError(pipeline_name, cells, k, x, error):
  """A ValueError naming cell k, its input's shapes and the likely fix."""
  source = (f'the output of cell {k - 1} ({cells[k - 1].name})'
            if k else 'the pipeline input')
  shapes = tf.nest.map_structure(
      lambda t: None if t is None else tuple(t.shape), x)
  text = str(error).lower()
  hint = (' Check that the cells\' layers fit each other (e.g. input_dims).'
          if 'shape' in text or 'dimension' in text else '')
  return ValueError(
      f'{pipeline_name}: cell {k} ({cells[k].name}) failed on {source} with '
      f'shapes {shapes}.{hint} Cause: {type(error).__name__}: {error}')


class DiscardingCollector(base_layer.DeferredStatsCollector):
  """Swallows statistics recorded while a cell is being recomputed."""

  def Add(self, layer, stats, count):
    del layer, stats, count


def SplitFloat(structure):
  """Separates the floating leaves (differentiable) from the rest.

  Returns (float_leaves, rebuild) where rebuild(new_float_leaves) puts new
  floating leaves back into the original structure, keeping the others.
  """
  leaves = tf.nest.flatten(structure)
  float_index = [i for i, t in enumerate(leaves)
                 if t is not None and tf.as_dtype(t.dtype).is_floating]

  def Rebuild(new_floats):
    out = list(leaves)
    for i, t in zip(float_index, new_floats):
      out[i] = t
    return tf.nest.pack_sequence_as(structure, out)
  return [leaves[i] for i in float_index], Rebuild


def OrderAfter(previous):
  """Control dependency on the previous action of a device (graph mode only)."""
  if not previous or tf.executing_eagerly():
    return contextlib.nullcontext()
  return tf.control_dependencies([
      t.values if isinstance(t, tf.IndexedSlices) else t
      for t in previous if t is not None and not isinstance(t, tf.Variable)])


def Timestamp(after, device):
  """A tf.timestamp() that runs after `after` on `device`."""
  with tf.device(device), OrderAfter(after):
    return tf.timestamp()


def ParseLoss(loss_output):
  if isinstance(loss_output, (tuple, list)) and len(loss_output) == 2 and (
      isinstance(loss_output[1], dict)):
    return loss_output[0], loss_output[1]
  return loss_output, {}


def Weighted(value, weight, batch_size):
  """Micro-batch mean -> its share of the full-batch mean (see microbatch.py)."""
  value = tf.convert_to_tensor(value)
  if value.shape.rank == 0:
    return tf.cast(value, tf.float32) * weight
  return tf.reduce_sum(tf.cast(value, tf.float32)) / tf.cast(
      batch_size, tf.float32)


def AsDense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


class GradientAccumulators:
  """One buffer per trainable variable, on its device, summed with assign_add.

  Why buffers and not `acc = acc + g`: Grappler's arithmetic optimizer turns a
  chain of adds into one AddN, which waits for, and so keeps alive, every
  micro-batch's gradient at once: M copies of the parameters, which erased
  1F1B's memory advantage. Stateful assign_adds run as each gradient arrives
  and free it. The buffers are the executor's, never checkpointed.
  """

  def __init__(self, variables):
    self._buffers = []
    with tf.init_scope():
      for v in variables:
        with tf.device(v.value.device):
          self._buffers.append(tf.Variable(
              tf.zeros(v.shape, v.dtype), trainable=False,
              name='grad_accumulator'))

  def Add(self, index, gradient, first):
    buffer = self._buffers[index]
    if first:
      return buffer.assign(gradient, read_value=False)
    return buffer.assign_add(gradient, read_value=False)

  def Read(self):
    return [b.read_value() for b in self._buffers]


class PipelineExecutor:
  """Executes forward and forward+backward passes of cells along a schedule."""

  def __init__(self, cells, cell_devices, schedule, remat_policy, name='pipe'):
    if remat_policy not in REMAT_POLICIES:
      raise ValueError(f'Unknown remat_policy {remat_policy!r}; expected one of '
                       f'{list(REMAT_POLICIES)}. Received: '
                       f'remat_policy={remat_policy!r}')
    self._cells = cells
    self._cell_devices = cell_devices
    self._schedule = schedule
    self._remat_policy = remat_policy
    self._name = name
    self._order = schedule_lib.Validate(schedule)
    self._accumulators = None
    self._forward_order = schedule_lib.Validate(schedule.ForwardOnly(),
                                                forward_only=True)

  @property
  def schedule(self):
    return self._schedule

  def UsesRemat(self, micro_batch, training):
    if not training or self._remat_policy == 'never':
      return False
    if self._remat_policy == 'except_last':
      return micro_batch != self._schedule.num_micro_batches - 1
    return True

  def _RunCell(self, k, x, training, seed, remat, collector):
    """Runs cell k on x; with remat only x is kept for the backward pass."""
    cell = self._cells[k]
    float_in, rebuild_in = SplitFloat(x)
    state = {'calls': 0}

    def CellFn(*float_args):
      first = state['calls'] == 0
      state['calls'] += 1
      active = collector if first or collector is None else DiscardingCollector()
      with base_layer.StepSeed(seed), base_layer.CollectDeferredStats(
          active), base_layer.Recomputing(not first):
        y = cell(rebuild_in(list(float_args)), training=training)
      float_out, rebuild_out = SplitFloat(y)
      if first:
        state['rebuild'] = rebuild_out
      return float_out

    try:
      if remat:
        float_out = tf.recompute_grad(CellFn)(*float_in)
      else:
        float_out = CellFn(*float_in)
    except CELL_ERRORS as e:
      raise CellError(self._name, self._cells, k, x, e) from e
    return state['rebuild'](list(float_out))

  # The executor's loops are static Python over the schedule: AutoGraph must
  # not convert them (that multiplied tracing time several times over).
  @tf.autograph.experimental.do_not_convert
  def Forward(self, micro_inputs, training, seeds, collector):
    """Forward of every micro-batch; returns the last cell's outputs."""
    last_cell = self._schedule.num_cells - 1
    outputs = {}
    last_on_device = {}
    for action in self._forward_order:
      _, m, k = action
      d = self._schedule.device_of_cell[k]
      x = micro_inputs[m] if k == 0 else outputs.pop((m, k - 1))
      with tf.device(self._cell_devices[k]), OrderAfter(
          last_on_device.get(d)):
        y = self._RunCell(k, x, training, seeds[m],
                          self.UsesRemat(m, training), collector)
      outputs[(m, k)] = y
      last_on_device[d] = [t for t in tf.nest.flatten(y) if t is not None]
    return [outputs[(m, last_cell)]
            for m in range(self._schedule.num_micro_batches)]

  @tf.autograph.experimental.do_not_convert
  def ForwardBackward(self, micro_inputs, micro_targets, weights, batch_size,
                      loss_fn, training, seeds, collector, record_times=False):
    """Runs every F and B action; returns LossAndGradients.

    `loss_fn(outputs, targets)` is applied to each micro-batch on the last
    cell's device and returns the micro-batch's mean loss (a scalar), or
    per-example losses, optionally with a dict of scalar metrics:
    `(loss, {'accuracy': acc})`. Scalars are weighted by n_m / N and
    per-example losses summed and divided by N, so the total is the mean over
    the whole batch however unevenly it was split.

    With `record_times`, each action is bracketed by `tf.timestamp()` ops
    ordered by control dependencies: the start waits for the action's inputs
    and its device's previous action, the end for its outputs. That measures
    when the runtime really ran it, for timelines and the measured bubble.
    """
    num_cells = self._schedule.num_cells
    last_cell = num_cells - 1
    var_lists = [list(cell.trainable_variables) for cell in self._cells]
    offsets = [sum(len(v) for v in var_lists[:k]) for k in range(num_cells)]
    if self._accumulators is None:
      self._accumulators = GradientAccumulators(
          [v for vs in var_lists for v in vs])
    accumulated_cells = set()
    outputs, tapes, input_grads = {}, {}, {}
    last_on_device = {}
    loss_total = None
    metric_totals = {}
    action_times = {} if record_times else None
    for action in self._order:
      kind, m, k = action
      d = self._schedule.device_of_cell[k]
      if record_times:
        if kind == schedule_lib.FORWARD:
          inputs = micro_inputs[m] if k == 0 else outputs[(m, k - 1)]
        else:
          inputs = tapes[(m, k)][2]
          if k != last_cell:
            inputs = list(inputs) + list(input_grads[(m, k + 1)])
        start = Timestamp(list(last_on_device.get(d, [])) +
                           tf.nest.flatten(inputs), self._cell_devices[k])
        last_on_device[d] = [start]
      with tf.device(self._cell_devices[k]), OrderAfter(
          last_on_device.get(d)):
        if kind == schedule_lib.FORWARD:
          x = micro_inputs[m] if k == 0 else outputs.pop((m, k - 1))
          x_float = SplitFloat(x)[0] if k > 0 else []
          tape = tf.GradientTape()
          with tape:
            tape.watch(x_float)
            y = self._RunCell(k, x, training, seeds[m],
                              self.UsesRemat(m, training), collector)
            if k == last_cell:
              loss_m, metrics_m = ParseLoss(
                  loss_fn(y, None if micro_targets is None else
                          micro_targets[m]))
              target = Weighted(loss_m, weights[m], batch_size)
            else:
              target = SplitFloat(y)[0]
          if k == last_cell:
            loss_total = target if loss_total is None else loss_total + target
            for name, value in metrics_m.items():
              w = Weighted(value, weights[m], batch_size)
              metric_totals[name] = (w if name not in metric_totals else
                                     metric_totals[name] + w)
            last_on_device[d] = [target]
          else:
            outputs[(m, k)] = y
            last_on_device[d] = list(target)
          tapes[(m, k)] = (tape, x_float, target)
        else:
          tape, x_float, target = tapes.pop((m, k))
          output_grads = None if k == last_cell else input_grads.pop(
              (m, k + 1))
          grads = tape.gradient(
              target, list(x_float) + var_lists[k],
              output_gradients=output_grads,
              unconnected_gradients=tf.UnconnectedGradients.ZERO)
          if k > 0:
            input_grads[(m, k)] = grads[:len(x_float)]
          updates = [
              self._accumulators.Add(offsets[k] + i, AsDense(g),
                                     first=k not in accumulated_cells)
              for i, g in enumerate(grads[len(x_float):])]
          accumulated_cells.add(k)
          last_on_device[d] = [g for g in grads[:len(x_float)]
                               if g is not None] + updates
      if record_times:
        end = Timestamp(last_on_device[d], self._cell_devices[k])
        action_times[action] = (start, end)
        last_on_device[d] = [end]
    gradients = self._accumulators.Read()
    return LossAndGradients(loss_total, gradients, metric_totals, action_times)
