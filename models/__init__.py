"""Model builders: each turns model params into the layer-params list a pipeline cuts.

GPipe partitions a model that is a sequence of layers. A builder here says
what that sequence is (`LayerParamsList`), what input shape it takes
(`InputShape`, for the partitioner's cost model) and how its last layer's
output is scored against the targets (`Loss`, run once per micro-batch).
Keeping these three together is what lets the task stay model-agnostic.
"""

from tfpipe import hyperparams


class BaseModel:
  """Base class of model builders; subclasses define the three methods below."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', 'model', 'Name prefix of the model\'s layers.')
    return p

  def __init__(self, params):
    self._params = params.Copy().Freeze()

  @property
  def p(self):
    return self._params

  def LayerParamsList(self):
    """The model as an ordered list of layer params."""
    raise NotImplementedError(
        f'{type(self).__name__} must implement LayerParamsList.')

  def InputShape(self):
    """Shape of the model's input with a None batch dim, e.g. (None, 16)."""
    raise NotImplementedError(
        f'{type(self).__name__} must implement InputShape.')

  def InputDtype(self):
    """Dtype of the model's input, for profiling ('time' balance)."""
    return 'float32'

  def Loss(self, outputs, targets):
    """(scalar mean loss, {metric name: scalar}) of one micro-batch."""
    raise NotImplementedError(f'{type(self).__name__} must implement Loss.')

  def NumParams(self):
    """Trainable parameters, from the layers' cost models: nothing is allocated.

    This is how a billion-parameter configuration can be sized on a laptop.
    """
    from tfpipe.gpipe import partition  # pylint: disable=g-import-not-at-top
    metas = partition.LayerCosts(self.LayerParamsList(), self.InputShape())
    return sum(int(m.num_params) for m in metas)
