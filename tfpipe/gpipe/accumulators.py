"""Gradient accumulation: one buffer per variable, on its cell's device.

A backward pass of M micro-batches produces M gradients per variable. They
are added, as they arrive, into one buffer per variable on the cell's
device, and the pass reads each buffer once at its end.

Why buffers and not `acc = acc + g`: Grappler's arithmetic optimizer turns a
chain of adds into one AddN, which waits for, and so keeps alive, every
micro-batch's gradient at once: M copies of the parameters, which erases
1F1B's memory advantage (and makes the tape path's memory grow with M).
Stateful assign_adds run as each gradient arrives and free it.

Each variable's first gradient of a pass is assigned (no zeroing first); with
M = 1 the gradient is kept as it is, with no buffer at all, so K=1, M=1 costs
what a plain step costs. A variable that no micro-batch's loss reaches reads
as None, as in plain TensorFlow.
"""

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # pylint: disable=g-direct-tensorflow-import

from tfpipe import initial_values

# How a gradient is taken: the pass's only one (kept as it is), its first
# (assigned to the buffer), or a later one (added).
ONLY, FIRST, ADD = 'only', 'first', 'add'


def Dense(g):
  """A dense tensor of a gradient (IndexedSlices are scattered)."""
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


class GradientAccumulators:
  """The buffers of one cell's variables on its device, made on first use.

  They belong to the runtime and are never checkpointed.
  """

  def __init__(self, device):
    self.device = device
    self._buffers = {}

  def Buffer(self, variable):
    key = variable.ref()
    if key not in self._buffers:
      # A buffer may first be needed in a later trace of a caller's
      # tf.function (a layer unfrozen between steps), where tf.Variable is
      # refused; a ResourceVariable made directly, out of the trace, is not.
      # Its zeros are made here when the device is another process's
      # (initial_values). Made without a value instead, the pass's first
      # gradient became the buffer, and the Transformer's device peaked 0.3
      # to 0.5 MiB higher (benchmarks/RESULTS.md, largest_model).
      with tf.init_scope(), tf.device(self.device), (
          initial_values.ComputedHere()):
        self._buffers[key] = resource_variable_ops.ResourceVariable(
            lambda: tf.zeros(variable.shape, variable.dtype),
            trainable=False, name='grad_accumulator')
    return self._buffers[key]

  def Add(self, variables, gradients, modes):
    """Ops taking each gradient as its mode says.

    Returns (update ops, [the gradients of mode ONLY, as they are]).
    """
    updates, kept = [], []
    for v, g, mode in zip(variables, gradients, modes):
      g = Dense(g)
      if mode == ONLY:
        kept.append(g)
      elif mode == FIRST:
        updates.append(self.Buffer(v).assign(g, read_value=False))
      else:
        updates.append(self.Buffer(v).assign_add(g, read_value=False))
    return [u for u in updates if u is not None], kept

  def Keep(self, variables):
    """Frees the buffers of variables no longer trained; returns their refs."""
    keep = {v.ref() for v in variables}
    dropped = {k for k in self._buffers if k not in keep}
    for key in dropped:
      del self._buffers[key]
    return dropped


class PassGradients:
  """One backward pass's gradients of one cell's variables.

  The actions of one cell run in order, from one thread, so this needs no
  lock.
  """

  def __init__(self, accumulators, variables, num_accumulations, need_dx):
    """Starts a pass.

    Args:
      accumulators: the cell's GradientAccumulators.
      variables: the variables differentiated, taken when the step began.
      num_accumulations: how many actions will add gradients (M).
      need_dx: whether the pass also returns the cell input's gradient.
    """
    self.variables = list(variables)
    self.need_dx = need_dx
    self._accumulators = accumulators
    self._remaining = num_accumulations
    self._values = {}  # variable index -> buffer, or the only gradient

  def Modes(self, connected):
    """How each of the variables `connected` (indices) takes its gradient."""
    if self._remaining == 1 and not self._values:
      return tuple(ONLY for _ in connected)
    return tuple(ADD if i in self._values else FIRST for i in connected)

  def Done(self, connected, modes, kept):
    """Records an accumulation of `connected`; `kept` its ONLY gradients."""
    self._remaining -= 1
    kept = iter(kept)
    for i, mode in zip(connected, modes):
      if mode == ONLY:
        self._values[i] = next(kept)
      elif mode == FIRST:
        self._values[i] = self._accumulators.Buffer(self.variables[i])

  def Read(self, scale=None):
    """Each variable's gradient (times `scale`), or None if it has none."""
    result = []
    for i in range(len(self.variables)):
      value = self._values.get(i)
      if value is not None:
        with tf.device(self._accumulators.device):
          if isinstance(value, tf.Variable):
            value = value.read_value()
          if scale is not None:
            value = value * tf.cast(scale, value.dtype)
      result.append(value)
    return result
