"""GPipe: partition a layer sequence into cells and pipeline micro-batches.

Data flows one way through the modules:
  partition (balance)  ->  microbatch (split/merge)  ->  schedule (actions per
  device, as data)  ->  executor (one tf.function: placement, remat, order,
  gradient accumulation) or threaded_executor (one thread per device calling
  per-cell traced functions, so stages overlap)  ->  pipelining_layer (the
  Keras layer users build).
"""

from tfpipe.gpipe.cell import FeatureExtractionLayer
from tfpipe.gpipe.executor import LossAndGradients
from tfpipe.gpipe.executor import REMAT_POLICIES
from tfpipe.gpipe.partition import BlockPartition
from tfpipe.gpipe.partition import FlattenSequentialLayers
from tfpipe.gpipe.partition import PartitionSequentialLayers
from tfpipe.gpipe.pipelining_layer import DefaultDevices
from tfpipe.gpipe.pipelining_layer import PipeliningLayer
from tfpipe.gpipe.pipelining_layer import ResolveDevices
from tfpipe.gpipe.schedule import GPipeSchedule
from tfpipe.gpipe.schedule import MakeSchedule
from tfpipe.gpipe.schedule import OneFOneBSchedule
from tfpipe.gpipe.schedule import Simulate
from tfpipe.gpipe.schedule import TextTimeline
