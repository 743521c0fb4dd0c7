"""Notebook 07, the performance lab (also ``python -m ddp_tutorial.bench``), in the notebook kernel:
``costmodel`` (pure arithmetic), ``measure`` (one launch of a ``workers/`` probe each), ``plots``.
"""
