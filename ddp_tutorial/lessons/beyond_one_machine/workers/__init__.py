"""Lesson 08's worker scripts: they run on the ranks (``launch`` or torchrun), not the kernel."""
