"""What a memory profile is asked for, and which cells profile alike.

A `ProfileRequest` crosses a process boundary (memory_profile runs it in
fresh processes, one per distinct cell on the CPU), so it holds only
picklable params, shapes and numpy batches. Two cells whose layers, input
shape and place in the pipeline agree hold the same memory
(`CellSignature`), and are profiled once.
"""

import re


def CellSignature(cell_params, input_shape, is_last, is_first):
  """What makes two cells' memory equal: their layers without names or
  seeds, their input shape, whether the loss runs on them, and whether they
  are first (whose backward computes no input gradient)."""
  text = '\n'.join(line for line in cell_params.ToText().splitlines()
                   if not re.search(r'(^|\.)(name|random_seed) :', line))
  return (text, repr(input_shape), bool(is_last), bool(is_first))


class ProfileRequest:
  """What ProfileCells needs; picklable, so a subprocess can run it.

  Attributes:
    cells: the cell params, in pipeline order.
    input_shapes: each cell's input shape (batch dim None).
    inputs: an example batch of the first cell's input (numpy leaves).
    targets: its targets (numpy leaves), or None.
    loss_fn: the model's loss, picklable (e.g. a model builder's Loss).
    micro_batch_sizes: the sizes to profile every cell at.
    optimizer_params: the task's optimizer params.
    clip_gradient_norm: the task's clipping.
    positions: each cell's index in the pipeline; the first gets `inputs`,
      the last the loss (default: the cells are the whole pipeline).
    num_cells: the pipeline's number of cells (default: len(cells)).
    intra_op_threads: the threads one op may use on the devices profiled
      for (0: TensorFlow's default). How many ops run at once, and so the
      working set of an action (the optimizer update's above all), follows
      it; ProfileInSubprocess profiles with it.
    single_threaded_calls: whether the devices run each action as a call on
      TensorFlow's single-threaded executor, as a worker process's CPU does
      (cell_runtime.OnWorkerCpu); the profile's actions then do too.
    device: the device the cells are profiled on, whose allocator is read;
      None: the profiling process's CPU. A GPU's own allocator counts what
      its kernels and libraries take, which a CPU profile cannot see, so a
      pipeline of GPUs is profiled on one of them (ProfileCells runs in the
      process that holds it).
    allocator_slack: also measure each cell's allocator slack
      (allocator_slack.BuildSlack), which the devices have if their
      allocator is one region from the start (GPUs, capped workers); False
      for devices whose allocator grows by regions (uncapped CPU
      processes).
    gpu_memory_mb: with a GPU `device`, profile on one logical GPU of this
      many MiB, whose allocator is one region from the start, as a run's
      GPUs are; None, on the GPU's allocator that grows (a request that
      opens a region counts as the region, which can be larger). Growing
      is the default until the two are compared on a GPU (RESULTS.md,
      section GPU, "Sixth H200 run").
    process_per_cell: on the CPU, profile each distinct cell in a fresh
      process of its own (ProfileInSubprocess); False: all in one, in
      turn. A planner's one-layer cells are a search's estimate, refined
      on the chosen cut's own cells, so they may share a process: Table 1
      predicted every size from layers profiled together (17.4 minutes;
      19.8 with a process per layer, the same sizes).
    profile_runs: with `process_per_cell`, how many fresh processes profile
      each remat mode of each distinct cell at each micro-batch size; each
      of its quantities is their median (memory_model.MedianProfile). One
      process's allocator settles on one packing of a step's chunks, which
      can put an action's working set 15% above or below another
      process's.
    modes: the remat modes a process profiles (ProfileInSubprocess gives
      each, and each size, its own process).
  """

  def __init__(self, cells, input_shapes, inputs, targets, loss_fn,
               micro_batch_sizes, optimizer_params, clip_gradient_norm=1.0):
    self.cells = list(cells)
    self.input_shapes = list(input_shapes)
    self.inputs = inputs
    self.targets = targets
    self.loss_fn = loss_fn
    self.micro_batch_sizes = sorted(set(int(n) for n in micro_batch_sizes))
    self.optimizer_params = optimizer_params
    self.clip_gradient_norm = clip_gradient_norm
    self.positions = list(range(len(self.cells)))
    self.num_cells = len(self.cells)
    # Instead of `inputs` and `targets`: input generator params whose first
    # batch the profiling process reads (so the caller runs no TF op).
    self.input_params = None
    self.intra_op_threads = 0
    self.single_threaded_calls = False
    self.device = None
    self.allocator_slack = True
    self.gpu_memory_mb = None
    self.process_per_cell = True
    self.profile_runs = 3
    self.modes = ('always', 'never')
    # Set in the process that profiles one cell for ProfileInSubprocess.
    self.in_this_process = False

  def Select(self, indices):
    """Keeps only the cells at these pipeline positions."""
    self.cells = [self.cells[i] for i in indices]
    self.input_shapes = [self.input_shapes[i] for i in indices]
    self.positions = [self.positions[i] for i in indices]


def DistinctCells(request):
  """{CellSignature: index in the request of the first cell with it}."""
  last = request.num_cells - 1
  first_of = {}
  for i, (k, cell, shape) in enumerate(zip(request.positions, request.cells,
                                           request.input_shapes)):
    first_of.setdefault(CellSignature(cell, shape, k == last, k == 0), i)
  return first_of
