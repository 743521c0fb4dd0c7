"""Worker scripts of lesson 07; each runs on the ranks (``launch`` or torchrun), never in the kernel."""
