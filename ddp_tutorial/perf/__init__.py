"""The performance lab (notebook 07, ``python -m ddp_tutorial.bench``), in the notebook kernel.

    perf/costmodel.py   the α-β ring model, algbw/busbw, the scaling projection (pure arithmetic)
    perf/measure.py     each measurement, one launch of a probe in perf/workers/
    perf/plots.py       one plot helper per figure of the lab
    perf/workers/       the probes: they run on the ranks
"""
