r"""Train-step overhead of tfpipe against a plain Keras step on the same model.

Why: a pipeline library should cost little when it cannot help (K=1, M=1),
and on top of micro-batching it should add little of its own. On CPU, small
micro-batches already cost real time (each adds a full weight-gradient
accumulation; see /work/shared/REFERENCE.md), so the K=4, M=8 step is shown
next to the *micro-batching floor*: the same model run as 8 sequential
micro-batches with accumulated gradients, no pipeline. The gap between the
floor and the pipeline is the pipeline's own overhead.

Configurations (one run, repetitions alternating, medians):
  keras            keras.Sequential of the same layers, tf.function,
                   GradientTape, SGD update.
  floor_m8         the same, as 8 sequential micro-batches, gradients summed.
  floor_m8_remat   the same with tf.recompute_grad around the model.
  pipe_k1_m1       tfpipe, 1 cell, 1 micro-batch, no remat.
  pipe_k1_m1_remat the same with remat_policy='always': the last cell's
                   forward and backward are one call, so nothing is
                   recomputed (target: at most 1.35x keras).
  pipe_k4_m1_remat 4 cells, 1 micro-batch, remat: cells 0-2 recompute their
                   forward once (one extra forward: about 1.33x at most).
  pipe_k4_m8       tfpipe, 4 cells on 4 logical CPU devices, M=8, no remat.
  pipe_k4_m8_remat the same with remat_policy='always'.
  pipe_k4_m8_remat_threads  the same with executor='threads' (one device
                   thread each, one traced function per action, ops on the
                   shared thread pool): what Python dispatch costs.

    python -m benchmarks.overhead --output_json=/tmp/overhead.json

On a GPU (--device=auto picks it when one is visible; --device=cpu keeps
the CPU), the K devices are logical GPUs: the GPU split into max(4, K),
each with an even share of its memory (--logical_gpu_memory_mb sets it).
They have their own allocators and streams but share the GPU's compute, so
the K=4 rows show what pipelining costs on one GPU, not a speed-up. The
issue-14 setting on one GPU:

    python -m benchmarks.overhead --device=gpu --models=transformer \
        --dim=1024 --seq=256 --batch=16 --output_json=/tmp/overhead_gpu.json
"""

from absl import app
from absl import flags

from benchmarks import bench_lib

tf = bench_lib.tf

FLAGS = flags.FLAGS
flags.DEFINE_list('models', ['transformer', 'conv', 'mlp'],
                  'Models to benchmark.')
flags.DEFINE_integer('mlp_dim', 1024, "Width of the 'mlp' model's layers.")
flags.DEFINE_integer('mlp_batch', 2048, "Batch size of the 'mlp' model "
                     '(8 x Dense 1024 at batch 2048: the remat measurement '
                     'of REFERENCE.md).')
flags.DEFINE_integer('num_layers', 8, 'Layers per model.')
flags.DEFINE_integer('batch', 64, 'Global batch size.')
flags.DEFINE_integer('seq', 32, 'Transformer sequence length.')
flags.DEFINE_integer('dim', 128, 'Transformer model dim.')
flags.DEFINE_integer('image', 16, 'Conv net image size.')
flags.DEFINE_integer('num_cells', 4, 'K of the pipelined configurations.')
flags.DEFINE_integer('num_micro_batches', 8, 'M of the pipelined '
                     'configurations and of the floor.')
flags.DEFINE_integer('reps', 9, 'Timed repetitions per configuration.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
bench_lib.DefineDeviceFlags()


def _KerasModel(layer_params, x):
  model = tf.keras.Sequential([p.Copy().Instantiate() for p in layer_params])
  model(x[:1])
  return model


def _KerasStep(model):
  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      loss = bench_lib.Loss(model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    bench_lib.Sgd(model.trainable_variables, grads)
    return loss
  return Step


def _FloorStep(model, num_micro_batches, remat):
  """The same step as M sequential micro-batches, gradients accumulated."""
  fn = model
  if remat:
    fn = tf.recompute_grad(lambda t: model(t, training=True))

  @tf.function
  def Step(x):
    variables = model.trainable_variables
    total, acc = 0.0, None
    for xm in tf.split(x, num_micro_batches):
      with tf.GradientTape() as tape:
        loss = bench_lib.Loss(fn(xm) if remat else fn(xm, training=True))
        loss = loss / num_micro_batches
      grads = tape.gradient(loss, variables)
      acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
      total += loss
    bench_lib.Sgd(variables, acc)
    return total
  return Step


def RunModel(kind, devices):
  mlp = kind == 'mlp'
  layer_params, x = bench_lib.MakeModel(
      kind, FLAGS.num_layers, FLAGS.mlp_batch if mlp else FLAGS.batch,
      seq=FLAGS.seq, dim=FLAGS.mlp_dim if mlp else FLAGS.dim,
      image=FLAGS.image)
  shape = (None,) + tuple(x.shape[1:])
  k, m = FLAGS.num_cells, FLAGS.num_micro_batches
  steps = {}
  steps['keras'] = _KerasStep(_KerasModel(layer_params, x))
  steps[f'floor_m{m}'] = _FloorStep(_KerasModel(layer_params, x), m, False)
  steps[f'floor_m{m}_remat'] = _FloorStep(_KerasModel(layer_params, x), m,
                                          True)
  steps['pipe_k1_m1'] = bench_lib.PipeTrainStep(bench_lib.MakePipe(
      layer_params, 1, 1, devices, 'never', input_shape=shape))
  steps['pipe_k1_m1_remat'] = bench_lib.PipeTrainStep(bench_lib.MakePipe(
      layer_params, 1, 1, devices, 'always', input_shape=shape))
  steps[f'pipe_k{k}_m1_remat'] = bench_lib.PipeTrainStep(bench_lib.MakePipe(
      layer_params, k, 1, devices, 'always', input_shape=shape))
  steps[f'pipe_k{k}_m{m}'] = bench_lib.PipeTrainStep(bench_lib.MakePipe(
      layer_params, k, m, devices, 'never', input_shape=shape))
  steps[f'pipe_k{k}_m{m}_remat'] = bench_lib.PipeTrainStep(bench_lib.MakePipe(
      layer_params, k, m, devices, 'always', input_shape=shape))
  fns = {name: (lambda s=s: s(x)) for name, s in steps.items()}
  fns[f'pipe_k{k}_m{m}_remat_threads'] = bench_lib.PipeTrainStep(
      bench_lib.MakePipe(layer_params, k, m, devices, 'always',
                         input_shape=shape, executor='threads'), x)
  samples = bench_lib.TimeAlternating(fns, FLAGS.reps, log=print)
  med = {name: bench_lib.Median(v) for name, v in samples.items()}
  base = med['keras']
  floor = med[f'floor_m{m}']
  floor_remat = med[f'floor_m{m}_remat']
  reference = {'keras': base, 'pipe_k1_m1': base, 'pipe_k1_m1_remat': base,
               f'pipe_k{k}_m1_remat': base,
               f'floor_m{m}': base, f'floor_m{m}_remat': f'floor_m{m}',
               f'pipe_k{k}_m{m}': floor,
               f'pipe_k{k}_m{m}_remat': floor_remat,
               f'pipe_k{k}_m{m}_remat_threads': floor_remat}
  rows = []
  for name, t in med.items():
    ref = reference[name]
    ref_t = med[ref] if isinstance(ref, str) else ref
    rows.append([name, t * 1e3, t / base, t / ref_t])
  return {'model': kind, 'median_s': med, 'samples_s': samples,
          'ratio_to_keras': {n: t / base for n, t in med.items()},
          'pipe_over_floor': med[f'pipe_k{k}_m{m}'] / floor,
          'pipe_remat_over_floor_remat':
              med[f'pipe_k{k}_m{m}_remat'] / floor_remat,
          'input_shape': list(x.shape), 'rows': rows}


def main(argv):
  del argv
  device_type, devices = bench_lib.LocalDevices(
      max(4, FLAGS.num_cells), FLAGS.device, FLAGS.logical_gpu_memory_mb)
  results = []
  for kind in FLAGS.models:
    print(f'== {kind} ==')
    res = RunModel(kind, devices)
    res['device_type'] = device_type
    results.append(res)
    print(f'{kind}: {FLAGS.num_layers} layers, input {res["input_shape"]}, '
          f'K={FLAGS.num_cells} on '
          f'{bench_lib.DeviceLabel(device_type, len(devices))}, '
          f'median of {FLAGS.reps} alternating reps')
    print(bench_lib.FormatTable(
        ['configuration', 'median ms', 'x keras', 'x its floor'],
        res['rows']))
    print('("its floor": keras for K=1 and the floor rows themselves '
          '(floor_remat vs floor); the M-micro-batch floor, with or without '
          'remat, for the K>1 pipelines)\n')
  for r in results:
    r.pop('rows')
  bench_lib.WriteJson(FLAGS.output_json, {'benchmark': 'overhead',
                                          'flags': FLAGS.flag_values_dict(),
                                          'results': results})


if __name__ == '__main__':
  app.run(main)
