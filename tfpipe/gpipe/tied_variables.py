"""Variables that more than one cell reads: a copy per reading cell, one update.

A language model's output projection often reuses its input embedding
(keras_hub's GPT2CausalLM calls one `ReversibleEmbedding` first and last;
`layers.FCLayer` has `tied_embedding`), and a Keras `Lambda` may read another
layer's kernel in a closure. Cut into cells, the variable lives on its
owner's device (the first cell whose layers hold it), yet a later cell reads
it too. A cell differentiates only its own variables, so that
second use's gradient would be lost.

Megatron-LM ties the first and last stages' embeddings this way, and so does
DeepSpeed's `TiedLayerSpec`:

    cell 0 (device 0)                  cell 3 (device 3)
    emb  <- the variable               emb' <- its copy: an ordinary variable
      |                                  |     of cell 3 for the engine
      |   start of a step: emb' := emb   |
      |--------------------------------->|
      |   end of a step: g(emb) += g(emb')
      |<---------------------------------|
    one optimizer update of emb; a checkpoint holds emb only

* Inside cell 3, every read of `emb` returns `emb'` (`ReadCopies`, a Keras
  `StatelessScope` that maps the variable to its copy and applies
  assignments for real), so remat recomputes, the split backward of zero
  bubble schedules and the tape path all see the copy.
* Each step first refreshes every copy from its variable on the copy's
  device (`Refresh`), so any optimizer loop, the user's own included, keeps
  them equal; `Fold` adds each copy's gradient into its variable's on the
  variable's device. The gradients are the un-pipelined model's.
* The copies are not tracked by the pipeline: the pipe's (and a Keras
  model's) trainable_variables and checkpoints hold each variable once. A
  copy is trainable exactly when its variable is, so freezing follows.

What a cell reads is found by tracing the cells' forward once, before the
first step (`Find`), watching every variable the trace reads: a layer's own
variables and those captured in closures alike. The cost is one extra copy
of the variable (and of its gradient accumulator) per reading cell, the
variable's transfer to each copy and each copy's gradient back, once per
step.
"""

import collections
import contextlib
import math
import re

import tensorflow as tf
from keras.src.backend.common import stateless_scope

from tfpipe import base_layer
from tfpipe import placement
from tfpipe.gpipe import accumulators
from tfpipe.gpipe import cell_runtime


class ReadCopies(stateless_scope.StatelessScope):
  """Within the block, reads of some Keras variables return other variables.

  `Variable.value` asks the active StatelessScope for every read, which is
  what lets a cell read its copies without changing its layers. Unlike
  Keras' own scope, assignments are applied at once (to the variable and
  its copy), so batch norm and seed updates behave as outside it. Every
  variable read is recorded in `reads`.
  """

  def __init__(self, copies=None):  # pylint: disable=super-init-not-called
    # StatelessScope's attributes, set for what Keras reads of them.
    self.collect_losses = True  # add_loss stays visible (Layer._get_own_losses).
    self.initialize_variables = True
    self.losses = []
    self.state_mapping = {}
    self._copies = copies or {}
    self.reads = {}

  def get_current_value(self, variable):
    self.reads[id(variable)] = variable
    copy = self._copies.get(id(variable))
    # The variable's own tf.Variable: the read is the one Keras makes outside.
    return copy if copy is not None else getattr(variable, '_value', None)

  def add_update(self, update):
    variable, value = update
    variable._direct_assign(value)  # pylint: disable=protected-access
    copy = self._copies.get(id(variable))
    if copy is not None:
      copy.assign(tf.cast(value, copy.dtype))


class Tie(collections.namedtuple('Tie', ['variable', 'owner', 'reader',
                                         'copy'])):
  """`variable` of cell `owner` is read by cell `reader` through `copy`."""


class _CellReadingCopies:
  """Cell k as the engine sees it: its own variables plus its copies.

  Variables that an earlier cell owns (a layer shared by both) are left out:
  the cell reads them through copies. The engine only calls the cell and
  reads `trainable_variables` and `name`; anything else is the cell's.
  """

  def __init__(self, cell, index, owner, ties):
    self._cell = cell
    self._index = index
    self._owner = owner
    self._ties = ties
    self._copies = {id(t.variable): t.copy for t in ties}

  def __getattr__(self, name):
    return getattr(self._cell, name)

  @property
  def trainable_variables(self):
    own = [v for v in self._cell.trainable_variables
           if self._owner.get(id(v), self._index) == self._index]
    return own + [t.copy for t in self._ties if t.variable.trainable]

  def __call__(self, *args, **kwargs):
    with ReadCopies(self._copies):
      return self._cell(*args, **kwargs)


class TiedVariables:
  """The cells' variables read by another cell than their owner, and copies."""

  def __init__(self, cells, ties, owner):
    self.ties = list(ties)
    self._cells = list(cells)
    self._owner = owner
    self._runtime_cells = [
        _CellReadingCopies(cell, k, owner,
                           [t for t in self.ties if t.reader == k])
        if self._NeedsWrapping(cell, k) else cell
        for k, cell in enumerate(self._cells)]

  def _NeedsWrapping(self, cell, k):
    if any(t.reader == k for t in self.ties):
      return True
    return any(self._owner.get(id(v), k) != k for v in cell.weights)

  def RuntimeCells(self):
    """The cells to hand to the engine: each reads its own copies."""
    return list(self._runtime_cells)

  def CellVariables(self):
    """The cells' trainable variables, each once, in the cells' order.

    The order of the pipe's `trainable_variables`, which the gradients of
    `Fold` follow.
    """
    seen, result = set(), []
    for cell in self._cells:
      for v in cell.trainable_variables:
        if id(v) not in seen:
          seen.add(id(v))
          result.append(v)
    return result

  def Refresh(self):
    """Sets every copy to its variable's value, on the copy's device.

    Called at the start of each step and forward, before any cell reads a
    copy: eagerly it runs first; in a graph, automatic control dependencies
    order the cells' reads of the copy after its assignment.
    """
    updates = []
    for t in self.ties:
      with tf.device(t.copy.device):
        updates.append(t.copy.assign(tf.cast(
            tf.convert_to_tensor(t.variable), t.copy.dtype), read_value=False))
    return updates

  def Fold(self, gradients):
    """The engine's gradients, with each copy's added into its variable's.

    Args:
      gradients: aligned with the runtime cells' trainable_variables, in
        cell order (what the engine returns); None for a variable no loss
        reaches.

    Returns:
      Gradients aligned with CellVariables(): each sum is taken on the
      variable's device, and None stays None only if no copy got a gradient.
    """
    if not self.ties:
      return list(gradients)
    engine_variables = [v for cell in self._runtime_cells
                        for v in cell.trainable_variables]
    if len(engine_variables) != len(gradients):
      raise ValueError(
          f'tied_variables.Fold: {len(gradients)} gradients for '
          f'{len(engine_variables)} variables of the cells and their copies.')
    variables = self.CellVariables()
    position = {id(v): i for i, v in enumerate(variables)}
    tie_of_copy = {id(t.copy): t for t in self.ties}
    result = [None] * len(variables)
    from_copies = []
    for v, g in zip(engine_variables, gradients):
      tie = tie_of_copy.get(id(v))
      if tie is not None:
        from_copies.append((tie.variable, g))
      elif id(v) in position:
        result[position[id(v)]] = g
    for variable, g in from_copies:
      if g is None or id(variable) not in position:
        continue
      i = position[id(variable)]
      with tf.device(placement.TfVariable(variable).device):
        g = accumulators.Dense(g)
        result[i] = g if result[i] is None else accumulators.Dense(result[i]) + g
    return result

  def Describe(self, devices):
    """One line per tie, for tfpipe.keras.describe."""
    return [f'tied: {_Name(t.variable)} (cell {t.owner}) is read by cell '
            f'{t.reader} through its copy on {devices[t.reader]}'
            for t in self.ties]


def _Name(variable):
  return getattr(variable, 'path', None) or variable.name


def MicroBatchSpec(inputs, p):
  """tf.TensorSpecs of the first micro-batch a pipeline with params `p` cuts
  from `inputs` (tensors or specs); the batch size stays None if unknown."""

  def Spec(t):
    if t is None:
      return None
    if not isinstance(t, (tf.TensorSpec, tf.Tensor)):
      t = tf.convert_to_tensor(t)
    shape = list(t.shape)
    if len(shape) > p.batch_dim and shape[p.batch_dim] is not None:
      shard = math.ceil(shape[p.batch_dim] / p.num_replicas)
      shape[p.batch_dim] = (min(p.micro_batch_size, shard)
                            if p.micro_batch_size else
                            math.ceil(shard / p.num_micro_batches))
    return tf.TensorSpec(shape, t.dtype)
  return tf.nest.map_structure(Spec, inputs)


def Find(cells, devices, input_spec, describe_error):
  """Traces the cells' forward once and ties what each reads of another's.

  Args:
    cells: the pipeline's built cells.
    devices: cell k's device (replica 0's); cell k's copies are made there.
    input_spec: the first cell's input for one micro-batch, as a structure
      of tf.TensorSpec (any batch size).
    describe_error: fn(k, x, error) -> ValueError naming cell k, for a
      cell that fails on its input.

  Returns:
    TiedVariables.

  Raises:
    ValueError: when a cell reads another cell's variable as a bare
      tf.Variable, which no copy can stand in for.
  """
  owner = {}
  for k, cell in enumerate(cells):
    for v in cell.weights:
      owner.setdefault(id(v), k)
  if len(cells) == 1:
    return TiedVariables(cells, [], owner)
  reads, accessed = [], []
  spec = input_spec
  with tf.init_scope():
    for k, cell in enumerate(cells):
      scope = ReadCopies()

      def Trace(x, k=k, cell=cell, scope=scope):
        with _AsARecompute(), tf.device(devices[k]), scope:
          try:
            return cell(x, training=True)
          except cell_runtime.CELL_ERRORS as e:
            raise describe_error(k, x, e) from e
      traced = tf.function(Trace, autograph=False).get_concrete_function(spec)
      reads.append(scope.reads)
      # Every variable the trace read, the bare tf.Variables included.
      accessed.append(traced.graph.variables)
      # A None leaf (an optional input a cell passes on) stays None.
      spec = tf.nest.map_structure(
          lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype),
          traced.structured_outputs)
  keras_of = {id(placement.TfVariable(v)): v
              for cell in cells for v in cell.weights}
  ties = []
  for k in range(len(cells)):
    for key, v in reads[k].items():
      if owner.get(key, k) != k:
        ties.append((v, owner[key], k))
    for tf_variable in accessed[k]:
      v = keras_of.get(id(tf_variable))
      if v is not None and owner[id(v)] != k and id(v) not in reads[k]:
        raise ValueError(
            f'cell {k} ({cells[k].name}) reads variable {_Name(v)} of cell '
            f'{owner[id(v)]} ({cells[owner[id(v)]].name}) as a bare '
            'tf.Variable (e.g. captured as `variable.value` outside the '
            'layer), so it cannot be given a copy on its own device and '
            'its gradient would be lost. Read the Keras variable itself '
            'inside the call.')
  return TiedVariables(cells, [_MakeCopy(v, j, k, devices[k])
                               for v, j, k in ties], owner)


@contextlib.contextmanager
def _AsARecompute():
  """As the runtime recomputes a cell: seeded, nothing recorded or updated."""
  with base_layer.StepSeed(tf.zeros([2], tf.int64), tf.zeros([], tf.int64)), (
      base_layer.CollectDeferredStats(base_layer.DeferredStatsCollector())):
    yield


def _MakeCopy(variable, owner, reader, device):
  source = placement.TfVariable(variable)
  name = re.sub(r'[^A-Za-z0-9_.\-/]', '_', _Name(variable))
  with tf.init_scope(), tf.device(device):
    copy = tf.Variable(tf.identity(source.read_value()),
                       name=f'{name}/copy_in_cell{reader}', trainable=True)
  return Tie(variable, owner, reader, copy)
