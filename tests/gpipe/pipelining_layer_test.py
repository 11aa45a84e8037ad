"""PipeliningLayer: the pipeline is transparent, placed and seeded.

The core promise (GPipe's, and torchgpipe's test_transparency): whatever K,
M, schedule and remat policy, the loss and gradients equal those of running
the same layers plainly on the whole batch. Its errors are tested in
pipelining_layer_errors_test.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import gpipe
from tfpipe import layers

DIM = 4
BATCH = 17  # Prime: every M in the grid but 1 splits it unevenly.


def _Devices(k):
  return [f'/CPU:{i}' for i in range(k)]


def _LayerParams(num_layers=8, keep_prob=1.0):
  params = []
  for i in range(num_layers):
    params.append(layers.FCLayer.Params().Set(
        name=f'fc{i}', input_dims=DIM, output_dims=DIM, activation='tanh',
        random_seed=100 + i))
    if keep_prob < 1.0 and i % 3 == 1:
      params.append(layers.DropoutLayer.Params().Set(
          name=f'drop{i}', keep_prob=keep_prob))
  return params


def _Data():
  x = tf.random.stateless_normal([BATCH, DIM], seed=[1, 2])
  y = tf.random.stateless_normal([BATCH, DIM], seed=[3, 4])
  return x, y


def _Loss(outputs, targets):
  return tf.reduce_mean(tf.square(outputs - targets))


def _Reference(layer_params, x, y):
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  with tf.GradientTape() as tape:
    loss = _Loss(plain(x, training=True), y)
  return loss, tape.gradient(loss, plain.trainable_variables)


def _Pipeline(layer_params, k, m, **kwargs):
  cells = gpipe.PartitionSequentialLayers(layer_params, k, balance='params')
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=m, devices=_Devices(k),
      **kwargs).Instantiate()


def _AssertAllClose(actual, expected, rtol=1e-5, atol=1e-6):
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def _ScheduledPipeline(layer_params, k, m, schedule, **kwargs):
  """K cells; interleaved 1F1B runs them two per device (K/2 devices)."""
  if schedule != 'interleaved_1f1b' or k == 1:
    return _Pipeline(layer_params, k, m, schedule=schedule, **kwargs)
  cells = gpipe.PartitionSequentialLayers(layer_params, k, balance='params')
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=m,
      devices=_Devices(k // 2), schedule=schedule, **kwargs).Instantiate()


_REMATS = ['always', 'except_last', 'never']
_GRID = [(k, m, ('gpipe', '1f1b')[m % 2]) for k in (1, 2, 4, 8)
         for m in (1, 2, 3, 4, 8, 16)]
_GRID += [(k, m, 'zb_h1') for k, m in
          [(1, 2), (2, 3), (2, 8), (4, 5), (4, 6), (4, 16), (8, 3)]]
_GRID += [(k, m, 'interleaved_1f1b') for k, m in
          [(2, 1), (2, 3), (4, 2), (4, 16), (8, 3), (8, 8)]]


@pytest.mark.parametrize('k,m,schedule', _GRID)
def test_transparency_grid(k, m, schedule):
  remat = _REMATS[(k + m) % 3]
  executor = ('graph', 'threads')[(k + m // 2) % 2]
  layer_params = _LayerParams()
  x, y = _Data()
  ref_loss, ref_grads = _Reference(layer_params, x, y)
  pipe = _ScheduledPipeline(layer_params, k, m, schedule, remat_policy=remat,
                            compile_step=False, executor=executor)
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)


@pytest.mark.parametrize('k,m,remat,schedule,executor', [
    (2, 3, 'always', 'gpipe', 'graph'), (4, 6, 'except_last', '1f1b', 'graph'),
    (4, 5, 'never', '1f1b', 'threads'), (2, 4, 'always', 'gpipe', 'threads'),
    (4, 5, 'never', 'zb_h1', 'graph'), (2, 3, 'always', 'zb_h1', 'threads'),
    (4, 6, 'except_last', 'interleaved_1f1b', 'graph'),
    (4, 3, 'never', 'interleaved_1f1b', 'threads')])
def test_transparency_in_tf_function_and_under_gradient_tape(
    k, m, remat, schedule, executor):
  layer_params = _LayerParams()
  x, y = _Data()
  ref_loss, ref_grads = _Reference(layer_params, x, y)
  pipe = _ScheduledPipeline(layer_params, k, m, schedule, remat_policy=remat,
                            executor=executor)
  out = pipe.ComputeLossAndGradients(x, y, _Loss)  # compiled tf.function
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)

  @tf.function
  def TapeStep(x, y):
    with tf.GradientTape() as tape:
      loss = _Loss(pipe(x, training=True), y)
    return loss, tape.gradient(loss, pipe.trainable_variables)
  loss, grads = TapeStep(x, y)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  _AssertAllClose(grads, ref_grads)
  with tf.GradientTape() as tape:  # Eagerly too.
    loss = _Loss(pipe(x, training=True), y)
  _AssertAllClose(tape.gradient(loss, pipe.trainable_variables), ref_grads)


def test_schedules_give_identical_gradients():
  layer_params = _LayerParams()
  x, y = _Data()
  results = []
  for schedule in sorted(gpipe.schedule.SCHEDULES):
    pipe = _ScheduledPipeline(layer_params, 4, 4, schedule,
                              compile_step=False)
    results.append(pipe.ComputeLossAndGradients(x, y, _Loss).gradients)
  for other in results[1:]:
    _AssertAllClose(other, results[0], rtol=1e-6, atol=1e-7)


def test_interleaving_places_cells_round_robin_and_checks_the_placement():
  cells = gpipe.PartitionSequentialLayers(_LayerParams(), 4, balance='params')
  p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4, devices=_Devices(2),
      schedule='interleaved_1f1b')
  pipe = p.Instantiate()  # No round_robin_placement=True needed.
  assert pipe.cell_devices == ['/CPU:0', '/CPU:1', '/CPU:0', '/CPU:1']
  sched = pipe.Schedule(4)
  assert sched.num_devices == 2 and sched.device_of_cell == [0, 1, 0, 1]
  with pytest.raises(ValueError, match=r"pipe: schedule='interleaved_1f1b'.*"
                     r'cell k on device k % D'):
    p.Copy().Set(devices=['/CPU:0', '/CPU:0', '/CPU:1', '/CPU:1']).Instantiate()
  with pytest.raises(ValueError, match='multiple of the number of devices'):
    p.Copy().Set(devices=_Devices(3)).Instantiate()


def test_per_example_losses_and_metrics_are_weighted_exactly():
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = _Reference(layer_params, x, y)
  pipe = _Pipeline(layer_params, 2, 5, compile_step=False)

  def PerExample(outputs, targets):
    per_example = tf.reduce_mean(tf.square(outputs - targets), axis=-1)
    return per_example, {'max_abs': tf.reduce_max(tf.abs(outputs)),
                         'mean_out': tf.reduce_mean(outputs)}
  out = pipe.ComputeLossAndGradients(x, y, PerExample)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)
  plain_out = pipe(x)
  np.testing.assert_allclose(out.metrics['mean_out'],
                             tf.reduce_mean(plain_out), rtol=1e-5)


class _DictLayer(base_layer.BaseLayer):
  """{'h': float, 'mask': int} -> same, with h passed through an FC layer."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Feature size.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('fc', layers.FCLayer.Params().Set(
        input_dims=self.p.dim, output_dims=self.p.dim, activation='tanh',
        random_seed=7))

  def FProp(self, inputs, training=None):
    h = self.fc(inputs['h']) * tf.cast(inputs['mask'], tf.float32)[:, None]
    return {'h': h, 'mask': inputs['mask']}

  @classmethod
  def FPropMeta(cls, p, input_shape):
    return base_layer.CostMeta(output_shape=input_shape, flops=1.0,
                               num_params=p.dim * (p.dim + 1))


def test_nested_inputs_cross_cells():
  layer_params = [_DictLayer.Params().Set(name=f'd{i}') for i in range(4)]
  x, y = _Data()
  mask = tf.constant([i % 3 != 0 for i in range(BATCH)], tf.int32)
  inputs = {'h': x, 'mask': mask}
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  loss_fn = lambda out, t: _Loss(out['h'], t)
  with tf.GradientTape() as tape:
    ref_loss = loss_fn(plain(inputs), y)
  ref_grads = tape.gradient(ref_loss, plain.trainable_variables)
  pipe = _Pipeline(layer_params, 4, 3)
  out = pipe.ComputeLossAndGradients(inputs, y, loss_fn)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)
  forward = pipe(inputs)
  assert forward['mask'].dtype == tf.int32
  np.testing.assert_array_equal(forward['mask'], mask)


def test_every_variable_of_cell_k_lives_on_device_k():
  layer_params = _LayerParams(4) + [layers.KerasLayer.Params().Set(
      name='keras_dense', cls=keras.layers.Dense, args=dict(units=DIM))]
  pipe = _Pipeline(layer_params, 4, 2)
  x, y = _Data()
  pipe.ComputeLossAndGradients(x, y, _Loss)
  assert len(pipe.trainable_variables) == 10
  for k, cell in enumerate(pipe.cells):
    assert cell.trainable_variables
    for v in cell.variables:
      assert v.value.device.endswith(f'CPU:{k}'), (k, v.path, v.value.device)


def test_round_robin_placement():
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = _Reference(layer_params, x, y)
  cells = gpipe.PartitionSequentialLayers(layer_params, 4, balance='params')
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4, devices=_Devices(2),
      round_robin_placement=True, schedule='1f1b').Instantiate()
  assert pipe.cell_devices == ['/CPU:0', '/CPU:1', '/CPU:0', '/CPU:1']
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  _AssertAllClose(out.gradients, ref_grads)
  for k, cell in enumerate(pipe.cells):
    for v in cell.variables:
      assert v.value.device.endswith(f'CPU:{k % 2}')


def test_replicas_give_the_full_batch_gradient():
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = _Reference(layer_params, x, y)
  cells = gpipe.PartitionSequentialLayers(layer_params, 2, balance='params')
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=2, num_replicas=2,
      devices=_Devices(4)).Instantiate()
  assert pipe.device_mesh == [['/CPU:0', '/CPU:1'], ['/CPU:2', '/CPU:3']]
  assert 'replica 1: [0] /CPU:2  [1] /CPU:3' in pipe.DeviceMeshText()
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)


@pytest.mark.parametrize('m', [1, 4])
def test_dropout_same_seed_same_result_with_and_without_remat(m):
  layer_params = _LayerParams(6, keep_prob=0.5)
  x, y = _Data()
  results = {}
  for remat in ('always', 'never', 'except_last'):
    pipe = _Pipeline(layer_params, 2, m, remat_policy=remat,
                     compile_step=(m == 1))
    results[remat] = pipe.ComputeLossAndGradients(x, y, _Loss, step=3)
  for remat in ('never', 'except_last'):
    np.testing.assert_allclose(results[remat].loss, results['always'].loss,
                               rtol=1e-6)
    _AssertAllClose(results[remat].gradients, results['always'].gradients,
                    rtol=1e-5, atol=1e-7)
  pipe = _Pipeline(layer_params, 2, m)
  other_step = pipe.ComputeLossAndGradients(x, y, _Loss, step=4)
  assert abs(float(other_step.loss) - float(results['always'].loss)) > 1e-6
  # Dropout really ran: eval differs from training.
  no_dropout = pipe.ComputeLossAndGradients(x, y, _Loss, training=False)
  assert abs(float(no_dropout.loss) - float(results['always'].loss)) > 1e-6


def _BatchNormParams():
  return [
      layers.FCLayer.Params().Set(name='fc0', input_dims=DIM, output_dims=DIM,
                                  activation='none', random_seed=1),
      layers.BatchNormLayer.Params().Set(name='bn0', dim=DIM, decay=0.9),
      layers.FCLayer.Params().Set(name='fc1', input_dims=DIM, output_dims=DIM,
                                  activation='tanh', random_seed=2),
      layers.BatchNormLayer.Params().Set(name='bn1', dim=DIM, decay=0.9),
  ]


def _MovingStats(layer):
  return [v.numpy() for v in layer.non_trainable_variables
          if 'moving' in v.path]


@pytest.mark.parametrize('remat', ['always', 'never'])
def test_batch_norm_moving_stats_equal_a_full_batch_update(remat):
  layer_params = _BatchNormParams()
  x, y = _Data()
  x = x * 3.0 + 1.0
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  pipe = _Pipeline(layer_params, 2, 4, remat_policy=remat)
  pipe.ComputeLossAndGradients(x, y, _Loss)
  # Reference: one full-batch update of each BN layer, on the activations the
  # pipeline's cells produce (normalised per micro-batch), gathered per layer.
  fc0_out = plain.sub[0](x)
  micro, _, _ = gpipe.microbatch.Split(fc0_out, 4)
  plain.sub[1](fc0_out, training=True)
  bn0_normalised = tf.concat([plain.sub[1](mb, training=False) * 0 +
                              _NormaliseWithOwnStats(mb) for mb in micro], 0)
  plain.sub[3](plain.sub[2](bn0_normalised), training=True)
  for pipe_bn, plain_bn in [(pipe.cells[0].sub[1], plain.sub[1]),
                            (pipe.cells[1].sub[1], plain.sub[3])]:
    _AssertAllClose(_MovingStats(pipe_bn), _MovingStats(plain_bn), rtol=1e-5)
  assert not np.allclose(_MovingStats(plain.sub[1])[0], 0.0)


def _NormaliseWithOwnStats(x, epsilon=1e-3):
  mean, var = tf.nn.moments(x, axes=[0])
  return (x - mean) / tf.sqrt(var + epsilon)


def test_batch_norm_gradients_equal_per_micro_batch_sum():
  layer_params = _BatchNormParams()
  x, y = _Data()
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  micro_x, sizes, _ = gpipe.microbatch.Split(x, 4)
  micro_y, _, _ = gpipe.microbatch.Split(y, 4)
  total = None
  for mx, my, n in zip(micro_x, micro_y, sizes):
    with tf.GradientTape() as tape:
      loss = _Loss(plain(mx, training=True), my) * n / BATCH
    grads = tape.gradient(loss, plain.trainable_variables)
    total = grads if total is None else [a + b for a, b in zip(total, grads)]
  pipe = _Pipeline(layer_params, 2, 4)
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  _AssertAllClose(out.gradients, total, rtol=1e-4, atol=1e-6)
  # Eval uses moving statistics: no micro-batch dependence.
  np.testing.assert_allclose(pipe(x)[:5], pipe(x[:5]), rtol=1e-5, atol=1e-6)


def test_lingvo_conv_anchor_same_gradient_norm_for_every_cell_count():
  """Lingvo's gpipe_test: 16 3x3 convs (weights 0.1, ReLU), M=8, 1/2/4 cells."""
  conv = lambda i: layers.Conv2DLayer.Params().Set(
      name=f'conv{i}', filter_shape=(3, 3, 1, 1), has_bias=False,
      activation='relu')
  layer_params = [conv(i) for i in range(16)]
  x = tf.reshape(tf.range(16 * 8 * 8, dtype=tf.float32) % 7.0 / 7.0,
                 [16, 8, 8, 1])
  norms = []
  for k in (1, 2, 4):
    pipe = _Pipeline(layer_params, k, 8, compile_step=False)
    for v in pipe.trainable_variables:
      v.assign(tf.fill(v.shape, 0.1))
    out = pipe.ComputeLossAndGradients(
        x, None, lambda outputs, _: tf.reduce_mean(outputs))
    norms.append(float(tf.linalg.global_norm(out.gradients)))
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  for v in plain.trainable_variables:
    v.assign(tf.fill(v.shape, 0.1))
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(plain(x))
  golden = float(tf.linalg.global_norm(
      tape.gradient(loss, plain.trainable_variables)))
  assert golden > 0
  np.testing.assert_allclose(norms, [golden] * 3, rtol=1e-5)


def test_step_counter_advances_and_seeds_steps():
  pipe = _Pipeline(_LayerParams(2), 2, 2)
  x, y = _Data()
  pipe.ComputeLossAndGradients(x, y, _Loss)
  pipe.ComputeLossAndGradients(x, y, _Loss)
  assert int(pipe._step_counter.numpy()) == 2  # pylint: disable=protected-access
  pipe.ComputeLossAndGradients(x, y, _Loss, training=False)
  assert int(pipe._step_counter.numpy()) == 2  # pylint: disable=protected-access


def test_micro_batch_size_alternative():
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = _Reference(layer_params, x, y)
  pipe = _Pipeline(layer_params, 2, 1, micro_batch_size=5)
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  assert pipe.Schedule(4).num_micro_batches == 4
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)


def test_cost_model_matches_the_built_cells():
  layer_params = _LayerParams(6)
  p = gpipe.PartitionSequentialLayers(layer_params, 3, balance='params')
  pipe_p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=p, devices=_Devices(3))
  pipe = pipe_p.Instantiate()
  per_cell = pipe.CellCosts((BATCH, DIM))
  assert [c.num_params for c in per_cell] == [
      sum(int(np.prod(v.shape)) for v in cell.trainable_variables)
      for cell in pipe.cells]
  total = gpipe.PipeliningLayer.FPropMeta(pipe_p, (None, DIM))
  assert total.output_shape == (None, DIM)
  assert total.num_params == sum(c.num_params for c in per_cell)
  assert total.flops > 0


def test_checkpoint_names_layers_not_cells_so_any_k_restores(tmp_path):
  x, y = _Data()
  two = _Pipeline(_BatchNormParams(), 2, 2)
  two.ComputeLossAndGradients(x * 3.0 + 1.0, y, _Loss)  # Moves the statistics.
  path = tf.train.Checkpoint(pipe=two).write(str(tmp_path / 'ckpt'))
  names = [n for n, _ in tf.train.list_variables(path)]
  assert any('layers.Sbn1/moving_mean' in n for n in names), names
  assert not any('cells' in n for n in names), names
  four = _Pipeline(_BatchNormParams(), 4, 3)
  tf.train.Checkpoint(pipe=four).read(path).assert_existing_objects_matched()
  want = {v.path.split('/', 2)[-1]: v.numpy() for v in two.variables}
  got = {v.path.split('/', 2)[-1]: v.numpy() for v in four.variables}
  assert want.keys() == got.keys()
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_auto_executor_reads_the_cells_cost_model():
  small = _Pipeline(_LayerParams(4), 2, 2)  # 4x4 layers: tiny actions.
  assert small.p.executor == 'auto'
  x, _ = _Data()
  assert small.ResolvedExecutor(x) == 'graph'
  wide = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dims=2048,
                                      output_dims=2048) for i in range(4)]
  big = _Pipeline(wide, 2, 2)
  assert big.ResolvedExecutor(tf.zeros([1024, 2048])) == 'threads'
  assert big.ResolvedExecutor(tf.zeros([8, 2048])) == 'graph'


def test_keras_fit_of_a_model_holding_a_pipeline_matches_the_plain_layers():
  """Keras' own train_step takes the gradient through pipe(x) (the tape path)."""
  layer_params = _LayerParams(4)
  x, y = _Data()

  def Fit(layer):
    inputs = keras.Input((DIM,))
    model = keras.Model(inputs, layer(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss='mse')
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
    return history.history['loss'], [v.numpy() for v in layer.weights
                                      if v.trainable]
  plain_loss, plain_weights = Fit(layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate())
  piped_loss, piped_weights = Fit(_Pipeline(layer_params, 2, 3))
  np.testing.assert_allclose(piped_loss, plain_loss, rtol=1e-5)
  _AssertAllClose(piped_weights, plain_weights)
