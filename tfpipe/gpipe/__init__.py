"""GPipe: partition a layer sequence into cells and pipeline micro-batches.

Data flows one way through the modules:
  partition (balance)  ->  microbatch (split/merge)  ->  schedule (actions per
  device, as data)  ->  stage (what one cell does for one micro-batch:
  forward, loss, backward, gradient accumulation; split_backward cuts the
  backward into B and W for zero-bubble schedules)  ->  runtime (one
  interpreter of the schedule for every entry point)  ->  dispatch (issue the
  actions inline in one graph, or from one thread per device, and which of
  the two 'auto' means)  ->  pipelining_layer (the Keras layer users build;
  cell_devices checks where its cells go; tied_variables gives a cell a copy
  of each variable it reads from another cell).
"""

from tfpipe import lazy_exports

# Submodules are imported on first use: see tfpipe/lazy_exports.py.
__getattr__, __dir__, __all__ = lazy_exports.Attach(__name__, {
    'cell': ['FeatureExtractionLayer'],
    'cell_devices': ['DefaultDevices', 'ResolveDevices'],
    'dispatch': [],
    'microbatch': [],
    'partition': [
        'BlockPartition',
        'FlattenSequentialLayers',
        'PartitionSequentialLayers',
    ],
    'pipelining_layer': ['PipeliningLayer'],
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
    'stage': ['LossAndGradients'],
    'tied_variables': [],
})
