"""Tests of --plan=auto (tfpipe.trainer.auto_plan) on emulated accelerators.

The CI-sized check of issue 20: two worker processes, each capped at 25 MiB
(the launcher's --device_memory_mb), and a model whose weights, gradients
and Adam slots alone need more than one of them (an MLP of eight 512-wide
layers: 28 MiB on one device). Protected properties:
the planner sees that one device cannot hold it and trains it on two, every
device within its limit; the same model forced onto one device runs out of
memory with a short error that names the worker, the cell and its layers,
the limit and the prediction, and exits with EXIT_OUT_OF_MEMORY, leaving the
plan's checkpoints as they were; when nothing fits a budget, the memory
the planner names trains it. The plan's pieces are also checked alone:
the micro-batch sizes profiled, the fallback to a CPU profile when the
GPU's fails, and a cluster's workers profiled as worker CPUs (one op at a
time per action, no build slack).
"""
# bazel: deps=//params,//tfpipe:launcher,//tfpipe/trainer:__main__

import hashlib
import os
import re
import shutil

import pytest

from tests import quiet_test
from tfpipe.gpipe import memory_model
from tfpipe.gpipe import planner
from tfpipe.trainer import auto_plan
from tfpipe.trainer import memory_report
from tfpipe.trainer import out_of_memory

_MODEL = ['--model=mlp.TinyMlp',
          '--model_params_override=task.model.hidden_dim: 512; '
          'task.model.num_hidden_layers: 8']


def _Launch(logdir, num_workers, *args, memory_mb=25):
  return quiet_test.RunPython(
      '-m', 'tfpipe.launcher', f'--num_workers={num_workers}',
      f'--device_memory_mb={memory_mb}', '--', *_MODEL, f'--logdir={logdir}',
      '--memory_profile_runs=1', *args, timeout=240)


def _Digests(directory):
  return {name: hashlib.sha256(open(os.path.join(directory, name),
                                    'rb').read()).hexdigest()
          for name in sorted(os.listdir(directory))}


@pytest.mark.skipif(not shutil.which('unshare'),
                    reason='needs unshare (util-linux) for loopback servers')
def test_a_model_too_big_for_one_capped_worker_trains_on_two(tmp_path):
  logdir = tmp_path / 'mlp'
  planned = _Launch(logdir, 2, '--plan=auto', '--max_steps=2',
                    '--save_interval_steps=2')
  out = planned.stdout + planned.stderr
  assert planned.returncode == 0, out[-3000:]
  assert 'Plan: 2 partition(s) x 1 replica(s)' in out
  assert '[1] partition(s) fit in no configuration' in out
  assert 'Final: step=2' in out
  checkpoints = _Digests(logdir / 'checkpoints')
  assert 'ckpt-2.index' in checkpoints

  # One capped worker: the one device the model is forced onto.
  forced = _Launch(logdir, 1, '--num_partitions=1', '--max_steps=4')
  assert forced.returncode == out_of_memory.EXIT_OUT_OF_MEMORY, (
      forced.stdout[-2000:] + forced.stderr[-3000:])
  assert 'Traceback' not in forced.stderr
  assert 'RecvAsync is cancelled' not in forced.stderr
  [error] = [line for line in forced.stderr.splitlines()
             if line.startswith('ERROR:')]
  assert error.startswith(
      'ERROR: Out of memory on /job:worker/replica:0/task:0/device:CPU:0, '
      'which runs cell0 (fc_0, fc_1, fc_2, fc_3, fc_4, fc_5, fc_6, fc_7, '
      'logits)')
  assert 'Its limit is 25 MiB; the memory model predicted' in error
  assert '--plan=auto' in error
  assert 'ckpt-2) were not touched' in error or 'ckpt-2, is kept' in error
  assert _Digests(logdir / 'checkpoints') == checkpoints


@pytest.mark.skipif(not shutil.which('unshare'),
                    reason='needs unshare (util-linux) for loopback servers')
def test_the_memory_named_when_nothing_fits_trains(tmp_path):
  """Nothing fits 16 MiB: the planner says so before anything runs and
  names a memory; workers of that memory then train the model. Planned to
  the last byte, this model ran out of memory on workers of the memory the
  planner named (benchmarks/RESULTS.md, "The planner's headroom"); the
  default headroom leaves room for the memory model's error."""
  small = _Launch(tmp_path / 'small', 2, '--plan=auto', '--max_steps=2',
                  memory_mb=16)
  assert small.returncode == out_of_memory.EXIT_OUT_OF_MEMORY, (
      small.stdout[-2000:] + small.stderr[-3000:])
  [error] = [line for line in small.stderr.splitlines()
             if line.startswith('ERROR:')]
  assert 'Nothing fits 2 device(s) of 13.6 MiB (16 MiB less a 15% headroom)' \
      in error, error
  named = re.search(r'the smallest per-device memory that would fit is '
                    r'(\d+) MiB \(a predicted peak of', error)
  assert named, error
  assert not os.path.exists(tmp_path / 'small' / 'checkpoints')

  fits = _Launch(tmp_path / 'fits', 2, '--plan=auto', '--max_steps=2',
                 memory_mb=int(named.group(1)))
  out = fits.stdout + fits.stderr
  assert fits.returncode == 0, out[-3000:]
  assert 'Final: step=2' in out


def test_the_plan_is_written_into_the_params():
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  plan = planner.PipelinePlan(
      num_partitions=2, num_replicas=2, layer_counts=[2, 3],
      num_micro_batches=4, remat_policy='except_last', schedule='1f1b',
      peaks=[], step_time_s=0.1, time_parts={}, memory_bytes=1.0)
  auto_plan.ApplyPlan(p, plan)
  pp = p.task.pipeline
  assert (pp.num_partitions, pp.num_replicas, pp.balance,
          pp.num_micro_batches, pp.remat_policy, pp.schedule) == (
              2, 2, [2, 3], 4, 'except_last', '1f1b')


def _Plan(layer_counts, m, remat='never', schedule='1f1b'):
  return planner.PipelinePlan(
      num_partitions=len(layer_counts), num_replicas=1,
      layer_counts=list(layer_counts), num_micro_batches=m,
      remat_policy=remat, schedule=schedule, peaks=[], step_time_s=0.1,
      time_parts={}, memory_bytes=1.0)


def _FakeCells(plan, sizes, modes):
  """One CellProfile per cell of the plan, of the modes profiled."""
  return [memory_model.CellProfile([memory_model.CellMemory(
      micro_batch_size=n, backward_peak={mode: 1.0 for mode in modes})
                                    for n in sizes])
          for _ in plan.layer_counts]


def test_plans_that_share_their_cells_are_checked_on_one_profile():
  """The three fastest plans were one cut at M=2 that did not fit once
  profiled as cells; M=1, next, did, and must be found. A cut is profiled
  in the remat modes its plan reads; a later plan of it that reads another
  mode adds only that one, without re-measuring the build's slack."""
  plans = [_Plan([4, 5], 2, 'never', '1f1b'),
           _Plan([4, 5], 2, 'never', 'gpipe'),
           _Plan([4, 5], 2, 'except_last', '1f1b'),
           _Plan([4, 5], 1)]
  profiled, lines = [], []

  def Profile(plan, sizes, modes, joining):
    profiled.append((tuple(plan.layer_counts), tuple(sizes), modes, joining))
    return _FakeCells(plan, sizes, modes)

  def Refine(plan, cells):
    n = 32 // plan.num_micro_batches
    assert all(c.sizes == [n] for c in cells)
    reads = memory_report.RematModes(plan.remat_policy,
                                     plan.num_micro_batches, step_time=True)
    assert all(set(reads) <= set(c.At(n).backward_peak) for c in cells)
    return None if plan.num_micro_batches == 2 else 'refined'

  plan, refined = auto_plan.FirstThatFits(plans, 32, Profile, Refine,
                                          '17.8 MiB', 21.0, lines.append)
  assert plan is plans[3] and refined == 'refined'
  assert profiled == [((4, 5), (16,), ('never',), False),
                      ((4, 5), (16,), ('always',), True),
                      ((4, 5), (32,), ('never',), False)]
  assert len(lines) == 3 and all('do not fit' in line for line in lines)


def test_the_modes_profiled_are_those_the_prediction_reads():
  """Each remat mode of a cell is profiled in processes of its own: a
  plan profiles what its memory walk and step time read, no more."""
  never, always = memory_model.NO_REMAT, memory_model.REMAT
  assert memory_report.RematModes('never', 4) == (never,)
  assert memory_report.RematModes('always', 4) == (always,)
  assert memory_report.RematModes('except_last', 4) == (always, never)
  # One micro-batch: except_last keeps it, re-materializing none.
  assert memory_report.RematModes('except_last', 1) == (never,)
  # The recompute's time: a re-materialized backward's less a plain one's.
  assert memory_report.RematModes('always', 4, step_time=True) == (
      always, never)
  assert memory_report.RematModes('never', 4, step_time=True) == (never,)


def test_no_plan_fits_after_three_cuts_are_profiled():
  plans = [_Plan([k, 9 - k], m) for k in (2, 3, 4, 5) for m in (1, 2)]
  profiled = []

  def Profile(plan, sizes, modes, joining):
    del modes, joining
    profiled.append(plan)
    return []

  with pytest.raises(planner.NoPlanError) as raised:
    auto_plan.FirstThatFits(plans, 32, Profile, lambda plan, cells: None,
                            '17.8 MiB', 21.0, lambda line: None)
  assert len(profiled) == 3
  assert str(raised.value).startswith(
      'The 3 fastest plans predicted to fit 17.8 MiB (their 3 distinct cuts '
      'and micro-batch sizes) do not fit once their cells are profiled')


def test_layers_are_profiled_at_every_halving_of_the_batch():
  assert auto_plan.ProfiledSizes(64, 2) == [1, 2, 4, 8, 16, 32, 64]
  assert auto_plan.ProfiledSizes(4096, 2) == [
      32, 64, 128, 256, 512, 1024, 2048, 4096]
  # The smallest size the planner considers, even between halvings.
  assert auto_plan.ProfiledSizes(96, 2) == [1, 3, 6, 12, 24, 48, 96]
  assert auto_plan.ProfiledSizes(1, 8) == [1]


@pytest.mark.parametrize('batch_size', [64, 256, 4096])
@pytest.mark.parametrize('count', [1, 2, 4, 8])
def test_every_candidate_runs_at_a_profiled_size(batch_size, count):
  """With a power-of-two batch and device count, no candidate's time or
  memory is interpolated: a kernel that slows at one size is seen there."""
  # pylint: disable=protected-access
  profiled = set(auto_plan.ProfiledSizes(batch_size, count))
  devices = planner.Devices(count=count, memory_bytes=1.0)
  for k, r, m, _, _ in planner._Candidates(
      16, devices, batch_size, None, None, ['always'], ['gpipe']):
    n = min(memory_model.MicroBatchSizes(batch_size // r, m))
    assert n in profiled, (k, r, m, n)


def _ChooseRecorded(monkeypatch, profile_device=None,
                    single_threaded_calls=False):
  """Choose for the 512-wide MLP on 2 devices of 25 MiB: (plan, the
  requests profiled, the log's lines)."""
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  requests, lines = [], []
  profile = memory_report.Profile

  def Recorded(request, **kwargs):
    requests.append(request)
    return profile(request, **kwargs)
  monkeypatch.setattr(memory_report, 'Profile', Recorded)
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  p.task.model.Set(hidden_dim=512, num_hidden_layers=8)
  plan = auto_plan.Choose(
      p, planner.Devices(count=2, memory_bytes=25 * 2**20), log=lines.append,
      profile_device=profile_device,
      single_threaded_calls=single_threaded_calls, profile_runs=1)
  assert p.task.pipeline.num_partitions == plan.num_partitions
  return plan, requests, lines


def test_a_failed_gpu_profile_falls_back_to_the_cpu_and_says_so(monkeypatch):
  """--plan=auto on GPUs profiles the layers on '/GPU:0' in a subprocess;
  where that fails (here: no GPU), it plans from a CPU profile and the log
  names the device, the error and the fallback. The plan's profiles are
  those of devices that are not worker CPUs (see the next test)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if tf.config.list_physical_devices('GPU'):
    pytest.skip('This machine has a GPU.')
  plan, requests, lines = _ChooseRecorded(monkeypatch, '/GPU:0')
  # Once: the chosen cut's cells are then profiled on the CPU directly.
  [fallback] = [line for line in lines if 'failed' in line]
  assert fallback.startswith('  Profiling the layers on /GPU:0 failed (')
  assert "unknown device '/GPU:0'" in fallback
  assert fallback.endswith('profiling them on the CPU instead, whose memory '
                           'and times may differ.')
  assert plan.num_partitions == 2
  # The layers (on the GPU, then on the CPU), then the chosen cut's cells.
  assert len(requests) >= 2
  assert [(r.single_threaded_calls, r.allocator_slack)
          for r in requests] == [(False, True)] * len(requests)


def test_a_clusters_workers_are_planned_for_as_worker_cpus(monkeypatch):
  """A cluster's workers run each action one op at a time and hold no build
  slack: the layers and the chosen cells are profiled that way, or the plan
  leaves memory unused (or runs out, if ever the other way round). (Devices
  that are not worker CPUs: the test above.)"""
  plan, requests, _ = _ChooseRecorded(monkeypatch, single_threaded_calls=True)
  assert plan.num_partitions == 2
  # The layers, then the chosen cut's cells, in the modes the plan reads.
  assert len(requests) >= 2
  assert requests[-1].modes == memory_report.RematModes(
      plan.remat_policy, plan.num_micro_batches, step_time=True)
  assert [(r.single_threaded_calls, r.allocator_slack)
          for r in requests] == [(True, False)] * len(requests)
