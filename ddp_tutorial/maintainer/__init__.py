"""The maintainer's tools, the kit's checks of itself (no notebook imports them): the README's tests
many times, over the notebooks, with another torch or Python (``suite.py``, ``pythons.py``;
``python -m ddp_tutorial.maintainer``), and how fast ``launch`` starts ranks (``launch_speed.py``,
printed by ``python -m ddp_tutorial.bench``)."""
