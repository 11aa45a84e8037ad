"""Tests of the image configs: AmoebaNet-D trains from the command line, paper sizes."""

# bazel: size=medium

from tests.params import command_line
from tfpipe import model_registry
from tfpipe.trainer import task as task_lib


command_line.Declare('image.TinyAmoebaNetD', '--model=image.TinyAmoebaNetD',
                     '--max_steps=2',
                     '--model_params_override=task.eval.num_batches: 1')


def test_tiny_amoebanet_trains_from_the_command_line():
  stdout = command_line.Stdout('image.TinyAmoebaNetD')
  assert 'step 2/2 loss=' in stdout
  assert 0.0 <= command_line.FinalEval(stdout)['accuracy'] <= 1.0


def test_paper_configurations_are_sized_without_allocating():
  """The cost model counts the paper's models; nothing is built."""
  want = {'image.AmoebaNetD': (224, 256, 122_470_120),
          'image.AmoebaNetD557M': (480, 512, 481_268_200)}
  for name, (image_size, num_filters, num_params) in want.items():
    p = model_registry.GetParams(name)
    model = p.task.model.Instantiate()
    assert (model.p.num_layers, model.p.num_filters) == (18, num_filters)
    assert model.p.image_size == image_size and model.p.num_classes == 1000
    assert model.NumParams() == num_params


def test_amoebanet_cuts_into_balanced_cells():
  """Cells of about 1/K of the flops at K=4 and K=8, cut along cells."""
  p = model_registry.GetParams('image.AmoebaNetD')
  model = p.task.model.Instantiate()
  for k, worst in ((4, 0.27), (8, 0.15)):
    p.task.pipeline.num_partitions = k
    cells = task_lib.PartitionCells(p.task, model)
    rows = task_lib.DescribeCells(cells, ['/CPU:0'] * k, (4, 224, 224, 3))
    flops = [r['flops'] for r in rows]
    assert max(flops) / sum(flops) <= worst, (k, flops)
    assert rows[0]['layers'][0] == 'stem' and rows[-1]['layers'][-1] == 'head'
