r"""How long `--mode=inspect_model` takes as K grows, for GPipe's largest Transformer.

Why: inspect_model is how a user sizes and cuts a model before asking for
devices, so it must answer at once for the paper's configurations. GPipe's
Table 1 Pipeline-128 row is a 1,663-block Transformer (d=2048, FFN 8192,
32 heads, vocabulary 32k: 83.9B parameters) on 128 accelerators. This runs
the trainer's own command on it, as a user would, in a fresh process per
run, at each K of --partitions, with the repetitions alternating between the
K values. A control process that only imports TensorFlow (what every run
pays first) gives the floor; the table shows each K's median wall time and
its time above that floor, which is what the model's size and K cost.

    python -m benchmarks.inspect_model --output_json=/tmp/bench/inspect_model.json
"""

import subprocess
import sys
import time

from absl import app
from absl import flags

from benchmarks import bench_lib

FLAGS = flags.FLAGS
flags.DEFINE_list('partitions', ['1', '8', '32', '128'], 'K values to run.')
flags.DEFINE_integer('num_layers', 1663, 'Transformer blocks (GPipe '
                     'Pipeline-128: 1663).')
flags.DEFINE_integer('reps', 3, 'Runs per K (and of the import control).')
flags.DEFINE_string('output_json', None, 'Where to write the results.')

# GPipe Table 1's Transformer-L: d=2048, FFN 8192, 32 heads, 32k vocabulary.
_MODEL = ('task.model.model_dim: 2048; task.model.hidden_dim: 8192; '
          'task.model.num_heads: 32; task.model.vocab_size: 32000')
_IMPORT_ONLY = 'from tfpipe import quiet; quiet.ImportTensorFlow()'


def Command(num_partitions, num_layers):
  """The trainer command that prints the table for K=num_partitions."""
  return [sys.executable, '-m', 'tfpipe.trainer',
          '--model=lm.LargeTransformerLm', '--mode=inspect_model',
          f'--num_partitions={num_partitions}',
          f'--model_params_override=task.model.num_layers: {num_layers}; '
          + _MODEL]


def _Timed(command):
  start = time.perf_counter()
  proc = subprocess.run(command, capture_output=True, text=True, check=False)
  seconds = time.perf_counter() - start
  if proc.returncode != 0:
    raise RuntimeError(f'{" ".join(command)} failed:\n{proc.stderr[-2000:]}')
  return seconds, proc.stdout


def main(argv):
  del argv
  ks = [int(k) for k in FLAGS.partitions]
  control = [sys.executable, '-c', _IMPORT_ONLY]
  times = {k: [] for k in ks}
  floor = []
  totals = {}
  for _ in range(FLAGS.reps):
    floor.append(_Timed(control)[0])
    for k in ks:
      seconds, out = _Timed(Command(k, FLAGS.num_layers))
      times[k].append(seconds)
      lines = out.splitlines()
      totals[k] = lines[-1].split()[1]
      assert len([l for l in lines if l.startswith('cell')]) == k + 1, out
  floor_s = bench_lib.Median(floor)
  rows = [['import TensorFlow only', floor_s, 0.0, '']]
  results = []
  for k in ks:
    median = bench_lib.Median(times[k])
    rows.append([f'inspect_model K={k}', median, median - floor_s, totals[k]])
    results.append({'num_partitions': k, 'wall_s': times[k],
                    'median_s': median, 'above_import_s': median - floor_s,
                    'params': totals[k]})
  print(f'{FLAGS.num_layers}-block Transformer (d=2048, FFN 8192, 32 heads), '
        f'median of {FLAGS.reps} alternating runs:')
  print(bench_lib.FormatTable(
      ['run', 'wall s', 's above import', 'params'], rows))
  bench_lib.WriteJson(FLAGS.output_json, {
      'num_layers': FLAGS.num_layers, 'import_only_s': floor,
      'results': results})


if __name__ == '__main__':
  app.run(main)
