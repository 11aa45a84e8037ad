"""benchmarks/memory_model_accuracy.py at a tiny size: one configuration.

The grid itself is a benchmark (benchmarks/RESULTS.md); this runs its whole
path once (profiling, fresh workers, the trainer's step, each worker's
peak, the prediction, the JSON) and checks the prediction is close.
"""
# bazel: tags=manual

import json
import shutil

import pytest

from tests.benchmarks import script_runner


@pytest.mark.skipif(not shutil.which('unshare'),
                    reason='needs unshare (util-linux) for loopback servers')
def test_one_configuration_is_measured_and_predicted(tmp_path):
  out = tmp_path / 'accuracy.json'
  script_runner.Run(
      'benchmarks.memory_model_accuracy', '--models=mlp', '--num_cells=2',
      '--micro_batches=2', '--remat_policies=always', '--schedules=1f1b',
      '--measured_steps=1', f'--output_json={out}', timeout=300)
  [row] = json.loads(out.read_text())['rows']
  assert (row['num_cells'], row['num_micro_batches']) == (2, 2)
  assert len(row['measured_mib']) == len(row['predicted_mib']) == 2
  assert min(row['measured_mib']) > 0
  assert abs(row['worst_error']) < 0.3, row
