"""benchmarks/inspect_model.py: a tiny run of the trainer's inspect_model timing."""
# bazel: tags=manual
# bazel: deps=//params,//tfpipe/trainer:__main__

import json

from tests.benchmarks import script_runner


def test_times_each_k_against_the_import_floor(tmp_path):
  out = tmp_path / 'inspect_model.json'
  proc = script_runner.Run('benchmarks.inspect_model', '--partitions=2',
                           '--num_layers=6', '--reps=1',
                           f'--output_json={out}')
  payload = json.loads(out.read_text())
  assert payload['num_layers'] == 6 and len(payload['import_only_s']) == 1
  (result,), = [payload['results']]
  assert result['num_partitions'] == 2 and len(result['wall_s']) == 1
  assert result['median_s'] > 0
  assert result['above_import_s'] == result['median_s'] - (
      payload['import_only_s'][0])
  # The model's size comes from the trainer's own table.
  assert result['params'].replace(',', '').isdigit()
  assert '6-block Transformer' in proc.stdout
  assert 'inspect_model K=2' in proc.stdout
