"""Notebook 07, the performance lab (also ``python -m ddp_tutorial.bench``), in the notebook kernel.

    costmodel.py   the α-β ring model, algbw/busbw, the scaling projection (pure arithmetic)
    measure.py     each measurement, one launch of a probe in workers/, and what it says in words
    plots.py       one plot helper per figure of the lab
    workers/       the probes: they run on the ranks
"""
