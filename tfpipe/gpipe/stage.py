"""Kept for code written against earlier releases, where `gpipe.stage` held
the per-cell runtime and the loss's parsing.

The cell's actions are now cell_runtime.py and what a loss_fn returns is
loss.py; the names such code used point there.
"""

from tfpipe.gpipe.loss import LossAndGradients  # pylint: disable=unused-import
from tfpipe.gpipe.loss import LossParts  # pylint: disable=unused-import
from tfpipe.gpipe.loss import ParseLoss  # pylint: disable=unused-import
