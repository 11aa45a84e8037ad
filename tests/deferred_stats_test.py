"""Tests of deferred_stats: statistics applied once per step.

Protected property: given a dict kept across steps, an eager Apply runs
each device's merges as one tf.function, traced once for steps of the same
structure, and updates the moving averages exactly as op by op. (Routing
through the step context is tested with BaseLayer, in base_layer_test.)
"""

import numpy as np
import tensorflow as tf

from tfpipe import deferred_stats
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
