"""The script the kit's launch-speed check launches: a minimal DDP hello."""
