"""benchmarks/gradient_handover.py: a tiny run on two worker processes
reports both configurations' peaks and step times, and stops its workers."""
# bazel: tags=manual

import json

from tests.benchmarks import script_runner


def test_tiny_run_reports_both_configurations(tmp_path):
  out = tmp_path / 'handover.json'
  proc = script_runner.Run(
      'benchmarks.gradient_handover', '--dim=32', '--slow_layers=2',
      '--micro_batch=4', '--num_micro_batches=4', '--steps=2', '--trials=1',
      f'--output_json={out}', timeout=300)
  payload = json.loads(out.read_text())
  assert sorted(payload['steps']) == ['at once', 'hand-over']
  for steps in payload['steps'].values():
    assert len(steps) == 2
    for step in steps:
      assert len(step['peak_mib']) == 2 and min(step['peak_mib']) >= 0
      assert step['seconds'] > 0
  assert 'device 0 median peak, hand-over / at once' in proc.stdout
