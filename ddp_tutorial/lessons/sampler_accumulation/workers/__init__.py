"""Worker scripts of lessons 03-04; each runs on the ranks (``launch`` or torchrun), never in the kernel."""
