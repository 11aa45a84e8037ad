r"""Records one step of a K=4 pipeline and draws what each device did.

Why: a bubble fraction is one number; a picture shows where the time went
(fill and drain, slow cells, gaps the schedule does not explain). This runs
a real pipelined Transformer step with in-graph timestamps, prints the
measured text timeline next to the simulator's prediction for the same
schedule and measured per-cell costs, and writes a PNG (needs matplotlib:
`pip install -e .[timeline]`).

On logical CPU devices the devices are not exclusive (one shared thread
pool), so actions of different devices can overlap in time *and* slow each
other down; see pipeline_efficiency.py for exclusive stages.

    python -m benchmarks.timeline --output_png=benchmarks/timeline.png
"""

from absl import app
from absl import flags

from benchmarks import bench_lib
from tfpipe import timeline

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_cells', 4, 'K.')
flags.DEFINE_integer('num_micro_batches', 8, 'M.')
flags.DEFINE_integer('num_layers', 8, 'Transformer layers.')
flags.DEFINE_integer('batch', 64, 'Global batch size.')
flags.DEFINE_integer('seq', 32, 'Sequence length.')
flags.DEFINE_integer('dim', 128, 'Model dim.')
flags.DEFINE_enum('schedule', 'gpipe', ['gpipe', '1f1b'], 'Schedule.')
flags.DEFINE_enum('remat', 'always', ['always', 'except_last', 'never'],
                  'Re-materialization policy.')
flags.DEFINE_integer('warmup_steps', 2, 'Untimed steps first.')
flags.DEFINE_string('output_png', 'benchmarks/timeline.png', 'Picture path '
                    '(empty: no picture).')
flags.DEFINE_string('output_json', None, 'Where to write the timeline.')


def main(argv):
  del argv
  k, m = FLAGS.num_cells, FLAGS.num_micro_batches
  devices = bench_lib.SplitCpu(k)
  layer_params, x = bench_lib.MakeModel('transformer', FLAGS.num_layers,
                                        FLAGS.batch, seq=FLAGS.seq,
                                        dim=FLAGS.dim)
  pipe = bench_lib.MakePipe(layer_params, k, m, devices, FLAGS.remat,
                            FLAGS.schedule,
                            input_shape=(None,) + tuple(x.shape[1:]))
  tl = timeline.RecordStep(pipe, x, None, bench_lib.Loss,
                           warmup_steps=FLAGS.warmup_steps)
  print(f'Transformer L={FLAGS.num_layers}, batch {FLAGS.batch}x{FLAGS.seq}x'
        f'{FLAGS.dim}, {FLAGS.schedule}, remat={FLAGS.remat}, on {k} logical '
        'CPU devices\n')
  print('measured:')
  print(tl.Text())
  print('\npredicted (simulator with the measured per-cell costs):')
  print(tl.PredictedText())
  print()
  print(tl.Summary())
  if FLAGS.output_png:
    tl.SavePng(FLAGS.output_png, title=(
        f'tfpipe {FLAGS.schedule} K={k} M={m} remat={FLAGS.remat} '
        f'(Transformer L={FLAGS.num_layers}, logical CPU devices)'))
    print(f'wrote {FLAGS.output_png}')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'timeline', 'flags': FLAGS.flag_values_dict(),
      'timeline': tl.AsDict()})


if __name__ == '__main__':
  app.run(main)
