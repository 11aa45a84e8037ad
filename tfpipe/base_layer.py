"""BaseLayer: a Keras layer built from Lingvo-style params.

Every tfpipe layer is a `keras.layers.Layer`, so it works inside `keras.Model`,
`tf.function`, `tf.GradientTape` and `tf.train.Checkpoint`. What it adds:

* `Params()`: a classmethod returning the layer's documented params, extending
  the parent's. A layer is `p.Instantiate()`d from them.
* `CreateChild` / `CreateChildren`: sub-layers are built from params too, so a
  whole network is one params tree that can be printed and overridden.
* `FProp`: the computation. `call` runs it, so Keras sees an ordinary layer.
* `FPropMeta`: a classmethod cost model (output shape, flops, parameter count,
  activation size), so a partitioner can balance cells without running them.

Variables are created eagerly in `__init__` when the params say their shapes
(Lingvo's way). That matters for pipelining: a cell instantiated under
`tf.device(d)` then has every variable on `d`, which lazily-built Keras layers
do not guarantee.

A variable's `path` names the layers that created it, e.g.
`block_3/ffn_in/w`: each `CreateChild` parent, leaving out the containers
that the partitioner flattens and cuts (`SequentialLayer`, the pipeline's
cells). So a path is unique in a model and the same for any number of
partitions, and in the un-pipelined reference of the same layers.
"""

import contextlib
import inspect
import numbers
import threading

import keras
from keras.src.backend.common import name_scope as keras_name_scope
import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx  # pylint: disable=g-direct-tensorflow-import

from tfpipe import cost_model
from tfpipe import deferred_stats
from tfpipe import hyperparams


# The cost model's types and shape helpers, which layers use through this
# module (base_layer.CostMeta, base_layer.NumElements, ...).
CostMeta = cost_model.CostMeta
LeafShapes = cost_model.LeafShapes
NumElements = cost_model.NumElements
MapShapes = cost_model.MapShapes
BatchDim = cost_model.BatchDim
SumCosts = cost_model.SumCosts
# The step's collector of batch statistics, which layers record into through
# CurrentStatsCollector (base_layer.DeferredStatsCollector).
DeferredStatsCollector = deferred_stats.DeferredStatsCollector


class _StepContext(threading.local):
  """Per-thread state that the pipeline executor sets around a cell's forward.

  `seed` is a [2] int64 tensor: seed[0] is unique to the step, seed[1] to the
  micro-batch (and replica) within it. Random layers derive stateless seeds
  from it so a re-materialized forward reproduces the original random values.
  `example_offset` is the index, within the whole (unsplit) batch, of the
  micro-batch's first example: with seed[0] it lets a layer draw randomness
  per example that does not depend on how the batch was split. None outside a
  pipeline step, or when the engine does not know it. `stats_collector`
  gathers statistics that layers such as batch norm want applied once per
  step rather than per micro-batch.
  """

  def __init__(self):
    super().__init__()
    self.seed = None
    self.example_offset = None
    self.stats_collector = None


_STEP_CONTEXT = _StepContext()


class _ConstructionContext(threading.local):
  """The variable-path prefix of the layer whose children are being built.

  Keras names a variable by the name scopes open when it is created, and
  tfpipe layers create theirs in `__init__`, where the parent's scope is not
  open. `CreateChild` sets `parent_path` around a child's construction, and
  the child records it as its Keras `_parent_path`, which Keras then uses
  for every variable the child creates (now, or later in `build`).
  """

  def __init__(self):
    super().__init__()
    self.parent_path = None


_CONSTRUCTION = _ConstructionContext()


@contextlib.contextmanager
def _ChildrenOf(parent_path):
  old = _CONSTRUCTION.parent_path
  _CONSTRUCTION.parent_path = parent_path
  try:
    yield
  finally:
    _CONSTRUCTION.parent_path = old


@contextlib.contextmanager
def StepSeed(seed, example_offset=None):
  """Makes random layers use stateless randomness derived from `seed`.

  Args:
    seed: [2] int tensor; seed[0] identifies the step, seed[1] the
      micro-batch within it.
    example_offset: scalar int tensor (or int), the position in the whole
      batch of this micro-batch's first example; None if unknown.
  """
  old = (_STEP_CONTEXT.seed, _STEP_CONTEXT.example_offset)
  _STEP_CONTEXT.seed = seed
  _STEP_CONTEXT.example_offset = example_offset
  try:
    yield
  finally:
    _STEP_CONTEXT.seed, _STEP_CONTEXT.example_offset = old


def CurrentStepSeed():
  return _STEP_CONTEXT.seed


def CurrentExampleOffset():
  """Index in the whole batch of the current micro-batch's first example."""
  return _STEP_CONTEXT.example_offset


@contextlib.contextmanager
def CollectDeferredStats(collector):
  """Routes layers' deferred statistics (e.g. batch norm) to `collector`."""
  old = _STEP_CONTEXT.stats_collector
  _STEP_CONTEXT.stats_collector = collector
  try:
    yield
  finally:
    _STEP_CONTEXT.stats_collector = old


def CurrentStatsCollector():
  return _STEP_CONTEXT.stats_collector


_CONVERTING = ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED)


def Autograph(fn):
  """`fn` converted by autograph, as a tf.function with autograph=True would.

  The pipeline traces its cells' functions with autograph off (its own
  Python control flow is trace-time logic); user code (a layer's FProp, a
  loss_fn) is converted here instead. Modules autograph leaves alone
  (TensorFlow, Keras) are called unchanged.
  """
  return tf.__internal__.autograph.tf_convert(fn, _CONVERTING)


# ---- step randomness ---------------------------------------------------------
#
# Random layers draw from the step context, never from a stateful generator,
# so a recomputed forward repeats the first draw exactly. When the engine
# passes the micro-batch's example offset, the bits of element j of example i
# are a pure function of (seed[0], salt, offset + i, j):
#
#   key     = mix(mix(mix(salt) ^ lo32(seed[0])) ^ hi32(seed[0]))
#   example = mix(key ^ mix(golden * (offset + i) + 1))
#   bits    = mix(example ^ mix(golden * j + 2))
#
# (mix is murmur3's 32-bit finalizer, a bijection with full avalanche). So
# dropout masks do not depend on how the batch is split into micro-batches
# (M), on which cell a layer lands in (K, via the salt: see
# BaseLayer.SeedPath), nor on the replica. Without the offset the bits are a
# stateless draw seeded per (step, micro-batch), which is still repeated
# exactly by a recompute but changes with M.

_GOLDEN = 0x9E3779B9


def _U32(value):
  return tf.constant(value, tf.uint32)


def _Mix32(h):
  """murmur3's fmix32 on a uint32 tensor."""
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, _U32(16)))
  h = h * _U32(0x85EBCA6B)
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, _U32(13)))
  h = h * _U32(0xC2B2AE35)
  return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, _U32(16)))


def _Low32(x):
  """The low 32 bits of an integer tensor, as uint32 (casts wrap)."""
  return tf.cast(tf.cast(x, tf.int64), tf.uint32)


def _StepKey(step_part, salt):
  """A uint32 scalar mixing seed[0] (all 64 bits) with a layer's salt."""
  step_part = tf.cast(step_part, tf.int64)
  key = _Mix32(_Mix32(_U32(salt & 0xFFFFFFFF)) ^ _Low32(step_part))
  return _Mix32(key ^ _Low32(tf.bitwise.right_shift(step_part, 32)))


def SaltedStepSeed(salt):
  """A [2] int64 seed for tf.random.stateless_* ops, or None outside a step.

  seed[0] of the step is mixed with `salt` (an int, e.g. a hash of a layer's
  path), seed[1] (the micro-batch) is kept. Draws from it are repeated by a
  recompute, but change with M; see StepRandomBits for draws that do not.
  """
  seed = CurrentStepSeed()
  if seed is None:
    return None
  seed = tf.cast(seed, tf.int64)
  key = tf.cast(_StepKey(seed[0], salt), tf.int64)
  return tf.stack([key, seed[1]])


def StepRandomBits(shape, salt, per_example=True, shared_across_batch=False):
  """uint32 random bits of `shape` for this step, or None outside a step.

  Args:
    shape: the shape (list, TensorShape or int tensor); axis 0 is the batch.
    salt: int that tells this draw apart from other layers' (same for the
      same layer in every partition; see BaseLayer.SeedSalt).
    per_example: False when axis 0 is not the pipeline's batch (e.g. a
      layer inside a Keras wrapper that folds time into the batch): the bits
      are then drawn per micro-batch.
    shared_across_batch: draw one slice (shape[0] must be 1) that every
      example shares, e.g. a dropout noise_shape of (1, ...): it is the
      same for every micro-batch too.

  Returns:
    With CurrentExampleOffset() known and per_example, bits that depend only
    on (seed[0], salt, global example index, element index), so they do not
    depend on M or K (see the comment above). Otherwise stateless bits
    seeded by (step, micro-batch, salt).
  """
  seed = CurrentStepSeed()
  if seed is None:
    return None
  shape = tf.cast(tf.convert_to_tensor(shape), tf.int32)
  offset = CurrentExampleOffset()
  if offset is None or not per_example:
    return tf.random.stateless_uniform(
        shape, SaltedStepSeed(salt), minval=None, maxval=None,
        dtype=tf.uint32)
  key = _StepKey(tf.cast(seed, tf.int64)[0], salt)
  if shared_across_batch:
    examples = tf.zeros([1], tf.int64)
  else:
    examples = tf.cast(offset, tf.int64) + tf.range(
        shape[0], dtype=tf.int64)
  golden = _U32(_GOLDEN)
  example_keys = _Mix32(key ^ _Mix32(_Low32(examples) * golden + _U32(1)))
  elements = tf.range(tf.reduce_prod(shape[1:]), dtype=tf.int32)
  element_keys = _Mix32(_Low32(elements) * golden + _U32(2))
  bits = _Mix32(example_keys[:, tf.newaxis] ^ element_keys[tf.newaxis, :])
  return tf.reshape(bits, shape)


def StepUniform(shape, salt, dtype=tf.float32, per_example=True,
                shared_across_batch=False):
  """Uniform values in (0, 1) from StepRandomBits (24 bits); None outside a step."""
  bits = StepRandomBits(shape, salt, per_example, shared_across_batch)
  if bits is None:
    return None
  values = (tf.cast(tf.bitwise.right_shift(bits, _U32(8)), tf.float32) +
            0.5) * (1.0 / (1 << 24))
  return tf.cast(values, dtype)


def StepNormal(shape, salt, dtype=tf.float32, per_example=True,
               shared_across_batch=False):
  """Standard normal values (inverse CDF of StepUniform); None outside a step."""
  uniform = StepUniform(shape, salt, tf.float32, per_example,
                        shared_across_batch)
  if uniform is None:
    return None
  return tf.cast(tf.math.ndtri(uniform), dtype)


def StepKeepMask(shape, keep_prob, salt, per_example=True,
                 shared_across_batch=False):
  """Bool mask, True with probability keep_prob; None outside a step."""
  bits = StepRandomBits(shape, salt, per_example, shared_across_batch)
  if bits is None:
    return None
  if keep_prob >= 1.0:
    return tf.ones_like(bits, tf.bool)
  return bits < _U32(min(int(round(keep_prob * 2.0**32)), 2**32 - 1))


def _StableHash(text):
  h = 2166136261
  for ch in text.encode('utf-8'):
    h = ((h ^ ch) * 16777619) % (1 << 31)
  return h


class BaseLayer(keras.layers.Layer):
  """Base class of tfpipe layers. Subclass it and override `FProp`."""

  # Whether this layer's name is part of its children's SeedPath. Containers
  # that the partitioner flattens and cuts into cells (SequentialLayer, and so
  # every cell) set it False: they differ with the number of partitions.
  NAMES_CHILD_SEEDS = True

  @classmethod
  def Params(cls):
    """The params of this layer class; subclasses extend their parent's."""
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', '', 'Name of the layer; also names its variables.')
    p.Define('dtype', 'float32', 'Dtype of the layer\'s variables.')
    p.Define('random_seed', None,
             'Seed of this layer\'s initializers and random ops; None draws '
             'from keras.utils.set_random_seed.')
    return p

  def __init__(self, params, **kwargs):
    if not isinstance(params, hyperparams.Params):
      raise TypeError(f'{type(self).__name__} is built from params: use '
                      f'{type(self).__name__}.Params().Set(...).Instantiate(); '
                      f'received {type(params).__name__}.')
    if not params.name:
      raise ValueError(f'{type(self).__name__}: params.name must be set, e.g. '
                       f'{type(self).__name__}.Params().Set(name="...").')
    super().__init__(name=params.name, dtype=params.dtype, **kwargs)
    parent_path = _CONSTRUCTION.parent_path
    _CONSTRUCTION.parent_path = None  # Only direct children inherit it.
    # Keras reads _parent_path as the layer's place in the model when it
    # names the layer's variables; it would set it at the first call.
    self._parent_path = (keras_name_scope.current_path()
                         if parent_path is None else parent_path)
    self._params = params.Copy().Freeze()
    self._children = {}
    self._seed_path = params.name
    self._fprop_accepts_training = (
        'training' in inspect.signature(self.FProp).parameters)

  @property
  def params(self):
    """The frozen params this layer was built from."""
    return self._params

  @property
  def p(self):
    return self._params

  def CheckPositive(self, *names):
    """Raises a ValueError naming every one of the params `names` that is not
    > 0, so a bad size fails at construction, not in a shape error later."""
    bad = [n for n in names
           if not (isinstance(self.p.Get(n), numbers.Real) and
                   self.p.Get(n) > 0)]
    if bad:
      received = ', '.join(f'{n}={self.p.Get(n)!r}' for n in bad)
      raise ValueError(f'{self.p.name}: {" and ".join(names)} must be > 0; '
                       f'received {received}.')

  # ---- children ---------------------------------------------------------

  def CreateChild(self, name, params):
    """Instantiates `params` as a child layer stored as `self.<name>`."""
    if name in self._children:
      raise ValueError(f'{self.name}: child {name!r} already exists.')
    p = params.Copy()
    if 'name' in p and not p.name:
      p.name = name
    with _ChildrenOf(self.ChildrenPath()):
      child = p.Instantiate()
    self._children[name] = child
    setattr(self, name, child)
    self._ScopeChildSeeds(child)
    return child

  def CreateChildren(self, name, params_list):
    """Instantiates a list of params as children stored as `self.<name>`."""
    if name in self._children:
      raise ValueError(f'{self.name}: children {name!r} already exist.')
    children = []
    for i, params in enumerate(params_list):
      p = params.Copy()
      if 'name' in p and not p.name:
        p.name = f'{name}_{i}'
      with _ChildrenOf(self.ChildrenPath()):
        children.append(p.Instantiate())
    self._children[name] = children
    setattr(self, name, children)
    for child in children:
      self._ScopeChildSeeds(child)
    return children

  @property
  def children(self):
    return dict(self._children)

  def ChildrenPath(self):
    """The variable-path prefix of this layer's children, e.g. 'block_3'.

    The layer's own place in the model, or, for a container that the
    partitioner flattens (NAMES_CHILD_SEEDS False), its parent's, so that a
    variable's path does not depend on the cut.
    """
    if not self.NAMES_CHILD_SEEDS:
      return self._parent_path or ''
    return '/'.join(filter(None, [self._parent_path, self.name]))

  def _trackable_children(self, save_type='checkpoint', **kwargs):
    """Adds trackables held in list attributes to `tf.train.Checkpoint`.

    Keras 3 tracks a list of layers for its own weight lists but not as a
    TensorFlow checkpoint dependency, so without this the children of
    `CreateChildren` (a SequentialLayer's `sub`, a pipeline's `cells`) would
    be missing from checkpoints of the layer. They are saved as
    `<attr>/<index>`.
    """
    children = super()._trackable_children(save_type, **kwargs)
    for attr, value in list(vars(self).items()):
      if attr.startswith('_') or not isinstance(value, (list, tuple)):
        continue
      for i, item in enumerate(value):
        if isinstance(item, tf.__internal__.tracking.Trackable):
          children.setdefault(f'{attr}/{i}', item)
    return children

  # ---- variables --------------------------------------------------------

  def CreateVariable(self, name, shape, initializer='glorot_uniform',
                     trainable=True, dtype=None):
    """Creates a variable now, on the current device (see module docstring)."""
    if isinstance(initializer, str):
      initializer = keras.initializers.get(initializer)
      if hasattr(initializer, 'seed') and self.p.random_seed is not None:
        config = initializer.get_config()
        config['seed'] = self.p.random_seed + _StableHash(name)
        initializer = type(initializer).from_config(config)
    return self.add_weight(
        name=name, shape=tuple(shape), initializer=initializer,
        trainable=trainable, dtype=dtype or self.p.dtype)

  # ---- computation --------------------------------------------------------

  def FProp(self, inputs, training=None):
    """The layer's computation; subclasses override it."""
    raise TypeError(f'{type(self).__name__} must override FProp.')

  def call(self, inputs, training=None, **kwargs):
    if self._fprop_accepts_training:
      kwargs['training'] = training
    fprop = self.FProp
    if not tf.executing_eagerly() and not type(self).FProp.__module__.startswith(
        'tfpipe.'):
      # A user's FProp is traced as a tf.function's code is: a Python `if`
      # on a tensor works. tfpipe's own layers need no conversion.
      fprop = Autograph(fprop)
    return fprop(inputs, **kwargs)

  def build(self, input_shape):
    """Builds children in order; layers that made their variables in __init__ need nothing."""
    del input_shape

  def compute_output_shape(self, input_shape):
    return type(self).FPropMeta(self.p, input_shape).output_shape

  # ---- randomness ---------------------------------------------------------

  def SeedPath(self):
    """This layer's name path for seeding, e.g. 'block_0/atten/atten_dropout'.

    The names of the CreateChild chain down to this layer, leaving out
    containers with NAMES_CHILD_SEEDS False (the pipeline's cells), so a
    layer draws the same random numbers whichever cell it lands in.
    """
    return self._seed_path

  def _ScopeChildSeeds(self, child):
    if isinstance(child, BaseLayer):
      child._SetSeedScope(  # pylint: disable=protected-access
          self._seed_path + '/' if self.NAMES_CHILD_SEEDS else '')

  def _SetSeedScope(self, scope):
    self._seed_path = scope + self.p.name
    for value in self._children.values():
      for child in value if isinstance(value, list) else [value]:
        self._ScopeChildSeeds(child)

  def SeedSalt(self, salt=''):
    """An int that tells this layer's random draws (named `salt`) apart."""
    return _StableHash(self.SeedPath() + salt)

  # ---- cost model ---------------------------------------------------------

  @classmethod
  def FPropMeta(cls, p, input_shape):
    """Estimates output shape and costs for `input_shape` (batch dim may be None).

    The default instantiates the layer once off to the side and reads its
    variables; subclasses with known formulas override it and stay cheap.
    """
    layer = p.Instantiate()
    if not layer.built:
      layer.build(input_shape)
    return cost_model.MeasuredCost(layer, input_shape)
