"""A pipeline on worker processes computes what it computes in one process.

The cells run on real tf.distribute.Server workers on loopback (a
loopback-only network namespace, as the launcher's), driven by a controller
process: every schedule, every remat policy, executor='auto' (which runs the
whole step as one graph over the workers) and 'threads', and R=2 replicas x
K=2 cells, must give the loss and gradients of the plain model run in one
process on the same batch. So must cells holding what users' models bring
(control flow, Keras LSTM and GRU, integer and string side inputs, nested
tf.functions: single_threaded_executor_test.py), whose calls the
single-threaded executor either runs or, where it cannot, leaves to the
default executor; a tf.py_function, which cannot run on a worker, is
refused when its cell is traced, with an error naming the cell, instead of
hanging. Starting TensorFlow processes costs seconds, so one probe process
for the file (this file run as a module) starts two workers of two CPU
devices each, checks every configuration of both tests, prints one JSON line
per check and kills the workers; each test reads its lines.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from tests import worker_probe

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_MODULE = 'tests.gpipe.remote_runtime_test'
_PROBE_TIMEOUT_S = 300
_WORKERS = 2
_DEVICES_PER_WORKER = 2
_SCHEDULES = ('gpipe', '1f1b', 'zb_h1', 'interleaved_1f1b')
_REMAT_POLICIES = ('never', 'always', 'except_last')
_SINGLE_THREADED = 'SINGLE_THREADED_EXECUTOR'


def _Configs():
  """(name, pipeline settings) of every check the probe runs."""
  configs = []
  for schedule in _SCHEDULES:
    # Every remat policy on GPipe; what F keeps is the schedules' shared
    # code (cell_runtime.py), so the others run without remat, which keeps
    # the most across micro-batches.
    for remat in _REMAT_POLICIES if schedule == 'gpipe' else ('never',):
      configs.append((f'{schedule}/{remat}', dict(
          schedule=schedule, remat_policy=remat, executor='auto',
          num_cells=4 if schedule == 'interleaved_1f1b' else 2,
          num_devices=2, num_replicas=1)))
  configs.append(('1f1b/never/threads', dict(
      schedule='1f1b', remat_policy='never', executor='threads', num_cells=2,
      num_devices=2, num_replicas=1)))
  configs.append(('gpipe/always/2 replicas', dict(
      schedule='gpipe', remat_policy='always', executor='auto', num_cells=2,
      num_devices=4, num_replicas=2)))
  return configs


def _ConstructConfigs():
  """(name, settings) of the cells holding users' constructs.

  Settings: the layers (half of them in each cell), whether the input is a
  sequence, the schedule, and, per worker task, the executor types of its
  action calls (or `fails`: the step raises a TensorFlow error).
  """
  # pylint: disable=g-import-not-at-top
  import keras
  from tests.gpipe import pipelining_layer_test as plt_test
  from tests.gpipe import single_threaded_executor_test as ste_test
  fc = plt_test._LayerParams(2)  # pylint: disable=protected-access
  return [
      # A cell with while loops next to one without.
      ('recurrent', dict(layers=[
          ste_test.RecurrentParams(keras.layers.LSTM, 'lstm', 1, True),
          ste_test.RecurrentParams(keras.layers.GRU, 'gru', 3, False)] + fc,
                         sequence=True, schedule='1f1b',
                         executors={'0': ['default'],
                                    '1': [_SINGLE_THREADED]})),
      # Zero bubble: B's input gradient and W apart.
      ('control flow', dict(layers=[
          ste_test.Params(ste_test.CondLayer, 'cond', 1),
          ste_test.Params(ste_test.SwitchCaseLayer, 'case', 2),
          ste_test.Params(ste_test.WhileLoopLayer, 'while', 3),
          ste_test.Params(ste_test.MapFnLayer, 'map_fn', 4)],
                            schedule='zb_h1',
                            executors={'0': ['default'], '1': ['default']})),
      # Re-materialized (GPipe's default): the nested call that stays one
      # ran inside the backward's call too.
      ('side inputs and nested calls', dict(layers=[
          ste_test.Params(ste_test.StringIndexLayer, 'strings', 1),
          ste_test.Params(ste_test.InlinedFunctionLayer, 'inlined', 2),
          ste_test.Params(ste_test.NoInlineFunctionLayer, 'noinline', 3),
          fc[0]], schedule='gpipe', executors={
              '0': [_SINGLE_THREADED], '1': ['default']})),
      # The Python function is not in the worker's process: refused when
      # the cell is traced, before anything runs (it hung, or failed late
      # as a bare CancelledError). Last: the workers need not serve on.
      ('py_function', dict(layers=fc + [
          ste_test.Params(ste_test.PyFunctionLayer, 'py_function', 1)],
                           schedule='gpipe', fails=True)),
  ]


def _ActionExecutors(pipe, x, y, per_task=False):
  """{executor type: number of the step's action calls on a worker}, or
  with `per_task` {worker task: the executor types of its calls}."""
  # pylint: disable=g-import-not-at-top
  import collections
  import tensorflow as tf
  from tests.gpipe import pipelining_layer_test as plt_test
  graph = tf.function(lambda: pipe.ComputeLossAndGradients(
      x, y, plt_test._Loss).loss).get_concrete_function().graph  # pylint: disable=protected-access
  counts = collections.Counter()
  for op in graph.get_operations():
    if (op.type in ('PartitionedCall', 'StatefulPartitionedCall') and
        '/job:worker' in op.device):
      executor = op.get_attr('executor_type').decode() or 'default'
      task = str(tf.DeviceSpec.from_string(op.device).task)
      counts[(task, executor) if per_task else executor] += 1
  if not per_task:
    return dict(counts)
  return {task: sorted(e for t, e in counts if t == task)
          for task in sorted({t for t, _ in counts})}


def _Errors(out, ref_loss, ref_grads):
  """The check's loss and worst gradient error (1: 1e-6 + 1e-5 |g_ref|)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  errors = [float(np.max(np.abs(g - r) / (1e-6 + 1e-5 * np.abs(r))))
            for g, r in zip(out.gradients, ref_grads)]
  return {'num_gradients': len(out.gradients),
          'loss_error': float(abs(out.loss - ref_loss)),
          'worst_gradient_error': max(errors),
          'loss_scale': float(ref_loss)}


def _CheckSchedules():
  """Every configuration of _Configs on the FC layers: CHECK lines."""
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from tests.gpipe import pipelining_layer_test as plt_test
  from tfpipe import device_names
  from tfpipe import gpipe
  layer_params = plt_test._LayerParams()  # pylint: disable=protected-access
  x, y = plt_test._Data()  # pylint: disable=protected-access
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  for name, c in _Configs():
    devices = device_names.WorkerDevices(
        c['num_devices'], _WORKERS, devices_per_worker=_DEVICES_PER_WORKER)
    cells = gpipe.PartitionSequentialLayers(layer_params, c['num_cells'],
                                            balance='params')
    pipe = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=3, devices=devices,
        num_replicas=c['num_replicas'], schedule=c['schedule'],
        remat_policy=c['remat_policy'], executor=c['executor'],
        round_robin_placement=c['num_cells'] > c['num_devices']
    ).Instantiate()
    out = pipe.ComputeLossAndGradients(x, y, plt_test._Loss)  # pylint: disable=protected-access
    executors = _ActionExecutors(pipe, x, y) if (
        pipe.ResolvedExecutor(x) == 'graph') else {}
    placed = sorted({tf.DeviceSpec.from_string(v.value.device).job
                     for v in pipe.trainable_variables})
    print('CHECK ' + json.dumps({
        'name': name, 'executor': pipe.ResolvedExecutor(x), 'jobs': placed,
        'action_executors': executors, **_Errors(out, ref_loss, ref_grads)}),
          flush=True)


def _CheckConstructs():
  """Every configuration of _ConstructConfigs, K=2 on two workers: CHECK
  lines."""
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from tests.gpipe import pipelining_layer_test as plt_test
  from tests.gpipe import single_threaded_executor_test as ste_test
  from tfpipe import device_names
  from tfpipe import gpipe
  devices = device_names.WorkerDevices(2, _WORKERS,
                                       devices_per_worker=_DEVICES_PER_WORKER)
  for name, c in _ConstructConfigs():
    x, y = plt_test._Data()  # pylint: disable=protected-access
    if c.get('sequence'):
      x = tf.random.stateless_normal(
          [plt_test.BATCH, ste_test.TIME_STEPS, plt_test.DIM], seed=[5, 6])
    half = len(c['layers']) // 2
    cells = gpipe.PartitionSequentialLayers(
        c['layers'], 2, balance=[half, len(c['layers']) - half])
    pipe = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=3, devices=devices,
        schedule=c['schedule'], executor='graph').Instantiate()
    check = {'name': name}
    if c.get('fails'):
      start = time.monotonic()
      try:
        pipe.ComputeLossAndGradients(x, y, plt_test._Loss)  # pylint: disable=protected-access
      except Exception as e:  # pylint: disable=broad-except
        check.update(error=type(e).__name__, message=str(e))
      check['seconds'] = time.monotonic() - start
    else:
      ref_loss, ref_grads = plt_test._Reference(c['layers'], x, y)  # pylint: disable=protected-access
      out = pipe.ComputeLossAndGradients(x, y, plt_test._Loss)  # pylint: disable=protected-access
      check.update(_Errors(out, ref_loss, ref_grads),
                   num_reference_gradients=len(ref_grads),
                   action_executors=_ActionExecutors(pipe, x, y,
                                                     per_task=True))
    print('CHECK ' + json.dumps(check), flush=True)


def _CheckAll():
  _CheckSchedules()
  _CheckConstructs()  # Its py_function comes last.


def _RunProbe():
  """{check name: check} from a probe process (killed at the timeout, its
  workers with it)."""
  proc = subprocess.run(
      [sys.executable, '-m', _MODULE, 'probe'], cwd=_REPO_ROOT,
      capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False)
  checks = {}
  for line in proc.stdout.splitlines():
    if line.startswith('CHECK '):
      check = json.loads(line[len('CHECK '):])
      checks[check['name']] = check
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return checks


def _AssertExact(check):
  assert check['loss_error'] <= 1e-5 * check['loss_scale'], check
  # |g - g_ref| <= 1e-6 + 1e-5 |g_ref| for every element.
  assert check['worst_gradient_error'] <= 1.0, check


@pytest.fixture(name='probe_checks', scope='module')
def fixture_probe_checks():
  """{check name: check} of every configuration of both tests."""
  return _RunProbe()


def test_every_schedule_on_worker_processes_equals_one_process(probe_checks):
  names = [name for name, _ in _Configs()]
  checks = {name: probe_checks[name] for name in names
            if name in probe_checks}
  assert sorted(checks) == sorted(names)
  num_reference_gradients = 16  # 8 FC layers, a weight and a bias each.
  for name, check in checks.items():
    assert check['jobs'] == ['worker'], check  # The cells ran on the workers.
    assert check['num_gradients'] == num_reference_gradients, check
    _AssertExact(check)
    if not name.endswith('/threads'):
      assert check['executor'] == 'graph', check
      # On a worker's CPU every action is a call on the single-threaded
      # executor, so that a worker computes one op at a time and its other
      # thread hands tensors on (cell_runtime.py); a replica's cell reading
      # replica 0's variables spans two devices, which that executor
      # cannot run.
      executors = check['action_executors']
      if name.endswith('replicas'):
        assert executors.get('default', 0) > 0, check
      else:
        assert list(executors) == [_SINGLE_THREADED], check


def test_cells_of_users_constructs_on_worker_processes_equal_one_process(
    probe_checks):
  """A cell holding control flow keeps the default executor for its calls
  (the single-threaded one refused them) and trains exactly; one without
  stays on the single-threaded executor; a py_function is refused at
  trace time instead of hanging."""
  configs = dict(_ConstructConfigs())
  checks = {name: probe_checks[name] for name in configs
            if name in probe_checks}
  assert sorted(checks) == sorted(configs)
  for name, check in checks.items():
    if configs[name].get('fails'):
      # The error names the cell, the op and the fix, and comes at once
      # (a bound far below the probe's timeout: it no longer hangs).
      assert check.get('error') == 'CellPlacementError', check
      for part in ('cell 1 (cell1)', 'EagerPyFunc', '/job:worker/',
                   'input pipeline'):
        assert part in check['message'], check
      assert check['seconds'] < _PROBE_TIMEOUT_S / 4, check
      continue
    assert check['num_gradients'] == check['num_reference_gradients'], check
    _AssertExact(check)
    assert check['action_executors'] == configs[name]['executors'], check


if __name__ == '__main__':
  if sys.argv[1] == 'worker':
    worker_probe.Serve(sys.argv[2], int(sys.argv[3]),
                       num_devices=_DEVICES_PER_WORKER)
  else:
    worker_probe.Probe(_MODULE, _WORKERS, _CheckAll)
