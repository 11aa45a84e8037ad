"""pipe(x) under a GradientTape: the pipeline's own backward, however asked.

The tape's gradient must run the pipeline's backward (re-materialized per
the remat policy, accumulated per variable) wherever the tape is: inside
the tf.function, or outside it. It must also answer what plain TensorFlow
answers: a persistent tape's second gradient, a jacobian, two losses, two
calls, None for a variable the output does not reach, and the trainable
variables as they are when the layer is called.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import base_layer
from tfpipe import layers
from tfpipe import placement
from tfpipe.gpipe import cell_runtime
from tfpipe.gpipe import runtime as runtime_lib

_Pipeline = plt_test._Pipeline  # pylint: disable=protected-access
_Data = plt_test._Data  # pylint: disable=protected-access
_Loss = plt_test._Loss  # pylint: disable=protected-access
_LayerParams = plt_test._LayerParams  # pylint: disable=protected-access
_AssertAllClose = plt_test._AssertAllClose  # pylint: disable=protected-access


def _Plain(layer_params):
  return layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()


def _Gradients(model, training=True):
  """The gradients of _Loss on _Data through `model`, under a tape."""
  x, y = _Data()
  with tf.GradientTape() as tape:
    loss = _Loss(model(x, training=training), y)
  return tape.gradient(loss, model.trainable_variables)


class _Backwards:
  """Counts the pipeline's backward passes and what their F actions kept."""

  def __init__(self, monkeypatch):
    self.passes, self.records = 0, []
    tape_backward = runtime_lib.PipelineRuntime.TapeBackward
    backward = cell_runtime.CellRuntime.Backward

    def TapeBackward(runtime, *args, **kwargs):
      self.passes += 1
      return tape_backward(runtime, *args, **kwargs)

    def Backward(cell, record, *args, **kwargs):
      self.records.append(type(record).__name__)
      return backward(cell, record, *args, **kwargs)
    monkeypatch.setattr(runtime_lib.PipelineRuntime, 'TapeBackward',
                        TapeBackward)
    monkeypatch.setattr(cell_runtime.CellRuntime, 'Backward', Backward)


@pytest.mark.parametrize('outer', ['eager', 'tf.function'])
def test_a_tape_outside_the_function_runs_the_pipelines_backward(
    outer, monkeypatch):
  """Re-materialization survives the function boundary (tf.custom_gradient)."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  pipe = _Pipeline(layer_params, 2, 3)
  forward = tf.function(lambda x: pipe(x, training=True))

  def Gradients(x, y):
    with tf.GradientTape() as tape:
      loss = _Loss(forward(x), y)
    return loss, tape.gradient(loss, pipe.trainable_variables)
  if outer == 'tf.function':
    Gradients = tf.function(Gradients)  # pylint: disable=invalid-name
  backwards = _Backwards(monkeypatch)
  loss, grads = Gradients(x, y)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  _AssertAllClose(grads, ref_grads)
  assert backwards.passes == 1
  # Cell 1's backward follows each of its forwards: those run at once.
  assert set(backwards.records) == {'KeptInput'}


def test_inference_mode_under_a_tape_still_rematerializes(monkeypatch):
  """training=False (fine-tuning with batch norm frozen) keeps only inputs."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_grads = _Gradients(_Plain(layer_params), training=False)
  pipe = _Pipeline(layer_params, 2, 3)
  backwards = _Backwards(monkeypatch)
  _AssertAllClose(_Gradients(pipe, training=False), ref_grads)
  assert backwards.records and set(backwards.records) == {'KeptInput'}
  out = pipe.ComputeLossAndGradients(x, y, _Loss, training=False)
  _AssertAllClose(out.gradients, ref_grads)


@pytest.mark.parametrize('traced', [False, True])
def test_persistent_tape_two_losses_and_a_jacobian(traced):
  layer_params = _LayerParams(4)
  x = _Data()[0][:5]
  models = {'plain': _Plain(layer_params),
            'pipe': _Pipeline(layer_params, 2, 2, schedule='1f1b',
                              remat_policy='except_last')}

  def Gradients(model):
    with tf.GradientTape(persistent=True) as tape:
      out = model(x, training=True)
      first, squares = out[:, 0], tf.reduce_sum(tf.square(out))
      first_sum = tf.reduce_sum(first)
    kernel = placement.TfVariable(model.trainable_variables[0])
    return (tape.gradient(first_sum, model.trainable_variables),
            tape.gradient(squares, model.trainable_variables),
            tape.gradient([squares, first], model.trainable_variables),
            tape.jacobian(first, kernel, experimental_use_pfor=False))
  results = {}
  for name, model in models.items():
    results[name] = (tf.function(lambda m=model: Gradients(m))() if traced
                     else Gradients(model))
  for got, want in zip(results['pipe'], results['plain']):
    _AssertAllClose(tf.nest.flatten(got), tf.nest.flatten(want))
  kernel = placement.TfVariable(models['pipe'].trainable_variables[0])
  with tf.GradientTape() as tape:
    first = models['pipe'](x, training=True)[:, 0]
  # Vectorized (the default), it is refused, saying what works.
  with pytest.raises(ValueError, match='experimental_use_pfor') as info:
    tape.jacobian(first, kernel)
  assert 'pass experimental_use_pfor=False' in str(info.value.__cause__)


def test_two_calls_under_one_tape():
  layer_params = _LayerParams(4)
  x, y = _Data()
  plain, pipe = _Plain(layer_params), _Pipeline(layer_params, 2, 3)

  def Gradients(model):
    with tf.GradientTape() as tape:
      loss = _Loss(model(x, training=True), y) + _Loss(
          model(x[:7] * 2.0, training=True), y[:7])
    return tape.gradient(loss, model.trainable_variables)
  _AssertAllClose(Gradients(pipe), Gradients(plain))
  _AssertAllClose(tf.function(lambda: Gradients(pipe))(), Gradients(plain))


class WithUnusedVariable(base_layer.BaseLayer):
  """An FC layer next to a variable its output does not depend on."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', plt_test.DIM, 'Feature size.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('fc', layers.FCLayer.Params().Set(
        input_dims=self.p.dim, output_dims=self.p.dim, activation='tanh',
        random_seed=3))
    self.unused = self.CreateVariable('unused', [self.p.dim])

  def FProp(self, inputs, training=None):
    return self.fc(inputs)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    return base_layer.CostMeta(output_shape=input_shape, flops=1.0,
                               num_params=p.dim * (p.dim + 2))


def UnusedVariableParams():
  return _LayerParams(2) + [WithUnusedVariable.Params().Set(name='odd')]


@pytest.mark.parametrize('traced', [False, True])
def test_a_variable_the_output_does_not_reach_gets_none(traced):
  layer_params = UnusedVariableParams()
  plain, pipe = _Plain(layer_params), _Pipeline(layer_params, 2, 3)
  want = _Gradients(plain)
  got = tf.function(lambda: _Gradients(pipe))() if traced else _Gradients(
      pipe)
  assert [g is None for g in got] == [g is None for g in want]
  assert sum(g is None for g in got) == 1
  _AssertAllClose([g for g in got if g is not None],
                  [g for g in want if g is not None])


@pytest.mark.parametrize('traced', [False, True])
def test_freezing_a_layer_between_steps_is_followed(traced):
  """Keras' fine-tuning idiom: layer.trainable = False after a step."""
  layer_params = _LayerParams(4)
  plain, pipe = _Plain(layer_params), _Pipeline(layer_params, 2, 3)
  for frozen in (None, 1, 2):
    for model in (plain, pipe):
      for i, layer in enumerate(model.sub if model is plain else [
          l for cell in model.cells for l in cell.sub]):
        layer.trainable = i != frozen
    # A tf.function retraces when the trainable set changes.
    run = (lambda m: tf.function(lambda: _Gradients(m))()) if traced else (
        _Gradients)
    want, got = run(plain), run(pipe)
    assert len(got) == len(pipe.trainable_variables) == len(want)
    _AssertAllClose(got, want)


def test_a_keras_model_through_tfpipe_keras_follows_freezing_and_gets_none():
  """The engine under tfpipe.keras: a Keras model's unused and frozen
  variables get what plain Keras gives them."""
  import keras  # pylint: disable=g-import-not-at-top
  import tfpipe.keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  inputs = keras.Input((plt_test.DIM,))
  h = inputs
  for i in range(4):
    h = keras.layers.Dense(plt_test.DIM, activation='tanh', name=f'd{i}')(h)
  model = keras.Model(inputs, h)
  unused = keras.layers.Dense(2, name='unused')
  unused.build((None, plt_test.DIM))
  model.unused = unused  # Tracked by the model, reached by no loss.
  piped = tfpipe.keras.pipeline(model, num_partitions=2, num_micro_batches=3,
                                devices=['/CPU:0', '/CPU:1'], balance=[2, 2])
  x, y = _Data()

  def Gradients(m):
    with tf.GradientTape() as tape:
      loss = _Loss(m(x, training=True), y)
    return tape.gradient(loss, model.trainable_variables)
  for frozen in (None, 'd1'):
    for layer in model.layers:
      layer.trainable = layer.name != frozen
    want, got = Gradients(model), Gradients(piped)
    assert [g is None for g in got] == [g is None for g in want]
    assert sum(g is None for g in got) == 2  # unused's kernel and bias.
    _AssertAllClose([g for g in got if g is not None],
                    [g for g in want if g is not None])
