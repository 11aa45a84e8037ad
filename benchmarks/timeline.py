r"""Records one pipelined training step and draws what each device did.

Why: a bubble fraction is one number; a picture shows where the time went
(fill and drain, slow cells, gaps the schedule does not explain). This runs
a real pipelined Transformer step with in-graph timestamps, prints the
measured text timeline next to the simulator's prediction for the same
schedule and measured per-cell costs, and writes a PNG (needs matplotlib:
`pip install -e .[timeline]`).

By default the step runs on executor='threads' with serialize_device_ops,
one op at a time per device (as in pipeline_efficiency.py), and K=2 to match
a 2-core machine: more devices than cores would time-slice them. With
--executor=graph the picture shows TensorFlow running one graph's stages
one after another on CPU.

    python -m benchmarks.timeline --output_png=benchmarks/timeline.png
"""

from absl import app
from absl import flags

from benchmarks import bench_lib
from tfpipe import timeline
from tfpipe.gpipe import threaded_executor

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_cells', 2, 'K.')
flags.DEFINE_integer('num_micro_batches', 8, 'M.')
flags.DEFINE_integer('num_layers', 8, 'Transformer layers.')
flags.DEFINE_integer('batch', 64, 'Global batch size.')
flags.DEFINE_integer('seq', 32, 'Sequence length.')
flags.DEFINE_integer('dim', 128, 'Model dim.')
flags.DEFINE_enum('schedule', 'gpipe', ['gpipe', '1f1b'], 'Schedule.')
flags.DEFINE_enum('remat', 'always', ['always', 'except_last', 'never'],
                  'Re-materialization policy.')
flags.DEFINE_enum('executor', 'threads', ['threads', 'graph'],
                  'PipeliningLayer executor.')
flags.DEFINE_integer('warmup_steps', 2, 'Untimed steps first.')
flags.DEFINE_string('output_png', 'benchmarks/timeline.png', 'Picture path '
                    '(empty: no picture).')
flags.DEFINE_string('output_json', None, 'Where to write the timeline.')


def main(argv):
  del argv
  k, m = FLAGS.num_cells, FLAGS.num_micro_batches
  threads = FLAGS.executor == 'threads'
  if threads:
    bench_lib.tf.config.threading.set_intra_op_parallelism_threads(1)
    bench_lib.tf.config.threading.set_inter_op_parallelism_threads(
        threaded_executor.InterOpThreadsNeeded(k))
  devices = bench_lib.SplitCpu(k)
  layer_params, x = bench_lib.MakeModel('transformer', FLAGS.num_layers,
                                        FLAGS.batch, seq=FLAGS.seq,
                                        dim=FLAGS.dim)
  pipe = bench_lib.MakePipe(layer_params, k, m, devices, FLAGS.remat,
                            FLAGS.schedule,
                            input_shape=(None,) + tuple(x.shape[1:]),
                            executor=FLAGS.executor,
                            serialize_device_ops=threads)
  tl = timeline.RecordStep(pipe, x, None, bench_lib.Loss,
                           warmup_steps=FLAGS.warmup_steps)
  print(f'Transformer L={FLAGS.num_layers}, batch {FLAGS.batch}x{FLAGS.seq}x'
        f'{FLAGS.dim}, {FLAGS.schedule}, remat={FLAGS.remat}, executor='
        f'{FLAGS.executor}, on {k} logical CPU devices\n')
  print('measured:')
  print(tl.Text())
  print('\npredicted (simulator with the measured per-cell costs):')
  print(tl.PredictedText())
  print()
  print(tl.Summary())
  if FLAGS.output_png:
    tl.SavePng(FLAGS.output_png, title=(
        f'tfpipe {FLAGS.schedule} K={k} M={m} remat={FLAGS.remat} '
        f'executor={FLAGS.executor} (Transformer L={FLAGS.num_layers}, '
        'logical CPU devices)'))
    print(f'wrote {FLAGS.output_png}')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'timeline', 'flags': FLAGS.flag_values_dict(),
      'timeline': tl.AsDict()})


if __name__ == '__main__':
  app.run(main)
