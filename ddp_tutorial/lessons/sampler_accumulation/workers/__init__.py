"""Worker scripts of lessons 03-04: they run on the ranks (``launch``, torchrun), not the kernel."""
