"""Worker scripts of lessons 01-02; each runs on the ranks (``launch`` or torchrun), never in the kernel."""
