"""Usage: python -m tfpipe.trainer --model=lm.TinyTransformerLm --logdir=/tmp/lm

Same entry point as `tfpipe-train`; --helpfull lists every flag.
"""

from tfpipe.trainer import trainer

if __name__ == '__main__':
  trainer.run()
