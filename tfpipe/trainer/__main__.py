"""`python -m tfpipe.trainer`: the same entry point as `tfpipe-train`."""

from tfpipe.trainer import trainer

if __name__ == '__main__':
  trainer.run()
