"""Worker scripts of lesson 05; each runs on the ranks (``launch`` or torchrun), never in the kernel."""
