"""Runs inside each rank, beside train.py; nothing here runs in the notebook kernel.

``bootstrap.py`` starts every rank ``launch`` starts; ``hooks.py`` is the interface train.py calls;
``instrument.py`` is the kit's hooks (records, with ``timing.py``; restarts and faults, with
``restarts.py``); ``original.py`` is the original demo's code (``--bug``).
"""
