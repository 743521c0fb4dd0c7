"""Worker scripts of lesson 08; each runs on the ranks (``launch`` or torchrun), never in the kernel."""
