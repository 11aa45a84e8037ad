"""Tests of BaseTask: pipelining does not change training, checks, cell tables."""

import numpy as np
import pytest
import tensorflow as tf

from models import conv_classifier
from models import mlp
from tfpipe import placement
from tfpipe.trainer import input_generator
from tfpipe.trainer import task as task_lib


def _MlpTaskParams(num_partitions, num_micro_batches, **train):
  p = task_lib.BaseTask.Params()
  p.model = mlp.Mlp.Params().Set(input_dim=8, hidden_dim=16,
                                 num_hidden_layers=5, num_classes=3)
  p.pipeline.Set(num_partitions=num_partitions,
                 num_micro_batches=num_micro_batches)
  p.train.Set(learning_rate=1e-2, **train)
  p.train.lr_schedule.Set(warmup_steps=5, decay='cosine', decay_steps=50)
  return p


def _Input(batch_size=16):
  return input_generator.SyntheticClassificationInput.Params().Set(
      batch_size=batch_size, input_dim=8, num_classes=3, seed=3).Instantiate()


def _Losses(task, num_steps):
  losses = []
  for batch in _Input().GetDataset(0).take(num_steps):
    out = task.TrainStep(batch)
    losses.append(float(out['loss']))
  return np.array(losses)


def test_pipelined_training_matches_unpipelined():
  """50 steps with K=1, M=1 and with K=4, M=8 give the same loss curve."""
  single = _MlpTaskParams(1, 1).Instantiate()
  piped = _MlpTaskParams(4, 8).Instantiate()
  assert len(piped.cell_params) == 4
  assert piped.devices == ['/CPU:0', '/CPU:1', '/CPU:2', '/CPU:3']
  for a, b in zip(single.pipe.trainable_variables,
                  piped.pipe.trainable_variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  want = _Losses(single, 50)
  got = _Losses(piped, 50)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  assert want[-1] < 0.5 * want[0]
  assert int(piped.global_step.numpy()) == 50


def test_batch_that_micro_batches_do_not_divide_trains_the_same():
  """16 examples over M=3 (sizes 6, 5, 5): the update is the full batch's."""
  single = _MlpTaskParams(1, 1).Instantiate()
  uneven = _MlpTaskParams(2, 3).Instantiate()
  task_lib.BaseTask.CheckParams(uneven.p, {'input.batch_size': 16})
  np.testing.assert_allclose(_Losses(uneven, 5), _Losses(single, 5),
                             rtol=1e-5)


def test_threaded_executor_trains_the_same_as_the_graph_executor():
  """--executor=threads changes how steps are dispatched, not the model."""
  graph = _MlpTaskParams(2, 4).Instantiate()
  threaded_p = _MlpTaskParams(2, 4)
  threaded_p.pipeline.executor = 'threads'
  threaded = threaded_p.Instantiate()
  np.testing.assert_allclose(_Losses(threaded, 20), _Losses(graph, 20),
                             rtol=1e-5)
  assert int(threaded.global_step.numpy()) == 20
  for a, b in zip(graph.pipe.trainable_variables,
                  threaded.pipe.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('schedule,devices', [
    ('zb_h1', None), ('interleaved_1f1b', ['/CPU:0', '/CPU:1'] * 2)])
def test_zero_bubble_and_interleaved_schedules_train_like_one_device(
    schedule, devices):
  """--schedule takes the new schedules; interleaving lists each device twice."""
  single = _MlpTaskParams(1, 1).Instantiate()
  p = _MlpTaskParams(4, 3)
  p.pipeline.Set(schedule=schedule, devices=devices)
  task_lib.BaseTask.CheckParams(p, {'input.batch_size': 16})
  piped = p.Instantiate()
  np.testing.assert_allclose(_Losses(piped, 20), _Losses(single, 20),
                             rtol=1e-4)
  assert piped.pipe.Schedule(3).num_devices == (2 if devices else 4)


def test_train_step_reports_scalars():
  task = _MlpTaskParams(2, 2, clip_gradient_norm=1e-3).Instantiate()
  batch = next(iter(_Input().GetDataset(0)))
  out = task.TrainStep(batch)
  assert set(out) >= {'loss', 'accuracy', 'grad_norm', 'learning_rate'}
  assert float(out['learning_rate']) == pytest.approx(1e-2 / 5)
  assert float(out['grad_norm']) > 1e-3  # Reported before clipping.
  metrics = task.Evaluate(_Input().GetDataset(0), 2)
  assert set(metrics) == {'loss', 'accuracy'}
  assert 0.0 <= metrics['accuracy'] <= 1.0


def test_batch_norm_model_trains():
  p = task_lib.BaseTask.Params()
  p.model = conv_classifier.ConvClassifier.Params().Set(
      image_size=8, channels=1, num_classes=3, base_width=4,
      blocks_per_stage=[1, 1])
  p.pipeline.Set(num_partitions=2, num_micro_batches=2)
  task = p.Instantiate()
  data = input_generator.SyntheticImageInput.Params().Set(
      batch_size=8, image_size=8, channels=1, num_classes=3).Instantiate()
  moving = [v for v in task.pipe.non_trainable_variables
            if 'moving_mean' in v.path]
  assert moving
  before = [v.numpy().copy() for v in moving]
  for batch in data.GetDataset(0).take(2):
    assert np.isfinite(float(task.TrainStep(batch)['loss']))
  assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, moving))


@pytest.mark.parametrize('change, batch, message', [
    ({'pipeline.num_micro_batches': 8}, 4,
     r'input.batch_size=4 is smaller than task.pipeline.num_micro_batches=8'),
    ({'pipeline.schedule': 'zigzag'}, 16, r"task.pipeline.schedule must be .*Received: schedule='zigzag'"),
    ({'pipeline.remat_policy': 'sometimes'}, 16,
     r"task.pipeline.remat_policy must be .*Received: remat_policy='sometimes'"),
    ({'pipeline.balance': 'luck'}, 16, r"task.pipeline.balance must be .*Received: balance='luck'"),
    ({'pipeline.executor': 'fibers'}, 16, r"task.pipeline.executor must be .*Received: executor='fibers'"),
    ({'pipeline.num_partitions': 0}, 16, r'task.pipeline.num_partitions'),
    ({'train.optimizer.type': 'adagrad'}, 16,
     r"task.train.optimizer.type='adagrad'"),
    ({'train.max_steps': 0}, 16, r'task.train.max_steps must be >= 1'),
    ({'model': None}, 16, r'task.model is not set'),
])
def test_check_params_names_the_bad_param(change, batch, message):
  p = _MlpTaskParams(1, 1).Set(**change)
  with pytest.raises(ValueError, match=message):
    task_lib.BaseTask.CheckParams(p, {'input.batch_size': batch})


def test_more_partitions_than_devices():
  p = _MlpTaskParams(9, 1)
  with pytest.raises(ValueError, match=r'task.pipeline: num_partitions x num_replicas = '
                     r'9 devices: 9 CPU devices are needed but TensorFlow has '
                     r'already started with 8 .*--num_devices'):
    task_lib.PipelineDevices(p.pipeline)
  p.pipeline.devices = ['/CPU:1', '/CPU:0']
  p.pipeline.num_partitions = 2
  assert task_lib.PipelineDevices(p.pipeline) == ['/CPU:1', '/CPU:0']


def test_describe_cells():
  p = _MlpTaskParams(3, 1)
  model = p.model.Instantiate()
  cells = task_lib.PartitionCells(p, model)
  rows = task_lib.DescribeCells(cells, ['/CPU:0', '/CPU:1', '/CPU:2'], (4, 8))
  assert [r['device'] for r in rows] == ['/CPU:0', '/CPU:1', '/CPU:2']
  layers = [name for r in rows for name in r['layers']]
  assert layers == ['fc_0', 'fc_1', 'fc_2', 'fc_3', 'fc_4', 'logits']
  want_params = 8 * 16 + 16 + 4 * (16 * 16 + 16) + 16 * 3 + 3
  assert sum(r['params'] for r in rows) == want_params
  assert rows[-1]['output_shape'] == (4, 3)
  # Seeds are distinct per layer, so layers do not start identical.
  seeds = [lp.random_seed for c in cells for lp in c.sub]
  assert len(set(seeds)) == len(seeds)


def _NoPlacement(monkeypatch):
  """What the trainer's update was before placement: no device at all."""
  import contextlib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(placement, 'FollowInputDevices', contextlib.nullcontext)
  monkeypatch.setattr(placement, 'FollowInputDevicesToTheEnd', lambda: None)
  monkeypatch.setattr(placement, 'OnVariableDevices', lambda ts, vs: list(ts))


@pytest.mark.parametrize('executor,remat_policy', [
    ('graph', 'always'), ('graph', 'never'), ('threads', 'always')])
def test_train_step_places_every_op_on_its_cells_device(executor,
                                                        remat_policy,
                                                        monkeypatch):
  """The placement audit: what the trainer traces has no op left unplaced.

  Logical CPUs share one allocator, so a misplaced update costs nothing
  here and runs out of memory on GPU:0; the audit reads the traced graphs
  (with and without remat: a backward's ops are imported into the call
  that accumulates its gradients, whole or cut).
  """
  p = _MlpTaskParams(4, 3)
  p.pipeline.Set(executor=executor, remat_policy=remat_policy)
  task = p.Instantiate()
  inputs, targets = next(iter(_Input().GetDataset(0)))
  pipe_step = lambda x, y: task.pipe._CompiledStep(  # pylint: disable=protected-access
      x, y, task.model.Loss, True, task.global_step, False)
  out = task.pipe.ComputeLossAndGradients(inputs, targets, task.model.Loss)
  update = (out.loss, out.gradients, out.metrics)
  findings = (placement.Audit(pipe_step, inputs, targets) +
              placement.Audit(task._ApplyGradients, *update))  # pylint: disable=protected-access
  assert not findings, findings
  # The same audit catches the unplaced update (the control).
  _NoPlacement(monkeypatch)
  unplaced = placement.Audit(task._ApplyGradients, *update)  # pylint: disable=protected-access
  assert len(unplaced) > 20, unplaced


def test_a_variable_without_a_gradient_is_left_alone():
  """None is skipped, as Keras skips it: a zero gradient would still move
  the variable by Adam's momentum from the earlier step."""
  task = _MlpTaskParams(2, 2).Instantiate()
  batch = next(iter(_Input().GetDataset(0)))
  task.TrainStep(batch)
  out = task.pipe.ComputeLossAndGradients(*batch, task.model.Loss)
  gradients = [None] + list(out.gradients[1:])
  before = [v.numpy() for v in task.pipe.trainable_variables]
  task._apply_step(out.loss, gradients, out.metrics)  # pylint: disable=protected-access
  after = [v.numpy() for v in task.pipe.trainable_variables]
  np.testing.assert_array_equal(after[0], before[0])
  assert not np.array_equal(after[1], before[1])


def test_eval_divides_per_example_losses_by_the_batch():
  """A loss_fn may return per-example losses; eval reports their mean."""
  batch = next(iter(_Input().GetDataset(0)))
  want = float(_MlpTaskParams(2, 2).Instantiate().EvalStep(batch)['loss'])
  task = _MlpTaskParams(2, 2).Instantiate()  # The same initial weights.
  task.model.Loss = lambda logits, labels: (
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                     logits=logits))
  np.testing.assert_allclose(float(task.EvalStep(batch)['loss']), want,
                             rtol=1e-5)
