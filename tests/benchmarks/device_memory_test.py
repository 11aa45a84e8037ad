"""Per-device memory on separate allocators (benchmarks/device_memory.py).

Each cell runs in its own single-device worker process with a BFC
allocator, so each device's peak is its own, as on K GPUs. No device of
equal cells may peak above 1.3x their median (what an op left on the
default device shows), and the control (the trainer's update with
tfpipe.placement switched off) must show worker 0, the default device,
holding far more: otherwise the measurement could not see a misplacement.
(Max over min was the bar until a loaded CI run saw one device 3 MiB
below the others, 13.7 / 13.9 / 13.1 / 10.7 MiB: these growing allocators'
remote frees race, and a low device is no misplacement.)
"""
# bazel: tags=manual

import json
import os

import pytest

from tests import quiet_test


@pytest.mark.skipif(not os.path.exists('/usr/bin/unshare'),
                    reason='needs unshare (util-linux) for loopback servers')
def test_equal_cells_have_equal_peaks_and_the_control_shows_worker_0(
    tmp_path):
  # One run per executor, started together: a row's controller uses about
  # one core while it traces. Each row still starts its own workers.
  started = {executor: quiet_test.Started(
      '-m', 'benchmarks.device_memory', '--num_cells=4', '--dim=512',
      '--batch=128', '--steps=1', f'--executors={executor}',
      f'--output_json={tmp_path / executor}.json', timeout=280,
      env=dict(os.environ)) for executor in ('graph', 'threads')}
  rows = {}
  for executor, proc in zip(started, quiet_test.RunAll(*started.values())):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows.update({(r['executor'], r['update']): r for r in json.loads(
        (tmp_path / f'{executor}.json').read_text())['rows']})
  for executor in ('graph', 'threads'):
    placed = rows[(executor, 'placed')]
    assert placed['max_over_median'] <= 1.3, placed
    control = rows[(executor, 'unplaced')]
    assert control['worker0_over_rest'] >= 1.5, control
