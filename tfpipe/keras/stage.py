"""KerasStageLayer: a pipeline cell that runs a slice of a Keras model's graph.

The cell owns nothing: its params hold references to the original Keras
layers (through the graph's steps), so the pipeline trains the user's own
variables. It takes a dict of named tensors and returns the dict the next
stage needs (the last stage returns the model's outputs), which is the nested
structure the executor already micro-batches, re-materializes and places.

Two kinds of Keras layers keep state that a micro-batched, recomputed forward
would corrupt, and are run here by hand:

* BatchNormalization in training normalises each micro-batch with its own
  statistics (as the plain model would on that micro-batch). Its moving
  statistics are deferred: each micro-batch records (count, mean, variance)
  with the step's `DeferredStatsCollector`, and one merged update, equal to
  the update an unsplit batch would make, is applied per step. Recomputes
  record nothing. Outside a pipeline step it updates immediately, as Keras
  does, unless it is being recomputed.
* Dropout draws its mask with a stateless op seeded by the pipeline's
  (step, micro-batch) seed and the layer's name, so the recomputed forward
  drops the same units.
"""

import numpy as np
import keras
import tensorflow as tf

from tfpipe import base_layer


class _KerasBatchNormStats:
  """Applies merged deferred statistics to a keras BatchNormalization layer."""

  def __init__(self, layer):
    self.layer = layer

  def ApplyDeferredStats(self, records):
    counts = [tf.cast(c, tf.float32) for c, _ in records]
    means = [tf.cast(s['mean'], tf.float32) for _, s in records]
    variances = [tf.cast(s['variance'], tf.float32) for _, s in records]
    total = tf.add_n(counts)
    mean = tf.add_n([c * m for c, m in zip(counts, means)]) / total
    second = tf.add_n([c * (v + tf.square(m))
                       for c, m, v in zip(counts, means, variances)]) / total
    variance = tf.maximum(second - tf.square(mean), 0.0)
    return UpdateMovingStats(self.layer, mean, variance)


def UpdateMovingStats(layer, mean, variance):
  """The keras BatchNormalization moving-average update, for given stats."""
  momentum = layer.momentum
  mm, mv = layer.moving_mean, layer.moving_variance
  mean = tf.cast(mean, mm.dtype)
  variance = tf.cast(variance, mv.dtype)
  mm.assign(mm.value * momentum + mean * (1.0 - momentum))
  mv.assign(mv.value * momentum + variance * (1.0 - momentum))
  return None


def _BatchNorm(layer, stats, inputs, training, kwargs):
  """Keras' BatchNormalization.call, with deferred moving statistics."""
  if kwargs.get('mask') is not None:
    raise ValueError(
        f'tfpipe.keras: layer {layer.name!r} (BatchNormalization) is called '
        'with a mask, which the pipeline does not support. Apply the mask '
        'explicitly before the layer.')
  if not (training and layer.trainable):
    return layer(inputs, training=training)
  compute_dtype = keras.backend.result_type(inputs.dtype, 'float32')
  x = tf.cast(inputs, compute_dtype)
  mean, variance = keras.ops.moments(x, axes=layer._reduction_axes,  # pylint: disable=protected-access
                                     synchronized=layer.synchronized)
  collector = base_layer.CurrentStatsCollector()
  if collector is not None:
    shape = tf.shape(x)
    count = tf.cast(tf.reduce_prod(tf.gather(
        shape, layer._reduction_axes)), tf.float32)  # pylint: disable=protected-access
    collector.Add(stats, {'mean': mean, 'variance': variance}, count)
  elif not base_layer.IsRecomputing():
    UpdateMovingStats(layer, mean, variance)
  gamma = tf.cast(layer.gamma, x.dtype) if layer.scale else None
  beta = tf.cast(layer.beta, x.dtype) if layer.center else None
  outputs = keras.ops.batch_normalization(
      x=x, mean=mean, variance=variance, axis=layer.axis, offset=beta,
      scale=gamma, epsilon=layer.epsilon)
  return tf.cast(outputs, layer.compute_dtype)


def _Dropout(layer, inputs, training):
  """Keras' Dropout with a stateless mask from the pipeline's step seed."""
  seed = base_layer.CurrentStepSeed()
  if not training or layer.rate == 0 or seed is None:
    return layer(inputs, training=training)
  if hasattr(layer, '_get_noise_shape'):
    noise_shape = layer._get_noise_shape(inputs)  # pylint: disable=protected-access
  else:
    noise_shape = layer.noise_shape
  if noise_shape is not None:
    dynamic = tf.shape(inputs)
    noise_shape = tf.stack([dynamic[i] if d is None else d
                            for i, d in enumerate(noise_shape)])
  salt = tf.constant([base_layer._StableHash(layer.name), 0], tf.int64)  # pylint: disable=protected-access
  return tf.nn.experimental.stateless_dropout(
      inputs, layer.rate, seed=tf.cast(seed, tf.int64) + salt,
      noise_shape=noise_shape)


class KerasStageLayer(base_layer.BaseLayer):
  """Runs a contiguous slice of a Keras graph's steps (see graph.py)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('steps', [], 'graph.Step objects of this stage, in order; they '
             'reference the original Keras layers (shared, never copied).')
    p.Define('input_keys', [], 'Keys of the dict this stage receives.')
    p.Define('output_keys', [], 'Keys of the tensors this stage sends on.')
    p.Define('outputs_struct', None, 'For the last stage: the model\'s output '
             'structure, to return the outputs in it; None returns a dict.')
    p.Define('stage_index', 0, 'Position of the stage, for messages.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if not p.steps:
      raise ValueError(f'{p.name}: steps is empty; every stage needs at least '
                       'one layer. Use fewer partitions.')
    ops, seen = [], set()
    for step in p.steps:
      if id(step.operation) not in seen:
        seen.add(id(step.operation))
        ops.append(step.operation)
    # Tracked by Keras, so the cell's variables are the layers' own variables.
    self.stage_layers = [op for op in ops
                         if isinstance(op, keras.layers.Layer)]
    self._bn_stats = {
        id(op): _KerasBatchNormStats(op) for op in ops
        if isinstance(op, keras.layers.BatchNormalization)}
    self.built = True

  def build(self, input_shape):
    del input_shape

  def FProp(self, inputs, training=None):
    p = self.p
    values = dict(inputs)
    missing = [k for k in p.input_keys if k not in values]
    if missing:
      raise ValueError(f'{p.name}: stage {p.stage_index} expects tensors '
                       f'{missing}, which the previous stage did not send.')
    for step in p.steps:
      outputs = self._RunStep(step, values, training)
      for key, value in zip(step.output_keys, tf.nest.flatten(outputs)):
        values[key] = value
    result = [values[k] for k in p.output_keys]
    if p.outputs_struct is not None:
      return keras.tree.pack_sequence_as(p.outputs_struct, result)
    return dict(zip(p.output_keys, result))

  def _RunStep(self, step, values, training):
    op = step.operation
    args, kwargs = step.Arguments(values)
    if isinstance(op, keras.layers.BatchNormalization):
      kwargs.pop('training', None)
      return _BatchNorm(op, self._bn_stats[id(op)], args[0], training, kwargs)
    if isinstance(op, keras.layers.Dropout):
      return _Dropout(op, args[0], training)
    if training is not None and getattr(op, '_call_has_training_arg', False):
      kwargs['training'] = training
    outputs = op(*args, **kwargs)
    if getattr(op, '_losses', None):
      raise ValueError(
          f'tfpipe.keras: layer {op.name!r} ({type(op).__name__}) called '
          'add_loss; the pipeline differentiates only the compiled loss, per '
          'micro-batch on the last stage. Return the extra loss as a model '
          'output with its own compiled loss instead.')
    return outputs

  def NumParams(self):
    return int(sum(np.prod(v.shape) for v in self.trainable_variables))

  def compute_output_shape(self, input_shape):
    del input_shape
    p = self.p
    keys = {}
    for step in p.steps:
      for key, t in zip(step.output_keys, tf.nest.flatten(step.node.outputs)):
        keys[key] = tuple(t.shape)
    shapes = [keys.get(k) for k in p.output_keys]
    if p.outputs_struct is not None:
      return keras.tree.pack_sequence_as(p.outputs_struct, shapes)
    return dict(zip(p.output_keys, shapes))

  @classmethod
  def FPropMeta(cls, p, input_shape):
    del input_shape
    num_params = 0
    for step in p.steps:
      if step.first_use:
        num_params += int(sum(np.prod(v.shape) for v in getattr(
            step.operation, 'trainable_variables', [])))
    return base_layer.CostMeta(output_shape=None, num_params=num_params)
