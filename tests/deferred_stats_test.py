"""Tests of deferred_stats: statistics applied once per step.

Protected properties: given a dict kept across steps, an eager Apply runs
each device's merges as one tf.function, traced once for steps of the same
structure, and updates the moving averages exactly as op by op. A cell's
batch norms travel as one packed record and update exactly as each layer's
own merge would, beside records that cannot be packed. (Routing through the
step context is tested with BaseLayer, in base_layer_test.)
"""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import deferred_stats
from tfpipe import gpipe
from tfpipe import layers


def test_eager_deferred_stats_apply_as_one_traced_call_per_device():
  """With a dict kept across steps, an eager Apply runs each device's
  merges as one tf.function, traced once for steps of the same structure:
  the same moving averages as op by op."""
  devices = [d.name for d in tf.config.list_logical_devices('CPU')][:2]
  x = tf.constant(np.random.default_rng(3).normal(size=(6, 4, 4, 2)),
                  tf.float32)
  traced = {}

  def Step(layers, traced_updates):
    collector = deferred_stats.DeferredStatsCollector(traced_updates)
    # As the pipeline records them: each micro-batch's, with its device.
    for layer, device in zip(layers, devices + devices[:1]):
      for part in (x[:2], x[2:]):
        with tf.device(device):
          mean, variance = tf.nn.moments(part, [0, 1, 2])
          collector.Add(layer, {'mean': mean, 'variance': variance},
                        tf.constant(32.0), device=device)
    assert collector.Apply() == []  # Applied, eagerly.

  def Layers():
    return [layers.BatchNormLayer.Params().Set(name=f'bn{k}', dim=2,
                                               decay=0.5).Instantiate()
            for k in range(3)]
  by_ops, by_trace = Layers(), Layers()
  for _ in range(2):
    Step(by_ops, None)
    Step(by_trace, traced)
  # Two devices (the first holds two layers' records): two functions, each
  # traced once and called in both steps.
  assert len(traced) == len(set(devices))
  assert [f.experimental_get_tracing_count() for f in traced.values()] == (
      [1] * len(set(devices)))
  for a, b in zip(by_ops, by_trace):
    np.testing.assert_allclose(b.moving_mean.numpy(), a.moving_mean.numpy(),
                               rtol=1e-6)
    np.testing.assert_allclose(b.moving_variance.numpy(),
                               a.moving_variance.numpy(), rtol=1e-6)
    assert not np.allclose(b.moving_variance.numpy(), 1.0)


def _Moments(x):
  mean, variance = tf.nn.moments(x, [0])
  return {'mean': mean, 'variance': variance}


def test_packed_moments_merge_as_each_layers_own_merge():
  """Layers of different widths and counts, packed into one record per
  micro-batch: each gets the update its own records would give it; a record
  that is not a batch's moments passes through unpacked."""
  rng = np.random.default_rng(0)
  bns = [layers.BatchNormLayer.Params().Set(name=f'bn{i}', dim=d,
                                            decay=0.5).Instantiate()
         for i, d in enumerate((3, 5, 2))]
  reference = [layers.BatchNormLayer.Params().Set(
      name=f'ref{i}', dim=d, decay=0.5).Instantiate()
               for i, d in enumerate((3, 5, 2))]
  other = _RunningMax.Params().Set(name='other', dim=2).Instantiate()
  packed, per_layer = [], [[] for _ in bns]
  for rows in (4, 7, 1):  # Unequal parts; one part of a single row.
    entries = []
    for k, (bn, dim) in enumerate(zip(bns, (3, 5, 2))):
      # Parts weigh differently in each layer (as after a stride).
      n = (rows, rows + 3, rows * rows)[k]
      x = tf.constant(rng.normal(size=(n, dim)) * (k + 2), tf.float32)
      count = tf.constant(float(n))
      entries.append((bn, count, _Moments(x)))
      per_layer[k].append((count, _Moments(x)))
      if k == 0:
        entries.append((other, tf.constant(1.0), {'max': tf.reduce_max(
            x[:, :2], 0)}))
    result = deferred_stats.PackMoments(entries)
    assert len(result) == 2 and result[1][0] is other
    group, counts, moments = result[0]
    assert isinstance(group, deferred_stats.MomentsGroup)
    assert counts.shape == [3] and moments['mean'].shape == [10]
    packed.append((counts, moments))
  # The same layers in another trace name the same group.
  assert deferred_stats.PackMoments(entries)[0][0] is group
  group.ApplyDeferredStats(packed)
  for ref, records in zip(reference, per_layer):
    ref.ApplyDeferredStats(records)
  for bn, ref in zip(bns, reference):
    np.testing.assert_allclose(bn.moving_mean.numpy(),
                               ref.moving_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(),
                               ref.moving_variance.numpy(), rtol=1e-6)
    assert not np.allclose(bn.moving_variance.numpy(), 1.0)


class _RunningMax(base_layer.BaseLayer):
  """Keeps the largest square each feature took: a deferred statistic that
  is not a batch's moments, so it is never packed."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 0, 'Features, the last dim.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.largest = self.CreateVariable('largest', (self.p.dim,), 'zeros',
                                       trainable=False)

  def FProp(self, inputs, training=None):
    collector = base_layer.CurrentStatsCollector()
    if training and collector is not None:
      collector.Add(self, {'max': tf.reduce_max(tf.square(inputs), 0)},
                    tf.constant(1.0))
    return inputs

  def ApplyDeferredStats(self, records):
    largest = tf.reduce_max(tf.stack([s['max'] for _, s in records]), 0)
    return self.largest.assign(tf.maximum(self.largest, largest))


def _MixedStatsParams():
  """Two cells of two batch norms each (of different widths) and, in the
  second, a statistic that is not a batch's moments."""
  fc = layers.FCLayer.Params()
  bn = layers.BatchNormLayer.Params()
  return [
      fc.Copy().Set(name='fc0', input_dims=4, output_dims=6,
                    activation='none', random_seed=1),
      bn.Copy().Set(name='bn0', dim=6, decay=0.5),
      fc.Copy().Set(name='fc1', input_dims=6, output_dims=3,
                    activation='tanh', random_seed=2),
      bn.Copy().Set(name='bn1', dim=3, decay=0.5),
      _RunningMax.Params().Set(name='max', dim=3),
      bn.Copy().Set(name='bn2', dim=3, decay=0.5),
      fc.Copy().Set(name='fc2', input_dims=3, output_dims=4,
                    activation='tanh', random_seed=3),
      bn.Copy().Set(name='bn3', dim=4, decay=0.5),
  ]


@pytest.mark.parametrize('executor', ['graph', 'threads'])
def test_pipelined_batch_norms_update_as_each_layer_alone(executor):
  """A pipelined step's moving statistics equal the plain model's, run
  micro-batch by micro-batch with each layer's records merged on its own;
  over two steps, so the traced update is also called again."""
  params = _MixedStatsParams()
  cells = gpipe.PartitionSequentialLayers(params, 2, balance=[4, 4])
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=3,
      devices=['/CPU:0', '/CPU:1'], executor=executor).Instantiate()
  plain = layers.SequentialLayer.Params().Set(
      name='plain', sub=params).Instantiate()
  x = tf.random.stateless_normal([17, 4], seed=[1, 2]) * 3.0 + 1.0
  y = tf.random.stateless_normal([17, 4], seed=[3, 4])
  micro, _, _ = gpipe.microbatch.Split(x, 3)
  for _ in range(2):
    pipe.ComputeLossAndGradients(
        x, y, lambda out, t: tf.reduce_mean(tf.square(out - t)))
    collector = deferred_stats.DeferredStatsCollector()
    with base_layer.CollectDeferredStats(collector):
      for mb in micro:
        plain(mb, training=True)
    collector.Apply()
  pipe_layers = [l for cell in pipe.cells for l in cell.sub]
  assert [l.name for l in pipe_layers] == [l.name for l in plain.sub]
  for mine, ref in zip(pipe_layers, plain.sub):
    for a, b in zip(mine.non_trainable_variables, ref.non_trainable_variables):
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
  moving = pipe_layers[1].moving_variance.numpy()
  assert not np.allclose(moving, 1.0)
  assert pipe_layers[4].largest.numpy().min() > 0.0
