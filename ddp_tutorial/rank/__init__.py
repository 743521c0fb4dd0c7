"""Runs inside each rank, beside train.py; nothing here runs in the notebook kernel.

- ``bootstrap.py``: what ``launch`` starts first in every rank (it then runs the script);
- ``hooks.py``: the five calls train.py makes (``Hooks``; ``NO_HOOKS`` does nothing);
- ``instrument.py``: ``Instrument``, the hooks ``python -m ddp_tutorial.train`` runs with: records;
- ``timing.py``: a step's times from torch's own hooks (``SyncTimer``, ``StepTimer``);
- ``checkpoint.py``: atomic save and load, exact resume (``Checkpointer``);
- ``restarts.py``: the restart-safe store, the attempt the group agrees on, injected faults;
- ``original.py``: the original demo's mistakes (``--bug``).
"""
