"""The stage runtime: what one cell does for one micro-batch.

A schedule says which action runs when; this module says what an action
does, once, for every entry point (a training step, `pipe(x)` under a
GradientTape, inference) and every dispatcher (inline in one graph, or one
thread per device). Each cell's work is a few `tf.function`s, traced once
per input signature rather than once per action, so tracing costs O(K)
instead of O(K*M):

    forward(x)                  -> y, stats        F(m, k) of a cell k < K-1,
                                                   or of the last cell under
                                                   a tape (no loss)
    forward_loss(x, t)          -> loss, dloss/dy  F(m, K-1): the loss is
                                                   applied once per micro-batch
    forward_loss_backward(x, t) -> loss, dx        F and B of the last cell in
                                                   one call, when B(m, K-1)
                                                   directly follows F(m, K-1)
    backward(x, dy)             -> dx              B(m, k): recompute, take the
                                                   gradient, accumulate

Re-materialization: F keeps only the cell's input, and B recomputes the
cell under a GradientTape (seeded and marked `Recomputing`, so dropout draws
the same mask and batch norm records nothing twice). Recomputing is pointless
when B comes right after F on the same device (the last cell in 1F1B, the
last micro-batch in GPipe): `forward_loss_backward` then does both in one
call, which is what keeps K=1 with remat as cheap as a plain step.
Without re-materialization (remat_policy 'never', or the last micro-batch of
'except_last') the caller records the forward call under a tape it keeps
until B (`TapedForward`/`TapedBackward`): the tape holds the activations.

Variables' gradients are added, as they arrive, into one buffer per variable
on the stage's device (`GradientAccumulators`). Every op a stage emits runs
on its device: the functions are traced under `tf.device(device)`, and the
accumulators live there.

Zero-bubble schedules split each backward into B (input gradient) and W
(weight gradient), run as separate actions: `SplitForward` is F,
`InputGradient` is B and `WeightGradient` is W, which accumulates. They are
three traced functions cut from one trace of the cell's forward and
backward, handing on exactly what the next part reads (split_backward.py).
"""

import collections
import threading
import weakref

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.gpipe import split_backward

LossAndGradients = collections.namedtuple(
    'LossAndGradients', ['loss', 'gradients', 'metrics', 'action_times'],
    defaults=[None])
LossAndGradients.__doc__ = (
    'Result of a pipelined training step: the exact full-batch loss, '
    'gradients aligned with the pipeline\'s trainable_variables, metrics, and '
    '(when recorded) {Action: (start, end)} timestamps.')

# Errors a cell raises when its layers do not fit its input.
CELL_ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)

# Tracing runs Python layer code that keeps per-thread context (seeds,
# collectors), but Keras and tf.function also hold process-wide state while
# tracing; tracing one function at a time keeps that simple and costs nothing
# after the first step.
_TRACE_LOCK = threading.RLock()

# _noinline: inside an outer tf.function the calls stay calls, so the outer
# graph holds K*M call ops rather than K*M inlined copies of the cells for
# Grappler to optimize.
_FUNCTION_OPTIONS = dict(autograph=False, reduce_retracing=True,
                         experimental_attributes={'_noinline': True})


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


def TfVariable(v):
  """The tf.Variable behind a Keras variable (tapes watch those)."""
  value = getattr(v, 'value', None)
  return value if isinstance(value, tf.Variable) else v


def AsDense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


class LossParts(collections.namedtuple(
    'LossParts', ['numerator', 'metrics', 'weight', 'is_sum'])):
  """One micro-batch's loss, reduced to a numerator of the batch's loss.

  A loss_fn returns one of:
    loss                          the micro-batch's mean loss (a scalar), or
                                  per-example losses (a vector);
    (loss, {'name': metric})      the same, with metrics of the same kind;
    (loss_sum, weight)            a sum and the weight it is a sum over (e.g.
                                  the number of unpadded tokens);
    (loss_sum, weight, metrics)   the same, with metrics that are sums too.
  Means are weighted by the micro-batch's share n_m / N of the examples and
  per-example values summed and divided by N, so numerators add up to the
  batch's mean. Sums add up as they are, and the pipeline divides the total
  (and the gradients) by the total weight at the end of the step: exact for
  any split, and nothing has to be known before the first backward.
  """


def ParseLoss(output, scale, batch_size):
  """LossParts of a loss_fn's output for a micro-batch of share `scale`."""
  if isinstance(output, (tuple, list)) and len(output) == 3 and isinstance(
      output[2], dict):
    return _SumParts(output[0], output[1], output[2])
  if isinstance(output, (tuple, list)) and len(output) == 2:
    if isinstance(output[1], dict):
      return _MeanParts(output[0], output[1], scale, batch_size)
    return _SumParts(output[0], output[1], {})
  return _MeanParts(output, {}, scale, batch_size)


def _MeanShare(value, scale, batch_size):
  value = tf.convert_to_tensor(value)
  if value.shape.rank == 0:
    return tf.cast(value, tf.float32) * scale
  return tf.reduce_sum(tf.cast(value, tf.float32)) / tf.cast(batch_size,
                                                               tf.float32)


def _MeanParts(loss, metrics, scale, batch_size):
  return LossParts(
      _MeanShare(loss, scale, batch_size),
      {name: _MeanShare(v, scale, batch_size) for name, v in metrics.items()},
      tf.zeros([], tf.float32), False)


def _SumParts(loss_sum, weight, metrics):
  def Total(value):
    return tf.reduce_sum(tf.cast(value, tf.float32))
  return LossParts(Total(loss_sum),
                   {name: Total(v) for name, v in metrics.items()},
                   Total(weight), True)


class GradientAccumulators:
  """One buffer per variable on a stage's device, summed with assign_add.

  Why buffers and not `acc = acc + g`: Grappler's arithmetic optimizer turns a
  chain of adds into one AddN, which waits for, and so keeps alive, every
  micro-batch's gradient at once: M copies of the parameters, which erases
  1F1B's memory advantage (and makes the tape path's memory grow with M).
  Stateful assign_adds run as each gradient arrives and free it. The buffers
  belong to the runtime and are never checkpointed.
  """

  def __init__(self, variables, device):
    self.buffers = []
    with tf.init_scope(), tf.device(device):
      for v in variables:
        self.buffers.append(tf.Variable(
            tf.zeros(v.shape, v.dtype), trainable=False,
            name='grad_accumulator'))

  def Add(self, gradients, first):
    """Adds (or, for the step's first backward, assigns) each gradient."""
    updates = []
    for buffer, g in zip(self.buffers, gradients):
      g = AsDense(g)
      if first:
        updates.append(buffer.assign(g, read_value=False))
      else:
        updates.append(buffer.assign_add(g, read_value=False))
    return [u for u in updates if u is not None]

  def Read(self, scale=None):
    """The accumulated gradients, each read (and scaled) on its buffer's device."""
    values = []
    for buffer in self.buffers:
      with tf.device(buffer.device):
        value = buffer.read_value()
        values.append(value if scale is None else
                      value * tf.cast(scale, value.dtype))
    return values


class _RecordingCollector(base_layer.DeferredStatsCollector):
  """Keeps a traced cell's deferred statistics so the function can return them."""

  def __init__(self):
    super().__init__()
    self.entries = []

  def Add(self, layer, stats, count):
    self.entries.append((layer, count, stats))


class DiscardingCollector(base_layer.DeferredStatsCollector):
  """Swallows statistics recorded while a cell is being recomputed."""

  def Add(self, layer, stats, count):
    del layer, stats, count


class Taped(collections.namedtuple('Taped', ['tape', 'sources', 'target'])):
  """A forward recorded under a tape, kept for its backward (no remat)."""


class Recorded(collections.namedtuple('Recorded', ['program', 'state'])):
  """A forward run for a split backward: its SplitProgram and what B and W
  read (split_backward.py)."""


class Stage:
  """Cell k's forward and backward, traced once per signature, on its device."""

  def __init__(self, cell, index, num_cells, device, name, describe_error):
    """Creates the stage; its accumulators live on `device`.

    Args:
      cell: the cell layer, built on its device.
      index: k.
      num_cells: K.
      device: where this stage runs (a replica's device, for replicas).
      name: the pipeline's name, for messages.
      describe_error: fn(k, x, error) -> ValueError naming the cell.
    """
    self.cell = cell
    self.index = index
    self.is_last = index == num_cells - 1
    self.device = device
    self.variables = [TfVariable(v) for v in cell.trainable_variables]
    self.accumulators = GradientAccumulators(self.variables, device)
    self._name = name
    self._describe_error = describe_error
    self._functions = {}
    # W's gradients-and-accumulation call, per split program and `first`;
    # dropped with the program.
    self._accumulate = weakref.WeakKeyDictionary()
    # Per loss_fn, set when it is traced: whether it returned sums.
    self._loss_is_sum = {}

  # ---- the traced functions ---------------------------------------------

  def _Function(self, kind, training, loss_fn=None):
    key = (kind, training, loss_fn)
    if loss_fn is not None and key not in self._functions:
      # Keep one loss_fn's functions: a caller that passes a new closure each
      # step retraces the last cell each step, but does not leak functions.
      for stale in [k for k in self._functions
                    if k[0] == kind and k[2] is not None]:
        del self._functions[stale]
        self._loss_is_sum.pop(stale[2], None)
    if key not in self._functions:
      body = getattr(self, '_' + kind)
      stat_layers = []

      def Traced(*args):
        with _TRACE_LOCK, tf.device(self.device):
          return body(training, loss_fn, stat_layers, *args)
      self._functions[key] = (tf.function(Traced, **_FUNCTION_OPTIONS),
                              stat_layers)
    return self._functions[key]

  def _Call(self, x, seed, offset, training, collector, recomputing):
    with base_layer.StepSeed(seed, offset), (
        base_layer.CollectDeferredStats(collector)), (
            base_layer.Recomputing(recomputing)):
      return self.cell(x, training=training)

  @staticmethod
  def _Stats(collector, stat_layers):
    stat_layers[:] = [layer for layer, _, _ in collector.entries]
    return [(count, stats) for _, count, stats in collector.entries]

  def _Loss(self, loss_fn, y, targets, scale, batch_size):
    parts = ParseLoss(loss_fn(y, targets), scale, batch_size)
    if self._loss_is_sum.setdefault(loss_fn, parts.is_sum) != parts.is_sum:
      raise ValueError(
          f'{self._name}: loss_fn returned a (sum, weight) pair for some '
          'micro-batches and a mean for others; return one kind.')
    return parts

  def _forward(self, training, loss_fn, stat_layers, x, seed, offset):
    del loss_fn
    collector = _RecordingCollector()
    y = self._Call(x, seed, offset, training, collector, recomputing=False)
    return y, self._Stats(collector, stat_layers)

  def _forward_loss_value(self, training, loss_fn, stat_layers, x, targets,
                          seed, offset, scale, batch_size):
    collector = _RecordingCollector()
    y = self._Call(x, seed, offset, training, collector, recomputing=False)
    parts = self._Loss(loss_fn, y, targets, scale, batch_size)
    return (parts.numerator, parts.metrics, parts.weight,
            self._Stats(collector, stat_layers))

  def _forward_loss(self, training, loss_fn, stat_layers, x, targets, seed,
                    offset, scale, batch_size):
    """Returns (numerator, metrics, weight, stats, d numerator / d output)."""
    collector = _RecordingCollector()
    y = self._Call(x, seed, offset, training, collector, recomputing=False)
    y_float, rebuild = SplitFloat(y)
    with tf.GradientTape() as tape:
      tape.watch(y_float)
      parts = self._Loss(loss_fn, rebuild(y_float), targets, scale,
                         batch_size)
    dy = tape.gradient(parts.numerator, y_float,
                       unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return (parts.numerator, parts.metrics, parts.weight,
            self._Stats(collector, stat_layers), dy)

  def _forward_loss_backward(self, training, loss_fn, stat_layers, x, targets,
                             seed, offset, scale, batch_size, first, need_dx):
    """F and B of the last cell in one call: no recompute needed."""
    collector = _RecordingCollector()

    def ForwardLoss(x_in):
      y = self._Call(x_in, seed, offset, training, collector,
                     recomputing=False)
      return self._Loss(loss_fn, y, targets, scale, batch_size)

    tape, x_float, parts = self._Taped(x, need_dx, ForwardLoss)
    stats = self._Stats(collector, stat_layers)
    dx, done = self._Gradients(tape, [parts.numerator], None, x_float, first)
    return (parts.numerator, parts.metrics, parts.weight, stats, dx, done)

  def _backward(self, training, loss_fn, stat_layers, x, dy, seed, offset,
                first, need_dx):
    """Recomputes the cell, accumulates its variables' gradients; returns dx."""
    del loss_fn, stat_layers

    def Recompute(x_in):
      y = self._Call(x_in, seed, offset, training, DiscardingCollector(),
                     recomputing=True)
      return SplitFloat(y)[0]

    tape, x_float, target = self._Taped(x, need_dx, Recompute)
    return self._Gradients(tape, target, list(dy), x_float, first)

  def _Taped(self, x, need_dx, fn):
    """Runs fn(x) under a tape that watches the variables, and the float
    parts of x when the input gradient is needed; returns
    (tape, watched float inputs, fn's result)."""
    x_float, rebuild = SplitFloat(x)
    if not need_dx:
      x_float = []
    with tf.GradientTape(watch_accessed_variables=False) as tape:
      tape.watch(x_float)
      tape.watch(self.variables)
      result = fn(rebuild(x_float) if x_float else x)
    return tape, x_float, result

  def _Gradients(self, tape, target, dy, x_float, first):
    """The input gradient and the weight gradient of one recorded forward.

    Returns (dx, done): `done` is a token that exists once the weight
    gradient is accumulated, so a traced step can order after it even when
    there is no input gradient (cell 0).
    """
    grads = tape.gradient(target, list(x_float) + self.variables,
                          output_gradients=dy,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    updates = self.accumulators.Add(grads[len(x_float):], first)
    with tf.control_dependencies(updates):
      return [tf.identity(g) for g in grads[:len(x_float)]], tf.constant(True)

  # ---- what the runtime calls -------------------------------------------

  def _Run(self, x, call):
    try:
      return call()
    except CELL_ERRORS as e:
      raise self._describe_error(self.index, x, e) from e

  def Forward(self, x, seed, offset, training):
    """Runs the cell; returns (y, [(layer, (count, stats))])."""
    fn, layers = self._Function('forward', training)
    y, stats = self._Run(x, lambda: fn(x, seed, offset))
    return y, list(zip(layers, stats))

  def ForwardLoss(self, x, targets, seed, offset, scale, batch_size, training,
                  loss_fn):
    """Last cell: (LossParts, stats, d numerator / d output)."""
    fn, layers = self._Function('forward_loss', training, loss_fn)
    numerator, metrics, weight, stats, dy = self._Run(
        x, lambda: fn(x, targets, seed, offset, scale, batch_size))
    return (LossParts(numerator, metrics, weight, self._loss_is_sum[loss_fn]),
            list(zip(layers, stats)), dy)

  def ForwardLossBackward(self, x, targets, seed, offset, scale, batch_size,
                          training, loss_fn, first, need_dx):
    """Last cell, F and B fused: (LossParts, stats, dx, done)."""
    fn, layers = self._Function('forward_loss_backward', training, loss_fn)
    numerator, metrics, weight, stats, dx, done = self._Run(
        x, lambda: fn(x, targets, seed, offset, scale, batch_size, first,
                      need_dx))
    return (LossParts(numerator, metrics, weight, self._loss_is_sum[loss_fn]),
            list(zip(layers, stats)), dx, done)

  def Backward(self, x, dy, seed, offset, training, first, need_dx):
    """Re-materialized backward: returns (dx, done)."""
    fn, _ = self._Function('backward', training)
    return self._Run(x, lambda: fn(x, dy, seed, offset, first, need_dx))

  def TapedForward(self, x, seed, offset, training, need_dx, loss=None):
    """The forward (with `loss`=(targets, scale, batch_size, loss_fn): the
    loss too) recorded under a tape kept for `TapedBackward`.

    Returns (outputs, stats, Taped): outputs is y, or LossParts with loss.
    """
    x_float = SplitFloat(x)[0] if need_dx else []
    tape = tf.GradientTape(watch_accessed_variables=False)
    with tape:
      tape.watch(x_float)
      tape.watch(self.variables)
      if loss is None:
        y, stats = self.Forward(x, seed, offset, training)
        outputs, target = y, SplitFloat(y)[0]
      else:
        targets, scale, batch_size, loss_fn = loss
        fn, layers = self._Function('forward_loss_value', training, loss_fn)
        numerator, metrics, weight, stats = self._Run(
            x, lambda: fn(x, targets, seed, offset, scale, batch_size))
        stats = list(zip(layers, stats))
        outputs = LossParts(numerator, metrics, weight, self._loss_is_sum[loss_fn])
        target = [numerator]
    return outputs, stats, Taped(tape, x_float, target)

  def TapedBackward(self, taped, dy, first):
    """Backward of a TapedForward: accumulates; returns (dx, done)."""
    grads = taped.tape.gradient(
        taped.target, list(taped.sources) + self.variables,
        output_gradients=None if dy is None else list(dy),
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    n = len(taped.sources)
    updates = self.accumulators.Add(grads[n:], first)
    dx = grads[:n]
    return dx, updates

  def _SplitProgram(self, flat, structure, training, need_dx, loss_fn,
                    recomputing):
    """The cell's F, B and W for these inputs' signature, traced once.

    `flat` is tf.nest.flatten(structure); its None leaves (no targets) are
    not inputs.
    """
    # The key is the leaves' shapes and types: a stage's input structure is
    # fixed by the model (and the targets' by the loss), and a cheap key
    # matters for small cells, where Python per action is the cost.
    key = ('split', training, need_dx, loss_fn, recomputing, len(flat),
           tuple(None if t is None else (tuple(t.shape), t.dtype)
                 for t in flat))
    if key not in self._functions:
      present = tuple(i for i, t in enumerate(flat) if t is not None)
      specs = tuple(tf.TensorSpec(flat[i].shape, flat[i].dtype)
                    for i in present)
      if loss_fn is not None:
        for stale in [k for k in self._functions if k[0] == 'split' and
                      k[3] is not None and k[3] is not loss_fn]:
          del self._functions[stale]
      stat_layers, stat_structure, forward_structure = [], [], []

      def Trace(inputs, end_forward):
        full = [None] * len(flat)
        for i, t in zip(present, inputs):
          full[i] = t
        x, seed, offset, loss = tf.nest.pack_sequence_as(structure, full)
        x_float, rebuild = SplitFloat(x)
        collector = (DiscardingCollector() if recomputing else
                     _RecordingCollector())
        with tf.GradientTape(watch_accessed_variables=False) as tape:
          tape.watch(x_float)
          tape.watch(self.variables)
          y = self._Call(rebuild(x_float), seed, offset, training, collector,
                         recomputing)
          if loss_fn is None:
            target = SplitFloat(y)[0]
            forward_structure.append(y)
          else:
            targets, scale, batch_size = loss
            parts = self._Loss(loss_fn, y, targets, scale, batch_size)
            target = [parts.numerator]
            forward_structure.append((parts.numerator, parts.metrics,
                                      parts.weight))
          forward = tf.nest.flatten(forward_structure[0])
        stats = [] if recomputing else tf.nest.map_structure(
            tf.convert_to_tensor, self._Stats(collector, stat_layers))
        stat_structure.append(stats)
        end_forward()
        dy = ([] if loss_fn is not None else
              [tf.raw_ops.Placeholder(dtype=t.dtype, shape=t.shape)
               for t in target])
        grads = tape.gradient(
            target, list(x_float) + self.variables,
            output_gradients=dy or None,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return split_backward.Traced(
            forward + tf.nest.flatten(stats), dy, grads[:len(x_float)],
            grads[len(x_float):])

      with _TRACE_LOCK:
        program = split_backward.SplitProgram(
            Trace, specs, self.device, need_input_gradients=need_dx,
            name=f'{self.cell.name}_split')
      self._functions[key] = (program, stat_layers, stat_structure[0],
                              forward_structure[0])
    return self._functions[key]

  def SplitForward(self, x, seed, offset, training, need_dx, loss=None,
                   recomputing=False):
    """F for a split backward: the cell's forward, keeping what B and W read.

    With `loss` = (targets, scale, batch_size, loss_fn) the loss is applied
    too, and B starts from it. With `recomputing` (B of a re-materialized
    micro-batch) statistics are not recorded again.

    Returns (outputs, stats, Recorded): outputs is y, or LossParts.
    """
    loss_fn = loss[3] if loss else None
    structure = (x, seed, offset, tuple(loss[:3]) if loss else None)
    flat = [t if t is None or isinstance(t, tf.Tensor) else
            tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    program, stat_layers, stat_structure, forward_structure = self._Run(
        x, lambda: self._SplitProgram(flat, structure, training, need_dx,
                                      loss_fn, recomputing))
    with tf.device(self.device):
      outputs, state = program.Forward([t for t in flat if t is not None])
    num_stats = len(tf.nest.flatten(stat_structure))
    stats = tf.nest.pack_sequence_as(
        stat_structure, outputs[len(outputs) - num_stats:])
    outputs = outputs[:len(outputs) - num_stats]
    result = tf.nest.pack_sequence_as(forward_structure, outputs)
    if loss_fn is not None:
      result = LossParts(*result, self._loss_is_sum[loss_fn])
    stats = [] if recomputing else list(zip(stat_layers, stats))
    return result, stats, Recorded(program, state)

  def InputGradient(self, recorded, dy):
    """B of a split backward: returns (dx, state for W, done tokens)."""
    with tf.device(self.device):
      return recorded.program.InputGradient(
          recorded.state, None if dy is None else list(dy))

  def WeightGradient(self, state, program, first):
    """W: accumulates the weight gradients; returns a token for when done.

    The gradients and their accumulation are one traced call.
    """
    inputs = program.WeightInputs(state)
    functions = self._accumulate.setdefault(program, {})
    if first not in functions:

      def Accumulate(*values):
        with tf.device(self.device):
          updates = self.accumulators.Add(program.WeightGradientOf(*values),
                                          first)
          with tf.control_dependencies(updates):
            return tf.constant(True)
      with _TRACE_LOCK:
        functions[first] = tf.function(
            Accumulate, **_FUNCTION_OPTIONS).get_concrete_function(
                *[tf.TensorSpec(t.shape, t.dtype) for t in inputs])
    with tf.device(self.device):
      return functions[first](*inputs)
