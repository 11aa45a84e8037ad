"""What one cell does for one micro-batch: records, programs and gradients."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import layers
from tfpipe.gpipe import cell_runtime
from tfpipe.gpipe import op_order

_Pipeline = plt_test._Pipeline  # pylint: disable=protected-access
_Data = plt_test._Data  # pylint: disable=protected-access
_Loss = plt_test._Loss  # pylint: disable=protected-access
_LayerParams = plt_test._LayerParams  # pylint: disable=protected-access


@pytest.mark.parametrize('schedule,fused', [('1f1b', 4), ('gpipe', 1)])
def test_last_cell_runs_forward_and_backward_as_one_call_when_adjacent(
    schedule, fused):
  """B(m, K-1) right after F(m, K-1): one call, no recompute, same result."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  pipe = _Pipeline(layer_params, 2, 4, schedule=schedule)
  calls = []
  last = pipe.runtime.cells[0][-1]
  for name in ('ForwardBackward', 'Backward'):
    original = getattr(last, name)
    setattr(last, name, lambda *a, original=original, name=name, **k: (
        calls.append(name), original(*a, **k))[1])
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  plt_test._AssertAllClose(out.gradients, ref_grads)  # pylint: disable=protected-access
  assert calls.count('ForwardBackward') == fused
  assert calls.count('Backward') == 4 - fused


def test_records_say_what_a_micro_batch_keeps():
  """Re-materialized: the input; otherwise the residuals, none of them the
  cell's input of another micro-batch or the weights."""
  x, _ = _Data()
  kept = {}
  for remat in ('always', 'never'):
    pipe = _Pipeline(_LayerParams(4), 2, 1, remat_policy=remat)
    pipe.build(x.shape)
    cell = pipe.runtime.cells[0][0]
    inputs = cell_runtime.ActionInputs(x, tf.constant([1, 2], tf.int64),
                                       tf.constant(0, tf.int64))
    keep = 'input' if remat == 'always' else 'residuals'
    _, _, record = cell.Forward(inputs, True, cell.Variables(), keep)
    kept[remat] = record
  assert isinstance(kept['always'], cell_runtime.KeptInput)
  assert kept['always'].tensors[0] is x
  assert isinstance(kept['never'], cell_runtime.KeptResiduals)
  # Two tanh layers: the input and each layer's output.
  assert sorted(tuple(t.shape) for t in kept['never'].tensors
                if t.dtype.is_floating and t.shape.rank) == [
                    (plt_test.BATCH, plt_test.DIM)] * 3


_STEP_PEAK = r"""
import json
import tensorflow as tf
from tfpipe import gpipe, layers

def Pipe(dim, num_micro_batches, schedule, remat_policy):
  # One cell of 8 FC(dim) tanh layers, on /CPU:0, one graph per step.
  params = [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=dim, output_dims=dim, activation='tanh',
      random_seed=i) for i in range(8)]
  return gpipe.PipeliningLayer.Params().Set(
      name=f'{schedule}{num_micro_batches}_{remat_policy}',
      cell_tpl=gpipe.PartitionSequentialLayers(params, 1, balance='params'),
      num_micro_batches=num_micro_batches, schedule=schedule,
      remat_policy=remat_policy, devices=['/CPU:0'],
      executor='graph').Instantiate()

def StepPeak(pipe, batch, dim):
  # Bytes above a step's start at its peak, the largest of 3 steps.
  x = tf.random.stateless_normal([batch, dim], seed=[1, 2])
  loss = lambda out, unused: tf.reduce_mean(tf.square(out))
  pipe.ComputeLossAndGradients(x, None, loss)
  peaks = []
  for _ in range(3):
    tf.config.experimental.reset_memory_stats('CPU:0')
    before = tf.config.experimental.get_memory_info('CPU:0')['current']
    out = pipe.ComputeLossAndGradients(x, None, loss)
    float(out.loss)
    peaks.append(tf.config.experimental.get_memory_info('CPU:0')['peak'] -
                 before)
    del out
  return max(peaks)
"""

_ONE_CELL_PEAK = _STEP_PEAK + r"""
# One op at a time: the peak is then the schedule's, not the executor's
# interleaving of two ops (which moves it by a few activations).
tf.config.threading.set_inter_op_parallelism_threads(1)
# One allocator region, as a device's (the process is capped): peaks then do
# not move with where the regions of a growing allocator end.
from tfpipe import memory_limit
assert memory_limit.OpenOneRegion()
# Small weights, large activations: a micro-batch's activations (8 x 128
# KiB) dominate, not the gradients (8 x 16 KiB).
print('RESULT' + json.dumps([
    StepPeak(Pipe(64, 1, 'gpipe', 'always'), 512, 64),
    StepPeak(Pipe(64, 8, '1f1b', 'always'), 4096, 64)]))
"""


def _ResultOf(script, memory_mb=None):
  """What `script` prints after RESULT (JSON), run in a process of its own
  whose CPU allocator counts its peak (TF_CPU_ALLOCATOR_USE_BFC), capped at
  memory_mb if given."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  env = memory_limit.CappedEnv(memory_mb)
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  proc = subprocess.run([sys.executable, '-c', script], env=env,
                        capture_output=True, text=True, timeout=240,
                        check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT')]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len('RESULT'):])


def test_one_cell_1f1b_keeps_one_micro_batch_at_a_time():
  """K=1, M=8: each 1F1B action is a fused F+B+W; its peak stays that of
  one micro-batch trained alone, not of several at once (a second one
  adds about half: its activations, 8 x 128 KiB). The one micro-batch's
  own peak varies from one process to the next (1.44 to 1.93 MiB in six
  runs, the 1F1B step's 1.72 to 1.83), so a ratio of the two flakes (1.3x
  left 0.04 MiB); the bound is 0.6 of those activations above it."""
  one_micro_batch_peak, one_f_one_b_peak = _ResultOf(_ONE_CELL_PEAK,
                                                      memory_mb=256)
  activations = 8 * 512 * 64 * 4  # One micro-batch's, at 512 examples.
  assert one_f_one_b_peak < one_micro_batch_peak + 0.6 * activations, (
      one_f_one_b_peak, one_micro_batch_peak)


_ACCUMULATING_PEAK = _STEP_PEAK + r"""
# One op at a time, so that the peak is the graph's order, not how busy the
# cores are: with TensorFlow's default threads a loaded CI machine once
# interleaved a backward's ops until 8.45 MiB of gradients were alive.
tf.config.threading.set_inter_op_parallelism_threads(1)
# Large weights, small activations: a backward's weight gradients (8 x 1
# MiB) dominate.
def PeakAndWeights(remat_policy):
  pipe = Pipe(512, 4, 'gpipe', remat_policy)
  return (StepPeak(pipe, 16, 512),
          sum(v.numpy().nbytes for v in pipe.trainable_variables))

print('RESULT' + json.dumps([PeakAndWeights('never'),
                             PeakAndWeights('always')]))
"""


def test_a_backward_adds_each_weight_gradient_as_it_is_made():
  """One process, one graph, M=4: each B adds its weight gradients to the
  accumulators as they are made, so a step holds about one layer's
  gradient beyond the accumulators, not the cell's (on a GPU, and on
  logical CPUs, a B that returned its gradients all at once held them all:
  the memory model's peak was short by the cell's weights)."""
  for peak, weights in _ResultOf(_ACCUMULATING_PEAK):
    # A layer or two's gradients in flight (1.1-2.3 MiB of 8 MiB, one op at
    # a time), not all of a B's at once on top of what remains (8.2 MiB
    # without remat when the backward is called, not imported).
    assert peak < 0.9 * weights, (peak, weights)


@pytest.mark.parametrize('remat_policy,schedule', [
    ('always', 'gpipe'), ('never', '1f1b'), ('never', 'zb_h1'),
    ('always', 'zb_h1')])
def test_single_threaded_actions_run_their_ops_in_one_order(
    remat_policy, schedule):
  """On a worker's CPU each action's ops are chained into one order
  (op_order.py), so every process runs them alike; the gradients stay the
  un-pipelined model's."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  pipe = _Pipeline(layer_params, 2, 2, remat_policy=remat_policy,
                   schedule=schedule)
  pipe.build(x.shape)
  for cell in pipe.runtime.cells[0]:
    cell.single_threaded_calls = True
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  plt_test._AssertAllClose(out.gradients, ref_grads)  # pylint: disable=protected-access
  actions = [action for cell in pipe.runtime.cells[0]
             for program in cell.programs._entries.values()  # pylint: disable=protected-access
             for _, action in program.actions.values()]
  assert actions
  for action in actions:
    # What tf.function adds after the body: an Identity per returned value
    # and the NoOp they wait on (automatic control dependencies).
    returned = [t.op for t in action.graph.outputs if t.op.type == 'Identity']
    added = {op.name for op in returned} | {
        op.name for identity in returned for op in identity.control_inputs
        if op.type == 'NoOp'}
    body = [op for op in action.graph.get_operations()
            if op.name not in added]
    assert op_order.IsOneOrder(body), action.name
