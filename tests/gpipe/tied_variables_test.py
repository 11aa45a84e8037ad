"""Variables read by more than one cell: gradients of the tied model, one
update, copies that stay equal and are never saved or optimized."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from models import transformer_lm
from tfpipe import gpipe
from tfpipe import layers
from tfpipe.gpipe import tied_variables
from tfpipe.trainer import input_generator
from tfpipe.trainer import task as task_lib

DEVICES = [f'/CPU:{i}' for i in range(8)]
VOCAB = 11


def _LayerParams():
  """emb -> 2 x FC -> logits whose weight is emb's table, transposed."""
  result = [layers.EmbeddingLayer.Params().Set(
      name='emb', vocab_size=VOCAB, embedding_dim=8, random_seed=1)]
  result += [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=8, output_dims=8, activation='tanh',
      random_seed=2 + i) for i in range(2)]
  result.append(layers.FCLayer.Params().Set(
      name='logits', input_dims=8, output_dims=VOCAB, activation='none',
      tied_embedding='emb', random_seed=9))
  return result


def _LossFn(logits, labels):
  return layers.SoftmaxCrossEntropyLoss(logits, labels)[0]


def _Plain():
  return layers.SequentialLayer.Params().Set(
      name='plain', sub=_LayerParams()).Instantiate()


def _Pipe(plain, num_micro_batches=3, **kwargs):
  kwargs.setdefault('devices', DEVICES[:4])
  cells = gpipe.PartitionSequentialLayers(_LayerParams(), 4,
                                          balance=[1, 1, 1, 1])
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches,
      **kwargs).Instantiate()
  pipe.build((None, 5))
  for a, b in zip(plain.trainable_variables, pipe.trainable_variables):
    b.assign(a)
  return pipe


def _Batch(seed=1, n=7):
  ids = tf.random.stateless_uniform([n, 5], [seed, 2], maxval=VOCAB,
                                    dtype=tf.int32)
  return ids, tf.roll(ids, 1, axis=1)


def _PlainGradients(plain, ids, labels):
  with tf.GradientTape() as tape:
    loss = _LossFn(plain(ids), labels)
  return loss, tape.gradient(loss, plain.trainable_variables)


def _AssertClose(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-7)


def test_the_softmax_owns_no_weight_and_reads_the_embedding():
  plain = _Plain()
  assert [v.path for v in plain.trainable_variables] == [
      'emb/emb', 'fc0/w', 'fc0/b', 'fc1/w', 'fc1/b', 'logits/b']
  meta = layers.FCLayer.FPropMeta(_LayerParams()[-1], (None, 5, 8))
  assert meta.num_params == VOCAB


def test_read_copies_maps_reads_and_applies_assignments_for_real():
  """Batch norm's moving statistics still update inside the scope."""
  dense = keras.layers.Dense(3, use_bias=False)
  norm = keras.layers.BatchNormalization(momentum=0.5)
  rng = np.random.RandomState(0)
  x, weights, value = [tf.constant(rng.randn(*shape), tf.float32)
                       for shape in ((4, 2), (4, 3), (2, 3))]
  dense.build((4, 2))
  norm.build((4, 3))
  copy = tf.Variable(value)
  with tf.GradientTape(watch_accessed_variables=False) as tape:
    tape.watch(copy)
    with tied_variables.ReadCopies({id(dense.kernel): copy}) as scope:
      y = norm(dense(x), training=True)
    loss = tf.reduce_sum(y * weights)
  np.testing.assert_allclose(dense(x), tf.matmul(x, dense.kernel))
  mean = tf.reduce_mean(tf.matmul(x, value), axis=0)
  np.testing.assert_allclose(norm.moving_mean, 0.5 * mean, rtol=1e-6)
  assert id(dense.kernel) in scope.reads and id(norm.gamma) in scope.reads
  assert np.abs(tape.gradient(loss, copy)).max() > 0


@pytest.mark.parametrize('schedule,remat_policy,executor', [
    ('gpipe', 'always', 'graph'), ('1f1b', 'never', 'graph'),
    ('zb_h1', 'always', 'graph'), ('zb_h1', 'except_last', 'graph'),
    ('1f1b', 'always', 'threads')])
def test_gradients_equal_the_tied_plain_model(schedule, remat_policy,
                                              executor):
  """Over 4 cells, with 7 examples in 3 micro-batches, on every path."""
  plain = _Plain()
  pipe = _Pipe(plain, schedule=schedule, remat_policy=remat_policy,
               executor=executor)
  ids, labels = _Batch()
  tied = pipe.TiedVariables(ids)
  assert [(t.variable.path, t.owner, t.reader) for t in tied.ties] == [
      ('emb/emb', 0, 3)]
  assert tied.ties[0].copy.device.endswith('CPU:3')
  want_loss, want = _PlainGradients(plain, ids, labels)
  out = pipe.ComputeLossAndGradients(ids, labels, _LossFn)
  np.testing.assert_allclose(out.loss, want_loss, rtol=1e-6)
  _AssertClose(out.gradients, want)
  # The tape path (pipe(x) under the caller's tape) folds the copy too.
  with tf.GradientTape() as tape:
    loss = _LossFn(pipe(ids, training=True), labels)
  _AssertClose(tape.gradient(loss, pipe.trainable_variables), want)


def test_copies_follow_any_update_and_are_neither_trained_nor_saved(tmp_path):
  """A user's own optimizer loop: the copy is refreshed at each step."""
  plain = _Plain()
  pipe = _Pipe(plain, num_micro_batches=2)
  assert [v.path for v in pipe.trainable_variables] == [
      v.path for v in plain.trainable_variables]
  optimizers = [keras.optimizers.SGD(0.5), keras.optimizers.SGD(0.5)]
  for step in range(3):
    ids, labels = _Batch(seed=step)
    _, want = _PlainGradients(plain, ids, labels)
    out = pipe.ComputeLossAndGradients(ids, labels, _LossFn)
    _AssertClose(out.gradients, want)
    optimizers[0].apply_gradients(zip(want, plain.trainable_variables))
    optimizers[1].apply_gradients(zip(out.gradients,
                                      pipe.trainable_variables))
  copy = pipe.TiedVariables().ties[0].copy
  assert all(copy is not v for v in pipe.weights)
  path = tf.train.Checkpoint(model=pipe).save(str(tmp_path / 'ckpt'))
  names = [name for name, _ in tf.train.list_variables(path)]
  assert sum('emb' in name and 'VARIABLE_VALUE' in name
             for name in names) == 1, names
  assert not any('copy' in name for name in names), names


def test_replicas_sum_the_copies_gradients_too():
  plain = _Plain()
  pipe = _Pipe(plain, num_micro_batches=2, num_replicas=2, devices=DEVICES)
  ids, labels = _Batch(n=8)
  _, want = _PlainGradients(plain, ids, labels)
  _AssertClose(pipe.ComputeLossAndGradients(ids, labels, _LossFn).gradients,
               want)


def test_a_tie_to_a_missing_or_misshaped_embedding_is_refused():
  params = _LayerParams()
  params[-1].tied_embedding = 'embedding'
  cells = gpipe.PartitionSequentialLayers(params, 2, balance=[2, 2])
  with pytest.raises(ValueError, match="layer 'logits' has tied_embedding="
                     "'embedding', but no cell holds an EmbeddingLayer"):
    gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, devices=DEVICES[:2]).Instantiate()
  params = _LayerParams()
  params[-1].Set(output_dims=VOCAB + 1)
  with pytest.raises(ValueError, match=r"logits: tied_embedding='emb' must "
                     r'name an EmbeddingLayer with a table of shape \(12, 8\)'):
    layers.SequentialLayer.Params().Set(name='s', sub=params).Instantiate()


def test_a_variable_read_bare_in_another_stage_is_refused():
  """A closure over the tf.Variable itself bypasses any copy: refused."""
  keras.utils.set_random_seed(0)
  i = keras.Input((4,))
  d0 = keras.layers.Dense(4, name='d0')
  h = keras.layers.Dense(4, name='d1')(d0(i))
  bare = d0.kernel.value
  h = keras.layers.Lambda(lambda t: keras.ops.matmul(t, bare),
                          name='reads_bare')(h)
  model = keras.Model(i, keras.layers.Dense(2, name='out')(h))
  with pytest.raises(ValueError, match=r"cell 1 .* reads variable d0/kernel "
                     r'of cell 0 .* as a bare tf.Variable'):
    tfpipe.keras.pipeline(model, num_partitions=2, devices=DEVICES[:2],
                          balance=[2, 2], place_variables=False)


def _LmTask(num_partitions, num_micro_batches):
  p = task_lib.BaseTask.Params()
  p.model = transformer_lm.TransformerLm.Params().Set(
      vocab_size=12, sequence_length=8, model_dim=8, num_layers=1,
      num_heads=2, hidden_dim=32, tie_embeddings=True)
  p.pipeline.Set(num_partitions=num_partitions,
                 num_micro_batches=num_micro_batches, balance='params')
  p.train.Set(learning_rate=1e-2)
  return p.Instantiate()


def test_a_tied_lm_trains_in_the_trainer_as_on_one_device():
  single, piped = _LmTask(1, 1), _LmTask(2, 2)
  ties = piped.pipe.TiedVariables(tf.TensorSpec([None, 8], tf.int32)).ties
  assert [(t.variable.path, t.reader) for t in ties] == [('emb/emb', 1)]
  dataset = input_generator.SequenceTaskInput.Params().Set(
      batch_size=8, seed=0, vocab_size=12, length=4,
      task='reverse').Instantiate().GetDataset(0)
  for batch in dataset.take(4):
    want, got = single.TrainStep(batch), piped.TrainStep(batch)
    np.testing.assert_allclose(got['loss'], want['loss'], rtol=1e-5)
  for a, b in zip(single.pipe.trainable_variables,
                  piped.pipe.trainable_variables):
    if a.path.endswith('b_k'):
      continue  # Its gradient is 0 up to rounding, which Adam scales up.
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6,
                               err_msg=a.path)
