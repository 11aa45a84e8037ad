"""GPipe: partition a layer sequence into cells and pipeline micro-batches.

Data flows one way through the modules:
  partition (balance)  ->  microbatch (split/merge)  ->  schedule (actions per
  device, as data)  ->  loss (what a loss_fn returns, added up exactly)  ->
  accumulators (a gradient buffer per variable)  ->  split_backward (a traced
  backward cut into parts that keep only what they read)  ->  cell_program
  (a cell's traces per input signature, cached)  ->  cell_runtime (what one
  cell does for one micro-batch: F, B, W, and the record F keeps)  ->  runtime
  (one interpreter of the schedule for every entry point; tape_path runs
  pipe(x) under a GradientTape)  ->  dispatch (issue the actions inline in
  one graph, or from one thread per device, and which of the two 'auto'
  means)  ->  pipelining_layer (the Keras layer users build; cell_devices
  checks where its cells go; tied_variables gives a cell a copy of each
  variable it reads from another cell); reference builds the same layers
  un-pipelined, with the pipeline's values, to check a model against.
"""

from tfpipe import lazy_exports

# Submodules are imported on first use: see tfpipe/lazy_exports.py.
__getattr__, __dir__, __all__ = lazy_exports.Attach(__name__, {
    'accumulators': [],
    'cell': ['FeatureExtractionLayer'],
    'cell_devices': ['DefaultDevices', 'ResolveDevices'],
    'cell_program': [],
    'cell_runtime': [],
    'dispatch': [],
    'loss': ['LossAndGradients'],
    'memory_model': ['CellMemory', 'CellProfile', 'PredictPeaks',
                     'StepConfig'],
    'memory_profile': ['ProfileCells', 'ProfileInSubprocess',
                       'ProfileRequest'],
    'microbatch': [],
    'partition': [
        'BlockPartition',
        'FlattenSequentialLayers',
        'PartitionSequentialLayers',
    ],
    'pipelining_layer': ['PipeliningLayer'],
    'plan_devices': ['Devices'],
    'planner': ['CandidatePlans', 'LayerProfiles', 'MemoryBalancedCut',
                'NoPlanError', 'PipelinePlan', 'PlanPipeline'],
    'reference': ['UnpipelinedReference'],
    'runtime': ['REMAT_POLICIES'],
    'schedule': [
        'GPipeSchedule',
        'InterleavedOneFOneBSchedule',
        'MakeSchedule',
        'OneFOneBSchedule',
        'Simulate',
        'TextTimeline',
        'ZeroBubbleH1Schedule',
    ],
    'split_backward': [],
    'stage': [],
    'tape_path': [],
    'tied_variables': [],
})
