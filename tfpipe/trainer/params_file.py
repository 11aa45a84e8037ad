"""A logdir's params.txt: what trained it, compared before a run resumes it.

A checkpoint holds values, not the config that gave them meaning: the same
variable shapes fit a 4-head and a 2-head attention, and a changed learning
rate or seed restores without a word. So the trainer compares the new run's
params with the logdir's params.txt BEFORE it writes anything, and only
after the checkpoint restored does it write the new params.txt.

Two kinds of difference:
* Execution params change how a run executes, never what it computes: the
  pipeline layout (task.pipeline.*: K, M, schedule, remat, executor,
  balance, devices, replicas; training is the same by construction) and the
  run's length and logging. They are accepted, with one line listing them.
* Everything else (model, optimizer, seeds, input, --model itself) would
  resume a different experiment from these weights. It is refused with the
  diff, unless --allow_params_change asks for it; the old params.txt is then
  kept as params.before_step_<N>.txt.
"""

import os

PARAMS_FILE = 'params.txt'

EXECUTION_PARAM_PREFIXES = ('task.pipeline.',)
EXECUTION_PARAMS = frozenset({
    'task.train.max_steps', 'task.train.save_interval_steps',
    'task.train.log_interval_steps', 'task.train.timeline_step',
    'task.train.max_checkpoints_to_keep', 'task.eval.interval_steps',
    'task.eval.num_batches'})

ALLOW_FLAG = '--allow_params_change'


class ParamsChangedError(Exception):
  """The run's params would change the model or training of a logdir."""


def IsExecutionParam(key):
  """True for params that change how a run executes, not what it computes."""
  return key in EXECUTION_PARAMS or key.startswith(EXECUTION_PARAM_PREFIXES)


def ParseParamsText(text):
  """{dotted name: value text} of `Params.ToText()` output."""
  values = {}
  for line in text.splitlines():
    key, sep, value = line.partition(' : ')
    if sep:
      values[key.strip()] = value.strip()
  return values


def Differences(old_text, new_text):
  """[(key, old value text or None, new value text or None)], sorted."""
  old, new = ParseParamsText(old_text), ParseParamsText(new_text)
  return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
          if old.get(k) != new.get(k)]


def DiffText(differences):
  """The differences in `Params.TextDiff` form: '- old' then '+ new' lines."""
  lines = []
  for key, old, new in differences:
    if old is not None:
      lines.append(f'- {key} : {old}')
    if new is not None:
      lines.append(f'+ {key} : {new}')
  return '\n'.join(lines)


def _Path(logdir, name=PARAMS_FILE):
  return os.path.join(logdir, name)


def ReadParamsText(logdir):
  """The logdir's params.txt, or None if it has none."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = _Path(logdir)
  if not tf.io.gfile.exists(path):
    return None
  with tf.io.gfile.GFile(path) as f:
    return f.read()


class Comparison:
  """How a run's params differ from those that trained its logdir.

  Attributes:
    execution: differences in execution params (accepted).
    training: differences that change the model or training.
    has_params_file: whether the logdir had a params.txt to compare with.
  """

  def __init__(self, old_text, new_text):
    self.has_params_file = old_text is not None
    diffs = Differences(old_text, new_text) if old_text is not None else []
    self.execution = [d for d in diffs if IsExecutionParam(d[0])]
    self.training = [d for d in diffs if not IsExecutionParam(d[0])]

  def ExecutionLine(self):
    """One line naming the accepted execution changes, or None."""
    if not self.execution:
      return None
    return ('params.txt differs only in how the run executes (training is '
            'unchanged): ' + ', '.join(
                f'{k} {o} -> {n}' for k, o, n in self.execution) + '.')


def CheckParams(logdir, params, allow_change=False, log=print):
  """Compares `params` with the logdir's params.txt; writes nothing.

  Args:
    logdir: the run's logdir.
    params: the run's experiment params.
    allow_change: accept differences that change the model or training.
    log: prints a line.

  Returns:
    The Comparison.

  Raises:
    ParamsChangedError: training differences without `allow_change`.
  """
  comparison = Comparison(ReadParamsText(logdir), params.ToText())
  line = comparison.ExecutionLine()
  if line:
    log(line)
  if comparison.training:
    diff = DiffText(comparison.training)
    if not allow_change:
      raise ParamsChangedError(
          f'--logdir={logdir} was trained with other params; these '
          'differences change the model or the training (- its params.txt, '
          f'+ this run):\n{diff}\nRun with the params of its params.txt, give '
          f'a new --logdir, or pass {ALLOW_FLAG} to resume it with these '
          'params on purpose.')
    log(f'{ALLOW_FLAG}: resuming {logdir} with changed params:\n{diff}')
  return comparison


def WriteParams(logdir, params, comparison=None, step=0):
  """Writes params.txt atomically; keeps a replaced training config.

  Args:
    logdir: the run's logdir.
    params: the run's experiment params.
    comparison: the Comparison from CheckParams, if any.
    step: the step the run starts at, which names a kept old params.txt.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if comparison is not None and comparison.training:
    tf.io.gfile.copy(_Path(logdir), _Path(
        logdir, f'params.before_step_{step}.txt'), overwrite=True)
  tmp = _Path(logdir, PARAMS_FILE + '.tmp')
  with tf.io.gfile.GFile(tmp, 'w') as f:
    f.write(params.ToText())
  tf.io.gfile.rename(tmp, _Path(logdir), overwrite=True)
