"""The performance lab's probes; each runs on the ranks, launched by ``measure``."""
