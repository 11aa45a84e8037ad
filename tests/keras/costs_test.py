"""Per-step costs of a Keras graph for each balance method."""

import keras
import numpy as np
import pytest

from tfpipe.keras import costs
from tfpipe.keras import graph as graph_lib
from tests.keras import model_test
from tests.keras import cell_test


def test_params_count_each_layer_once():
  model = model_test._Functional()
  graph = graph_lib.ModelGraph(model)
  got = costs.StepCosts(graph, 'params')
  assert len(got) == len(graph.steps)
  assert sum(got) == model.count_params()


@pytest.mark.parametrize('balance', ['flops', 'memory'])
def test_estimates_are_positive_and_grow_with_the_layer(balance):
  keras.utils.set_random_seed(0)
  i = keras.Input((8,))
  h = keras.layers.Dense(4, name='small')(i)
  model = keras.Model(i, keras.layers.Dense(512, name='big')(h))
  got = costs.StepCosts(graph_lib.ModelGraph(model), balance)
  assert all(c > 0 for c in got)
  assert got[1] > got[0]


def test_time_profiles_every_step_and_leaves_batch_norm_stats_alone():
  model = cell_test._ConvBn()
  before = cell_test._Stats(model)
  got = costs.StepCosts(graph_lib.ModelGraph(model), 'time',
                        profile_batch_size=4)
  assert len(got) == 7 and all(t > 0 for t in got)
  for name, (mean, var) in cell_test._Stats(model).items():
    np.testing.assert_array_equal(mean, before[name][0])
    np.testing.assert_array_equal(var, before[name][1])


def test_unknown_balance():
  graph = graph_lib.ModelGraph(model_test._Sequential())
  with pytest.raises(ValueError, match="Received: balance='speed'"):
    costs.StepCosts(graph, 'speed')
