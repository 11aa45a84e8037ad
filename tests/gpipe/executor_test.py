"""Executor memory behaviour: re-materialization and 1F1B bound the peak.

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

import pytest
import tensorflow as tf

from tfpipe.gpipe import executor as executor_lib
from tfpipe.gpipe import schedule as schedule_lib

_PROBE = textwrap.dedent('''
    import json, os, sys
    import tensorflow as tf
    cpus = tf.config.list_physical_devices('CPU')
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
    from tfpipe import gpipe, layers
    cfg = json.loads(sys.argv[1])
    dim, depth = cfg['dim'], cfg['depth']
    params = [layers.FCLayer.Params().Set(
        name=f'fc{i}', input_dims=dim, output_dims=dim, activation='tanh',
        random_seed=i) for i in range(depth)]
    cells = gpipe.PartitionSequentialLayers(params, 4, balance='params')
    pipe = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=cfg['m'],
        devices=['/CPU:%d' % i for i in range(4)], schedule=cfg['schedule'],
        remat_policy=cfg['remat']).Instantiate()
    x = tf.random.normal([cfg['batch'], dim])
    loss_fn = lambda y, t: tf.reduce_mean(tf.square(y))
    out = pipe.ComputeLossAndGradients(x, None, loss_fn)
    float(out.loss)
    tf.config.experimental.reset_memory_stats('CPU:0')
    base = tf.config.experimental.get_memory_info('CPU:0')['current']
    out = pipe.ComputeLossAndGradients(x, None, loss_fn)
    float(out.loss)
    peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
    print('RESULT' + json.dumps({'peak': peak - base}))
''')


def _PeakBytes(**cfg):
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true',
             TF_CPP_MIN_LOG_LEVEL='2', TF_NUM_INTEROP_THREADS='1',
             TF_NUM_INTRAOP_THREADS='1')
  proc = subprocess.run([sys.executable, '-c', _PROBE, json.dumps(cfg)],
                        env=env, capture_output=True, text=True, timeout=240,
                        check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT')]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len('RESULT'):])['peak']


def test_remat_lowers_peak_memory_on_a_deep_model():
  common = dict(dim=256, depth=32, batch=512, m=4, schedule='gpipe')
  no_remat = _PeakBytes(remat='never', **common)
  remat = _PeakBytes(remat='always', **common)
  # Without remat every layer's activations live until backward; with it only
  # the 4 cell boundaries do (plus one cell being recomputed).
  assert remat < 0.6 * no_remat, (remat, no_remat)


def test_1f1b_peak_memory_below_gpipe_at_16_micro_batches():
  common = dict(dim=256, depth=16, batch=1024, m=16, remat='never')
  gpipe_peak = _PeakBytes(schedule='gpipe', **common)
  one_f_one_b_peak = _PeakBytes(schedule='1f1b', **common)
  assert one_f_one_b_peak < 0.8 * gpipe_peak, (one_f_one_b_peak, gpipe_peak)


def test_executor_rejects_unknown_remat_policy_by_name():
  sched = schedule_lib.GPipeSchedule(1, 1)
  with pytest.raises(ValueError, match="remat_policy='sometimes'"):
    executor_lib.PipelineExecutor([], ['/CPU:0'], sched, 'sometimes')


def test_uses_remat_policy_per_micro_batch():
  sched = schedule_lib.GPipeSchedule(2, 3)
  ex = executor_lib.PipelineExecutor([None, None], ['/CPU:0', '/CPU:1'],
                                     sched, 'except_last')
  assert [ex.UsesRemat(m, True) for m in range(3)] == [True, True, False]
  assert not ex.UsesRemat(0, False)


def test_split_float_keeps_integer_leaves_in_place():
  structure = {'a': tf.ones([2]), 'b': (tf.zeros([2], tf.int32), tf.ones([1]))}
  floats, rebuild = executor_lib.SplitFloat(structure)
  assert len(floats) == 2
  rebuilt = rebuild([f * 2 for f in floats])
  assert rebuilt['b'][0].dtype == tf.int32
  assert float(rebuilt['a'][0]) == 2.0
