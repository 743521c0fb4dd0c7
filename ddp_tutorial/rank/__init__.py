"""Runs inside each rank, beside train.py: the bootstrap ``launch`` starts, the measuring hooks,
the original demo's mistakes, checkpoints. Nothing here runs in the notebook kernel."""
