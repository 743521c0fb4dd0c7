"""The exercises' starting points, copied to the learner's folder by ``exercises.start(name)``."""
