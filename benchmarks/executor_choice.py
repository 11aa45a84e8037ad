r"""Where executor='threads' starts to beat executor='graph' on CPU devices.

Why: executor='auto' (the PipeliningLayer default) picks 'threads' on two or
more CPU devices only when one forward action (a cell on a micro-batch)
costs at least gpipe.dispatch.THREADS_MIN_FORWARD_FLOPS by the
cells' cost model, and 'graph' below it (ChooseExecutor). The threshold is
a guess until it is measured: 'threads' overlaps the stages, which one graph
over logical CPU devices does not do, but every action costs a hand-off to a
device thread and a function call, which only large actions amortise. This
script measures both executors on the same pipeline over a sweep of action
sizes and prints the crossover next to the threshold.

How (one run, repetitions alternating between the executors, medians):
  * K cells (--num_cells) on K logical CPU devices, split as the trainer
    splits a CPU machine (bench_lib.LocalDevices with --device=cpu). The
    device ops are NOT serialized (no bench_lib.SerializeDeviceOps): the
    devices share TensorFlow's thread pools, as they do for a user.
  * An MLP of --num_layers FC layers (bench_lib.MakeModel('mlp')) of width
    d for each d in --dims, at batch --batch, M micro-batches, the
    pipeline's default remat policy and schedule.
  * Both executors run the trainer's step (tfpipe/trainer/task.py,
    TrainStep): pipe.ComputeLossAndGradients called eagerly (executor
    'graph' traces it itself, compile_step; 'threads' dispatches its actions
    from the device threads), then a traced update (SGD here).
  * "forward flops / action" is what 'auto' sees: the mean FPropMeta flops
    of one cell on one micro-batch, computed by the pipeline itself
    (PipeliningLayer._ForwardFlopsPerAction); "auto picks" is
    ChooseExecutor on the pipeline's devices and that number, checked
    against a pipeline built with executor='auto'.
  * The crossover is the smallest of those flops at which 'threads' beats
    'graph' by more than --margin (5%: threads/graph < 0.95).

With the defaults the actions span about 1e6 (d=32) to 4e9 (d=2048)
forward flops; the run takes about two minutes on 2 cores, and a d=2048
step about 3 s (--batch=256 halves every action and step);
--dims=...,4096 reaches about 2e10 flops per action, at over 10 s a step.

    python -m benchmarks.executor_choice --output_json=/tmp/executor_choice.json
"""

from absl import app
from absl import flags

from benchmarks import bench_lib
from tfpipe.gpipe import dispatch

tf = bench_lib.tf

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_cells', 2, 'K: cells, one per logical CPU device.')
flags.DEFINE_integer('num_micro_batches', 4, 'M: micro-batches per step.')
flags.DEFINE_integer('num_layers', 8, 'FC layers of the MLP (split evenly '
                     'over the cells).')
flags.DEFINE_list('dims', ['32', '64', '128', '256', '512', '1024', '2048'],
                  'Widths of the MLP, one pipeline each.')
flags.DEFINE_integer('batch', 512, 'Global batch size (every width). A '
                     'forward action costs about 2 * batch / M * d^2 * '
                     'num_layers / K flops.')
flags.DEFINE_float('margin', 0.05, "How much faster 'threads' must be to "
                   'count as beating graph for the crossover (0.05: '
                   'threads/graph < 0.95).')
flags.DEFINE_integer('reps', 7, 'Timed repetitions per executor and width.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')


def _TrainerStep(pipe, x):
  """The trainer's step for either executor: eager pipeline, traced update.

  Mirrors Task.TrainStep, so each executor runs as a user's training does:
  'graph' compiles its own step (compile_step), 'threads' must be called
  eagerly for its device threads to overlap.
  """
  update = tf.function(
      lambda grads: bench_lib.Sgd(pipe.trainable_variables, grads))

  def Step():
    out = pipe.ComputeLossAndGradients(x, None, bench_lib.Loss)
    update(out.gradients)
    return out.loss
  return Step


def _ForwardFlopsPerAction(pipe, x):
  """The flops per forward action that executor='auto' decides on."""
  # Same shape structure as PipeliningLayer.ResolvedExecutor passes.
  shape = tf.nest.map_structure(lambda t: tuple(t.shape), x)
  return pipe._ForwardFlopsPerAction(shape)  # pylint: disable=protected-access


def RunWidth(dim, devices):
  """Times both executors on one MLP width; returns a result dict."""
  k, m = FLAGS.num_cells, FLAGS.num_micro_batches
  layer_params, x = bench_lib.MakeModel('mlp', FLAGS.num_layers, FLAGS.batch,
                                        dim=dim)
  shape = (None,) + tuple(x.shape[1:])
  pipes = {executor: bench_lib.MakePipe(layer_params, k, m, devices,
                                        remat='always', input_shape=shape,
                                        executor=executor)
           for executor in ('graph', 'threads', 'auto')}
  flops = _ForwardFlopsPerAction(pipes['graph'], x)
  pipe_devices = list(pipes['graph'].p.devices)
  auto = dispatch.ChooseExecutor(pipe_devices, flops)
  resolved = pipes['auto'].ResolvedExecutor(x)
  if resolved != auto:
    raise AssertionError(f"d={dim}: executor='auto' resolved to {resolved!r} "
                         f'but ChooseExecutor gives {auto!r}.')
  steps = {executor: _TrainerStep(pipes[executor], x)
           for executor in ('graph', 'threads')}
  samples = bench_lib.TimeAlternating(steps, FLAGS.reps, log=print)
  med = {name: bench_lib.Median(v) for name, v in samples.items()}
  return {'dim': dim, 'batch': FLAGS.batch, 'devices': pipe_devices,
          'forward_flops_per_action': flops, 'graph_s': med['graph'],
          'threads_s': med['threads'],
          'threads_over_graph': med['threads'] / med['graph'],
          'auto': auto, 'samples_s': samples}


def Crossover(results, margin):
  """Smallest forward flops per action where threads beats graph by > margin."""
  wins = [r['forward_flops_per_action'] for r in results
          if r['threads_over_graph'] < 1 - margin]
  return min(wins) if wins else None


def main(argv):
  del argv
  k = FLAGS.num_cells
  _, devices = bench_lib.LocalDevices(k, 'cpu')
  results = []
  for dim in [int(d) for d in FLAGS.dims]:
    print(f'== d={dim} ==', flush=True)
    results.append(RunWidth(dim, devices))
  threshold = dispatch.THREADS_MIN_FORWARD_FLOPS
  rows = [[f'{r["dim"]}', f'{r["forward_flops_per_action"]:.3g}',
           r['graph_s'] * 1e3, r['threads_s'] * 1e3, r['threads_over_graph'],
           r['auto']] for r in results]
  print(f'MLP of {FLAGS.num_layers} FC layers, batch {FLAGS.batch}, '
        f'K={k}, M={FLAGS.num_micro_batches} on '
        f'{bench_lib.DeviceLabel("CPU", len(devices))} (ops not serialized), '
        f"trainer's step, median of {FLAGS.reps} alternating reps")
  print(bench_lib.FormatTable(
      ['d', 'fwd flops/action', 'graph ms', 'threads ms', 'threads/graph',
       'auto picks'], rows))
  crossover = Crossover(results, FLAGS.margin)
  beats = (f'{crossover:.3g} forward flops per action' if crossover else
           f'none (threads never beats graph by > {FLAGS.margin:.0%})')
  print(f'measured crossover (threads > {FLAGS.margin:.0%} faster than '
        f'graph): {beats}; THREADS_MIN_FORWARD_FLOPS = {threshold:.3g}')
  if crossover is not None:
    losses = [r['dim'] for r in results
              if r['forward_flops_per_action'] > crossover and
              r['threads_over_graph'] >= 1 - FLAGS.margin]
    if losses:
      print(f'note: threads does not win at every larger size (d={losses}).')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'executor_choice', 'flags': FLAGS.flag_values_dict(),
      'threads_min_forward_flops': threshold, 'crossover_flops': crossover,
      'results': results, 'environment': bench_lib.Environment()})


if __name__ == '__main__':
  app.run(main)
