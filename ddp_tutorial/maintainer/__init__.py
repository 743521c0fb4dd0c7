"""The maintainer's tools, the kit's checks of itself (no notebook imports them): the suite's rounds
(``python -m ddp_tutorial.maintainer``), launch speed (for the bench), a local SLURM cluster."""
