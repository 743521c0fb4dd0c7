"""Code that runs inside each rank, beside train.py; nothing here runs in the notebook kernel."""
