"""Tests of tfpipe.trainer.memory_report: the memory model for an experiment.

Protected properties (no profiling here; gpipe/memory_profile_test and the
trainer's end-to-end tests run it): each cell's input shape follows from
the cost model, the step the walk sees is the experiment's (schedule, M,
one replica's batch, remat, interleaved placement), the layers become
one-layer cells for the planner (profiled in one process, where a CPU's
cells get a fresh process each), and the inspect_model lines put each
device's prediction next to the budget and say what to change when one
does not fit.
"""

import pytest

from tfpipe import model_registry
from tfpipe.gpipe import memory_model
from tfpipe.trainer import memory_report
from tfpipe.trainer import task as task_lib

MIB = 2**20


def _Params():
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  p.task.pipeline.Set(num_partitions=2, num_micro_batches=4,
                      schedule='1f1b', remat_policy='except_last',
                      num_replicas=2)
  return p


def test_cell_input_shapes_and_step_follow_the_experiment():
  p = _Params()
  model = p.task.model.Instantiate()
  cells = task_lib.PartitionCells(p.task, model)
  shapes = memory_report.CellInputShapes(cells, model.InputShape())
  assert shapes == [(None, 16), (None, 32)]
  step = memory_report.StepConfig(p)
  assert (step.schedule, step.num_micro_batches, step.batch_size,
          step.remat_policy) == ('1f1b', 4, 16, 'except_last')
  assert step.input_example_bytes == 16 * 4
  assert memory_report.StepMicroBatchSizes(p) == [4]
  p.task.pipeline.Set(devices=['/CPU:0', '/CPU:1', '/CPU:0', '/CPU:1'],
                      num_partitions=4, schedule='interleaved_1f1b',
                      num_replicas=1)
  assert memory_report.StepConfig(p).device_of_cell == [0, 1, 0, 1]


def test_layers_become_one_layer_cells():
  cells = memory_report.LayerCells(_Params())
  assert [c.name for c in cells] == [f'layer{i}' for i in range(5)]
  assert [c.sub[0].name for c in cells] == [
      'fc_0', 'fc_1', 'fc_2', 'fc_3', 'logits']
  assert all(c.sub[0].random_seed is not None for c in cells)


def _TwoPeaks(first_mib, second_mib):
  """Two devices' predicted peaks, one cell each."""
  return [memory_model.DevicePeak(0, [0], first_mib * MIB, variable_bytes=MIB,
                                  action='B3.0'),
          memory_model.DevicePeak(1, [1], second_mib * MIB,
                                  variable_bytes=MIB, action='F0.1')]


def test_budget_lines_compare_each_device_with_the_budget():
  p = _Params()
  peaks = _TwoPeaks(3, 9)
  lines = memory_report.BudgetLines(p, peaks, 8, ['/CPU:0', '/CPU:1'])
  assert lines[0].startswith('Predicted peak memory per device')
  assert lines[2].split()[:6] == ['/CPU:0', 'cell0', '3.0', 'MiB', '8', 'MiB']
  assert lines[2].split()[6] == 'yes' and lines[3].split()[6] == 'NO'
  assert '--plan=auto' in lines[-1]
  assert memory_report.SmallestBudgetMb(peaks) == 9


def test_a_device_in_the_planners_headroom_is_called_tight():
  p = _Params()
  peaks = _TwoPeaks(6, 7.5)
  lines = memory_report.BudgetLines(p, peaks, 8, ['/CPU:0', '/CPU:1'],
                                    headroom=0.15)
  assert lines[2].split()[6] == 'yes' and lines[3].split()[6] == 'tight'
  assert lines[-1].startswith('A tight device is predicted within its 8 MiB '
                              'but in the last 15% of it')
  assert 'tight' not in '\n'.join(memory_report.BudgetLines(
      p, peaks, 9, ['/CPU:0', '/CPU:1'], headroom=0.15))


def test_a_cpu_profile_runs_in_fresh_processes_with_the_devices_threads(
    monkeypatch):
  """The update's working set follows how many ops run at once, and what
  the allocator grants follows what it held before: a CPU profile runs in
  fresh processes (one per distinct cell) with the devices' intra-op
  threads, even from a process whose allocator counts bytes; a GPU's, in
  the process that holds it."""
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  from tfpipe.gpipe import memory_profile  # pylint: disable=g-import-not-at-top
  request = memory_report.ProfileRequest(_Params(), example=(None, None),
                                         intra_op_threads=1)
  assert request.intra_op_threads == 1
  where = []
  monkeypatch.setattr(memory_profile, 'ProfileCells',
                      lambda r, log=None: where.append('here'))
  monkeypatch.setattr(memory_profile, 'ProfileInSubprocess',
                      lambda r, log=None: where.append('subprocess'))
  monkeypatch.setenv(memory_limit.BFC_ENV, 'true')
  monkeypatch.delenv(memory_limit.LIMIT_ENV, raising=False)
  monkeypatch.setenv(memory_profile.INTRA_OP_ENV, '1')
  memory_report.Profile(request)
  assert memory_profile.SubprocessEnv(
      request, 'profile')[memory_profile.INTRA_OP_ENV] == '1'
  request.device = '/job:localhost/replica:0/task:0/device:GPU:0'
  memory_report.Profile(request)
  memory_report.Profile(request, in_subprocess=True)
  assert where == ['subprocess', 'here', 'subprocess']


def test_the_planners_layers_share_one_process_its_cells_do_not(monkeypatch):
  """A planner's one-layer cells are a search's estimate, refined on the
  chosen cut's cells: the layers are profiled in one process, the cells
  each in a fresh one (memory_profile.ProfileRequest.process_per_cell)."""
  requests = []

  def Capture(request, log=None, in_subprocess=False):
    del log, in_subprocess
    requests.append(request)
    raise StopIteration

  monkeypatch.setattr(memory_report, 'Profile', Capture)
  with pytest.raises(StopIteration):
    memory_report.PlannerProfiles(_Params(), [4], example=(None, None))
  [layers] = requests
  assert len(layers.cells) > 2 and not layers.process_per_cell
  assert memory_report.ProfileRequest(
      _Params(), example=(None, None)).process_per_cell
