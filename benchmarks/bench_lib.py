"""Shared pieces of the benchmarks: models, timing, tables and JSON.

Why one module: every benchmark must compare configurations on the same
model and batch, time them the same way (alternating repetitions, medians)
and report the same way (a printed table and a JSON file), so that ratios
between scripts mean the same thing.

Logical CPU devices must be configured before TensorFlow initialises its
runtime; `SplitCpu` is called by each script right after flag parsing.
"""

import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfpipe import gpipe  # pylint: disable=g-import-not-at-top
from tfpipe import layers  # pylint: disable=g-import-not-at-top


def SplitCpu(num_devices):
  """Splits the CPU into `num_devices` logical devices (before TF starts)."""
  cpus = tf.config.list_physical_devices('CPU')
  try:
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError:
    pass  # Runtime already initialised; keep what exists.
  return [d.name for d in tf.config.list_logical_devices('CPU')]


def TransformerLayerParams(num_layers, dim=256, heads=4, hidden=1024):
  return [layers.TransformerLayer.Params().Set(
      name=f'xf{i}', input_dim=dim, num_heads=heads, hidden_dim=hidden)
          for i in range(num_layers)]


def ConvLayerParams(num_layers, channels=32, in_channels=3):
  out = [layers.Conv2DLayer.Params().Set(
      name='conv0', filter_shape=(3, 3, in_channels, channels))]
  out += [layers.Conv2DLayer.Params().Set(
      name=f'conv{i}', filter_shape=(3, 3, channels, channels))
          for i in range(1, num_layers)]
  return out


def MakeModel(kind, num_layers, batch, seq=64, dim=256, image=32):
  """(layer params, input tensor) for 'transformer' or 'conv'."""
  if kind == 'transformer':
    x = tf.random.stateless_normal([batch, seq, dim], seed=[1, 2])
    return TransformerLayerParams(num_layers, dim=dim, heads=4,
                                  hidden=4 * dim), x
  if kind == 'conv':
    x = tf.random.stateless_normal([batch, image, image, 3], seed=[1, 2])
    return ConvLayerParams(num_layers), x
  raise ValueError(f'Unknown model kind {kind!r}; expected transformer or '
                   'conv.')


def Loss(y, unused_targets=None):
  return tf.reduce_mean(tf.square(y))


def Sgd(variables, gradients, lr=1e-3):
  """Plain SGD, applied where each variable lives (no optimizer slots)."""
  for v, g in zip(variables, gradients):
    with tf.device(v.value.device):
      v.assign_sub(lr * g)


def MakePipe(layer_params, num_cells, num_micro_batches, devices, remat,
             schedule='gpipe', input_shape=None, executor='graph',
             **pipe_params):
  """A PipeliningLayer over the first num_cells devices; extra params as given."""
  cells = gpipe.PartitionSequentialLayers(
      layer_params, num_cells, balance='flops' if input_shape else 'params',
      input_shape=input_shape)
  p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches,
      devices=list(devices[:num_cells]), remat_policy=remat,
      schedule=schedule, executor=executor, **pipe_params)
  return p.Instantiate()


def PipeTrainStep(pipe, x=None):
  """One pipelined forward+backward and an SGD update.

  For executor='graph' the whole step is a tf.function of x. For
  executor='threads' the pipelined part runs eagerly (it dispatches its own
  traced functions) and only the update is traced; pass x then, and call the
  result with no arguments.
  """
  if pipe.p.executor == 'threads':
    update = tf.function(lambda grads: Sgd(pipe.trainable_variables, grads))

    def ThreadedStep():
      out = pipe.ComputeLossAndGradients(x, None, Loss)
      update(out.gradients)
      return out.loss
    return ThreadedStep

  @tf.function
  def Step(x):
    out = pipe.ComputeLossAndGradients(x, None, Loss)
    Sgd(pipe.trainable_variables, out.gradients)
    return out.loss
  return Step


def TimeAlternating(steps, reps, warmup=2, log=None):
  """Times each named step `reps` times, configurations interleaved.

  Alternating (A B C A B C ...) rather than (A A A B B B) spreads the load of
  a shared machine evenly over the configurations. Every call syncs by
  reading its result back.

  Returns:
    {name: list of seconds}.
  """
  for name, fn in steps.items():
    t = time.perf_counter()
    for _ in range(warmup):
      _Sync(fn())
    if log:
      log(f'  warmed up {name} in {time.perf_counter() - t:.1f}s')
  samples = {name: [] for name in steps}
  for _ in range(reps):
    for name, fn in steps.items():
      t = time.perf_counter()
      _Sync(fn())
      samples[name].append(time.perf_counter() - t)
  return samples


def _Sync(result):
  tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, 'numpy') else t,
                        result)


def Median(xs):
  return statistics.median(xs)


def FormatTable(header, rows):
  """Left-aligned first column, right-aligned others, markdown pipes."""
  cells = [list(map(str, header))] + [[_Fmt(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = []
  for j, r in enumerate(cells):
    parts = [r[0].ljust(widths[0])] + [
        c.rjust(w) for c, w in zip(r[1:], widths[1:])]
    lines.append('| ' + ' | '.join(parts) + ' |')
    if j == 0:
      lines.append('|' + '|'.join('-' * (w + 2) for w in widths) + '|')
  return '\n'.join(lines)


def _Fmt(c):
  if isinstance(c, float):
    return f'{c:.3f}' if abs(c) < 100 else f'{c:.1f}'
  return str(c)


def Environment():
  return {
      'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'),
      'command': ' '.join([os.path.basename(sys.executable)] + sys.argv),
      'tensorflow': tf.__version__,
      'python': platform.python_version(),
      'cpu_count': os.cpu_count(),
      'load_average': os.getloadavg() if hasattr(os, 'getloadavg') else None,
  }


def WriteJson(path, payload):
  if not path:
    return
  payload = dict(payload)
  payload.setdefault('environment', Environment())
  with open(path, 'w') as f:
    json.dump(payload, f, indent=2, default=float)
  print(f'wrote {path}')
