"""initial_values: a worker's variables get the values they would get there.

Protected property: inside ComputedHere, a variable made on another
process's device holds exactly the values it holds when its initializer runs
on that device (seeded Keras initializers, a tfpipe layer's, a tensor given
as the value), and it lives on that device; its initializer ran in this
process. One probe process (this file run
as a module, in a loopback-only network namespace) starts a worker, checks,
prints one JSON line and kills the worker.
"""

import json
import os
import subprocess
import sys

from tests import worker_probe

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODULE = 'tests.initial_values_test'


def _Check():
  # pylint: disable=g-import-not-at-top
  import keras
  import numpy as np
  import tensorflow as tf
  from tfpipe import initial_values
  from tfpipe import layers
  worker = '/job:worker/replica:0/task:0/device:CPU:0'
  ran_on = []

  def Recording(shape, dtype=None):
    value = tf.ones(shape, dtype)
    ran_on.append(value.device)
    return value

  def Make(here):
    made = []
    with tf.device(worker), (initial_values.ComputedHere() if here else
                             tf.init_scope()):
      for k, init in enumerate([
          keras.initializers.GlorotUniform(seed=3),
          keras.initializers.RandomNormal(seed=4),
          keras.initializers.TruncatedNormal(seed=5),
          keras.initializers.Orthogonal(seed=6),
          keras.initializers.Constant(0.5), 'zeros', Recording]):
        made.append(keras.Variable(initializer=init, shape=(7, 5),
                                   name=f'v{k}'))
      made.append(tf.Variable(tf.range(6.0), name='given'))
      fc = layers.FCLayer.Params().Set(name='fc', input_dims=5, output_dims=3,
                                       random_seed=11).Instantiate()
      made.extend(fc.weights)
    return made
  remote, here = Make(False), Make(True)
  print('CHECK ' + json.dumps({
      'equal': [bool(np.array_equal(np.asarray(a.numpy()),
                                    np.asarray(b.numpy())))
                for a, b in zip(remote, here)],
      'devices': [(v.value if isinstance(v, keras.Variable) else v).device
                  for v in here],
      'distinct': bool(not np.allclose(here[0].numpy(), here[1].numpy())),
      'ran_on': ran_on}),
        flush=True)


def test_a_workers_variables_hold_the_values_made_on_the_worker():
  proc = subprocess.run(
      [sys.executable, '-m', _MODULE, 'probe'], cwd=_REPO_ROOT,
      capture_output=True, text=True, timeout=180, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith('CHECK '))
  check = json.loads(line[len('CHECK '):])
  assert check['equal'] and all(check['equal']), check
  # 7 initializers, a tensor, fc's 2.
  assert len(check['equal']) == 10, check
  assert all(d.startswith('/job:worker/replica:0/task:0/')
             for d in check['devices']), check
  assert check['distinct'], check
  # The initializer ran on the worker without the scope, here within it.
  remote, here = check['ran_on']
  assert remote.startswith('/job:worker/'), check
  assert not here.startswith('/job:worker/'), check


if __name__ == '__main__':
  if sys.argv[1] == 'worker':
    worker_probe.Serve(sys.argv[2], int(sys.argv[3]), num_devices=1)
  else:
    worker_probe.Probe(_MODULE, 1, _Check)
