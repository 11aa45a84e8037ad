"""benchmarks/bench_lib: serialized device ops, the benchmarks' exclusive devices.

bench_lib.SerializeDeviceOps makes each device of executor='threads' run its
ops one at a time, as an accelerator does. It must give the same losses as
the inline dispatcher, run many steps without starving, and refuse, with
the fix named, the settings under which it would hang.
"""
# bazel: tags=manual

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import bench_lib
from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import gpipe

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def test_error_with_too_few_inter_op_threads_names_the_call():
  if (tf.config.threading.get_inter_op_parallelism_threads() or
      os.cpu_count()) >= bench_lib.InterOpThreadsNeeded(8):
    pytest.skip('This machine has enough inter-op threads.')
  pipe = plt_test._Pipeline(plt_test._LayerParams(8), 8, 2,  # pylint: disable=protected-access
                            executor='threads')
  with pytest.raises(ValueError,
                     match=r'set_inter_op_parallelism_threads\(17\)'):
    bench_lib.SerializeDeviceOps(pipe)


def test_error_with_replicas_names_the_variable(monkeypatch):
  monkeypatch.setattr(bench_lib, 'InterOpThreadsNeeded', lambda n: 1)
  cells = gpipe.PartitionSequentialLayers(plt_test._LayerParams(2), 2,  # pylint: disable=protected-access
                                          balance='params')
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=2, num_replicas=2,
      devices=['/CPU:0', '/CPU:1', '/CPU:2', '/CPU:3'],
      executor='threads').Instantiate()
  with pytest.raises(ValueError, match=r'cell 0 \(cell0\) of replica 1 runs '
                     r'on /CPU:2 and its variable .*fc0.* lives on .*CPU:0'):
    bench_lib.SerializeDeviceOps(pipe)


_SERIALIZED_PROBE = r'''
import json, os, sys
os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(5)
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from benchmarks import bench_lib
from tfpipe import gpipe, layers
params = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dims=32,
                                      output_dims=32, random_seed=i)
          for i in range(4)]
cells = gpipe.PartitionSequentialLayers(params, 2, balance='params')
x = tf.random.stateless_normal([64, 32], seed=[1, 2])
loss = lambda out, t: tf.reduce_mean(tf.square(out))
losses = {}
for executor in ('graph', 'threads'):
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4, schedule='1f1b',
      devices=['/CPU:0', '/CPU:1'], executor=executor).Instantiate()
  if executor == 'threads':
    bench_lib.SerializeDeviceOps(pipe)
  losses[executor] = [float(pipe.ComputeLossAndGradients(x, None, loss).loss)
                      for _ in range(30)]
print(json.dumps(losses))
'''


def test_serialized_device_ops_run_many_steps_without_starving():
  """Regression: 2 inter-op threads for 2 serialized devices used to hang."""
  proc = subprocess.run(
      [sys.executable, '-c', _SERIALIZED_PROBE], capture_output=True,
      text=True, timeout=240, cwd=_ROOT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  losses = json.loads(proc.stdout.strip().splitlines()[-1])
  np.testing.assert_allclose(losses['threads'], losses['graph'], rtol=1e-6)


def test_adam_on_each_device_matches_keras_adam():
  """bench_lib.Adam, used for GPU memory trials, is the update Keras makes."""
  gradients = [tf.constant([[0.5, -1.0], [2.0, 0.25]]),
               tf.constant([-0.75, 1.5])]
  initial = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
             np.array([0.5, -0.5], np.float32)]
  ours = [tf.Variable(v) for v in initial]
  theirs = [tf.Variable(v) for v in initial]
  adam = bench_lib.Adam(ours, lr=1e-2)
  keras_adam = tf.keras.optimizers.Adam(learning_rate=1e-2, beta_1=0.9,
                                        beta_2=0.999, epsilon=1e-7)
  apply = tf.function(adam.Apply)
  for step in range(3):
    scaled = [g * (step + 1) for g in gradients]
    apply(scaled)
    keras_adam.apply_gradients(zip(scaled, theirs))
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
  assert [m.device for m, _ in adam.slots] == [v.device for v in ours]


def test_local_devices_refuse_gpu_options_without_a_gpu():
  from absl import app  # pylint: disable=g-import-not-at-top
  if tf.config.list_physical_devices('GPU'):
    pytest.skip('This machine has a GPU.')
  with pytest.raises(app.UsageError, match=r'^--device=gpu but no GPU'):
    bench_lib.LocalDevices(2, 'gpu')
  with pytest.raises(app.UsageError, match=r'--logical_gpu_memory_mb=100 sets '
                     r'the memory of logical GPUs, but this run is on the CPU'):
    bench_lib.LocalDevices(2, 'cpu', memory_limit_mb=100)
  device_type, names = bench_lib.LocalDevices(2, 'auto')
  assert device_type == 'CPU' and len(names) >= 2
