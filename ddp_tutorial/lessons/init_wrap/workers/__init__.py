"""Worker scripts of lessons 01-02: they run on the ranks (``launch``, torchrun), not the kernel."""
