r"""Records one pipelined training step and draws what each device did.

Why: a bubble fraction is one number; a picture shows where the time went
(fill and drain, slow cells, gaps the schedule does not explain). This runs
a real pipelined Transformer step with in-graph timestamps, prints the
measured text timeline next to the simulator's prediction for the same
schedule and measured per-cell costs, and writes a PNG (needs matplotlib:
`pip install -e .[timeline]`).

By default the step runs on executor='threads' with each device's ops
serialized (bench_lib.SerializeDeviceOps), one op at a time per device (as in pipeline_efficiency.py), and K=2 to match
a 2-core machine: more devices than cores would time-slice them. With
--executor=graph the picture shows TensorFlow running one graph's stages
one after another on CPU.

    python -m benchmarks.timeline --output_png=benchmarks/timeline.png

On a GPU (--device=auto picks it when one is visible) the K devices are
logical GPUs of one GPU (tfpipe.devices), with their own streams, and ops
are not serialized (a GPU stream already runs one kernel after another).
What the times mean there:
  executor='threads' (default)  host time: an action's start is when its
      device thread issued it (after its inputs were ready), its end is
      after its outputs exist: the dispatcher reads one element of them back
      (tfpipe/gpipe/dispatch.py, _WaitFor), which waits for the GPU's
      kernels. Without that wait a host timestamp would mark when the kernels
      were launched, not when they finished. The wait also keeps one action
      in flight per device, as a stage of a real pipeline has.
  executor='graph'  in-graph tf.timestamp ops run on the host once the
      action's ops are done for TensorFlow's executor, which for a GPU
      kernel means queued: these mark launches, not completion, and the
      picture shows issue order rather than device time.

    python -m benchmarks.timeline --device=gpu --dim=1024 --seq=256 \
        --batch=16 --num_cells=4 --output_png=/tmp/timeline_gpu.png
"""

from absl import app
from absl import flags

from benchmarks import bench_lib
from tfpipe import timeline

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
bench_lib.DefineDeviceFlags()


def main(argv):
  del argv
  k, m = FLAGS.num_cells, FLAGS.num_micro_batches
  threads = FLAGS.executor == 'threads'
  device_type = bench_lib.ChooseDeviceType(FLAGS.device)
  # Logical CPU devices share one thread pool: serialize each device's ops
  # to make them exclusive, as accelerators are. GPUs need no emulation.
  serialize = threads and device_type == 'CPU'
  if serialize:
    bench_lib.tf.config.threading.set_intra_op_parallelism_threads(1)
    bench_lib.tf.config.threading.set_inter_op_parallelism_threads(
        bench_lib.InterOpThreadsNeeded(k))
  device_type, devices = bench_lib.LocalDevices(k, FLAGS.device,
                                                FLAGS.logical_gpu_memory_mb)
  layer_params, x = bench_lib.MakeModel('transformer', FLAGS.num_layers,
                                        FLAGS.batch, seq=FLAGS.seq,
                                        dim=FLAGS.dim)
  pipe = bench_lib.MakePipe(layer_params, k, m, devices, FLAGS.remat,
                            FLAGS.schedule,
                            input_shape=(None,) + tuple(x.shape[1:]),
                            executor=FLAGS.executor,
                            serialize_device_ops=serialize)
  tl = timeline.RecordStep(pipe, x, None, bench_lib.Loss,
                           warmup_steps=FLAGS.warmup_steps)
  where = bench_lib.DeviceLabel(device_type, k)
  print(f'Transformer L={FLAGS.num_layers}, batch {FLAGS.batch}x{FLAGS.seq}x'
        f'{FLAGS.dim}, {FLAGS.schedule}, remat={FLAGS.remat}, executor='
        f'{FLAGS.executor}, on {where}\n')
  if device_type == 'GPU':
    print('(GPU times: ' + (
        'start = issued, end = outputs ready (dispatch._WaitFor)'
        if threads else 'in-graph timestamps mark kernel launches, not '
        'completion') + ')\n')
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
        f'{where})'))
    print(f'wrote {FLAGS.output_png}')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'timeline', 'device_type': device_type,
      'flags': FLAGS.flag_values_dict(),
      'timeline': tl.AsDict()})


if __name__ == '__main__':
  app.run(main)
