"""Initial values of variables on another process's devices, computed here.

A variable is made where its device scope says, and so is its initial
value: Keras runs the initializer under the same scope. On a worker
process's device, each of the initializer's ops is then a remote call, and
tf.Variable asks the value's shape before it makes the handle, which waits
for them: one variable after another, each several round trips. Building
AmoebaNet-D (L=99) on 8 worker processes of a 2-core machine took 40 s that
way (benchmarks/RESULTS.md, largest_model), most of it waiting.

Inside `ComputedHere()`, a variable made eagerly on another process's device
computes its initial value on this process's CPU; the handle is still made
on the device, and the assignment carries the value there. The values are
the same: Keras' initializers draw stateless random numbers from their
seeds, which TensorFlow keeps the same on CPU and GPU, and the rest is
arithmetic on them. An initial value given as a tensor, or a variable made
on a device of this process, is left as it is.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.eager import context  # pylint: disable=g-direct-tensorflow-import

from tfpipe import device_names


def _OnOtherProcess():
  """Whether the current eager device scope is another process's device."""
  device = context.context().device_name
  return bool(device) and device_names.OnOtherProcess(device)


def _HostCpu():
  return context.context().host_address_space() + '/device:CPU:0'


@contextlib.contextmanager
def ComputedHere():
  """A scope in which remote variables' callable initial values run here."""

  def Creator(next_creator, **kwargs):
    initial_value = kwargs.get('initial_value')
    if (callable(initial_value) and tf.executing_eagerly() and
        _OnOtherProcess()):
      host = _HostCpu()

      def Here(compute=initial_value):
        with tf.device(host):
          return compute()
      kwargs['initial_value'] = Here
    return next_creator(**kwargs)

  with tf.variable_creator_scope(Creator):
    yield
