"""The tfpipe trainer: inputs, optimizers, the pipelined task and the training loop.

Submodules are imported by name (`from tfpipe.trainer import task`) so that
`python -m tfpipe.trainer` can configure devices before TensorFlow starts.
"""
