r"""GPipe, 1F1B, interleaved 1F1B and ZB-H1 side by side on exclusive devices.

Why: a schedule's claim is a shorter step on devices that each run one op
at a time. The simulator says how much shorter for given action costs; this
measures it. Every schedule trains the same model (--num_layers x FC(--dim),
batch --batch, M=--num_micro_batches) on K=--num_devices logical CPU devices
with executor='threads' and each device's ops serialized
(bench_lib.SerializeDeviceOps), as in pipeline_efficiency.py: one Python
thread per device issues its actions in schedule order, one op at a time,
as an accelerator would run them. Interleaved 1F1B cuts the same layers
into K*v cells, v per device, round-robin; the others into K cells. All use
the same re-materialization policy (--remat, default 'never': ZB-H1 keeps
1F1B's memory by its order, not by recomputing).

Step times alternate between the schedules (bench_lib.TimeAlternating), so
a shared machine's load falls on all of them alike; the table gives the
median, the range, and each schedule's step relative to 1F1B in the same
repetition. Then recorded steps (tfpipe.timeline, --record_steps per
schedule) give the measured bubble, the per-action F, B and W costs, and
the simulator's prediction from them.

The ZB-H1 check: the measured step saving over 1F1B against the saving the
simulator predicts from ZB-H1's measured F, B and W costs, with 1F1B's
backward costing B + W (the same work, one action), so the prediction is
the schedule's effect alone. The measured saving is the median over
repetitions of 1F1B's step minus ZB-H1's in the same repetition (pairs see
the same load); the difference of the two medians and the mean with its
standard error are printed too.

    python -m benchmarks.schedules --output_json=/tmp/bench/schedules.json
"""

import os
import statistics

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_devices', 2, 'K: devices (one stage each; '
                     'interleaved 1F1B runs v cells on each).')
flags.DEFINE_integer('num_micro_batches', 8, 'M.')
flags.DEFINE_integer('num_layers', 8, 'FC layers (dim x dim matmuls).')
flags.DEFINE_integer('dim', 256, 'Width of the FC layers.')
flags.DEFINE_integer('batch', 8192, 'Global batch size.')
flags.DEFINE_list('schedules', ['gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1'],
                  'Schedules to compare (keys of schedule.SCHEDULES).')
flags.DEFINE_integer('virtual_stages', 2, 'v: cells per device for '
                     'interleaved_1f1b (num_layers must split K*v ways).')
flags.DEFINE_enum('remat', 'never', ['never', 'always', 'except_last'],
                  'Re-materialization policy, the same for every schedule.')
flags.DEFINE_integer('reps', 40, 'Timed repetitions per schedule. The '
                     'ZB-H1 saving is about 5% of a step and one step varies '
                     'by +-10% on a shared 2-core machine, so it takes tens.')
flags.DEFINE_integer('record_steps', 3, 'Recorded steps per schedule; the '
                     'ZB-H1 prediction is the median over them.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')


def _Pipes(devices):
  """{schedule: PipeliningLayer} over the same layers, serialized devices."""
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  from tfpipe import gpipe
  from tfpipe import layers
  k, v = FLAGS.num_devices, FLAGS.virtual_stages
  layer_params = [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=FLAGS.dim, output_dims=FLAGS.dim,
      random_seed=i) for i in range(FLAGS.num_layers)]
  pipes = {}
  for name in FLAGS.schedules:
    num_cells = k * v if name == 'interleaved_1f1b' else k
    cells = gpipe.PartitionSequentialLayers(layer_params, num_cells,
                                            balance='params')
    pipes[name] = bench_lib.SerializeDeviceOps(
        gpipe.PipeliningLayer.Params().Set(
            name='pipe', cell_tpl=cells,
            num_micro_batches=FLAGS.num_micro_batches, devices=devices[:k],
            round_robin_placement=True, remat_policy=FLAGS.remat,
            schedule=name, executor='threads').Instantiate(),
        concurrent_devices=k)
  return pipes


def PredictedZeroBubbleSaving(one_f_one_b, zero_bubble, zb_timeline):
  """Simulated 1F1B makespan minus ZB-H1's, both with ZB-H1's measured costs.

  1F1B's B is the same work as ZB-H1's B and W together, so it costs their
  sum; the difference is then what the order alone saves.
  """
  # pylint: disable=g-import-not-at-top
  from tfpipe.gpipe import schedule as schedule_lib
  fwd = zb_timeline.forward_costs
  full = [b + w for b, w in zip(zb_timeline.backward_costs,
                                zb_timeline.weight_costs)]
  one = schedule_lib.Simulate(one_f_one_b, fwd, full)
  zero = schedule_lib.Simulate(zero_bubble, fwd, zb_timeline.backward_costs,
                               weight_costs=zb_timeline.weight_costs)
  return one.makespan - zero.makespan, one, zero


def main(argv):
  del argv
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  from tfpipe import timeline
  from tfpipe.gpipe import schedule as schedule_lib
  tf = bench_lib.tf
  k, m = FLAGS.num_devices, FLAGS.num_micro_batches
  unknown = [s for s in FLAGS.schedules if s not in schedule_lib.SCHEDULES]
  if unknown:
    raise app.UsageError(f'--schedules: unknown {unknown}; use some of '
                         f'{sorted(schedule_lib.SCHEDULES)}.')
  if 'interleaved_1f1b' in FLAGS.schedules and (
      FLAGS.num_layers < k * FLAGS.virtual_stages):
    raise app.UsageError(
        f'--num_layers={FLAGS.num_layers} cannot fill K*v = '
        f'{k * FLAGS.virtual_stages} cells for interleaved_1f1b; raise '
        '--num_layers or lower --virtual_stages.')
  load_before = os.getloadavg()
  # Each device's ops run one at a time in its own lane (see module doc).
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(
      bench_lib.InterOpThreadsNeeded(k))
  devices = bench_lib.SplitCpu(k)
  x = tf.random.stateless_normal([FLAGS.batch, FLAGS.dim], seed=[1, 2])
  pipes = _Pipes(devices)
  steps = {name: bench_lib.PipeTrainStep(pipe, x)
           for name, pipe in pipes.items()}
  samples = bench_lib.TimeAlternating(steps, FLAGS.reps, log=print)
  records = {name: [timeline.RecordStep(pipe, x, None, bench_lib.Loss)
                     for _ in range(FLAGS.record_steps)]
             for name, pipe in pipes.items()}
  # The table shows each schedule's recorded step of median makespan.
  timelines = {name: sorted(tls, key=lambda tl: tl.makespan)[len(tls) // 2]
               for name, tls in records.items()}
  load_after = os.getloadavg()

  med = {name: bench_lib.Median(v) for name, v in samples.items()}
  base = '1f1b' if '1f1b' in samples else FLAGS.schedules[0]
  rows, results = [], []
  for name in FLAGS.schedules:
    tl = timelines[name]
    # Same repetition, so the machine's load at that moment cancels.
    paired = [t / b for t, b in zip(samples[name], samples[base])]
    sched = pipes[name].Schedule(m)
    inflight = schedule_lib.MaxInFlight(sched)
    rows.append([name, sched.num_cells, med[name] * 1e3,
                 f'{min(samples[name]) * 1e3:.1f}-'
                 f'{max(samples[name]) * 1e3:.1f}',
                 statistics.median(paired),
                 f'{min(paired):.3f}-{max(paired):.3f}',
                 tl.bubble_fraction, tl.predicted.bubble_fraction,
                 tl.makespan * 1e3, tl.predicted.makespan * 1e3,
                 ' '.join(map(str, inflight))])
    results.append({
        'schedule': name, 'num_cells': sched.num_cells,
        'median_step_s': med[name], 'step_s': samples[name],
        f'step_over_{base}': paired, 'measured_bubble': tl.bubble_fraction,
        'predicted_bubble': tl.predicted.bubble_fraction,
        'recorded_makespan_s': tl.makespan,
        'predicted_makespan_s': tl.predicted.makespan,
        'forward_costs_s': tl.forward_costs,
        'backward_costs_s': tl.backward_costs,
        'weight_costs_s': tl.weight_costs, 'max_in_flight': inflight})
  print(f'\nK={k} device threads, executor=threads, serialized device ops; '
        f'{FLAGS.num_layers} x FC({FLAGS.dim}), batch {FLAGS.batch}, M={m}, '
        f'remat={FLAGS.remat}; interleaved: v={FLAGS.virtual_stages}; '
        f'{FLAGS.reps} alternating reps; load average '
        f'{load_before[0]:.2f} before, {load_after[0]:.2f} after')
  print(bench_lib.FormatTable(
      ['schedule', 'cells', 'median step ms', 'range ms', f'step / {base}',
       'range', 'bubble measured', 'bubble predicted', 'recorded ms',
       'predicted ms', 'max in flight'], rows))
  for name in FLAGS.schedules:
    print(f'\n{name}, one recorded step:')
    print(timelines[name].Text())
    print(timelines[name].Summary())
  payload = {'benchmark': 'schedules', 'flags': FLAGS.flag_values_dict(),
             'results': results,
             'load_average_before_after': [load_before, load_after]}
  if '1f1b' in pipes and 'zb_h1' in pipes:
    predictions = sorted(
        (PredictedZeroBubbleSaving(pipes['1f1b'].Schedule(m),
                                   pipes['zb_h1'].Schedule(m), tl)
         for tl in records['zb_h1']), key=lambda p: p[0])
    predicted, one, zero = predictions[len(predictions) // 2]
    paired = sorted(b - z for b, z in zip(samples['1f1b'], samples['zb_h1']))
    measured = statistics.median(paired)
    of_medians = med['1f1b'] - med['zb_h1']
    mean = statistics.mean(paired)
    error = (statistics.stdev(paired) / len(paired)**0.5 if len(paired) > 1
             else float('nan'))
    print(f'\nZB-H1 vs 1F1B: the simulator, with ZB-H1\'s measured costs, '
          f'predicts {one.makespan * 1e3:.1f} ms vs {zero.makespan * 1e3:.1f} '
          f'ms: a saving of {predicted * 1e3:.1f} ms. Measured saving: median '
          f'of the per-repetition differences {measured * 1e3:.1f} ms '
          f'({measured / predicted:.2f}x the prediction; target >= 0.5x: '
          f'{"met" if measured >= 0.5 * predicted else "not met"}); '
          f'difference of the medians {of_medians * 1e3:.1f} ms; mean '
          f'{mean * 1e3:.1f} +- {error * 1e3:.1f} ms (standard error); per '
          f'repetition {paired[0] * 1e3:.1f} to {paired[-1] * 1e3:.1f} ms.')
    payload['zero_bubble'] = {
        'predicted_saving_s': predicted,
        'predicted_1f1b_makespan_s': one.makespan,
        'predicted_zb_h1_makespan_s': zero.makespan,
        'measured_saving_s': measured, 'difference_of_medians_s': of_medians,
        'mean_saving_s': mean, 'standard_error_s': error,
        'paired_savings_s': paired,
        'measured_over_predicted': measured / predicted}
  bench_lib.WriteJson(FLAGS.output_json, payload)


if __name__ == '__main__':
  app.run(main)
