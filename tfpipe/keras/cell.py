"""KerasCellLayer: a pipeline cell that runs a slice of a Keras model's graph.

The cell owns nothing: its params hold references to the original Keras
layers (through the graph's steps), so the pipeline trains the user's own
variables. It takes a dict of named tensors and returns the dict the next
cell needs (the last cell returns the model's outputs), which is the nested
structure the executor already micro-batches, re-materializes and places.

Keras layers that keep state or draw random numbers, which a micro-batched,
recomputed forward would corrupt, run through `layers.keras_exact`, the
same code as `layers.KerasLayer` uses, with the layer's name and position in
the model's graph as its seed path (the same whatever the cells):

* BatchNormalization in training normalises each micro-batch with its own
  statistics (as the plain model would on that micro-batch). Its moving
  statistics are deferred: each micro-batch records (count, mean, variance)
  with the step's `DeferredStatsCollector`, and one merged update, equal to
  the update an unsplit batch would make, is applied per step. Recomputes
  record nothing. Outside a pipeline step it updates immediately, as Keras
  does, unless it is being recomputed.
* Dropout and the other noise layers draw per example from the step's
  seed, the layer's name and the example's index, so the recomputed forward
  drops the same units; other seeded layers get stateless seeds per
  micro-batch. This holds for layers nested inside custom layers too.
"""

import numpy as np
import keras
import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import keras_exact


class KerasCellLayer(base_layer.BaseLayer):
  """Runs a contiguous slice of a Keras graph's steps (see graph.py)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('steps', [], 'graph.Step objects of this cell, in order; they '
             'reference the original Keras layers (shared, never copied).')
    p.Define('input_keys', [], 'Keys of the dict this cell receives.')
    p.Define('output_keys', [], 'Keys of the tensors this cell sends on.')
    p.Define('outputs_struct', None, 'For the last cell: the model\'s output '
             'structure, to return the outputs in it; None returns a dict.')
    p.Define('cell_index', 0, 'Position of the cell, for messages.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if not p.steps:
      raise ValueError(f'{p.name}: steps is empty; every cell needs at least '
                       'one layer. Use fewer partitions.')
    ops, seen = [], set()
    for step in p.steps:
      if id(step.operation) not in seen:
        seen.add(id(step.operation))
        ops.append(step.operation)
    # Tracked by Keras, so the cell's variables are the layers' own variables.
    self.cell_layers = [op for op in ops
                         if isinstance(op, keras.layers.Layer)]
    self.built = True

  def build(self, input_shape):
    del input_shape

  def FProp(self, inputs, training=None):
    p = self.p
    values = dict(inputs)
    missing = [k for k in p.input_keys if k not in values]
    if missing:
      raise ValueError(f'{p.name}: cell {p.cell_index} expects tensors '
                       f'{missing}, which the previous cell did not send.')
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
    if training is not None and getattr(op, '_call_has_training_arg', False):
      kwargs['training'] = training
    # The step's index makes the seed path unique (nested models may reuse a
    # name; a shared layer's calls draw apart) and the same for any cells.
    with keras_exact.ExactCalls(op, f'{op.name}#{step.index}'):
      outputs = op(*args, **kwargs)
    # Own losses, also where a StatelessScope collects them (tied_variables).
    if hasattr(op, '_get_own_losses') and op._get_own_losses():  # pylint: disable=protected-access
      raise ValueError(
          f'tfpipe.keras: layer {op.name!r} ({type(op).__name__}) called '
          'add_loss; the pipeline differentiates only the compiled loss, per '
          'micro-batch on the last cell. Return the extra loss as a model '
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
