"""Registered experiment configurations, found by `model_registry` by module path.

`params/lm.py: TinyTransformerLm` is registered as `lm.TinyTransformerLm`.
Modules here are imported on demand when a name asks for them.
"""
