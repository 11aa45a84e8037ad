"""tfpipe.keras.pipeline: gradients, fit, evaluate/predict and saving.

The reference is always the plain Keras model on the same variables: the
pipeline must compute the same gradients (per micro-batch where batch norm
makes micro-batches differ), reach the same weights through fit, write
weight files the plain model loads, and save model files that keep the
optimizer state and compile config to train on from.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe

DEVICES = [f'/CPU:{i}' for i in range(8)]


def _Sequential(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((6,)),
      keras.layers.Dense(16, activation='relu', name='s1'),
      keras.layers.Dense(16, activation='tanh', name='s2'),
      keras.layers.Dense(8, activation='relu', name='s3'),
      keras.layers.Dense(3, name='s4'),
  ], name='seq')


def _Functional(seed=0):
  """Two inputs, two outputs, a residual Add, a Concatenate and a long skip."""
  keras.utils.set_random_seed(seed)
  a = keras.Input((6,), name='a')
  b = keras.Input((4,), name='b')
  h = keras.layers.Dense(8, activation='relu', name='d1')(a)
  h2 = keras.layers.Dense(8, activation='tanh', name='d2')(h)
  h3 = keras.layers.Add(name='add')([h, h2])
  c = keras.layers.Concatenate(name='cat')([h3, b])
  d = keras.layers.Dense(8, activation='relu', name='d3')(c)
  e = keras.layers.Dense(8, activation='tanh', name='d4')(d)
  o1 = keras.layers.Dense(3, name='o1')(keras.layers.Add(name='add2')([e, h]))
  o2 = keras.layers.Dense(1, name='o2')(h2)
  return keras.Model([a, b], [o1, o2], name='func')


def _Data(model, n=10, seed=0):
  rng = np.random.RandomState(seed)
  xs = [rng.randn(n, *t.shape[1:]).astype(np.float32) for t in model.inputs]
  ys = [rng.randn(n, *t.shape[1:]).astype(np.float32) for t in model.outputs]
  unwrap = lambda v: v[0] if len(v) == 1 else v
  return unwrap(xs), unwrap(ys)


def _Mse(y, y_pred):
  ys, ps = keras.tree.flatten(y), keras.tree.flatten(y_pred)
  return tf.add_n([tf.reduce_mean(tf.square(p - t)) for t, p in zip(ys, ps)])


def _Slice(structure, start, end):
  return keras.tree.map_structure(lambda t: t[start:end], structure)


def PlainGradients(model, x, y, loss_fn, num_micro_batches=1):
  """Gradients of the plain model, per micro-batch, weighted n_m / N."""
  n = keras.tree.flatten(x)[0].shape[0]
  base, extra = divmod(n, num_micro_batches)
  sizes = [base + 1] * extra + [base] * (num_micro_batches - extra)
  total, start = None, 0
  for size in sizes:
    xm, ym = _Slice(x, start, start + size), _Slice(y, start, start + size)
    with tf.GradientTape() as tape:
      loss = loss_fn(ym, model(xm, training=True)) * size / n
    grads = tape.gradient(loss, model.trainable_variables)
    total = grads if total is None else [a + g for a, g in zip(total, grads)]
    start += size
  return total


def _AssertGradientsEqual(pm, model, x, y, loss_fn, micro, rtol=1e-5):
  """Gradients agree to rtol, relative to the largest gradient of the model.

  (Biases before a batch norm have zero gradient up to rounding noise, so a
  per-variable relative tolerance would compare noise with noise.)
  """
  _, got = pm.ComputeLossAndGradients(x, y)
  want = [np.asarray(w) for w in PlainGradients(model, x, y, loss_fn, micro)]
  assert len(got) == len(want)
  scale = max(np.abs(w).max() for w in want)
  for v, g, w in zip(model.trainable_variables, got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * scale,
                               err_msg=v.path)


@pytest.mark.parametrize('k,m,eager', [(2, 1, True), (4, 4, True),
                                     (2, 4, False), (4, 1, True)])
def test_sequential_gradients(k, m, eager):
  model = _Sequential()
  pm = tfpipe.keras.pipeline(model, num_partitions=k, num_micro_batches=m,
                             devices=DEVICES[:k], balance='params')
  pm.compile(loss='mse', run_eagerly=eager)
  x, y = _Data(model)
  _AssertGradientsEqual(pm, model, x, y, _Mse, 1)


@pytest.mark.parametrize('k,m,schedule,eager', [
    (2, 4, 'gpipe', True), (4, 1, 'gpipe', True), (4, 4, '1f1b', True)])
def test_functional_gradients_with_skips_and_several_inputs_and_outputs(
    k, m, schedule, eager):
  model = _Functional()
  pm = tfpipe.keras.pipeline(model, num_partitions=k, num_micro_batches=m,
                             devices=DEVICES[:k], balance='flops',
                             schedule=schedule)
  pm.compile(loss=['mse', 'mse'], run_eagerly=eager)
  x, y = _Data(model)
  _AssertGradientsEqual(pm, model, x, y, _Mse, 1)


@pytest.mark.parametrize('schedule,num_devices', [('zb_h1', 4),
                                                  ('interleaved_1f1b', 2)])
def test_zero_bubble_and_interleaved_schedules_give_the_plain_gradients(
    schedule, num_devices):
  model = _Functional()
  pm = tfpipe.keras.pipeline(model, num_partitions=4, num_micro_batches=3,
                             devices=DEVICES[:num_devices], balance='flops',
                             schedule=schedule)
  pm.compile(loss=['mse', 'mse'])
  x, y = _Data(model)
  _AssertGradientsEqual(pm, model, x, y, _Mse, 1)


def test_variables_are_the_models_own():
  model = _Functional()
  pm = tfpipe.keras.pipeline(model, num_partitions=4, devices=DEVICES[:4],
                             balance='params')
  assert [id(v) for v in pm.trainable_variables] == [
      id(v) for v in model.trainable_variables]


def _Logits(y, y_pred):
  return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
      y, y_pred, from_logits=True))


_APPLICATIONS = [('MobileNetV2', {'alpha': 0.35}),
                 ('MobileNet', {'alpha': 0.25, 'dropout': 0.0})]


@pytest.fixture
def exact_float_order():
  """Grappler's arithmetic optimizer off while the test builds its functions.

  The pipeline traces each cell; the plain reference runs eagerly. Grappler
  reorders float sums in traced code, and these tiny models (batch norm
  over 4 examples at 1x1 spatial size) amplify that rounding into
  percent-level gradient differences. With the reordering off, the two
  compute the same float operations and must agree to 1e-5.
  """
  before = tf.config.optimizer.get_experimental_options()
  tf.config.optimizer.set_experimental_options(
      {'arithmetic_optimization': False})
  yield
  tf.config.optimizer.set_experimental_options(
      {'arithmetic_optimization': before.get('arithmetic_optimization',
                                             True)})


# Each model at two (K, M) pairs, and every pair of K in {2, 4} and M in
# {1, 4} by one model: the full cross product took two minutes of CI.
@pytest.mark.parametrize('name,kwargs,k,m', [
    pytest.param(*_APPLICATIONS[i], k, m, id=f'{_APPLICATIONS[i][0]}-k{k}-m{m}')
    for i, k, m in ((0, 4, 4), (0, 2, 1), (1, 2, 4), (1, 4, 1))])
def test_application_gradients(name, kwargs, k, m, exact_float_order):
  """keras.applications models, batch norm included, per micro-batch.

  Called eagerly (run_eagerly=True): each cell is still traced once, and
  fit's fully traced path is covered above.
  """
  del exact_float_order
  keras.utils.set_random_seed(0)
  model = getattr(keras.applications, name)(
      input_shape=(32, 32, 3), weights=None, classes=5,
      classifier_activation=None, **kwargs)
  pm = tfpipe.keras.pipeline(model, num_partitions=k, num_micro_batches=m,
                             devices=DEVICES[:k], balance='flops')
  pm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
             run_eagerly=True)
  rng = np.random.RandomState(0)
  n = 6 if m == 4 else 4  # 6 over 4 micro-batches: an uneven split.
  x = rng.rand(n, 32, 32, 3).astype(np.float32)
  y = rng.randint(0, 5, size=(n,))
  _AssertGradientsEqual(pm, model, x, y, _Logits, m)


@pytest.mark.parametrize('make,eager', [(_Sequential, False),
                                        (_Functional, True)])
def test_fit_reaches_the_plain_models_weights(make, eager):
  plain, piped = make(seed=1), make(seed=1)
  x, y = _Data(plain, n=20, seed=2)
  losses = 'mse' if make is _Sequential else ['mse', 'mse']
  plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=losses,
                run_eagerly=eager)
  history_plain = plain.fit(x, y, batch_size=10, epochs=3, shuffle=False,
                            verbose=0)
  pm = tfpipe.keras.pipeline(piped, num_partitions=4, num_micro_batches=4,
                             devices=DEVICES[:4], balance='params')
  pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=losses,
             run_eagerly=eager)
  history_piped = pm.fit(x, y, batch_size=10, epochs=3, shuffle=False,
                         verbose=0)
  for a, b in zip(plain.weights, piped.weights):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6,
                               err_msg=a.path)
  np.testing.assert_allclose(history_piped.history['loss'],
                             history_plain.history['loss'], rtol=1e-4)


def test_threaded_executor_fits_like_the_graph_executor():
  """executor='threads' gives fit the same losses, metrics and weights."""
  histories, weights = {}, {}
  for executor in ('graph', 'threads'):
    model = _Sequential(seed=5)
    x, y = _Data(model, n=14, seed=6)
    pm = tfpipe.keras.pipeline(model, num_partitions=2, num_micro_batches=3,
                               devices=DEVICES[:2], balance='params',
                               executor=executor)
    pm.compile(optimizer=keras.optimizers.Adam(0.01), loss='mse',
               metrics=['mae'])
    assert pm.run_eagerly == (executor == 'threads')
    # 14 examples in batches of 10: the last batch has 4, a second size.
    histories[executor] = pm.fit(x, y, batch_size=10, epochs=2,
                                 shuffle=False, verbose=0).history
    weights[executor] = [w.numpy() for w in model.weights]
  for name in ('loss', 'mae'):
    np.testing.assert_allclose(histories['threads'][name],
                               histories['graph'][name], rtol=1e-5)
  for a, b in zip(weights['threads'], weights['graph']):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  pm = tfpipe.keras.pipeline(_Sequential(), num_partitions=2,
                             devices=DEVICES[:2], balance='params',
                             executor='threads')
  with pytest.raises(ValueError, match='train_step must run eagerly'):
    pm.compile(optimizer='sgd', loss='mse', run_eagerly=False)


@pytest.mark.parametrize('executor', ['graph', 'threads'])
def test_metrics_evaluate_predict_and_sum_reduction_match_plain(executor):
  plain, piped = _Sequential(seed=3), _Sequential(seed=3)
  x, y = _Data(plain, n=10, seed=4)
  loss = keras.losses.MeanSquaredError(reduction='sum')
  plain.compile(optimizer='sgd', loss=loss, metrics=['mae'], run_eagerly=True)
  pm = tfpipe.keras.pipeline(piped, num_partitions=2, num_micro_batches=4,
                             devices=DEVICES[:2], balance='params',
                             executor=executor)
  pm.compile(optimizer='sgd', loss=keras.losses.MeanSquaredError(
      reduction='sum'), metrics=['mae'], run_eagerly=True)
  want = plain.fit(x, y, batch_size=10, epochs=1, verbose=0).history
  got = pm.fit(x, y, batch_size=10, epochs=1, verbose=0).history
  for name in ('loss', 'mae'):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
  np.testing.assert_allclose(
      pm.evaluate(x, y, batch_size=10, verbose=0),
      plain.evaluate(x, y, batch_size=10, verbose=0), rtol=1e-5)
  np.testing.assert_allclose(pm.predict(x, batch_size=5, verbose=0),
                             plain.predict(x, batch_size=5, verbose=0),
                             rtol=1e-5, atol=1e-6)


def test_saved_weights_load_into_the_plain_model(tmp_path):
  model = _Functional(seed=5)
  x, y = _Data(model, n=8)
  pm = tfpipe.keras.pipeline(model, num_partitions=2, num_micro_batches=2,
                             devices=DEVICES[:2], balance='params')
  pm.compile(optimizer='adam', loss=['mse', 'mse'], run_eagerly=True)
  checkpoint = keras.callbacks.ModelCheckpoint(
      str(tmp_path / 'ckpt.weights.h5'), save_weights_only=True)
  log = keras.callbacks.CSVLogger(str(tmp_path / 'log.csv'))
  pm.fit(x, y, batch_size=4, epochs=2, verbose=0,
         callbacks=[checkpoint, log])
  pm.save_weights(str(tmp_path / 'final.weights.h5'))
  for path in ('final.weights.h5', 'ckpt.weights.h5'):
    fresh = _Functional(seed=6)
    fresh.load_weights(str(tmp_path / path))
    for a, b in zip(model.weights, fresh.weights):
      np.testing.assert_array_equal(b.numpy(), a.numpy())
  assert (tmp_path / 'log.csv').read_text().count('\n') == 3


def test_save_keeps_the_optimizer_state_and_compile_config(tmp_path):
  # pm.save wrote the uncompiled plain model: load_model gave no optimizer.
  x, y = _Data(_Sequential(), n=16)
  pm = tfpipe.keras.pipeline(_Sequential(seed=3), num_partitions=2,
                             num_micro_batches=2, devices=DEVICES[:2],
                             balance='params')
  pm.compile(optimizer=keras.optimizers.Adam(0.01), loss='mse',
             metrics=['mae'])
  pm.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  pm.save(str(tmp_path / 'model.keras'))
  loaded = keras.models.load_model(str(tmp_path / 'model.keras'))
  assert isinstance(loaded.optimizer, keras.optimizers.Adam)
  assert int(loaded.optimizer.iterations) == int(pm.optimizer.iterations) == 4
  assert loaded.loss == 'mse'
  assert loaded.get_compile_config()['metrics'] == ['mae']
  assert len(loaded.optimizer.variables) == len(pm.optimizer.variables)
  for a, b in zip(pm.optimizer.variables, loaded.optimizer.variables):
    np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)
  # Pipelined again, it trains on exactly as the saved model does.
  again = tfpipe.keras.pipeline(loaded, num_partitions=2, num_micro_batches=2,
                                devices=DEVICES[2:4], balance='params')
  again.compile(optimizer=loaded.optimizer, loss=loaded.loss)
  again.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  pm.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  for a, b in zip(pm.source_model.weights, loaded.weights):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-7)
  foreign = keras.optimizers.Adam()
  foreign.build([keras.Variable(np.zeros(3, np.float32))])
  with pytest.raises(ValueError, match='was built for other variables'):
    again.compile(optimizer=foreign, loss='mse')


def test_summary_and_describe_show_stages():
  model = _Functional()
  pm = tfpipe.keras.pipeline(model, num_partitions=3, devices=DEVICES[:3],
                             balance=[3, 3, 3])
  text = tfpipe.keras.describe(pm)
  assert 'cell 2 on /CPU:2' in text and 'params' in text
  assert 'cost' in text
  lines = []
  pm.summary(print_fn=lines.append)
  assert lines == [text]


def test_place_variables_moves_them_to_the_stage_devices():
  model = _Sequential()
  x, y = _Data(model)
  want = model(x)
  pm = tfpipe.keras.pipeline(model, num_partitions=2, devices=DEVICES[2:4],
                             balance='params', place_variables=True)
  for cell, device in zip(pm.pipe.cells, ['CPU:2', 'CPU:3']):
    for v in cell.weights:
      assert v.value.device.endswith(device), (v.path, v.value.device)
  np.testing.assert_allclose(pm(x), want, rtol=1e-5, atol=1e-6)
  pm.compile(optimizer='sgd', loss='mse', run_eagerly=True)
  pm.fit(x, y, batch_size=10, verbose=0)
  assert not np.allclose(model(x), want)


def test_errors():
  model = _Sequential()
  with pytest.raises(ValueError, match='num_partitions=9'):
    tfpipe.keras.pipeline(model, num_partitions=9, balance='params')
  with pytest.raises(ValueError, match='explicit balance'):
    tfpipe.keras.pipeline(model, num_partitions=2, balance=[1, 1])
  with pytest.raises(ValueError, match='unknown balance'):
    tfpipe.keras.pipeline(model, num_partitions=2, balance='speed')
  with pytest.raises(ValueError, match='num_partitions must be'):
    tfpipe.keras.pipeline(model, num_partitions=0)
  pm = tfpipe.keras.pipeline(model, num_partitions=2, devices=DEVICES[:2],
                             balance='params')
  x, y = _Data(model)
  with pytest.raises(ValueError, match='compile the pipelined model'):
    pm.ComputeLossAndGradients(x, y)
  with pytest.raises(ValueError, match='describe expects'):
    tfpipe.keras.describe(model)


@pytest.mark.parametrize('executor', ['graph', 'threads'])
def test_train_step_places_every_op_on_its_cells_device(executor):
  """Keras fit's traced step (and the update) leave no op unplaced."""
  from tfpipe import placement  # pylint: disable=g-import-not-at-top
  model = _Functional()
  pm = tfpipe.keras.pipeline(model, num_partitions=4, num_micro_batches=2,
                             devices=DEVICES[4:8], balance='params',
                             executor=executor)
  for cell, device in zip(pm.pipe.cells, DEVICES[4:8]):
    for v in cell.weights:
      assert v.value.device.endswith(device[1:]), (v.path, v.value.device)
  pm.compile(optimizer='adam', loss=['mse', 'mse'])
  x, y = _Data(model)
  pm.fit(x, y, batch_size=10, epochs=1, verbose=0)
  for v in pm.optimizer.variables:
    if len(v.shape):
      assert not v.value.device.endswith('CPU:0'), (v.path, v.value.device)
  x, y = keras.tree.map_structure(tf.convert_to_tensor, (x, y))
  findings = placement.Audit(lambda a, b: pm.train_step((a, b)), x, y)
  assert not findings, findings


@pytest.mark.parametrize('executor', ['graph', 'threads'])
@pytest.mark.parametrize('reduction', ['sum_over_batch_size', 'sum'])
def test_per_output_losses_and_metrics_match_plain_with_uneven_micro_batches(
    executor, reduction):
  """o1_loss, o2_loss and compiled metrics weigh micro-batches by their size.

  Batches of 10 and 4 over M=3 (sizes 4,3,3 and 2,1,1). Keras would weigh
  each micro-batch's per-output loss by its static batch dimension, None in
  the pipeline's traced functions, so 1 each.
  """
  def Compile(m, **kwargs):
    m.compile(optimizer='sgd', loss=[
        keras.losses.MeanSquaredError(reduction=reduction),
        keras.losses.MeanAbsoluteError(reduction=reduction)],
              metrics=[['mae'], ['mse']], **kwargs)
  plain, piped = _Functional(seed=7), _Functional(seed=7)
  x, y = _Data(plain, n=14, seed=8)
  Compile(plain, run_eagerly=True)
  want = plain.fit(x, y, batch_size=10, epochs=1, shuffle=False,
                   verbose=0).history
  pm = tfpipe.keras.pipeline(piped, num_partitions=2, num_micro_batches=3,
                             devices=DEVICES[:2], balance='params',
                             executor=executor)
  Compile(pm)
  got = pm.fit(x, y, batch_size=10, epochs=1, shuffle=False,
               verbose=0).history
  assert sorted(got) == sorted(want) == [
      'loss', 'o1_loss', 'o1_mae', 'o2_loss', 'o2_mse']
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5,
                               err_msg=name)


def test_per_output_loss_trackers_are_right_before_fit_builds_them():
  """A direct ComputeLossAndGradients builds the trackers itself."""
  plain, piped = _Functional(seed=9), _Functional(seed=9)
  x, y = _Data(plain, n=10, seed=10)
  pm = tfpipe.keras.pipeline(piped, num_partitions=2, num_micro_batches=3,
                             devices=DEVICES[:2], balance='params')
  pm.compile(loss=['mse', 'mae'])
  pm.ComputeLossAndGradients(x, y)
  got = {m.name: float(m.result()) for m in pm._compile_loss.metrics}  # pylint: disable=protected-access
  outputs = plain(x)
  want = {'o1_loss': float(keras.losses.MeanSquaredError()(y[0], outputs[0])),
          'o2_loss': float(keras.losses.MeanAbsoluteError()(y[1],
                                                            outputs[1]))}
  np.testing.assert_allclose([got[k] for k in want], list(want.values()),
                             rtol=1e-5)
