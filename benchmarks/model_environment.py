"""The environment of a Table 1 model's processes: profiles, workers, trials.

AmoebaNet's convolutions run on oneDNN's kernels. Where TensorFlow runs
without them (its default on x86 CPUs without AVX-512, such as AMD EPYC),
a convolution's input gradient (Conv2DCustomBackpropInput) takes an im2col
scratch buffer sized for a 30 MiB cache rather than for the batch, so plain
Keras ran out of memory on AmoebaNet-D L=3 in 32, 40 and 48 MiB: GPipe's
naive-1 model did not train in the budget at all, an artifact of the CPU
that no accelerator has. With oneDNN, L=3 trains in 32 MiB, as on the CPUs
where oneDNN is the default and where largest_model was first measured.
(memory_model_accuracy keeps TensorFlow's default: the memory model must
predict what a user's run takes, with whichever kernels it has.)

A variable the user has set is left as it is. The settings must be in a
process's environment before TensorFlow starts, so they go to the
subprocesses (`Environment`, `Within`), never to a running TensorFlow.
"""

import contextlib
import os

SETTINGS = {'amoebanet': {'TF_ENABLE_ONEDNN_OPTS': '1'}}


def Environment(model, environ=None):
  """os.environ (or `environ`) with `model`'s settings the user left unset."""
  env = dict(os.environ if environ is None else environ)
  for name, value in SETTINGS.get(model, {}).items():
    env.setdefault(name, value)
  return env


def Has(model):
  """Whether `model`'s processes need settings of their own."""
  return bool(SETTINGS.get(model))


@contextlib.contextmanager
def Within(model):
  """Within the block os.environ holds `model`'s settings, for the
  subprocesses started there (which copy it)."""
  added = {name: value for name, value in Environment(model).items()
           if name not in os.environ}
  os.environ.update(added)
  try:
    yield
  finally:
    for name in added:
      os.environ.pop(name, None)
