"""Experiment configurations: one class per experiment, registered by name.

An experiment is a task (model, loss, optimizer, pipeline layout) plus the
input it trains and evaluates on. Writing it as a small class with one
method per part (`Task`, `Train`, `Test`) keeps each part overridable by
subclassing, and lets `model_registry.GetParams` assemble the whole tree
(`p.task`, `p.input`, `p.eval_input`) that the trainer prints, diffs and
overrides from the command line.
"""


class SingleTaskModelParams:
  """Base class of registered experiment configurations.

  Subclasses override `Task()` and `Train()`; `Test()` defaults to the
  training input with a different seed, so evaluation sees unseen examples.
  Other datasets (e.g. `Dev`) are added as further methods returning input
  params and are selected by name in `model_registry.GetParams`.
  """

  # Seed offset between the training input and the default evaluation input.
  TEST_SEED_OFFSET = 100003

  def Train(self):
    """Params of the training input generator."""
    raise NotImplementedError(
        f'{type(self).__name__} must define Train() returning input params.')

  def Test(self):
    """Params of the evaluation input generator."""
    p = self.Train()
    p.name = 'test'
    p.seed += self.TEST_SEED_OFFSET
    return p

  def Task(self):
    """Params of the task: model, loss, optimizer and pipeline layout."""
    raise NotImplementedError(
        f'{type(self).__name__} must define Task() returning task params.')

  @classmethod
  def Datasets(cls):
    """Names of the dataset methods this configuration offers."""
    names = []
    for name in dir(cls):
      if name[:1].isupper() and name not in ('Task', 'Datasets'):
        if callable(getattr(cls, name)) and not isinstance(
            getattr(cls, name), type):
          names.append(name)
    return sorted(names)
