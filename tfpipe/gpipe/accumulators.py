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

  def Add(self, variables, gradients, modes, one_at_a_time=False):
    """Ops taking each gradient as its mode says; with `one_at_a_time` (in
    a graph), a gradient larger than what its ops read is made only after
    the additions before it (AddedOneAtATime).

    Returns (update ops, [the gradients of mode ONLY, as they are]).
    """
    updates, kept, added = [], [], []
    for v, g, mode in zip(variables, gradients, modes):
      if mode == ONLY:
        kept.append(Dense(g))
        continue
      buffer = self.Buffer(v)
      dense = Dense(g)
      update = (buffer.assign(dense, read_value=False) if mode == FIRST else
                buffer.assign_add(dense, read_value=False))
      updates.append(update)
      added.append((g, update))
    if one_at_a_time:
      AddedOneAtATime(added)
    return [u for u in updates if u is not None], kept

  def Keep(self, variables):
    """Frees the buffers of variables no longer trained; returns their refs."""
    keep = {v.ref() for v in variables}
    dropped = {k for k in self._buffers if k not in keep}
    for key in dropped:
      del self._buffers[key]
    return dropped


def AddedOneAtATime(added):
  """Orders a backward's weight gradients so that each is made only once
  the one made before it is added to its buffer.

  `added`: [(gradient, the op adding it)], in a graph whose ops were made
  in a topological order (traced, or imported). TensorFlow's single-threaded
  executor runs a function's ops in one fixed order, which need not add a
  gradient before it makes the next: a worker's one-cell MLP (five
  1024 x 1024 weights) held all five gradients before the first addition,
  20 MiB. Here the ops that make a gradient that outweighs what they read
  wait for the additions before it, where those additions do not need them
  (so no cycle): beside the buffers, one such gradient is being added and
  the next being made. Only for that executor: on the others, waiting
  would take away the gradients' parallel computation.
  """
  if len(added) < 2:
    return
  position = {op: i for i, op in enumerate(
      added[0][1].graph.get_operations())}

  def Made(gradient):
    """{op: the bytes of `gradient` it makes (None: not known)}, an
    output's Identity skipped (a function's outputs are made last)."""
    made = {}
    for t in tf.nest.flatten(gradient, expand_composites=True):
      while t.op.type == 'Identity':
        t = t.op.inputs[0]
      made[t.op] = _Sum(made.get(t.op, 0), _Bytes(t))
    return made

  def Ancestors(ops, stop=frozenset()):
    seen, stack = set(), list(ops)
    while stack:
      op = stack.pop()
      if op not in seen and op not in stop:
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen

  ordered = sorted(((Made(gradient), update) for gradient, update in added),
                   key=lambda pair: max(position[op] for op in pair[0]))
  # What the additions so far need, grown as the chain is built: the ops
  # made to wait were none of it, so it stays each addition's ancestors
  # (one walk of the graph in all, not one per gradient).
  needed, pending = set(), []
  for (_, update), (after, _) in zip(ordered, ordered[1:]):
    pending.append(update)
    needed |= Ancestors([update], stop=needed)
    # Waiting keeps what the gradient's ops read alive: worth it only where
    # the gradient is the larger (a dense layer's weight gradient at a
    # small micro-batch; not a convolution's filter gradient, whose
    # activation and output gradient are larger: AmoebaNet-D's backward
    # held 9 MiB more at micro-batch 64 when they waited too).
    waiting = [op for op, made_bytes in after.items()
               if op.inputs and op not in needed and
               _Outweighs(made_bytes, [_Bytes(t) for t in op.inputs])]
    if not waiting:
      continue
    # Those ops' ancestors that no addition so far needs, and of those the
    # ones that read none of the others: the rest wait through them, for
    # every addition since the last wait.
    own = Ancestors(waiting, stop=needed)
    for op in own:
      # The function's arguments and captures wait for nothing.
      if op.type != 'Placeholder' and not any(
          t.op in own for t in op.inputs) and not any(
              c in own for c in op.control_inputs):
        op._add_control_inputs(pending)  # pylint: disable=protected-access
    pending = []


def _Outweighs(made_bytes, input_bytes):
  """Whether a gradient of `made_bytes` is larger than the inputs it is
  made from (False where a shape is not known)."""
  return (made_bytes is not None and None not in input_bytes and
          made_bytes > sum(input_bytes))


def _Bytes(tensor):
  """A tensor's bytes, or None if its shape is not fully known."""
  count = tensor.shape.num_elements()
  return None if count is None else count * tensor.dtype.size


def _Sum(a, b):
  return None if a is None or b is None else a + b


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
