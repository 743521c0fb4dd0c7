"""Scripts the ranks run for ``exercises.check``: the harness that observes a learner's script."""
