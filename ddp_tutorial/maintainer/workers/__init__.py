"""Scripts the kit's self-checks launch: a minimal DDP hello, and a probe that times each launch phase."""
