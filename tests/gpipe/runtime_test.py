"""The runtime: one interpreter for every entry point, with bounded memory.

Peak memory is read from TensorFlow's BFC allocator, which must be chosen
before TensorFlow starts, so each measurement runs in a fresh subprocess with
TF_CPU_ALLOCATOR_USE_BFC=true. All logical CPU devices share one allocator,
so the number is the whole pipeline's peak.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tests.gpipe import tape_path_test
from tfpipe import base_layer
from tfpipe import layers
from tfpipe.gpipe import schedule as schedule_lib

_Pipeline = plt_test._Pipeline  # pylint: disable=protected-access
_Data = plt_test._Data  # pylint: disable=protected-access
_Loss = plt_test._Loss  # pylint: disable=protected-access
_LayerParams = plt_test._LayerParams  # pylint: disable=protected-access
_AssertAllClose = plt_test._AssertAllClose  # pylint: disable=protected-access

_PROBE = textwrap.dedent('''
    import gc, json, os, sys
    import tensorflow as tf
    cpus = tf.config.list_physical_devices('CPU')
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
    from tfpipe import gpipe, layers

    def Peak(cfg):
      dim, depth = cfg['dim'], cfg['depth']
      params = [layers.FCLayer.Params().Set(
          name=f'fc{i}', input_dims=dim, output_dims=dim, activation='tanh',
          random_seed=i) for i in range(depth)]
      k = cfg.get('cells', 4)
      cells = gpipe.PartitionSequentialLayers(params, k, balance='params')
      pipe = gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=cells, num_micro_batches=cfg['m'],
          devices=['/CPU:%d' % i for i in range(k)], schedule=cfg['schedule'],
          remat_policy=cfg['remat'],
          executor=cfg.get('executor', 'graph')).Instantiate()
      if cfg.get('single_threaded'):  # As on a worker process's CPU.
        for cell in pipe.runtime.cells[0]:
          cell.single_threaded_calls = True
      x = tf.random.normal([cfg['batch'], dim])
      loss_fn = lambda y, t: tf.reduce_mean(tf.square(y))

      # Each step uses its gradients, so that a traced step cannot prune them.
      def TrainStep():
        out = pipe.ComputeLossAndGradients(x, None, loss_fn)
        return out.loss + 0.0 * tf.linalg.global_norm(out.gradients)

      def TapeStep():
        with tf.GradientTape() as tape:
          loss = loss_fn(pipe(x, training=True), None)
        grads = tape.gradient(loss, pipe.trainable_variables)
        return loss + 0.0 * tf.linalg.global_norm(grads)

      forward = tf.function(lambda x: pipe(x, training=True))
      def OuterTapeStep():  # The tape outside the function with pipe(x).
        with tf.GradientTape() as tape:
          loss = loss_fn(forward(x), None)
        grads = tape.gradient(loss, pipe.trainable_variables)
        return loss + 0.0 * tf.linalg.global_norm(grads)
      step = {'tape': TapeStep, 'outer_tape': OuterTapeStep}.get(
          cfg.get('entry'), TrainStep)
      if cfg.get('traced'):
        step = tf.function(step)
      float(step())
      gc.collect()
      tf.config.experimental.reset_memory_stats('CPU:0')
      base = tf.config.experimental.get_memory_info('CPU:0')['current']
      float(step())
      return tf.config.experimental.get_memory_info('CPU:0')['peak'] - base

    # One process for all: each pipeline is freed before the next is built.
    print('RESULT' + json.dumps([Peak(cfg) for cfg in json.loads(sys.argv[1])]))
''')


def _PeakBytes(*configs):
  """The peak bytes one step adds, per configuration (one process for all)."""
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true',
             TF_CPP_MIN_LOG_LEVEL='2', TF_NUM_INTEROP_THREADS='1',
             TF_NUM_INTRAOP_THREADS='1')
  proc = subprocess.run([sys.executable, '-c', _PROBE, json.dumps(configs)],
                        env=env, capture_output=True, text=True, timeout=480,
                        check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT')]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len('RESULT'):])


_DEEP = dict(dim=256, depth=32, batch=512, m=4, schedule='gpipe')
_SIXTEEN_MICRO_BATCHES = dict(dim=256, depth=16, batch=1024, m=16,
                              remat='never')
_TAPE_PATHS = [('tape', True, 'graph'), ('tape', False, 'threads'),
               ('outer_tape', False, 'graph')]


# One cell of 32 weights of 512 x 512 (1 MiB each) on a worker's executor.
_ONE_CELL_BACKWARD = dict(dim=512, depth=32, batch=16, schedule='gpipe',
                          cells=1, single_threaded=True)


def _TapePath(entry, traced, executor, m):
  return dict(dim=512, depth=8, batch=256, remat='always', schedule='gpipe',
              entry=entry, traced=traced, executor=executor, m=m)


# The configurations the tests below compare, by test. Starting a process
# that measures costs seconds, so one probe measures them all.
_MEASURED = {
    'remat': [dict(remat='never', **_DEEP), dict(remat='always', **_DEEP)],
    'schedules': [dict(schedule=s, **_SIXTEEN_MICRO_BATCHES)
                  for s in ('gpipe', '1f1b', 'zb_h1')],
    # The same micro-batch size, twice as many micro-batches.
    'schedules_at_32': [dict(_SIXTEEN_MICRO_BATCHES, schedule=s, m=32,
                             batch=2 * _SIXTEEN_MICRO_BATCHES['batch'])
                        for s in ('1f1b', 'zb_h1')],
    **{path: [_TapePath(*path, m=1), _TapePath(*path, m=16)]
       for path in _TAPE_PATHS},
    'one_cell_backward': [dict(_ONE_CELL_BACKWARD, remat=remat, m=m)
                          for m in (2, 4) for remat in ('never', 'always')],
}


@pytest.fixture(name='peak_bytes', scope='module')
def fixture_peak_bytes():
  """{test's key: the peak bytes of its configurations, in order}."""
  peaks = iter(_PeakBytes(*[cfg for configs in _MEASURED.values()
                            for cfg in configs]))
  return {key: [next(peaks) for _ in configs]
          for key, configs in _MEASURED.items()}


def test_remat_lowers_peak_memory_on_a_deep_model(peak_bytes):
  no_remat, remat = peak_bytes['remat']
  # Without remat every layer's activations live until backward; with it only
  # the 4 cell boundaries do (plus one cell being recomputed).
  assert remat < 0.6 * no_remat, (remat, no_remat)


def test_1f1b_and_zb_h1_peak_memory_below_gpipe_at_16_micro_batches(
    peak_bytes):
  gpipe_peak, one_f_one_b_peak, zero_bubble_peak = peak_bytes['schedules']
  assert one_f_one_b_peak < 0.8 * gpipe_peak, (one_f_one_b_peak, gpipe_peak)
  # ZB-H1 frees a micro-batch's activations only at its W, so it holds K
  # micro-batches on every device where 1F1B holds K-k: more than 1F1B in all
  # (the devices share one allocator here), far less than GPipe's M.
  in_flight = [sum(schedule_lib.MaxInFlight(schedule_lib.MakeSchedule(
      name, 4, 16))) for name in ('zb_h1', '1f1b')]
  assert in_flight == [16, 10]
  assert zero_bubble_peak < 0.6 * gpipe_peak, (zero_bubble_peak, gpipe_peak)


def test_1f1b_and_zb_h1_peak_memory_does_not_grow_with_micro_batches(
    peak_bytes):
  """Twice the micro-batches of one size: GPipe's peak doubles, theirs not.

  Sixteen more micro-batches held until backward would add about GPipe's
  whole peak at 16; holding at most K per device adds nothing. The bound is
  on the growth, with a quarter of GPipe's peak as the margin, not on a
  ratio: 1F1B's peak alone varies by a quarter or more between runs (the
  four devices' transients overlap or not in the one allocator they share
  here; CI once measured 3.0 MiB at 16 and 3.9 at 32).
  """
  gpipe_at_16 = peak_bytes['schedules'][0]
  for name, at_16, at_32 in zip(('1f1b', 'zb_h1'),
                                peak_bytes['schedules'][1:],
                                peak_bytes['schedules_at_32']):
    assert at_32 - at_16 < 0.25 * gpipe_at_16, (name, at_32, at_16,
                                                gpipe_at_16)


def test_a_backward_on_a_workers_executor_adds_each_gradient_as_made(
    peak_bytes):
  """A worker's CPU runs each action on the single-threaded executor; its
  backward must still add each weight gradient to its buffer as it is made,
  and make the next one only then.

  As a call inside the accumulating call, the backward returned all of the
  cell's weight gradients at once, and held them all before adding the
  first: the one-cell MLP's worker peaked 20 MiB higher. Imported, the
  executor's one fixed order still made several before adding any: here
  3.5-11.1 MiB of the 32 gradients' 32 MiB, by configuration and run, the
  largest of the four 10.5-11.1 MiB; 1.6-2.6 MiB in order.
  """
  one_gradient = 512 * 512 * 4
  peaks = peak_bytes['one_cell_backward']
  configs = [(c['m'], c['remat']) for c in _MEASURED['one_cell_backward']]
  # One gradient being added and the next being made, and the activations
  # of a micro-batch of 8 or 4 rows: under 4 gradients, but BFC may give a
  # gradient a free chunk of up to twice its size (CI measured 4.03 MiB
  # once): under 6, still well apart from the 10.5-11.1 MiB out of order.
  assert max(peaks) < 6 * one_gradient, [
      (config, round(peak / 2**20, 2)) for config, peak in zip(configs, peaks)]


@pytest.mark.parametrize('entry,traced,executor', _TAPE_PATHS)
def test_tape_path_memory_does_not_grow_with_micro_batches(
    peak_bytes, entry, traced, executor):
  """pipe(x) under a GradientTape: one gradient buffer, not one per micro-batch.

  Before the runtime ran the tape's backward itself, TensorFlow kept one
  weight gradient per micro-batch alive until it summed them (12x the
  memory at M=16 for 8 x FC(1024)); with the tape outside the tf.function
  that runs pipe(x), it did so until tf.custom_gradient carried the
  pipeline's backward across the function boundary.
  """
  one, sixteen = peak_bytes[(entry, traced, executor)]
  assert sixteen <= 1.3 * one, (sixteen / 2**20, one / 2**20)


def test_uses_remat_policy_per_micro_batch():
  pipe = _Pipeline(_LayerParams(2), 2, 3, remat_policy='except_last')
  runtime = pipe.runtime
  assert [runtime.UsesRemat(m, 3) for m in range(3)] == [True, True, False]


@pytest.mark.parametrize('executor', ['graph', 'threads'])
@pytest.mark.parametrize('remat', ['never', 'except_last'])
def test_every_remat_policy_with_every_executor(executor, remat):
  layer_params = _LayerParams()
  x, y = _Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  pipe = _Pipeline(layer_params, 4, 3, remat_policy=remat, executor=executor,
                   schedule='1f1b')
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)
  with tf.GradientTape() as tape:
    loss = _Loss(pipe(x, training=True), y)
  _AssertAllClose(tape.gradient(loss, pipe.trainable_variables), ref_grads)


@pytest.mark.parametrize('executor', ['graph', 'threads'])
def test_split_backward_keeps_dropout_masks_and_batch_norm_statistics(
    executor):
  """ZB-H1's F, B and W see the seeds and statistics GPipe's actions see."""
  layer_params = (plt_test._LayerParams(4, keep_prob=0.5) +  # pylint: disable=protected-access
                  plt_test._BatchNormParams())  # pylint: disable=protected-access
  x, y = _Data()
  x = x * 3.0 + 1.0
  results = {}
  for schedule in ('gpipe', 'zb_h1'):
    pipe = _Pipeline(layer_params, 2, 4, schedule=schedule, executor=executor,
                     remat_policy='except_last')
    out = pipe.ComputeLossAndGradients(x, y, _Loss, step=5)
    moving = [v.numpy() for v in pipe.non_trainable_variables
              if 'moving' in v.path]
    results[schedule] = (out, moving)
  (ref, ref_moving), (out, moving) = results['gpipe'], results['zb_h1']
  np.testing.assert_allclose(out.loss, ref.loss, rtol=1e-6)
  _AssertAllClose(out.gradients, ref.gradients)
  assert len(moving) == 4
  _AssertAllClose(moving, ref_moving)


def test_tape_path_gives_the_input_gradient_too():
  """A pipeline inside a bigger model: the gradient flows through it."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  pipe = _Pipeline(layer_params, 2, 3)
  scale = tf.Variable(1.5)

  def Gradients(model):
    with tf.GradientTape() as tape:
      loss = _Loss(model(x * scale, training=True), y)
    return tape.gradient(loss, [scale] + model.trainable_variables)
  _AssertAllClose(Gradients(pipe), Gradients(plain))
  _AssertAllClose(tf.function(lambda: Gradients(pipe))(), Gradients(plain))


def test_tape_path_with_integer_inputs_and_unused_outputs():
  layer_params = [plt_test._DictLayer.Params().Set(name=f'd{i}')  # pylint: disable=protected-access
                  for i in range(4)]
  x, y = _Data()
  inputs = {'h': x, 'mask': tf.constant([i % 3 != 0 for i in range(
      plt_test.BATCH)], tf.int32)}
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  pipe = _Pipeline(layer_params, 4, 3)

  def Gradients(model):
    with tf.GradientTape() as tape:
      loss = _Loss(model(inputs, training=True)['h'], y)
    return tape.gradient(loss, model.trainable_variables)
  _AssertAllClose(Gradients(pipe), Gradients(plain))


def _PaddedLm(vocab=11, dim=8):
  return [
      layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=vocab,
                                         embedding_dim=dim, random_seed=1),
      layers.FCLayer.Params().Set(name='fc0', input_dims=dim, output_dims=dim,
                                  activation='tanh', random_seed=2),
      layers.FCLayer.Params().Set(name='fc1', input_dims=dim, output_dims=dim,
                                  activation='tanh', random_seed=3),
      layers.FCLayer.Params().Set(name='logits', input_dims=dim,
                                  output_dims=vocab, activation='none',
                                  random_seed=4),
  ]


def _TokenSums(logits, targets):
  """Sum of per-token cross-entropy over unpadded tokens, and their count."""
  ids, weights = targets
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ids,
                                                        logits=logits)
  correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                             ids), tf.float32)
  return (tf.reduce_sum(xent * weights), tf.reduce_sum(weights),
          {'accuracy': tf.reduce_sum(correct * weights)})


@pytest.mark.parametrize('schedule,executor', [('gpipe', 'graph'),
                                               ('1f1b', 'threads')])
def test_token_weighted_loss_equals_the_full_batch_sum_over_weight(
    schedule, executor):
  """Padding differs per micro-batch, so example-count weights would be wrong."""
  batch, length = 9, 6
  ids = tf.random.stateless_uniform([batch, length], [5, 6], maxval=11,
                                    dtype=tf.int32)
  # Example i has 1 + (i * 2) % length real tokens: uneven across M=4.
  lengths = tf.constant([1 + (i * 2) % length for i in range(batch)])
  weights = tf.cast(tf.sequence_mask(lengths, length), tf.float32)
  layer_params = _PaddedLm()
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  with tf.GradientTape() as tape:
    loss_sum, weight, metrics = _TokenSums(plain(ids), (ids, weights))
    ref_loss = loss_sum / weight
  ref_grads = [tf.convert_to_tensor(g) for g in tape.gradient(
      ref_loss, plain.trainable_variables)]  # The embedding's are sparse.
  pipe = _Pipeline(layer_params, 2, 4, schedule=schedule, executor=executor)
  out = pipe.ComputeLossAndGradients(ids, (ids, weights), _TokenSums)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(out.metrics['accuracy'],
                             metrics['accuracy'] / weight, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)
  # Weighting by examples instead (a mean per micro-batch) is not the same.
  mean_loss = lambda logits, t: _TokenSums(logits, t)[0] / _TokenSums(
      logits, t)[1]
  wrong = _Pipeline(layer_params, 2, 4).ComputeLossAndGradients(
      ids, (ids, weights), mean_loss)
  assert abs(float(wrong.loss) - float(ref_loss)) > 1e-3


def test_mixing_sum_and_mean_losses_is_refused():
  pipe = _Pipeline(_LayerParams(2), 1, 2, compile_step=False)
  x, y = _Data()
  calls = []

  def Mixed(outputs, targets):
    calls.append(1)
    if len(calls) == 1:
      return _Loss(outputs, targets)
    return tf.reduce_sum(tf.square(outputs - targets)), 3.0
  with pytest.raises(ValueError, match='one kind'):
    pipe.ComputeLossAndGradients(x, y, Mixed)


# ---- edges: inputs, variables and user code ---------------------------------


class _WithOptional(layers.FCLayer):
  """An FC layer on inputs['h'], passing inputs['extra'] (maybe None) on."""

  def FProp(self, inputs, training=None):
    return {'h': super().FProp(inputs['h']), 'extra': inputs['extra']}

  @classmethod
  def FPropMeta(cls, p, input_shape):
    return base_layer.CostMeta(output_shape=input_shape, flops=1.0,
                               num_params=p.input_dims * (p.output_dims + 1))


@pytest.mark.parametrize('executor', ['auto', 'graph', 'threads'])
def test_a_none_leaf_in_the_input_under_every_executor(executor):
  params = [_WithOptional.Params().Set(
      name=f'fc{i}', input_dims=plt_test.DIM, output_dims=plt_test.DIM,
      activation='tanh', random_seed=i) for i in range(4)]
  x, y = _Data()
  inputs = {'h': x, 'extra': None}
  plain = layers.SequentialLayer.Params().Set(name='plain',
                                              sub=params).Instantiate()
  loss_fn = lambda out, t: _Loss(out['h'], t)
  with tf.GradientTape() as tape:
    ref_loss = loss_fn(plain(inputs, training=True), y)
  ref_grads = tape.gradient(ref_loss, plain.trainable_variables)
  # A fresh pipe's first call resolves the executor and builds the cells.
  pipe = _Pipeline(params, 2, 3, executor=executor)
  out = pipe.ComputeLossAndGradients(inputs, y, loss_fn)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)
  with tf.GradientTape() as tape:
    loss = loss_fn(pipe(inputs, training=True), y)
  _AssertAllClose(tape.gradient(loss, pipe.trainable_variables), ref_grads)
  assert pipe(inputs)['extra'] is None


@pytest.mark.parametrize('schedule,remat,executor', [
    ('gpipe', 'always', 'graph'), ('1f1b', 'never', 'threads'),
    ('zb_h1', 'except_last', 'graph')])
def test_a_variable_no_loss_reaches_gets_none(schedule, remat, executor):
  """Decided when traced; the trainer's update then leaves it alone."""
  layer_params = tape_path_test.UnusedVariableParams()
  x, y = _Data()
  pipe = _Pipeline(layer_params, 2, 3, schedule=schedule,
                   remat_policy=remat, executor=executor)
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  assert [g is None for g in out.gradients] == [g is None for g in ref_grads]
  assert sum(g is None for g in out.gradients) == 1
  _AssertAllClose([g for g in out.gradients if g is not None],
                  [g for g in ref_grads if g is not None])


@pytest.mark.parametrize('executor,schedule', [('graph', 'gpipe'),
                                               ('threads', 'zb_h1')])
def test_freezing_a_layer_between_steps_realigns_the_gradients(
    executor, schedule):
  layer_params = _LayerParams(4)
  x, y = _Data()
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=layer_params).Instantiate()
  pipe = _Pipeline(layer_params, 2, 3, executor=executor, schedule=schedule,
                   remat_policy='never')
  piped_layers = [layer for cell in pipe.cells for layer in cell.sub]
  for frozen in (None, 2, 0):
    for i, (a, b) in enumerate(zip(plain.sub, piped_layers)):
      a.trainable = b.trainable = i != frozen
    with tf.GradientTape() as tape:
      loss = _Loss(plain(x, training=True), y)
    want = tape.gradient(loss, plain.trainable_variables)
    out = pipe.ComputeLossAndGradients(x, y, _Loss)
    assert len(out.gradients) == len(pipe.trainable_variables) == len(want)
    _AssertAllClose(out.gradients, want)


def test_a_loss_fn_error_is_reported_as_the_loss_fns_own():
  pipe = _Pipeline(_LayerParams(4), 2, 2)
  x, y = _Data()

  def WrongTargets(outputs, targets):
    return tf.reduce_mean(tf.square(outputs - targets[:, :3]))
  with pytest.raises(ValueError, match='Dimensions must be equal') as info:
    pipe.ComputeLossAndGradients(x, y, WrongTargets)
  assert 'cell 1 (cell1) failed' not in str(info.value)
  assert 'Raised by loss_fn on the output of cell 1' in ''.join(
      info.value.__notes__)


class _Gated(layers.FCLayer):
  """Python control flow on a tensor, as Keras users write it."""

  def FProp(self, inputs, training=None):
    if tf.reduce_all(tf.math.is_finite(inputs)):  # A tensor, in Python.
      return super().FProp(inputs)
    return super().FProp(tf.zeros_like(inputs))


def test_user_fprop_and_loss_fn_are_converted_by_autograph():
  params = [_Gated.Params().Set(name=f'g{i}', input_dims=plt_test.DIM,
                                output_dims=plt_test.DIM, activation='tanh',
                                random_seed=i) for i in range(2)]
  x, y = _Data()

  def Loss(outputs, targets):
    loss = _Loss(outputs, targets)
    if loss > 100.0:
      loss = loss / 100.0
    return loss
  plain = layers.SequentialLayer.Params().Set(name='plain',
                                              sub=params).Instantiate()
  with tf.GradientTape() as tape:
    ref_loss = Loss(plain(x, training=True), y)
  ref_grads = tape.gradient(ref_loss, plain.trainable_variables)
  for executor in ('graph', 'threads'):
    out = _Pipeline(params, 2, 3, executor=executor).ComputeLossAndGradients(
        x, y, Loss)
    np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
    _AssertAllClose(out.gradients, ref_grads)
