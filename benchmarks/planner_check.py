r"""The planner on emulated accelerators: a model too big for one trains on more.

Why: --plan=auto promises the fastest configuration that fits every
device's memory, with a predicted step time. This checks both halves with
the trainer itself, through the launcher (python -m tfpipe.launcher
--device_memory_mb=N: each worker an accelerator of N MiB):

  1. on one capped worker, the model as configured runs out of memory
     (exit status 4, the trainer's plain error);
  2. on 2 and on 4 capped workers, --plan=auto chooses a configuration and
     the model trains; the step time the plan predicted is compared with
     the trainer's measured step_time (the median of its progress lines
     after the first, which includes tracing).

Step times are wall time on a shared machine: run it on a quiet one.

    python -m benchmarks.planner_check --output_json=/tmp/bench/planner_check.json
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'mlp.SmallMlp', 'Registered experiment.')
flags.DEFINE_string('model_params_override',
                    'task.model.hidden_dim: 1024; '
                    'task.model.num_hidden_layers: 6; input.batch_size: 256',
                    'Its overrides: big enough not to fit one device.')
flags.DEFINE_integer('device_memory_mb', 80, 'Each worker\'s limit.')
flags.DEFINE_list('num_workers', ['2', '4'], 'Worker counts to plan for.')
flags.DEFINE_integer('max_steps', 40, 'Steps of each planned run.')
flags.DEFINE_integer('log_interval_steps', 5, 'Steps per progress line.')
flags.DEFINE_integer('timeout_s', 900, 'Timeout of one run.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PREDICTED = re.compile(r'predicted step time (\S+)s')
_MEASURED = re.compile(r'^step \d+/\d+ .*step_time=([\d.]+)ms')


def _Launch(num_workers, logdir, *args):
  cmd = [sys.executable, '-m', 'tfpipe.launcher',
         f'--num_workers={num_workers}',
         f'--device_memory_mb={FLAGS.device_memory_mb}', '--',
         f'--model={FLAGS.model}',
         f'--model_params_override={FLAGS.model_params_override}',
         f'--logdir={logdir}', f'--max_steps={FLAGS.max_steps}',
         f'--log_interval_steps={FLAGS.log_interval_steps}',
         '--eval_interval_steps=0', *args]
  start = time.time()
  proc = subprocess.run(cmd, cwd=_REPO_ROOT, capture_output=True, text=True,
                        timeout=FLAGS.timeout_s, check=False)
  return proc, time.time() - start


def main(argv):
  del argv
  import tempfile  # pylint: disable=g-import-not-at-top
  rows = []
  with tempfile.TemporaryDirectory(prefix='planner_check_') as tmp:
    proc, seconds = _Launch(1, os.path.join(tmp, 'one'), '--num_partitions=1')
    errors = [l for l in proc.stderr.splitlines() if l.startswith('ERROR:')]
    print(f'1 worker of {FLAGS.device_memory_mb} MiB, as configured: exit '
          f'status {proc.returncode} ({seconds:.0f}s)')
    print('  ' + (errors[-1] if errors else proc.stderr[-500:]))
    one = {'num_workers': 1, 'exit_status': proc.returncode,
           'error': errors[-1] if errors else None}
    for workers in [int(w) for w in FLAGS.num_workers]:
      proc, seconds = _Launch(workers, os.path.join(tmp, f'w{workers}'),
                              '--plan=auto')
      out = proc.stdout + proc.stderr
      plan = [l for l in out.splitlines() if l.startswith(('Plan:', '  '))]
      predicted = _PREDICTED.search(out)
      measured = [float(m.group(1)) / 1000 for m in map(
          _MEASURED.match, out.splitlines()) if m][1:]
      row = {'num_workers': workers, 'exit_status': proc.returncode,
             'plan': plan,
             'predicted_s': float(predicted.group(1)) if predicted else None,
             'measured_s': statistics.median(measured) if measured else None,
             'seconds': round(seconds, 1)}
      if row['predicted_s'] and row['measured_s']:
        row['predicted_over_measured'] = row['predicted_s'] / row['measured_s']
      rows.append(row)
      print(f'\n{workers} workers of {FLAGS.device_memory_mb} MiB, '
            f'--plan=auto: exit status {proc.returncode} ({seconds:.0f}s)')
      print('\n'.join(plan[:3]))
      if row.get('predicted_over_measured'):
        print(f'  predicted {row["predicted_s"] * 1000:.1f} ms, measured '
              f'{row["measured_s"] * 1000:.1f} ms (median of '
              f'{len(measured)} progress lines): '
              f'{row["predicted_over_measured"]:.2f}x')
      elif proc.returncode:
        print(out[-2000:])
  if FLAGS.output_json:
    with open(FLAGS.output_json, 'w') as f:
      json.dump({'benchmark': 'planner_check', 'one_device': one,
                 'planned': rows, 'model': FLAGS.model,
                 'overrides': FLAGS.model_params_override,
                 'device_memory_mb': FLAGS.device_memory_mb,
                 'load_average': os.getloadavg()}, f, indent=2)
    print(f'wrote {FLAGS.output_json}')


if __name__ == '__main__':
  app.run(main)
