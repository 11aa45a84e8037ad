"""benchmarks/timeline.py: a tiny recorded step on CPU, and --device.

On a GPU the same path runs without serialized ops; a tiny CPU run checks
the recording and the report, and --device=gpu without a GPU must stop with
the flag named.
"""
# bazel: tags=manual

import json

import pytest

from tests.benchmarks import script_runner

_TINY = ['--num_layers=2', '--num_cells=2', '--batch=8', '--seq=4',
         '--dim=16', '--num_micro_batches=2', '--output_png=']


@pytest.fixture(name='runs', scope='module')
def fixture_runs(tmp_path_factory):
  """The tiny run and --device=gpu, started together: {name: (run, json)}."""
  tmp = tmp_path_factory.mktemp('timeline')
  yield from script_runner.KillAfter({
      'tiny': script_runner.StartWritingJson('benchmarks.timeline',
                                             tmp / 'timeline.json', *_TINY),
      'gpu': (script_runner.StartGpuMode('benchmarks.timeline', *_TINY), None),
  })


def test_tiny_recorded_step_has_every_action(runs):
  run, out = runs['tiny']
  proc = script_runner.Finished(run)
  payload = json.loads(out.read_text())
  assert payload['device_type'] == 'CPU'
  actions = payload['timeline']['actions']
  # K=2 cells x M=2 micro-batches, a forward and a backward each.
  assert sorted((a['kind'], a['cell'], a['micro_batch']) for a in actions) == [
      (kind, cell, m) for kind in 'BF' for cell in (0, 1) for m in (0, 1)]
  assert all(a['end_s'] >= a['start_s'] for a in actions)
  assert 'executor=threads, on 2 logical CPU devices' in proc.stdout
  assert 'bubble' in proc.stdout


def test_gpu_mode_without_a_gpu_names_the_flag(runs):
  script_runner.AssertGpuModeRefused(runs['gpu'][0])
