"""Tests of gpipe.memory_profile: one profiled step per distinct cell.

The profile runs in a subprocess with TensorFlow's counting (BFC) CPU
allocator, as the trainer runs it. Protected properties: variables and
Adam's slots are counted exactly; without remat a forward keeps the
activations its backward reads, as the allocator holds them, with remat
(on a cell that is not last) nothing beyond its input; a forward keeps its
input only where its backward reads it (always when re-materialized); the
last cell, profiled with the model's loss, keeps the loss's gradient when
re-materialized; a re-materialized backward holds none of its recomputed
outputs; equal cells are profiled once, the first apart, each the median of three
processes (whose allocators settle on different packings), and a
cell that is not first is measured computing its input gradient; a process
without the counting allocator is told how to get one; and for worker
processes' CPUs, whose actions are calls on the single-threaded executor,
the profile's actions are such calls too (on the default executor an
action's ops ran two at a time, and AmoebaNet-D's backward was predicted
60% above what its workers reached).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfpipe.gpipe import cell as cell_lib
from tfpipe.gpipe import memory_model
from tfpipe.gpipe import memory_profile
from tfpipe.trainer import optimizer as optimizer_lib

_DIM = 256
_MODULE = 'tests.gpipe.memory_profile_test'
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _Cell(name, activation='relu'):
  from tfpipe import layers  # pylint: disable=g-import-not-at-top
  return cell_lib.FeatureExtractionLayer.Params().Set(name=name, sub=[
      layers.FCLayer.Params().Set(name=f'{name}_fc{i}', input_dims=_DIM,
                                  output_dims=_DIM, activation=activation)
      for i in range(2)])


def _Loss(outputs, targets):
  del targets
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.reduce_mean(tf.square(outputs))


@pytest.fixture(scope='module')
def profiles():
  request = memory_profile.ProfileRequest(
      [_Cell('a'), _Cell('b'), _Cell('c', activation='none')],
      [(None, _DIM)] * 3,
      np.random.RandomState(0).normal(size=(64, _DIM)).astype(np.float32),
      None, _Loss, [32], optimizer_lib.OptimizerParams())
  # What one process measures; one size (each size is a process of its own
  # per cell and mode: 12 processes and 80 s of CI with two); no build
  # slack (a process per cell more; allocator_slack_test's).
  request.profile_runs = 1
  request.allocator_slack = False
  return memory_profile.ProfileInSubprocess(request, timeout_s=240)


def test_variables_and_adam_slots_are_counted_exactly(profiles):
  cell = profiles[0].At(32)
  assert cell.variable_bytes == 2 * (_DIM * _DIM + _DIM) * 4
  assert cell.optimizer_bytes == 2 * cell.variable_bytes
  assert cell.input_bytes == cell.output_bytes == 32 * _DIM * 4


def test_what_a_forward_keeps_is_its_buffers(profiles):
  cell = profiles[0].At(32)
  activation = _DIM * 4  # One example's output of one FC layer, in bytes.
  # Without re-materialization, F keeps what its backward reads: the two
  # FC layers' activations, at least, and at most the chunks the allocator
  # gave them. BFC hands a request a whole free chunk under twice its size,
  # so those chunks can take up to twice the buffers' bytes (how much
  # depends on what happened to be free: 1.0x in a quiet run, up to 1.5x
  # with busy cores). Which of the recorded steps counts is pinned apart,
  # without an allocator, below.
  buffers = 2 * 32 * activation
  assert buffers <= cell.kept['never'] <= 2 * buffers + 4096, cell.kept
  # Re-materialized, a cell that is not last keeps its input (counted
  # apart), a few scalars, and what the process allocated meanwhile in every
  # recorded step (up to 5.5 KiB seen, in a full test run).
  assert cell.kept['always'] <= 0.5 * cell.kept['never']
  assert min(cell.backward_peak.values()) > 0
  assert cell.fused_peak > 0 and cell.update_peak > 0


def _Record(kind, before, peak, after, held=None):
  from tfpipe.gpipe import action_memory  # pylint: disable=g-import-not-at-top
  from tfpipe.gpipe import schedule  # pylint: disable=g-import-not-at-top
  return action_memory.ActionRecord(schedule.Action(kind, 0, 0), before, peak,
                                    after, 0.1, held=held)


def test_a_forward_keeps_its_smallest_difference_never_below_its_buffers():
  """The allocator's difference around F moves up with tensors other
  threads make while it runs; the smallest over the recorded steps is the
  closest to what F keeps, and the buffers its record holds are a floor."""
  steps = [[_Record('F', 100, 900, 700, held=500)],
           [_Record('F', 100, 800, 650, held=500)],
           [_Record('F', 100, 950, 800, held=500)]]
  forward = memory_profile._Worst(steps, 'F', 0)  # pylint: disable=protected-access
  assert forward.delta == 550  # Not 700, the largest.
  assert forward.transient == 850  # The largest peak of the three.
  floored = [[_Record('F', 0, 400, 300, held=450)],
             [_Record('F', 0, 500, 400, held=450)]]
  assert memory_profile._Worst(floored, 'F', 0).delta == 450  # pylint: disable=protected-access
  # A fused forward holds no record: its largest difference counts.
  fused = [[_Record('F', 0, 500, 40)], [_Record('F', 0, 500, 60)]]
  assert memory_profile._Worst(fused, 'F', 0).delta == 60  # pylint: disable=protected-access


def test_the_last_cell_keeps_its_loss_gradient(profiles):
  # Only the first cell hands back no input gradient.
  assert [p.At(32).includes_input_gradient for p in profiles] == [
      False, True, True]
  last = profiles[2].At(32)
  assert last.is_last and not profiles[0].At(32).is_last
  assert 0 <= last.kept['always'] - last.output_gradient_bytes <= 1024
  assert memory_model.CellProfile.FromDict(profiles[2].ToDict()).At(32) == last


def test_a_forward_keeps_its_input_where_its_backward_reads_it(profiles):
  # An FC layer's weight gradient reads its input, with remat or without.
  for p in profiles:
    cell = p.At(32)
    assert cell.kept_input == {'always': cell.input_bytes,
                               'never': cell.input_bytes}


@pytest.fixture(scope='module')
def later_cells():
  """One cell first and second in a pipeline, twice a cell whose backward
  reads its ReLU's output, not its input, and a linear cell whose output is
  1024 times as wide as its input (none of them last)."""
  from tfpipe import layers  # pylint: disable=g-import-not-at-top
  from tfpipe.layers import amoeba  # pylint: disable=g-import-not-at-top
  wide = cell_lib.FeatureExtractionLayer.Params().Set(name='wide', sub=[
      layers.FCLayer.Params().Set(name='fc', input_dims=_WIDE,
                                  output_dims=8)])
  relu_first = cell_lib.FeatureExtractionLayer.Params().Set(
      name='relu_first', sub=[amoeba.ReluConvBn.Params().Set(
          name='rcb', in_channels=8, out_channels=8)])
  widening = cell_lib.FeatureExtractionLayer.Params().Set(
      name='widening', sub=[layers.FCLayer.Params().Set(
          name='fc', input_dims=8, output_dims=_WIDE, activation='none')])
  request = memory_profile.ProfileRequest(
      [wide, wide.Copy(), relu_first, relu_first.Copy().Set(name='again'),
       widening],
      [(None, _WIDE), (None, _WIDE), (None, 8, 8, 8), (None, 8, 8, 8),
       (None, 8)],
      np.random.RandomState(0).normal(size=(_N, _WIDE)).astype(np.float32),
      None, _Loss, [_N], optimizer_lib.OptimizerParams())
  request.num_cells = 6  # None of them is last.
  request.profile_runs = 1  # What one process measures.
  request.allocator_slack = False  # allocator_slack_test's.
  return memory_profile.ProfileInSubprocess(request, timeout_s=240)


def test_equal_cells_are_profiled_once_the_first_apart(later_cells):
  assert later_cells[3].ToDict() == later_cells[2].ToDict()
  assert later_cells[1].ToDict() != later_cells[0].ToDict()


_WIDE, _N = 8192, 64


def test_a_later_cells_backward_is_measured_making_its_input_gradient(
    later_cells):
  """Only the second's backward computes d loss / d input, and its profile
  holds it: wide in, narrow out, that gradient (2 MiB) is the backward's
  largest tensor."""
  first, second = [p.At(_N) for p in later_cells[:2]]
  assert not first.includes_input_gradient and second.includes_input_gradient
  gradient = _N * _WIDE * 4
  assert second.input_gradient_bytes == gradient
  for mode in ('always', 'never'):
    grown = second.backward_peak[mode] - first.backward_peak[mode]
    # Up to twice its bytes, as BFC gives a request a free chunk under
    # twice its size whole; what the first's backward got that way (its
    # weight gradient is 8 times smaller) may come off.
    assert 0.75 * gradient <= grown <= 2 * gradient, (mode, grown)


def test_a_rematerialized_backward_does_not_hold_the_recomputed_output(
    later_cells):
  """A linear layer's gradients read its input and d loss / d output, not
  its output, so the recompute need not make the output (2 MiB) at all.
  Returned from the backward's call, it was made and held until the call
  ended (AmoebaNet-D's first cell was predicted about 20% above its
  worker). What the backward makes is its weight gradient (256 KiB) and
  its input gradient (2 KiB), and BFC may give a request up to twice its
  bytes: under half the output in all, as without remat."""
  cell = later_cells[4].At(_N)
  assert cell.output_bytes == _N * _WIDE * 4
  assert cell.backward_peak['always'] < cell.output_bytes / 2, (
      cell.backward_peak)


def test_an_input_no_backward_reads_is_not_kept(later_cells):
  """BN(conv(relu(x))): the backward reads relu(x), so without remat the
  received x is freed after the forward; re-materialized, x is the record."""
  cell = later_cells[2].At(_N)
  assert cell.includes_input_gradient
  assert cell.kept_input == {'always': cell.input_bytes, 'never': 0}


def test_each_distinct_cell_is_profiled_in_a_process_of_its_own(monkeypatch):
  """What BFC grants follows what the allocator held before, and a worker's
  has held its own cell, at its own micro-batch size, only: a CPU profile
  starts one process per distinct cell, remat mode and micro-batch size,
  each profiling that cell alone (the batch only where it is read), and
  hands each cell its own profile, equal cells the same."""
  started = []

  def Run(sub, mode, timeout_s=900, log=None, memory_mb=None):
    del log, memory_mb
    assert mode == 'profile' and timeout_s > 0
    started.append(sub)
    profile = memory_model.CellProfile([  # variable_bytes: which process.
        memory_model.CellMemory(micro_batch_size=n,
                                variable_bytes=len(started))
        for n in sub.micro_batch_sizes])
    return [profile.ToDict()] * len(sub.cells)

  monkeypatch.setattr(memory_profile, 'RunInSubprocess', Run)
  cells = [_Cell('a'), _Cell('b'), _Cell('b2'), _Cell('c', activation='none')]
  batch = np.zeros((16, _DIM), np.float32)
  request = memory_profile.ProfileRequest(
      cells, [(None, _DIM)] * 4, batch, batch, _Loss, [16, 8],
      optimizer_lib.OptimizerParams())
  request.allocator_slack = False
  request.profile_runs = 1
  profiles = memory_profile.ProfileCells(request)
  # One process per remat mode and size; the variables are the
  # re-materialized one's.
  assert [p.At(8).variable_bytes for p in profiles] == [1, 5, 5, 9]
  assert [p.At(16).variable_bytes for p in profiles] == [2, 6, 6, 10]
  assert [s.positions for s in started] == [[0]] * 4 + [[1]] * 4 + [[3]] * 4
  assert [s.modes for s in started] == (
      [('always',)] * 2 + [('never',)] * 2) * 3
  assert [s.micro_batch_sizes for s in started] == [[8], [16]] * 6
  assert all(s.in_this_process and len(s.cells) == 1 and s.num_cells == 4
             for s in started)
  assert [s.inputs is not None for s in started[::4]] == [True, False, True]
  assert [s.targets is not None for s in started[::4]] == [True, False, True]
  assert request.positions == [0, 1, 2, 3] and len(request.cells) == 4
  assert request.micro_batch_sizes == [8, 16]
  # A planner's one-layer cells share one process.
  started.clear()
  request.process_per_cell = False
  assert len(memory_profile.ProfileInSubprocess(request)) == 4
  assert [s.positions for s in started] == [[0, 1, 2, 3]]
  assert started[0].modes == ('always', 'never')
  assert started[0].micro_batch_sizes == [8, 16]


def test_each_cell_is_the_median_of_its_profile_processes(monkeypatch):
  """One process's allocator settles on one packing of a step's chunks,
  which what ran before in it shapes: by default each distinct cell is
  profiled in three processes per remat mode, and each measured quantity
  is the median of its mode's three (an outlier process moves nothing)."""
  started = []
  backward = {(0, 'always'): [10, 30, 11], (0, 'never'): [3, 2, 9],
              (1, 'always'): [4, 5, 6], (1, 'never'): [1, 1, 1]}  # MiB

  def Run(sub, mode, timeout_s=900, log=None, memory_mb=None):
    del mode, timeout_s, log, memory_mb
    [k] = sub.positions
    [remat] = sub.modes
    run = sum(s == (k, remat) for s in started)
    started.append((k, remat))
    memory = memory_model.CellMemory(
        micro_batch_size=8, variable_bytes=7 if remat == 'always' else 0,
        backward_peak={remat: backward[(k, remat)][run] * 2**20},
        fused_peak=float(run + (10 if remat == 'never' else 0)),
        is_last=k == 1)
    return [memory_model.CellProfile([memory]).ToDict()]

  monkeypatch.setattr(memory_profile, 'RunInSubprocess', Run)
  batch = np.zeros((8, _DIM), np.float32)
  request = memory_profile.ProfileRequest(
      [_Cell('a'), _Cell('c', activation='none')], [(None, _DIM)] * 2, batch,
      batch, _Loss, [8], optimizer_lib.OptimizerParams())
  request.allocator_slack = False
  assert request.profile_runs == 3
  first, last = [p.At(8) for p in memory_profile.ProfileCells(request)]
  assert started == ([(0, 'always')] * 3 + [(0, 'never')] * 3 +
                     [(1, 'always')] * 3 + [(1, 'never')] * 3)
  assert first.backward_peak == {'always': 11 * 2**20, 'never': 3 * 2**20}
  assert last.backward_peak == {'always': 5 * 2**20, 'never': 2**20}
  # Variables from the re-materialized processes; the fused call's larger.
  assert first.variable_bytes == 7 and first.fused_peak == 11
  assert (not first.is_last) and last.is_last
  # A prediction for one policy may read one mode: only its processes run.
  started.clear()
  request.modes = ('never',)
  first, _ = [p.At(8) for p in memory_profile.ProfileCells(request)]
  assert started == [(0, 'never')] * 3 + [(1, 'never')] * 3
  assert first.backward_peak == {'never': 3 * 2**20}
  assert first.variable_bytes == 0 and first.fused_peak == 11


def test_profiling_needs_the_counting_allocator(monkeypatch):
  monkeypatch.delenv('TF_CPU_ALLOCATOR_USE_BFC', raising=False)
  with pytest.raises(RuntimeError, match='TF_CPU_ALLOCATOR_USE_BFC=true'):
    memory_profile.CheckAllocatorCounts()
  # A GPU's allocator counts bytes whatever the CPU's does.
  memory_profile.CheckAllocatorCounts('/job:localhost/replica:0/task:0/'
                                      'device:GPU:1')


def test_a_device_is_read_through_its_own_allocator():
  assert memory_profile.AllocatorName(None) == 'CPU:0'
  assert memory_profile.AllocatorName('/device:GPU:3') == 'GPU:3'
  assert memory_profile.AllocatorName(
      '/job:localhost/replica:0/task:0/device:GPU:1') == 'GPU:1'


def _ProbeExecutors():
  """Profiles a cell with and without single-threaded calls, recording the
  executor each of its actions' calls asked for: a CHECK line."""
  # pylint: disable=g-import-not-at-top
  from tfpipe import quiet
  tf = quiet.ImportTensorFlow()
  from tfpipe.gpipe import cell_runtime
  asked = []
  real = cell_runtime._SingleThreaded  # pylint: disable=protected-access

  def Spy(enabled):
    asked.append(bool(enabled))
    return real(enabled)
  cell_runtime._SingleThreaded = Spy  # pylint: disable=protected-access
  x = np.random.RandomState(0).normal(size=(16, _DIM)).astype(np.float32)
  check = {}
  for single_threaded in (False, True):
    del asked[:]
    memory = memory_profile.ProfileCell(
        _Cell('a'), x, None, _Loss, 8, False,
        optimizer_lib.OptimizerParams(),
        single_threaded_calls=single_threaded)
    check[str(single_threaded)] = {
        'asked': sorted(set(asked)), 'num_calls': len(asked),
        'kept_never': memory.kept['never'],
        'backward_peak': memory.backward_peak}
  # A plan that never re-materializes reads one mode's profile: the last
  # cell's every action is timed in it too.
  for modes in (('always', 'never'), ('never',)):
    memory = memory_profile.ProfileCell(
        _Cell('c', activation='none'), x, None, _Loss, 8, True,
        optimizer_lib.OptimizerParams(), single_threaded_calls=True,
        modes=modes)
    check['times ' + ','.join(modes)] = {
        'forward_s': memory.forward_s, 'fused_s': memory.fused_s,
        'backward_s': memory.backward_s, 'update_s': memory.update_s}
  del tf
  print('CHECK ' + json.dumps(check), flush=True)


@pytest.fixture(scope='module')
def probe():
  """_ProbeExecutors's CHECK, from a process with the counting allocator."""
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true',
             TF_CPP_MIN_LOG_LEVEL='2')
  proc = subprocess.run([sys.executable, '-m', _MODULE, 'executors'],
                        cwd=_REPO_ROOT, env=env, capture_output=True,
                        text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(next(line[len('CHECK '):]
                         for line in proc.stdout.splitlines()
                         if line.startswith('CHECK ')))


def test_worker_cpus_actions_are_profiled_as_single_threaded_calls(probe):
  """A worker's CPU runs each action as a call on the single-threaded
  executor (gpipe/cell_runtime.py); asked to, the profile runs every
  action so, and otherwise none."""
  check = probe
  assert check['False']['asked'] == [False], check
  assert check['True']['asked'] == [True], check
  assert check['True']['num_calls'] > 0, check
  # What a forward keeps does not depend on the executor.
  assert abs(check['True']['kept_never'] -
             check['False']['kept_never']) <= 16 * 1024, check
  assert min(check['True']['backward_peak'].values()) > 0, check


def test_a_profile_of_one_remat_mode_times_every_action(probe):
  """A plan's step time reads the profile of its policy's mode alone
  (memory_report.RematModes): profiled in NO_REMAT only, the forward and
  the fused call were once left at 0 s, and a plan of SmallMlp on two
  workers was predicted 28% under its measured step."""
  both, never = probe['times always,never'], probe['times never']
  for times in (both, never):
    assert times['forward_s'] > 0 and times['fused_s'] > 0, probe
    assert times['update_s'] > 0, probe
  assert set(never['backward_s']) == {'never'}, probe
  assert min(both['backward_s'].values()) > 0, probe


if __name__ == '__main__':
  if sys.argv[1] == 'executors':
    _ProbeExecutors()
