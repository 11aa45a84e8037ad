"""Runs Keras layers that draw random numbers or update state exactly in a pipeline.

A pipeline step calls every layer once per micro-batch, and again when it
re-materializes a cell for the backward pass. Run naively, a Keras layer
that draws from its stateful `SeedGenerator` gets a new mask on the
recompute (so the gradient belongs to another mask), and a layer that
assigns to its variables in `call` updates M times per step plus once per
recompute. Both `layers.KerasLayer` and `tfpipe.keras` run Keras layers
through `ExactCalls`, which, inside a step, replaces for the duration of the
call:

  Dropout, SpatialDropout1D/2D/3D, GaussianNoise, GaussianDropout,
  AlphaDropout   `call` by the same maths on `base_layer.StepRandomBits`:
                 values per example, from (step, layer, global example index,
                 element), so a recompute repeats them and they depend on
                 neither K nor M (inside layers that reshape the batch, such
                 as TimeDistributed, they are drawn per micro-batch).
  BatchNormalization
                 `call` by the same normalisation with the micro-batch's
                 statistics; the moving statistics are recorded with the
                 step's DeferredStatsCollector and merged into one update per
                 step, equal to the full batch's; recomputes record nothing.
  any other SeedGenerator (random preprocessing and augmentation layers,
  RNN-cell and Attention dropout)
                 by a stand-in whose draws are stateless seeds from (step,
                 micro-batch, layer, draw): exact under recompute and
                 independent of K; they are drawn per micro-batch, so they
                 change with M.

and, for every other layer, makes `assign` on its variables raise a
ValueError naming the layer, so an unknown state update is refused, never
silently repeated. Layers that cannot be made exact are refused up front by
`CheckLayer` (stateful RNNs, renorm, SpectralNormalization, float8 training).
Outside a step nothing is replaced: the layer behaves as in plain Keras.
"""

import contextlib
import math
import threading
import weakref

import keras
from keras.src import backend as keras_backend
from keras.src.backend.common import global_state
from keras.src.random import seed_generator as keras_seed_generator
import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import normalization

# Layers whose randomness is re-implemented per example (see module doc).
NOISE_CLASSES = (keras.layers.Dropout, keras.layers.SpatialDropout1D,
                 keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D,
                 keras.layers.GaussianNoise, keras.layers.GaussianDropout,
                 keras.layers.AlphaDropout)
# Only their own `call`s are replaced: a subclass that overrides `call` runs
# its own code, with its seed generators swapped like any other layer's.
_NOISE_CALLS = {cls.call for cls in NOISE_CLASSES}
# Containers whose sublayers see batch-first tensors of the same examples, so
# a noise layer inside them can still draw per example. Elsewhere (e.g.
# TimeDistributed, which folds time into the batch) a nested noise layer
# draws per micro-batch: exact under recompute, but dependent on M.
_BATCH_FIRST_CONTAINERS = (keras.layers.MultiHeadAttention,
                           keras.layers.GroupQueryAttention)


def Refusal(layer):
  """Why `layer` itself cannot run exactly in a pipeline, and the fix; or None."""
  if getattr(layer, 'stateful', False) is True:
    return ('is stateful: its state would carry from one micro-batch to the '
            'next and change again when the cell is recomputed. Use '
            'stateful=False and pass the state explicitly (as an input and '
            'an output), or run it outside the pipeline.')
  if isinstance(layer, keras.layers.BatchNormalization) and getattr(
      layer, 'renorm', False):
    return ('uses renorm=True, whose renorm statistics are updated and used '
            'within each call, so they cannot be deferred to one update per '
            'step. Use renorm=False.')
  if isinstance(layer, keras.layers.SpectralNormalization):
    return ('assigns its kernel and power-iteration vector in every training '
            'call: a pipeline calls it once per micro-batch and again per '
            'recompute. Use a kernel_constraint (e.g. '
            'keras.constraints.MaxNorm) instead, or run it outside the '
            'pipeline.')
  if getattr(layer, 'quantization_mode', None) == 'float8':
    return ('is quantized to float8, whose scaling history is updated in '
            'every training call (once per micro-batch and per recompute). '
            "Train it unquantized or quantize it with 'int8'.")
  if isinstance(layer, keras.layers.AugMix):
    return ("picks its augmentations with Python's random module while it "
            'is traced, so a recompute applies other operations than the '
            'first forward. Apply it in the input pipeline (tf.data) '
            'instead, or use keras.layers.RandAugment, which tfpipe runs '
            'exactly.')
  if isinstance(layer, keras.layers.TFSMLayer) and getattr(
      layer, 'call_training_endpoint', None):
    return ("calls the SavedModel's training endpoint, whose random ops and "
            'state updates tfpipe cannot see, so a recompute would not '
            'repeat them. Drop call_training_endpoint (the serving endpoint '
            'is deterministic) or rebuild the model from Keras layers.')
  return None


def CheckLayer(layer, where):
  """Raises ValueError if `layer` or a layer inside it is refused.

  Args:
    layer: a Keras layer.
    where: how the caller names the place, e.g. "KerasLayer 'enc'"; the
      message adds the offending (sub)layer's name and class.
  """
  for sub in _Layers(layer):
    reason = Refusal(sub)
    if reason:
      inside = '' if sub is layer else f' inside {layer.name!r}'
      raise ValueError(
          f'{where}: layer {sub.name!r} ({type(sub).__name__}){inside} '
          f'{reason}')


def _Layers(layer):
  if isinstance(layer, keras.layers.Layer):
    return list(layer._flatten_layers(include_self=True))  # pylint: disable=protected-access
  return []


def _InStep():
  return (base_layer.CurrentStepSeed() is not None or
          base_layer.CurrentStatsCollector() is not None)


# The replacements are attributes of layers that other threads may call too
# (replicas share layers); one thread at a time replaces and restores them.
# Engines trace cells once, so this serializes tracing, not running.
_LOCK = threading.RLock()


@contextlib.contextmanager
def ExactCalls(layer, seed_path):
  """Within the block, calls of `layer` (and of its sublayers) are exact.

  Args:
    layer: the Keras layer about to be called.
    seed_path: a name that is the same for this layer in every partition
      (e.g. KerasLayer.SeedPath(), or the layer's name in its model); the
      i-th sublayer in `_flatten_layers` order draws with f'{seed_path}/{i}'.
  """
  if not _InStep():
    yield
    return
  undo = []
  seeded = base_layer.CurrentStepSeed() is not None
  _LOCK.acquire()
  try:
    sublayers = _Layers(layer)
    batch_first = {id(layer)}
    for sub in sublayers:
      if isinstance(sub, _BATCH_FIRST_CONTAINERS) and id(sub) in batch_first:
        batch_first.update(id(s) for s in _Layers(sub))
    for i, sub in enumerate(sublayers):
      path = seed_path if i == 0 else f'{seed_path}/{i}'
      salt = base_layer._StableHash(path)  # pylint: disable=protected-access
      if type(sub).call in _NOISE_CALLS:
        _Replace(sub, 'call',
                 _NoiseCall(sub, salt, per_example=id(sub) in batch_first),
                 undo)
      elif type(sub).call is keras.layers.BatchNormalization.call:
        _Replace(sub, 'call', _BatchNormCall(sub), undo)
      else:
        _GuardAssignments(sub, undo)
      for name, value in list(vars(sub).items()):
        if seeded and isinstance(value, keras.random.SeedGenerator):
          _Replace(sub, name, _StepSeedGenerator(value, f'{path}:{name}'),
                   undo)
    if seeded:
      # keras.random ops called with seed=None draw from Keras' global
      # generator (thread-local): stateless for the call too.
      key = keras_seed_generator.GLOBAL_SEED_GENERATOR
      old = global_state.get_global_attribute(key)
      global_state.set_global_attribute(
          key, _StepSeedGenerator(None, f'{seed_path}:global'))
      undo.append(lambda: global_state.set_global_attribute(key, old))
    yield
  finally:
    for restore in reversed(undo):
      restore()
    _LOCK.release()


def _Replace(obj, name, value, undo):
  """Sets obj.name in the instance dict (bypassing Keras tracking) until undone."""
  had = name in obj.__dict__
  old = obj.__dict__.get(name)
  obj.__dict__[name] = value

  def Restore():
    if had:
      obj.__dict__[name] = old
    else:
      del obj.__dict__[name]
  undo.append(Restore)


class _StepSeedGenerator(keras.random.SeedGenerator):
  """Stands in for a layer's SeedGenerator during a step: stateless draws.

  Draw n of a call gets a seed from (step, micro-batch, path, n); a recompute
  calls the layer again with a fresh stand-in, so it draws the same seeds.
  """

  def __init__(self, original, path):  # pylint: disable=super-init-not-called
    # No state variable: nothing is assigned, nothing is checkpointed.
    self.name = getattr(original, 'name', 'seed_generator')
    self.backend = getattr(original, 'backend', keras_backend)
    self._initial_seed = getattr(original, '_initial_seed', None)
    self._path = path
    self._draws = 0

  def next(self, ordered=True):
    del ordered
    self._draws += 1
    return base_layer.SaltedStepSeed(
        base_layer._StableHash(f'{self._path}#{self._draws}'))  # pylint: disable=protected-access


def _GuardAssignments(layer, undo):
  """Makes assign* on the layer's own variables raise a ValueError naming it."""
  variables = list(getattr(layer, '_trainable_variables', [])) + list(
      getattr(layer, '_non_trainable_variables', []))
  for v in variables:
    for method in ('assign', 'assign_add', 'assign_sub'):
      _Replace(v, method, _Refuse(layer, v), undo)


def _Refuse(layer, variable):
  def Assign(*args, **kwargs):
    del args, kwargs
    raise ValueError(
        f'tfpipe: layer {layer.name!r} ({type(layer).__name__}) assigns to '
        f'its variable {variable.path!r} in call. A pipeline calls the layer '
        'once per micro-batch and again when it recomputes the cell, so the '
        'update would be applied several times per step. Make the update '
        "outside the layer's call (e.g. in a callback), or pipeline with "
        'a tfpipe layer that defers it like layers.BatchNormLayer.')
  return Assign


# ---- randomness ---------------------------------------------------------------


def _NoiseShape(layer, inputs):
  """(shape of the random draw, whether one slice is shared by the batch)."""
  if hasattr(layer, '_get_noise_shape'):  # SpatialDropout*: per example.
    noise = layer._get_noise_shape(inputs)  # pylint: disable=protected-access
    configured = None
  else:
    noise = configured = getattr(layer, 'noise_shape', None)
  if noise is None:
    return tf.shape(inputs), False
  dynamic = tf.shape(inputs)
  dims = [dynamic[i] if d is None else d for i, d in enumerate(noise)]
  shared = configured is not None and isinstance(
      configured[0], int) and configured[0] == 1
  return tf.stack([tf.cast(d, tf.int32) for d in dims]), shared


def _NoiseCall(layer, salt, per_example):
  """Keras' call of a NOISE_CLASSES layer, drawing from StepRandomBits."""
  original = type(layer).call

  def Call(inputs, training=False, **kwargs):
    rate = getattr(layer, 'rate', getattr(layer, 'stddev', 0.0))
    if not training or rate == 0 or base_layer.CurrentStepSeed() is None:
      return original(layer, inputs, training=training, **kwargs)
    if isinstance(layer, (keras.layers.GaussianNoise,
                          keras.layers.GaussianDropout)):
      noise = base_layer.StepNormal(tf.shape(inputs), salt, inputs.dtype,
                                    per_example)
      if isinstance(layer, keras.layers.GaussianNoise):
        return inputs + tf.cast(layer.stddev, inputs.dtype) * noise
      stddev = math.sqrt(layer.rate / (1.0 - layer.rate))
      return inputs * (1.0 + tf.cast(stddev, inputs.dtype) * noise)
    shape, shared = _NoiseShape(layer, inputs)
    kept = base_layer.StepKeepMask(shape, 1.0 - layer.rate, salt,
                                   per_example, shared)
    if isinstance(layer, keras.layers.AlphaDropout):
      # keras.layers.AlphaDropout.call's affine correction, same constants.
      alpha_p = -1.6732632423543772848170429916717 * (
          1.0507009873554804934193349852946)
      kept = tf.cast(kept, inputs.dtype)
      a = ((1 - layer.rate) * (1 + layer.rate * alpha_p**2))**-0.5
      b = -a * alpha_p * layer.rate
      return a * (inputs * kept + alpha_p * (1 - kept)) + b
    return tf.where(kept, inputs / (1.0 - layer.rate), tf.zeros_like(inputs))
  return Call


# ---- batch normalization ------------------------------------------------------


class _DeferredKerasBatchNorm:
  """What the step's DeferredStatsCollector applies for a Keras BatchNormalization.

  One per layer (see _DeferredStatsOf), so all micro-batches' records of a
  layer are merged into one update. It holds its layer weakly: it is the
  value of a WeakKeyDictionary keyed by that layer, and a value that held
  its key would keep the layer alive forever.
  """

  def __init__(self, layer):
    self._layer = weakref.ref(layer)

  def ApplyDeferredStats(self, records):
    return self.ApplyMergedMoments(*normalization.MergeMoments(records))

  def ApplyMergedMoments(self, mean, variance):
    return UpdateMovingStats(self._layer(), mean, variance)


_DEFERRED = weakref.WeakKeyDictionary()


def _DeferredStatsOf(layer):
  if layer not in _DEFERRED:
    _DEFERRED[layer] = _DeferredKerasBatchNorm(layer)
  return _DEFERRED[layer]


def UpdateMovingStats(layer, mean, variance):
  """The keras BatchNormalization moving-average update, for given stats."""
  momentum = layer.momentum
  mm, mv = layer.moving_mean, layer.moving_variance
  mm.assign(mm.value * momentum + tf.cast(mean, mm.dtype) * (1.0 - momentum))
  mv.assign(mv.value * momentum + tf.cast(variance, mv.dtype) * (
      1.0 - momentum))


def _BatchNormCall(layer):
  """Keras' BatchNormalization.call with deferred moving statistics."""
  original = type(layer).call

  def Call(inputs, training=None, mask=None):
    if mask is not None:
      raise ValueError(
          f'tfpipe: layer {layer.name!r} (BatchNormalization) is called with '
          'a mask, which the pipeline does not support. Apply the mask '
          'explicitly before the layer.')
    if not (training and layer.trainable):
      return original(layer, inputs, training=training)
    compute_dtype = keras.backend.result_type(inputs.dtype, 'float32')
    x = tf.cast(inputs, compute_dtype)
    axes = layer._reduction_axes  # pylint: disable=protected-access
    mean, variance = keras.ops.moments(x, axes=axes,
                                       synchronized=layer.synchronized)
    collector = base_layer.CurrentStatsCollector()
    if collector is not None:
      count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)),
                      tf.float32)
      collector.Add(_DeferredStatsOf(layer),
                    {'mean': mean, 'variance': variance}, count)
    else:
      UpdateMovingStats(layer, mean, variance)
    gamma = tf.cast(layer.gamma, x.dtype) if layer.scale else None
    beta = tf.cast(layer.beta, x.dtype) if layer.center else None
    outputs = keras.ops.batch_normalization(
        x=x, mean=mean, variance=variance, axis=layer.axis, offset=beta,
        scale=gamma, epsilon=layer.epsilon)
    return tf.cast(outputs, layer.compute_dtype)
  return Call
