"""Models users bring from the Keras ecosystem, pipelined at K=4.

Tiny keras_hub models, built from constructor arguments (nothing is
downloaded), and plain Keras models that tie a weight through a closure.
Each is held against the plain model on the same variables: the forward
pass, the gradients (rtol 1e-5) and a few `fit` steps. The models are built
once per module and shared; the tests that train copy their weights into
fresh models first.
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.keras import model_test

DEVICES = model_test.DEVICES
K = 4

def _Gpt2CausalLm():
  """GPT-2 whose output projection is its input embedding (first and last)."""
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8,
      intermediate_dim=16, max_sequence_length=8, dropout=0.0)
  return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _BertBackbone():
  return keras_hub.models.BertBackbone(
      vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8,
      intermediate_dim=16, max_sequence_length=8, dropout=0.0)


def _BertClassifier():
  """A task model that calls its backbone on a dict, with None masks."""
  keras.utils.set_random_seed(0)
  return keras_hub.models.BertTextClassifier(
      backbone=_BertBackbone(), num_classes=3, preprocessor=None,
      dropout=0.0)


def _EncoderWithUnusedPooler():
  """A head on the sequence output only: the pooler's weights get no loss."""
  keras.utils.set_random_seed(0)
  backbone = _BertBackbone()
  inputs = {name: keras.Input((8,), dtype='int32', name=name)
            for name in ('token_ids', 'segment_ids', 'padding_mask')}
  pooled = keras.layers.GlobalAveragePooling1D(name='mean')(
      backbone(inputs)['sequence_output'])
  return keras.Model(inputs, keras.layers.Dense(3, name='head')(pooled),
                     name='encoder_classifier')


def _ClosureModel():
  """Cell 3 reads cell 0's kernel in a Lambda (an untracked tie)."""
  keras.utils.set_random_seed(0)
  i = keras.Input((6,), name='x')
  d0 = keras.layers.Dense(8, name='d0')
  h = d0(i)
  h = keras.layers.Dense(8, activation='tanh', name='d1')(h)
  h = keras.layers.Dense(8, activation='tanh', name='d2')(h)
  h = keras.layers.Lambda(
      lambda t: keras.ops.matmul(t, keras.ops.transpose(d0.kernel)),
      name='reads_d0')(h)
  return keras.Model(i, keras.layers.Dense(3, name='out')(h), name='closure')


_RNG = np.random.RandomState(0)
_IDS = _RNG.randint(1, 50, size=(6, 8)).astype('int32')
_MASK = np.ones((6, 8), 'int32')
_MASK[:3, 6:] = 0
_TEXT = {'token_ids': _IDS * _MASK, 'padding_mask': _MASK}
_BERT_TEXT = dict(_TEXT, segment_ids=np.zeros_like(_IDS))
_LOGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _TokenLoss(y, y_pred):
  return _LOGITS_LOSS(y, y_pred)


# name: (builder, balance, x, y, loss)
_MODELS = {
    'gpt2_causal_lm': (_Gpt2CausalLm, 'params', _TEXT,
                       np.roll(_IDS, -1, axis=1)),
    'bert_classifier': (_BertClassifier, 'params', _BERT_TEXT, _IDS[:, 0] % 3),
    'unused_pooler': (_EncoderWithUnusedPooler, 'params', _BERT_TEXT,
                      _IDS[:, 1] % 3),
    'closure': (_ClosureModel, [1, 1, 1, 2],
                _RNG.randn(6, 6).astype(np.float32), _IDS[:, 2] % 3),
}


def _Pipelined(name, model, **kwargs):
  make, balance, _, _ = _MODELS[name]
  del make
  pm = tfpipe.keras.pipeline(model, num_partitions=K, num_micro_batches=3,
                             devices=DEVICES[:K], balance=balance, **kwargs)
  pm.compile(loss=_LOGITS_LOSS)
  return pm


@pytest.fixture(scope='module')
def built():
  """name -> (plain model, pipelined model on its variables), built once."""
  result = {}

  def Get(name):
    if name not in result:
      model = _MODELS[name][0]()
      result[name] = (model, _Pipelined(name, model))
    return result[name]
  return Get


def _Dense(g):
  return None if g is None else np.asarray(tf.convert_to_tensor(g))


def _PlainGradients(model, x, y, variables):
  """Per micro-batch, weighted n_m / N, as in model_test.PlainGradients."""
  grads = model_test.PlainGradients(model, x, y, _TokenLoss)
  position = {id(v): i for i, v in enumerate(model.trainable_variables)}
  return [_Dense(grads[position[id(v)]]) for v in variables]


def _AssertGradientsEqual(pm, model, x, y, got=None):
  if got is None:
    _, got = pm.ComputeLossAndGradients(x, y)
  variables = model.trainable_variables
  want = _PlainGradients(model, x, y, variables)
  assert len(got) == len(want)
  scale = max(np.abs(w).max() for w in want if w is not None)
  for v, g, w in zip(variables, got, want):
    if w is None:
      assert g is None, f'{v.path}: no loss reaches it, but got a gradient'
      continue
    np.testing.assert_allclose(_Dense(g), w, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=v.path)


def _FitLikePlain(name, model, pm, optimizer, steps=2, prepare=None):
  """Fits `pm` (on `model`'s variables) and a plain copy; checks the weights.

  Both run eagerly: the pipeline still runs its traced step, and nothing
  else is traced again. `prepare(model)`, if given, runs on the copy too.
  """
  make, _, x, y = _MODELS[name]
  plain = make()
  plain.set_weights(model.get_weights())
  if prepare:
    prepare(plain)
  # A plain functional model: keras_hub's task `fit` would preprocess.
  reference = keras.Model(plain.inputs, plain.outputs)
  for trained in (reference, pm):
    trained.compile(optimizer=optimizer(), loss=_LOGITS_LOSS,
                    run_eagerly=True)
    trained.fit(x, y, batch_size=6, epochs=steps, shuffle=False, verbose=0)
  for a, b in zip(plain.weights, model.weights):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6,
                               err_msg=a.path)
  return plain


@pytest.mark.parametrize('name', ['gpt2_causal_lm', 'bert_classifier',
                                  'closure'])
def test_forward_gradients_and_fit_equal_the_plain_models(built, name):
  model, pm = built(name)
  _, _, x, y = _MODELS[name]
  assert [id(v) for v in pm.trainable_variables] == [
      id(v) for v in model.trainable_variables]
  np.testing.assert_allclose(pm(x), model(x), rtol=1e-5, atol=1e-6)
  _AssertGradientsEqual(pm, model, x, y)
  # Keras' TF optimizers apply an embedding's sparse gradient entry by
  # entry, so Adam's second moment of a repeated token is a sum of squares,
  # not the square of the sum the pipeline's dense gradient gives. The BERT
  # model (untied embeddings) is fitted with SGD, where both agree.
  _FitLikePlain(name, model, pm, (
      lambda: keras.optimizers.SGD(0.1)) if name == 'bert_classifier' else (
          lambda: keras.optimizers.Adam(0.01)))


def test_what_is_cut_and_what_is_tied(built):
  """The nested backbones are cut; the tied weights are named."""
  for name in ('bert_classifier', 'unused_pooler'):
    names = [s.name for plan in built(name)[1].cell_plans
             for s in plan.steps]
    assert 'bert_backbone' not in names and 'transformer_layer_1' in names
  text = tfpipe.keras.describe(built('gpt2_causal_lm')[1])
  assert ('tied: token_embedding/embeddings (cell 0) is read by cell 3 '
          'through its copy on /CPU:3') in text
  text = tfpipe.keras.describe(built('closure')[1])
  assert 'tied: d0/kernel (cell 0) is read by cell 3' in text


def test_gradients_of_a_model_with_a_variable_no_loss_reaches(built):
  """Forward and the reached variables' gradients match today."""
  model, pm = built('unused_pooler')
  _, _, x, y = _MODELS['unused_pooler']
  np.testing.assert_allclose(pm(x), model(x), rtol=1e-5, atol=1e-6)
  _, got = pm.ComputeLossAndGradients(x, y)
  want = _PlainGradients(model, x, y, model.trainable_variables)
  unreached = [v.path for v, w in zip(model.trainable_variables, want)
               if w is None]
  assert unreached == ['pooled_dense/kernel', 'pooled_dense/bias']
  for v, g, w in zip(model.trainable_variables, got, want):
    if w is not None:
      np.testing.assert_allclose(_Dense(g), w, rtol=1e-5, atol=1e-7,
                                 err_msg=v.path)


def _Backbone(model, prefix):
  # Keras numbers a backbone's name by how many were built before it.
  return next(layer for layer in model.layers
              if layer.name.startswith(prefix))


def _Pooler(model):
  return _Backbone(model, 'bert_backbone').get_layer('pooled_dense')


def test_a_variable_no_loss_reaches_gets_none_and_weight_decay_skips_it(
    built):
  model, pm = built('unused_pooler')
  _, _, x, y = _MODELS['unused_pooler']
  _AssertGradientsEqual(pm, model, x, y)
  before = _Pooler(model).get_weights()
  plain = _FitLikePlain('unused_pooler', model, pm, lambda: (
      keras.optimizers.SGD(0.05, weight_decay=0.01)))
  for trained in (plain, model):
    for a, b in zip(before, _Pooler(trained).get_weights()):
      np.testing.assert_array_equal(b, a)


_FROZEN = ('transformer_layer_0', 'token_embedding')


def _Freeze(model, trainable=False):
  """Freezes a block and the tied embedding (read in cells 0 and 3)."""
  backbone = _Backbone(model, 'gpt2_backbone')
  for layer in _FROZEN:
    backbone.get_layer(layer).trainable = trainable


def test_freezing_between_steps_gives_the_plain_gradients(built):
  """ComputeLossAndGradients, the tape path and fit (recompiled)."""
  model, pm = built('gpt2_causal_lm')
  _, _, x, y = _MODELS['gpt2_causal_lm']
  _AssertGradientsEqual(pm, model, x, y)
  try:
    _Freeze(model)
    assert [id(v) for v in pm.trainable_variables] == [
        id(v) for v in model.trainable_variables]
    _AssertGradientsEqual(pm, model, x, y)
    with tf.GradientTape() as tape:
      loss = _TokenLoss(y, pm(x, training=True))
    _AssertGradientsEqual(pm, model, x, y,
                          got=tape.gradient(loss, pm.trainable_variables))
    before = [_Backbone(model, 'gpt2_backbone').get_layer(
        layer).get_weights() for layer in _FROZEN]
    _FitLikePlain('gpt2_causal_lm', model, pm,
                  lambda: keras.optimizers.Adam(0.01), prepare=_Freeze)
    for layer, weights in zip(_FROZEN, before):
      for a, b in zip(weights, _Backbone(model, 'gpt2_backbone').get_layer(
          layer).get_weights()):
        np.testing.assert_array_equal(b, a)
  finally:
    _Freeze(model, trainable=True)
